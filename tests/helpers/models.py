"""Small models and helpers for the offloader's exactness, behaviour and reliability tests.

Every model is tiny (runs a step in milliseconds on a CPU) but saves real activations
of real sizes, so that with ``min_bytes=0`` (or a small ``min_bytes``) they are offloaded.
:func:`train_step` runs one step and returns the loss and gradients; :func:`assert_same`
compares two such results bit for bit (``torch.equal``), never ``allclose``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gds_offload

__all__ = [
    "MLP",
    "TinyGPT",
    "ConvNet",
    "FusedQKVNet",
    "SparseInputNet",
    "ManySmall",
    "Result",
    "TanhStack",
    "offload_everything",
    "train_step",
    "assert_same",
    "between",
    "make",
    "grads_of",
    "param_grads",
    "settled",
]

class MLP(nn.Module):
    """``depth`` blocks of Linear + GELU in a ModuleList."""

    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class CausalSelfAttention(nn.Module):
    """One fused QKV projection split into q/k/v views (one storage, three saved views)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder: token + position embeddings (tokens tied to the LM head), pre-LN
    blocks with causal SDPA attention and a GELU MLP, dropout. Returns the LM loss."""

    def __init__(
        self, vocab: int = 256, dim: int = 64, heads: int = 4, depth: int = 3, ctx: int = 32, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(dim, heads, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


class ConvNet(nn.Module):
    """Conv + BatchNorm + in-place ReLU stages (BatchNorm running stats change every step)."""

    def __init__(self, channels: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.stages = nn.Sequential(
            *(
                nn.Sequential(
                    nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(inplace=True)
                )
                for _ in range(depth)
            )
        )
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(F.relu(self.stem(x), inplace=True))
        return self.head(x.mean(dim=(2, 3)))


class FusedQKVNet(nn.Module):
    """Blocks whose attention splits one fused QKV projection into q/k/v views."""

    def __init__(self, dim: int = 64, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CausalSelfAttention(dim, heads, 0.0) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


class SparseInputNet(nn.Module):
    """``torch.sparse.mm(sparse_input, W)``: autograd saves the sparse input for W's gradient."""

    def __init__(self, n_in: int = 64, width: int = 32) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_in, width) / math.sqrt(n_in))
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

    def forward(self, x_sparse: torch.Tensor) -> torch.Tensor:
        x = torch.sparse.mm(x_sparse, self.w)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


class ManySmall(nn.Module):
    """Saves ``n`` small tensors per step (one scalar parameter multiplied in ``n`` chunks)."""

    def __init__(self, n: int = 10_000) -> None:
        super().__init__()
        self.n = n
        self.w = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each row is cloned (its own storage); ``row * w`` saves the row for w's gradient.
        return sum((row.clone() * self.w).sum() for row in x.unbind(0))


class TanhStack(nn.Module):
    """Four blocks of Linear(64, 64) + Tanh; the output is the sum of squares (a scalar)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.pow(2).sum()


def param_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The gradients of ``model(x)`` (a scalar) with respect to every parameter, without touching ``.grad``."""
    return torch.autograd.grad(model(x), list(model.parameters()))


@dataclass
class Result:
    """What a step produced: the loss and every parameter's gradient (by name)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def train_step(
    model: nn.Module,
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    seed: int = 1234,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    sync: Callable[[], object] | None = None,
) -> Result:
    """One forward/backward from zeroed grads with the RNG reset to ``seed`` (dropout identical).

    ``sync`` runs between forward and backward: :meth:`~gds_offload.Offloader.synchronize`
    there makes every write land first, so backward reads every offloaded tensor back from
    the drive (see :func:`between`)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    out = model(*args)
    loss = loss_fn(out) if loss_fn is not None else (out if out.dim() == 0 else out.float().pow(2).mean())
    if sync is not None:
        sync()
    loss.backward()
    return grads_of(model, loss)


def grads_of(model: nn.Module, loss: torch.Tensor) -> Result:
    return Result(
        loss.detach().clone(),
        {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
    )


def assert_same(ref: Result, got: Result) -> None:
    """Bit-identical loss and gradients (``torch.equal``), naming the first parameter that differs."""
    assert torch.equal(ref.loss, got.loss), f"loss differs: {ref.loss.item()!r} vs {got.loss.item()!r}"
    assert ref.grads.keys() == got.grads.keys(), f"gradients of {sorted(ref.grads)} vs {sorted(got.grads)}"
    for name, g in ref.grads.items():
        assert torch.equal(g, got.grads[name]), f"grad of {name} differs (max abs diff {(g - got.grads[name]).abs().max()})"


def make(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A fresh model (fixed init) and its inputs, by name: mlp, gpt, conv, qkv."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), (torch.randn(64, 128),)
    if name == "gpt":
        return TinyGPT(), (torch.randint(0, 256, (8, 32)),)
    if name == "conv":
        return ConvNet(), (torch.randn(8, 3, 16, 16),)
    if name == "qkv":
        return FusedQKVNet(), (torch.randn(4, 16, 64),)
    raise ValueError(f"unknown test model {name!r}")


def offload_everything(model: nn.Module, path: Path, engine: str = "posix", **kw: Any) -> gds_offload.Offloader:
    """``attach`` that offloads every saved tensor (no size floor, no layer kept), so that tiny
    test models really exercise the drive."""
    return gds_offload.attach(model, path=path, mode=engine, **({"min_bytes": 0, "keep_last": 0} | kw))


def between(off: gds_offload.Offloader, timing: str) -> Callable[[], None]:
    """What a step runs between forward and backward under ``timing`` (:data:`helpers.exact.TIMINGS`):
    ``drive``, :meth:`~gds_offload.Offloader.synchronize` (every write lands and leaves memory,
    so backward reads every offloaded tensor back from the drive); ``natural``, nothing (a
    tensor whose write is still in flight is served from memory)."""
    assert timing in ("drive", "natural"), timing
    return off.synchronize if timing == "drive" else lambda: None


def settled(off: gds_offload.Offloader) -> gds_offload.OffloadStats:
    """``off.stats()`` once every write in flight has landed (bytes_offloaded counts completed writes)."""
    off.synchronize()
    return off.stats()
