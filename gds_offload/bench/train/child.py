"""Train one run's model in this process and measure it: the child process's job.

:func:`gds_offload.bench.train.runner.run_mode` starts ``python -m gds_offload.bench.train.child --spec JSON``
and reads the events this module writes to stdout. The modes are listed in
:mod:`gds_offload.bench.train.spec`.

One step is forward, backward, ``AdamW.step()`` and ``zero_grad(set_to_none=True)``.
The seed of step ``i`` (dropout masks) and its batch depend only on ``spec.seed`` and
``i``, so every mode computes the same losses unless a mode changes the numbers.

Peak activation memory (:mod:`gds_offload.bench.train.memory`): the peak from before the first
step (model and AdamW state built, the mode not set up yet) to the end of the last, warm-up
included, above the level at that baseline; the same definition for every mode. Step
times are those of the measured steps (after the warm-up).

Paired runs (``RunSpec(paired=True)``, ``gds-offload bench --paired``): an offload mode's
child alternates offloaded steps with steps under :meth:`~gds_offload.Offloader.paused`
(no offloading), in ABBA order, and reports both (an odd count's last step is offloaded,
without a partner). Their ratio compares steps seconds
apart in one process, so a shared machine's slow spells, which last minutes and can move a
mode's median by a third between processes, hit both sides alike.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import gds_offload
from gds_offload.activations.layers import find_layers
from gds_offload.bench.procs import emit, read_spec
from gds_offload.bench.train.determinism import deterministic_kernels
from gds_offload.bench.train.memory import Peak, adamw_with_state, proc_status_bytes
from gds_offload.bench.train.spec import RunResult, RunSpec, Unavailable, attach_kwargs, parse_mode
from gds_offload.bench.train.workload import Workload, build_workload

if TYPE_CHECKING:
    import torch

    from gds_offload.activations.offloader import Offloader

__all__ = [
    "run_here",
    "exact_in_process",
    "abba_first_half",
    "is_unpaired",
    "in_process_verdict",
    "LOSSES_DIFFER_NOTE",
    "main",
]

#: Printed by ``bench`` and ``demo`` when modes disagree.
LOSSES_DIFFER_NOTE = (
    "modes run in separate processes with MKL_CBWR=AUTO,STRICT so that torch's CPU kernels give the same bits in "
    "each; a few runs of the demo model still differ in their last steps, with or without the offloader "
    "(see gds_offload.bench.train.runner). So an offload mode that differs is checked again in one process, 2 steps "
    "without and then with the offloader, where only the offloader can make a difference."
)


def in_process_verdict(exact: bool) -> str:
    """The line (rich markup) that reports :func:`exact_in_process`'s answer after a cross-process difference."""
    if exact:
        return ("[green]bit-identical in one process[/] (2 steps without, then with the offloader, every loss and "
                "gradient): the difference came from separate processes, not the offloader")
    return "[red]NOT bit-identical in one process: the offloader changed a result; please report it[/]"


def _params_digest(model: Any) -> str:
    import torch
    import xxhash

    h = xxhash.xxh3_64()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _checkpoint_layers(layers: list[tuple[str, Any]]) -> None:
    """Wrap each layer's forward in non-reentrant activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    for _, layer in layers:
        inner = layer.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


def _offload_snapshot(off: Any) -> dict[str, Any]:
    s = off.stats()
    e = off.engine.stats()
    return {
        "resident_bytes": s.resident_bytes,
        "peak_resident_bytes": s.peak_resident_bytes,
        "bytes_offloaded": s.bytes_offloaded,
        "bytes_read": s.bytes_read,
        "io_wait_s": s.io_wait_s,
        "write_gbps": e.write_gbps(),
        "read_gbps": e.read_gbps(),
    }


def abba_first_half(k: int) -> bool:
    """Whether measured step ``k`` of a paired run is the treated half of its pair (A in ABBA).

    Pair ``j`` is steps ``2j`` and ``2j + 1``: A then B when ``j`` is even, B then A when it
    is odd, so a steady drift of the machine's speed cancels over two pairs.
    """
    return (k % 2 == 0) == ((k // 2) % 2 == 0)


def is_unpaired(k: int, steps: int) -> bool:
    """Whether measured step ``k`` of ``steps`` has no partner: the last one of an odd count
    (it runs offloaded, and only the complete pairs give ratios)."""
    return steps % 2 == 1 and k == steps - 1


def _seed_step(spec: RunSpec, i: int) -> None:
    """Seed step ``i``'s random numbers (dropout masks) from ``spec.seed`` and ``i`` alone, so
    every mode, in any process, draws the same ones."""
    import torch

    torch.manual_seed(spec.seed * 1_000_003 + i)


def exact_in_process(spec: RunSpec, steps: int = 2) -> bool:
    """Whether ``spec``'s offload mode is bit-exact, decided in this one process.

    Trains ``steps`` steps of ``spec``'s model from the same weights twice here, without
    and then with :func:`gds_offload.attach` (``spec``'s engine and policy), and compares
    every loss and every gradient with ``torch.equal``. Comparing runs of separate
    processes can show kernel differences that are not the offloader's (see
    :mod:`gds_offload.bench.train.runner`); this cannot. On CUDA both runs use deterministic kernels
    (:func:`~gds_offload.bench.train.determinism.deterministic_kernels`, which says what it
    excludes); an op without a deterministic CUDA kernel raises.
    """
    import contextlib

    import torch

    kind, engine = parse_mode(spec.mode)
    if kind not in ("offload", "adaptive"):
        raise ValueError(f"exact_in_process checks an offload mode, not {spec.mode!r}")
    policy = "adaptive" if kind == "adaptive" else spec.policy
    with deterministic_kernels() if spec.device.startswith("cuda") else contextlib.nullcontext():
        plain = _losses_and_grads(spec, steps, None)
        offloaded = _losses_and_grads(spec, steps, attach_kwargs(spec, engine or "auto", policy))
    return len(plain) == len(offloaded) and all(torch.equal(a, b) for a, b in zip(plain, offloaded))


def _losses_and_grads(spec: RunSpec, steps: int, attach_kw: dict[str, Any] | None) -> list[Any]:
    """Every loss and gradient of ``steps`` steps of ``spec``'s model (no optimizer step), with
    :func:`gds_offload.attach` ``(**attach_kw)`` or, for ``None``, without an offloader."""

    wl = build_workload(replace(spec, mode="keep"))
    model = wl.model
    model.train()
    off = gds_offload.attach(model, **attach_kw) if attach_kw is not None else None
    seen: list[Any] = []
    try:
        for i in range(steps):
            _seed_step(spec, i)
            loss = wl.loss_fn(model, wl.batch_fn(i))
            loss.backward()
            seen.append(loss.detach().clone())
            seen.extend(p.grad.clone() for p in model.parameters() if p.grad is not None)
            model.zero_grad(set_to_none=True)
    finally:
        if off is not None:
            off.detach()
    return seen


def _apply_mode(spec: RunSpec, kind: str, engine: str | None, model: Any, result: RunResult) -> Offloader | None:
    """Set ``model`` up for ``kind``: attach the offloader (offload modes, which it returns) or
    checkpoint every layer (``recompute``); record in ``result`` what was set up.

    Raises:
        Unavailable: ``attach()`` refused the arguments, or ``recompute`` found no layers.
    """
    if kind in ("offload", "adaptive"):

        try:
            off = gds_offload.attach(model, **attach_kwargs(spec, engine or "auto", "adaptive" if kind == "adaptive" else spec.policy))
        except gds_offload.ConfigError as exc:
            raise Unavailable(str(exc)) from exc
        result.engine, result.engine_reason, result.gds = off.engine.name, off.stats().engine_reason, off.engine.uses_gds
        result.layer_names = list(off.layer_names)
        return off
    if kind == "recompute":

        layers = find_layers(model)
        if not layers:
            raise Unavailable("recompute: no repeated layers found in the model to checkpoint")
        _checkpoint_layers(layers)
        result.layer_names = [n for n, _ in layers]
    return None


class _Trainer:
    """One run's training step in this process, and the record of each step it runs."""

    def __init__(self, spec: RunSpec, wl: Workload, opt: Any, off: Offloader | None, result: RunResult,
                 emit: Callable[[dict[str, Any]], None], *, save_on_cpu: bool) -> None:
        import torch

        self.spec, self.wl, self.opt, self.off, self.result, self.emit = spec, wl, opt, off, result, emit
        # Every CUDA call names the device: without it, --device cuda:1 would time and measure GPU 0.
        self.gpu: torch.device | None = torch.device(spec.device) if spec.device.startswith("cuda") else None
        self._saving: Callable[[], contextlib.AbstractContextManager[Any]] = (
            (lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)) if save_on_cpu else contextlib.nullcontext)
        #: How long the last :meth:`step` waited for its batch.
        self.input_wait_s = 0.0

    def sync(self) -> None:
        """Wait for the GPU's queued work, so that times and memory counters include it."""
        if self.gpu is not None:
            import torch

            torch.cuda.synchronize(self.gpu)

    def step(self, i: int) -> tuple[float, float]:
        """Train step ``i``; returns its loss and its wall time (the batch is made outside it, and
        the wait for it kept in :attr:`input_wait_s`)."""
        t0 = time.perf_counter()
        batch = self.wl.batch_fn(i)
        self.input_wait_s = time.perf_counter() - t0
        self.sync()
        t0 = time.perf_counter()
        _seed_step(self.spec, i)
        with self._saving():
            loss = self.wl.loss_fn(self.wl.model, batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return float(loss.detach()), time.perf_counter() - t0

    def record(self, i: int, phase: str, loss: float, dt: float) -> None:
        """Keep step ``i``'s loss; with ``spec.progress``, emit the step (the demo's live display)."""
        self.result.losses.append(loss)
        self.result.losses_hex.append(loss.hex())
        if self.spec.progress:
            ev: dict[str, Any] = {"event": "step", "phase": phase, "step": i, "loss": loss, "step_s": dt,
                                  "rss_bytes": proc_status_bytes("VmRSS")}
            if self.off is not None:
                ev["offload"] = _offload_snapshot(self.off)
            self.emit(ev)


def _measure(trainer: _Trainer, peak: Peak) -> int | None:
    """Run the measured steps; return the memory peak since the baseline, warm-up included
    (``None``: not measured).

    With ``spec.paired`` (offload modes) offloaded and paused steps alternate in ABBA order,
    the paused ones go to ``paired_keep_s``, and the peak is that of the offloaded
    ones and of the warm-up (offloaded too).
    """
    spec, off, result = trainer.spec, trainer.off, trainer.result
    paired = spec.paired and off is not None
    paired_peak = peak.now() or 0  # the warm-up's
    for k in range(spec.steps):
        i = spec.warmup + k
        offloaded = not paired or abba_first_half(k) or is_unpaired(k, spec.steps)
        if paired and offloaded:  # the peak of offloaded steps only
            peak.reset()
        with off.paused() if off is not None and not offloaded else contextlib.nullcontext():
            loss, dt = trainer.step(i)
        if paired and offloaded:
            paired_peak = max(paired_peak, peak.now() or 0)
        (result.step_s if offloaded else result.paired_keep_s).append(dt)
        result.input_wait_s.append(trainer.input_wait_s)
        trainer.record(i, "measure" if offloaded else "paused", loss, dt)
    if not paired:
        return peak.now()
    return paired_peak if peak.measuring else None


def run_here(
    spec: RunSpec,
    emit: Callable[[dict[str, Any]], None] = emit,  # the protocol's (gds_offload.bench.procs.emit)
    workload: Callable[[RunSpec], Workload] = build_workload,
) -> RunResult:
    """Run ``spec`` in this process (the child's job; call :func:`~gds_offload.bench.train.runner.run_mode` instead).

    With ``spec.paired`` an offload mode alternates its measured steps between offloaded
    and :meth:`~gds_offload.Offloader.paused` ones (pairs in ABBA order): the paused steps
    go to ``paired_keep_s``, and the memory peak is that of the offloaded steps. With
    an odd ``spec.steps`` the last step is offloaded and unpaired (:func:`is_unpaired`).
    ``workload`` builds the model (``bench --nproc``: wrapped in DDP, each rank its batches).

    Raises:
        Unavailable: the mode cannot run here.
    """
    import torch

    kind, engine = parse_mode(spec.mode)
    if spec.warmup < 1 or spec.steps < 1:
        raise ValueError(f"need warmup >= 1 and steps >= 1, got warmup={spec.warmup} steps={spec.steps}")
    # Modes are compared bit for bit across processes: ask torch for its deterministic kernels.
    torch.use_deterministic_algorithms(True, warn_only=True)
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    if kind == "save_on_cpu" and not spec.device.startswith("cuda"):
        raise Unavailable("save_on_cpu moves CUDA activations to host memory; it needs --device cuda")
    result = RunResult(spec.mode, model=spec.model, device=spec.device, tokens_per_step=spec.tokens_per_step,
                       torch_threads=torch.get_num_threads())
    wl = workload(spec)
    wl.model.train()
    opt = adamw_with_state(wl.model.parameters(), spec.lr)
    gc.collect()
    peak = Peak(torch.device(spec.device) if spec.device.startswith("cuda") else None)
    peak.start(spec, result)  # the baseline: before the mode is set up and before the first step
    off = _apply_mode(spec, kind, engine, wl.model, result)
    emit({"event": "setup", "mode": spec.mode, "engine": result.engine, "engine_reason": result.engine_reason,
          "gds": result.gds, "layers": len(result.layer_names), "device": spec.device})
    trainer = _Trainer(spec, wl, opt, off, result, emit, save_on_cpu=kind == "save_on_cpu")
    try:
        for i in range(spec.warmup):
            trainer.record(i, "warmup", *trainer.step(i))
        # The counters of the measured steps (bytes and waits per step; each step's writes
        # counted once landed, so synchronize() at both ends), the peaks of the whole run.
        if off is not None:
            off.synchronize()
        warm = off.stats(reset=True) if off is not None else None
        peak_abs = _measure(trainer, peak)
        if peak_abs is not None and result.base_bytes is not None:
            result.peak_activation_bytes = peak_abs - result.base_bytes
        if off is not None and warm is not None:
            off.synchronize()
            result.offload = off.stats().as_dict()
            for key in ("peak_resident_bytes", "peak_kept_bytes", "peak_writing_bytes", "peak_loaded_bytes", "peak_read_buffer_bytes"):
                result.offload[key] = max(result.offload[key], getattr(warm, key))
    finally:
        if off is not None:
            off.detach()
    result.median_step_s = statistics.median(result.step_s)
    result.tokens_per_s = spec.tokens_per_step / result.median_step_s if result.median_step_s else None
    result.params_digest = _params_digest(wl.model)
    result.status = "ok"
    return result


def child_spec(argv: list[str] | None, module: str, description: str) -> RunSpec:
    """A child's :class:`RunSpec` (its ``--spec JSON``, read by :func:`~gds_offload.bench.procs.read_spec`)."""
    return RunSpec.from_json(read_spec(argv, module, description))


def main(argv: list[str] | None = None) -> int:
    """The child process: run the ``--spec`` and emit its result as the last event."""
    spec = child_spec(argv, "gds_offload.bench.train.child", __doc__.splitlines()[0])
    t0 = time.perf_counter()
    try:
        result = run_here(spec)
    except Unavailable as exc:
        result = RunResult(spec.mode, "unavailable", f"unavailable: {exc}", spec.model, spec.device, spec.tokens_per_step)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as an error row
        traceback.print_exc()
        result = RunResult(spec.mode, "error", f"{type(exc).__name__}: {exc}", spec.model, spec.device, spec.tokens_per_step)
    result.wall_s = time.perf_counter() - t0
    emit({"event": "result", **result.as_dict()})
    return 1 if result.status == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
