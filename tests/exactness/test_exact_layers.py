"""Common layers and training modes under the offloader: attention, conv nets with BatchNorm and
in-place ReLU, activation checkpointing, bf16 autocast.

Ported from torchtune's ``tests/torchtune/training/test_activation_offloading.py``
(``test_offloading_is_same_as_without``: same model with and without the offloading context,
``torch.equal`` on every gradient) applied to more layer types, and from PyTorch's
``test/test_utils.py`` checkpoint tests (``test_checkpoint``, ``test_checkpoint_non_reentrant*``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from helpers.exact import Run, loss_step
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


class MHA(nn.Module):
    """Two nn.MultiheadAttention blocks (batch_first, causal mask, dropout, need_weights) + FFN."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.attn = nn.ModuleList(nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True) for _ in range(2))
        self.ffn = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU()) for _ in range(2))

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None, weights: bool) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1) if kv is None else None
        for attn, ffn in zip(self.attn, self.ffn):
            src = x if kv is None else kv
            y, w = attn(x, src, src, attn_mask=mask, need_weights=weights)
            x = x + ffn(x + y)
            if w is not None:
                x = x + w.sum(-1, keepdim=True)
        return x.pow(2).mean()


@pytest.mark.parametrize(
    ("cross", "weights"), [(False, False), (False, True), (True, False)], ids=["self", "self-weights", "cross"]
)
def test_multihead_attention(cross: bool, weights: bool, exact) -> None:
    """nn.MultiheadAttention: self-attention with a causal mask (with and without returned
    weights) and cross-attention; dropout on, RNG reset per step."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return MHA()

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = torch.randn(2, 6, 32, requires_grad=True)
        kv = torch.randn(2, 9, 32, requires_grad=True) if cross else None
        return model(x, kv, weights), {"x": x} | ({"kv": kv} if cross else {})

    exact(build, loss_step(forward))


class SDPA(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.blocks = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))

    def forward(self, x: torch.Tensor, causal: bool, dropout: float, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, c = x.shape
        for lin in self.blocks:
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in lin(x).chunk(3, -1))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout)
            x = x + y.transpose(1, 2).reshape(b, t, c)
        return x.pow(2).mean()


@pytest.mark.parametrize("variant", ["causal", "float-mask", "dropout"])
def test_scaled_dot_product_attention(variant: str, exact) -> None:
    """F.scaled_dot_product_attention with the math backend (the CPU reference): causal, an
    additive float mask, and dropout (its mask drawn from the reset RNG)."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return SDPA()

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = torch.randn(2, 8, 32, requires_grad=True)
        mask = torch.randn(8, 8) if variant == "float-mask" else None
        with sdpa_kernel(SDPBackend.MATH):
            loss = model(x, variant == "causal", 0.2 if variant == "dropout" else 0.0, mask)
        return loss, {"x": x}

    exact(build, loss_step(forward))


class ConvBN(nn.Module):
    """Conv2d + BatchNorm2d + ReLU(inplace=True) stages, then pooling and a linear head."""

    def __init__(self, channels: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.stages = nn.Sequential(
            *(
                nn.Sequential(
                    nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                    nn.BatchNorm2d(channels),
                    nn.ReLU(inplace=True),
                )
                for _ in range(depth)
            )
        )
        self.head = nn.Linear(channels, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(F.relu(self.stem(x), inplace=True))
        return F.cross_entropy(self.head(x.mean((2, 3))), torch.arange(x.shape[0]) % 5)


def test_conv_batchnorm_inplace_relu(exact) -> None:
    """Train mode: BatchNorm's running mean/var/num_batches_tracked (buffers) are compared with
    ``torch.equal`` after every step, with the gradients; ReLU(inplace=True) overwrites BN's
    output, which it then saves."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return ConvBN()

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = torch.randn(4, 3, 10, 10, requires_grad=True)
        return model(x), {"x": x}

    exact(build, loss_step(forward), steps=3)


class Checkpointed(nn.Module):
    """Blocks of Linear+GELU+Dropout; every other one under torch.utils.checkpoint."""

    def __init__(self, reentrant: bool, width: int = 32) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, blk in enumerate(self.blocks):
            x = cp.checkpoint(blk, x, use_reentrant=self.reentrant) if k % 2 == 0 else blk(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpoint(reentrant: bool, exact) -> None:
    """torch.utils.checkpoint with use_reentrant=True and False (dropout inside: the recompute
    restores the RNG state); the blocks are the offloader's layers."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Checkpointed(reentrant)

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = torch.randn(8, 32, requires_grad=True)
        return model(x), {"x": x}

    exact(build, loss_step(forward))


@pytest.mark.parametrize("model_kind", ["conv", "sdpa", "mha"])
def test_bf16_autocast(model_kind: str, exact) -> None:
    """torch.autocast("cpu", dtype=torch.bfloat16): bf16 activations (and fp32 ones autocast
    keeps) are saved and restored with their dtype."""
    builders = {"conv": ConvBN, "sdpa": SDPA, "mha": MHA}

    def build() -> nn.Module:
        torch.manual_seed(0)
        return builders[model_kind]()

    def step(model: nn.Module, run: Run, i: int) -> dict:
        x = torch.randn(4, 3, 10, 10) if model_kind == "conv" else torch.randn(2, 8, 32)
        x.requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if model_kind == "conv":
                loss = model(x)
            elif model_kind == "sdpa":
                with sdpa_kernel(SDPBackend.MATH):
                    loss = model(x, True, 0.0, None)
            else:
                loss = model(x, None, False)
        run.sync()
        loss.backward()
        return {"loss": loss, "x.grad": x.grad}

    exact(build, step)
