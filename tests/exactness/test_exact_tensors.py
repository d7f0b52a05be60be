"""Saved tensors of every layout and dtype a model produces: each is restored with its exact
bytes, dtype, sizes, strides and storage offset.

Ported in spirit from PyTorch's ``test/test_autograd.py`` saved-tensor tests
(``test_saved_variable_packing_unpacking_saved_original_with_hooks`` over
``test_saved_variables``-style inputs: views, non-contiguous, expanded, wrapped numbers) and
``test/test_nn.py`` channels_last convolution tests; plus a block reused twice in one forward
(ALBERT-style weight sharing).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.exact import loss_step
from torch import nn

W = 8


class Zoo(nn.Module):
    """One forward per ``kind``, each saving a particular kind of tensor for backward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList(nn.Linear(W, W) for _ in range(2))
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.emb = nn.Embedding(20, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[1](torch.tanh(self.blocks[0](x)))  # (B, W)
        k = self.kind
        if k == "channels_last_conv":
            img = h.reshape(-1, 1, 1, W).expand(-1, 3, W, W).contiguous(memory_format=torch.channels_last)
            return self.conv(img * 1.5).relu().pow(2).mean()
        if k == "expanded_stride0":
            e = h[:, None, :].expand(-1, 5, -1)  # stride 0, saved by mul
            return (e * e.transpose(0, 1).transpose(0, 1)).sum()
        if k == "offset_and_strided":
            v = h.flatten()[3:].as_strided((3, 4), (5, 2), 1)  # storage offset, odd strides
            return (v.exp() * v).sum() + (h[1::2, ::3] ** 3).sum()
        if k == "zero_dim_and_empty":
            s = h.sum()  # 0-dim, saved by mul
            empty = h[:, :0]
            return (s * s.sigmoid()) + (empty * empty).sum() + (h[0, 0] * h[1, 1])
        if k == "float64":
            d = h.double()
            return (d.sin() * d).sum().float()
        if k == "float16_bfloat16":
            a, b = h.half(), h.bfloat16()
            return (a * a).sum().float() + (b * b.tanh()).sum().float()
        if k == "int_index_and_bool_mask":
            idx = torch.arange(h.shape[0] * 3).remainder(20).view(-1, 3)
            g = self.emb(idx).sum(1) + h  # embedding saves the int64 indices
            picked = torch.gather(g, 1, idx.remainder(W))  # gather saves the index
            mask = g > 0
            return (picked**2).sum() + g.masked_fill(mask, 0.0).pow(2).sum()  # the bool mask is saved
        if k == "complex_and_conj":
            z = torch.view_as_complex(h.reshape(h.shape[0], -1, 2).contiguous())
            y = z * z.conj()  # a lazily conjugated view is saved
            return y.real.sum() + torch.fft.fft(z).abs().sum()
        if k == "block_reused":
            for _ in range(3):  # the same layer module called three times
                h = torch.tanh(self.blocks[1](h))
            return h.pow(2).sum()
        raise ValueError(k)


KINDS = [
    "channels_last_conv",
    "expanded_stride0",
    "offset_and_strided",
    "zero_dim_and_empty",
    "float64",
    "float16_bfloat16",
    "int_index_and_bool_mask",
    "complex_and_conj",
    "block_reused",
]


@pytest.mark.parametrize("kind", KINDS)
def test_saved_tensor_kinds(kind: str, exact) -> None:
    """channels_last conv input, stride-0 expanded views, views with a storage offset and odd
    strides, 0-dim and empty tensors, float64 / float16 / bfloat16, int64 indices and bool
    masks, complex tensors with a lazy conj, and one layer called three times."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Zoo(kind)

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = torch.randn(6, W, requires_grad=True)
        return model(x), {"x": x}

    exact(build, loss_step(forward))


def test_saved_tensor_shares_storage_with_model_output(exact) -> None:
    """The model returns a view of a saved activation and the caller uses both (loss over
    the returned view and a reduction of the saved base)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(W, 2 * W) for _ in range(2))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = F.gelu(self.blocks[0](x))[:, :W]
            base = torch.sigmoid(self.blocks[1](h))  # saves its output
            return base, base[:, W:]

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Net()

    def forward(model: nn.Module, i: int):  # noqa: ANN202
        x = torch.randn(6, W, requires_grad=True)
        base, view = model(x)
        return (view * view).sum() + base.mean(), {"x": x}

    exact(build, loss_step(forward))
