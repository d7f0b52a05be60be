"""Run a case plain, run it attached in a given timing, compare everything bit for bit.

A *case* is two callables:

* ``build() -> nn.Module``: a fresh model; it seeds the RNG itself, so two calls give the
  same weights;
* ``step(model, run, i) -> dict``: one training step (forward and backward). The harness
  zeroes the gradients and calls ``torch.manual_seed(1000 + i)`` before it, so inputs drawn
  with ``torch.randn`` inside the step and dropout masks are the same in both runs. ``run``
  says how to time the step: call ``run.sync()`` where the drive must have caught up
  (always between forward and backward; a step may call it elsewhere too). The returned
  tensors (loss, input gradients, outputs...) are compared, and so are, after each step,
  every parameter's gradient, every parameter and every buffer (BatchNorm running stats).

Timings (:data:`TIMINGS`):

* ``drive``: ``run.sync()`` is :meth:`Offloader.synchronize`; every write has landed and
  left memory before backward, so backward reads the bytes back from the drive. The
  harness asserts ``stats().bytes_read > 0``.
* ``natural``: ``run.sync()`` does nothing; writes race with the step as in real
  training. The harness asserts ``stats().bytes_offloaded > 0``.

Comparisons use ``torch.equal`` (and the dtype), never ``allclose``. :func:`loss_step`
builds the common ``forward -> sync -> backward`` step.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gds_offload

__all__ = [
    "TIMINGS",
    "Run",
    "check",
    "loss_step",
    "record",
    "assert_records_equal",
]

#: ``drive``: synchronize before backward (bytes come back from the drive); ``natural``: no forced timing.
TIMINGS = ["drive", "natural"]

Record = dict[str, Any]


@dataclass
class Run:
    """How the current run is timed; handed to every step.

    ``attached`` is False for the plain reference run, where :meth:`sync` does nothing;
    ``syncs`` counts the synchronizations a drive-timed run made.
    """

    attached: bool
    timing: str
    offloader: gds_offload.Offloader | None = None
    syncs: int = 0

    def sync(self) -> None:
        """``drive`` timing of an attached run: wait for every write in flight. Else nothing."""
        if self.attached and self.timing == "drive":
            assert self.offloader is not None
            self.offloader.synchronize()
            self.syncs += 1


def _detach(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_detach(x) for x in v)
    if isinstance(v, Mapping):
        return {k: _detach(x) for k, x in v.items()}
    return v


def record(model: nn.Module, extra: Mapping[str, Any] | None = None) -> Record:
    """What a step left behind: ``extra`` (from the step) plus every parameter's gradient,
    every parameter and every buffer of ``model``, as detached copies."""
    out: Record = {f"out:{k}": _detach(v) for k, v in (extra or {}).items()}
    for name, p in model.named_parameters():
        out[f"grad:{name}"] = _detach(p.grad)
        out[f"param:{name}"] = _detach(p)
    for name, b in model.named_buffers():
        out[f"buffer:{name}"] = _detach(b)
    return out


def _flat(prefix: str, v: Any) -> list[tuple[str, Any]]:
    if isinstance(v, (list, tuple)):
        return [kv for i, x in enumerate(v) for kv in _flat(f"{prefix}[{i}]", x)]
    if isinstance(v, Mapping):
        return [kv for k, x in v.items() for kv in _flat(f"{prefix}.{k}", x)]
    return [(prefix, v)]


def assert_records_equal(ref: Record, got: Record, where: str = "") -> None:
    """Same keys; every tensor ``torch.equal`` with the same dtype; names the first that differs."""
    __tracebackhide__ = True
    assert ref.keys() == got.keys(), f"{where}recorded {sorted(ref)} vs {sorted(got)}"
    for key in ref:
        for (name, a), (_, b) in zip(_flat(key, ref[key]), _flat(key, got[key]), strict=True):
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}{name}: {a!r} vs {b!r}"
                same_kind = a.dtype == b.dtype and a.shape == b.shape
                assert same_kind, f"{where}{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
                if not torch.equal(a, b):
                    diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "n/a"
                    raise AssertionError(f"{where}{name} differs (max abs diff {diff})")
            else:
                assert a == b, f"{where}{name}: {a!r} vs {b!r}"


def _run_steps(model: nn.Module, step: Callable[..., Mapping[str, Any] | None], run: Run, steps: int) -> list[Record]:
    out = []
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1000 + i)
        out.append(record(model, step(model, run, i)))
    return out


def check(
    build: Callable[[], nn.Module],
    step: Callable[..., Mapping[str, Any] | None],
    *,
    engine: str,
    timing: str,
    spill_dir: Path,
    steps: int = 2,
    raises: tuple[type[BaseException], str] | None = None,
    **attach_kw: Any,
) -> gds_offload.OffloadStats:
    """Run ``steps`` steps of ``step`` on ``build()`` plain, then on a fresh ``build()`` attached
    (``min_bytes=0, keep_last=0`` unless ``attach_kw`` says otherwise) with ``timing``;
    assert every record equal, and that bytes went to the drive (``natural``) and came
    back from it (``drive``). Returns the attached run's stats (after a final synchronize).

    ``raises=(cls, fragment)``: plain PyTorch raises ``cls`` with ``fragment`` in its message
    (checked, so the case is meaningful) and the attached run must raise it too.
    """
    assert timing in TIMINGS, timing
    plain_model = build()
    plain = Run(attached=False, timing=timing)
    if raises is not None:
        with pytest.raises(raises[0], match=re.escape(raises[1])):
            _run_steps(plain_model, step, plain, steps)
    else:
        ref = _run_steps(plain_model, step, plain, steps)
    del plain_model

    model = build()
    kw = {"min_bytes": 0, "keep_last": 0} | attach_kw
    with gds_offload.attach(model, path=spill_dir, mode=engine, **kw) as off:
        run = Run(attached=True, timing=timing, offloader=off)
        if raises is not None:
            with pytest.raises(raises[0], match=re.escape(raises[1])):
                _run_steps(model, step, run, steps)
            off.synchronize()
            return off.stats()
        got = _run_steps(model, step, run, steps)
        off.synchronize()
        st = off.stats()
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        assert_records_equal(r, g, where=f"[{engine}/{timing}] step {i}: ")
    assert_io(st, timing, run)
    return st


def assert_io(st: gds_offload.OffloadStats, timing: str, run: Run | None = None, *, backwards: int | None = None) -> None:
    """``drive``: bytes were read back from the drive; ``natural``: bytes were written to it.

    ``backwards``: with ``drive``, every offloaded byte was read back from the drive that many
    times (once per backward through it) and none was served from memory, so a read path that
    lost or changed bytes shows in the results; with ``natural``, some bytes were read back or
    served from memory."""
    if timing == "drive":
        assert run is None or run.syncs > 0, "a drive-timed step never called run.sync()"
        assert st.bytes_read > 0, f"drive timing but nothing was read back: {st}"
        if backwards is not None:
            assert st.bytes_read == backwards * st.bytes_offloaded and st.bytes_forwarded == 0, (
                f"drive timing: expected every offloaded byte read back {backwards}x from the drive: {st}"
            )
    else:
        assert st.bytes_offloaded > 0, f"nothing was offloaded: {st}"
        if backwards is not None:
            assert st.bytes_read + st.bytes_forwarded > 0, f"backward used no offloaded tensor: {st}"


def loss_step(forward: Callable[[nn.Module, int], Any]) -> Callable[[nn.Module, Run, int], Record]:
    """The common step: ``forward(model, i)`` returns ``loss`` or ``(loss, leaves)``, where
    ``leaves`` maps names to leaf tensors whose ``.grad`` is compared too. Then
    ``run.sync()`` and ``loss.backward()``."""

    def step(model: nn.Module, run: Run, i: int) -> Record:
        out = forward(model, i)
        loss, leaves = out if isinstance(out, tuple) else (out, {})
        run.sync()
        loss.backward()
        return {"loss": loss} | {f"{k}.grad": v.grad for k, v in leaves.items()}

    return step

