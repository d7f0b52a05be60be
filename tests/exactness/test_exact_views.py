"""Several saved tensors over one storage: views, in-place ops on them, fused projections, tied weights.

The offloader deduplicates by storage (a storage saved several times is written once); these
cases check that every view is rebuilt from the right bytes, also when its storage was
modified in place between two saves. Ported from the patterns of ATen's CPU ``lstm_cell`` /
``gru_cell`` (``unsafe_chunk`` + ``sigmoid_``), PyTorch's ``test/test_autograd.py``
(``test_unsafe_split``, ``test_inplace_on_view_*``) and nanoGPT/HF fused-QKV attention.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.exact import Run, loss_step
from torch import nn

WIDTH = 16


def _unsafe_chunk(h: torch.Tensor) -> list[torch.Tensor]:
    return list(h.unsafe_chunk(2, 1))


def _unsafe_split(h: torch.Tensor) -> list[torch.Tensor]:
    return list(h.unsafe_split(WIDTH // 2, 1))


def _unsafe_split_with_sizes(h: torch.Tensor) -> list[torch.Tensor]:
    return list(h.unsafe_split_with_sizes([5, WIDTH - 5], 1))


SPLITS = {
    "unsafe_chunk": _unsafe_chunk,
    "unsafe_split": _unsafe_split,
    "unsafe_split_with_sizes": _unsafe_split_with_sizes,
}


class InplaceChunks(nn.Module):
    """``a, b = split(lin(x)); a = a.sigmoid_(); [mid()]; b = b.sigmoid_(); 2a + 3b``: both
    in-place ops save their output, two views of one storage; ``mid`` runs between them."""

    def __init__(self, split: str) -> None:
        super().__init__()
        self.split = SPLITS[split]
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.mid = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.blocks:
            a, b = self.split(lin(x))
            a = a.sigmoid_()
            self.mid()
            b = b.sigmoid_()
            x = torch.cat([2 * a, 3 * b], 1)
        return x.sum()


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_unsafe_split_views_modified_in_place(split: str, exact) -> None:
    """``unsafe_chunk`` / ``unsafe_split`` / ``unsafe_split_with_sizes`` outputs do not share a
    version counter, so after ``a.sigmoid_()`` and ``b.sigmoid_()`` both saved views are at
    version 1 of the same storage. In the ``drive`` timing the drive catches up between the
    two ``sigmoid_`` calls (inside forward), so the first view's write holds ``b`` *before*
    its ``sigmoid_``: a deduplication keyed on (storage, version) serves stale bytes.
    (The pattern of ATen's CPU LSTM/GRU cells.)"""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return InplaceChunks(split)

    def step(model: nn.Module, run: Run, i: int) -> dict:
        model.mid = run.sync
        x = torch.randn(8, WIDTH, requires_grad=True)
        loss = model(x)
        run.sync()
        loss.backward()
        return {"loss": loss, "x.grad": x.grad}

    exact(build, step)


class ViewsOfOne(nn.Module):
    """One projection, several views of its output saved by different ops (no in-place op):
    ``split_with_sizes``, ``chunk``, ``narrow``, a transpose and a strided slice."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, 2 * WIDTH) for _ in range(2))
        self.w = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.blocks:
            h = lin(x)
            a, b, c = h.split_with_sizes([WIDTH // 2, WIDTH // 2, WIDTH], 1)
            p, q = c.chunk(2, 1)
            y = a * b  # saves a and b
            z = torch.cat([p.exp(), q.tanh()], 1)  # outputs saved
            s = (h.narrow(1, 3, WIDTH) * self.w).sum(1, keepdim=True)  # saves the narrow view
            t = h[:, ::3].t() @ h[:, 1::3]  # transposed, strided views
            x = torch.cat([y, y], 1) + z + s + t.sum()
        return x.pow(2).mean()


def test_views_of_one_storage(exact) -> None:
    """Views with offsets, strides and transposes over one storage, all saved: each is rebuilt
    from the bytes it was saved with."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return ViewsOfOne()

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = torch.randn(8, WIDTH, requires_grad=True)
        return model(x), {"x": x}

    exact(build, loss_step(forward))


class FusedQKV(nn.Module):
    """Fused QKV projection split into q/k/v views, attention written out (softmax(qk^T) v)."""

    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(depth))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in qkv(x).split(c, dim=-1))
            att = (q @ k.transpose(-2, -1)) / (c // self.heads) ** 0.5
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
            x = x + proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x.pow(2).mean()


def test_fused_qkv_split_views(exact) -> None:
    """q, k, v: three transposed views of one fused projection, saved by two matmuls."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return FusedQKV()

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = torch.randn(2, 8, 32, requires_grad=True)
        return model(x), {"x": x}

    exact(build, loss_step(forward))


class TiedLM(nn.Module):
    """Embedding whose weight is also the LM head (``head.weight = emb.weight``), two blocks."""

    def __init__(self, vocab: int = 50, dim: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = x + blk(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())


def test_tied_embedding_and_head(exact) -> None:
    """Tied weights: the shared parameter is saved by the embedding and the head (never
    offloaded: a parameter); its one gradient sums both uses."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return TiedLM()

    def forward(model: nn.Module, i: int) -> torch.Tensor:
        return model(torch.randint(0, 50, (4, 12)))

    st = exact(build, loss_step(forward))
    assert st.bytes_packed > 0
