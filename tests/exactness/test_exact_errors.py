"""Misuse that plain PyTorch detects must be detected with the offloader too; what plain
PyTorch allows must give equal results.

Plain autograd checks each saved tensor's version counter at backward ("modified by an
inplace operation"), refuses a saved tensor detached in place, and refuses to save
inference tensors. With saved-tensor hooks PyTorch skips the version check (the hooks own
the data), so the offloader has to do it. Every case states what plain PyTorch does and the
harness checks that first. Ported from PyTorch's ``test/test_autograd.py``
(``test_inplace_on_view_saved_output``-style version checks,
``test_saved_variable_saved_original_inplace_detach``,
``test_inference_mode_*`` in ``TestAutogradInferenceMode``).
"""
from __future__ import annotations

import pytest
import torch
from helpers.exact import Run
from torch import nn

WIDTH = 12
INPLACE = (RuntimeError, "modified by an inplace operation")
DETACHED = (RuntimeError, "Trying to use a saved tensor that has been detached")
INFERENCE = (RuntimeError, "Inference tensors cannot be saved for backward")


class Net(nn.Module):
    """Returns ``(loss_parts, h, y)``: ``h = blocks(x)`` (Linear+Tanh, Tanh saves its output h),
    ``y = h.exp()`` (saves y), ``z = lin(h)`` (Linear saves h), ``s = h.sin()`` (saves h)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(2))
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = x
        for b in self.blocks:
            h = b(h)
        out = {"h": h, "y": h.exp(), "z": self.lin(h), "s": h.sin()}
        if extra is not None:
            out["e"] = h * extra  # saves both factors
        return out


def build() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _loss(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum((v * (k + 1)).sum() for k, v in enumerate(out.values()) if v.requires_grad)


#: name -> (what is done between forward and backward, what plain PyTorch does: None = allows it)
MUTATIONS = {
    # y = h.exp() saved its output y: modifying y invalidates exp's backward.
    "saved_output_add_": (lambda out, x: out["y"].add_(1), INPLACE),
    # h is saved by lin, sin and tanh: modifying it in place (no_grad, as an optimizer would).
    "saved_activation_mul_no_grad": (lambda out, x: _no_grad(lambda: out["h"].mul_(2)), INPLACE),
    # x (no grad) is saved by the first Linear for its weight gradient.
    "saved_input_refilled": (lambda out, x: x.add_(1), INPLACE),
    # z = lin(h) is not saved by anything: modifying it is allowed.
    "unsaved_output_add_": (lambda out, x: out["z"].add_(1), None),
    # s = h.sin() saves its input h, not s: s may be modified in place.
    "unsaved_sin_output": (lambda out, x: out["s"].mul_(3), None),
    # h saved as an input of sin/lin and detached in place afterwards.
    "saved_input_detach_": (lambda out, x: out["h"].detach_(), DETACHED),
    # y saved as exp's output and detached in place: plain autograd allows it (a saved
    # output is kept with its grad_fn when it is saved).
    "saved_output_detach_": (lambda out, x: out["y"].detach_(), None),
}


def _no_grad(fn):  # noqa: ANN001, ANN202
    with torch.no_grad():
        return fn()


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutation_between_forward_and_backward(name: str, exact) -> None:
    """Mutate (in place, or ``detach_()``) a tensor after forward, before backward. If plain
    autograd raises, the attached run raises the same error class with the same message
    fragment; if plain autograd allows it, results are equal."""
    mutate, raises = MUTATIONS[name]

    def step(model: nn.Module, run: Run, i: int) -> dict:
        x = torch.randn(6, WIDTH)
        out = model(x)
        run.sync()
        loss = _loss(out)  # computed from the outputs *before* the mutation
        mutate(out, x)
        loss.backward()
        return {"loss": loss}

    exact(build, step, raises=raises)


#: How an inference-mode tensor enters the attached model.
INFERENCE_USES = {
    "as_model_input": ("input", INFERENCE),  # saved by the first Linear
    "as_saved_factor": ("extra", INFERENCE),  # h * extra saves extra
    "cloned_first": ("clone", None),  # a clone is a normal tensor
}


@pytest.mark.parametrize("use", sorted(INFERENCE_USES))
def test_inference_mode_tensor_in_autograd(use: str, exact) -> None:
    """A tensor created under ``torch.inference_mode()`` and then used in the attached model:
    refused the same way as in plain PyTorch when it would be saved for backward; a clone
    of it works and gives equal results."""
    where, raises = INFERENCE_USES[use]

    def step(model: nn.Module, run: Run, i: int) -> dict:
        with torch.inference_mode():
            t = torch.randn(6, WIDTH)
        x = t if where == "input" else (t.clone() if where == "clone" else torch.randn(6, WIDTH))
        out = model(x, t if where == "extra" else None)
        run.sync()
        loss = _loss(out)
        loss.backward()
        return {"loss": loss}

    exact(build, step, raises=raises)
