"""What one benchmark run is: its :class:`RunSpec`, its :class:`RunResult`, and the mode names.

A run trains one model in one *mode* (:mod:`gds_offload.bench.train.child` runs it,
:func:`gds_offload.bench.train.runner.run_mode` starts it in a child process):

* ``keep``: no offloader: autograd keeps every saved activation in memory.
* ``offload`` / ``offload:<engine>``: :func:`gds_offload.attach` with ``mode=<engine>``
  (``auto``, ``gds``, ``compat``, ``posix``, ``host``; plain ``offload`` is ``auto``).
* ``adaptive`` / ``adaptive:<engine>``: ``attach(policy="adaptive")``. Where this version
  of ``attach`` does not know that policy the row is ``status="unavailable"`` with the error.
* ``recompute``: activation checkpointing of every layer
  (``torch.utils.checkpoint.checkpoint(layer, ..., use_reentrant=False)``).
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (CUDA only).

The comparisons of results (:func:`compare_losses`, :func:`paired_ratios`) live here too:
they read nothing but :class:`RunResult` fields.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from gds_offload.io.directory import default_spill_dir
from gds_offload.node.choice import choose_engine

__all__ = [
    "RunSpec",
    "RunResult",
    "Unavailable",
    "parse_mode",
    "available_offload_engines",
    "expand_modes",
    "compare_losses",
    "paired_ratios",
    "attach_kwargs",
]

_SIMPLE_MODES = ("keep", "recompute", "save_on_cpu")
_ENGINES = ("auto", "gds", "compat", "posix", "host")


class Unavailable(Exception):
    """A mode that cannot run here (recorded as ``status="unavailable"``, not as a failure)."""


@dataclass(frozen=True)
class RunSpec:
    """One run: a model, a size, a mode, and how long to measure.

    ``path``, ``max_bandwidth``, ``policy``, ``keep_last``, ``min_bytes``,
    ``prefetch_bytes`` and ``num_threads`` go to :func:`gds_offload.attach` (``None``:
    its default) in the offload modes.
    """

    mode: str
    model: str = "gpt"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq: int = 256
    vocab: int = 4096
    batch: int = 8
    dropout: float = 0.0
    steps: int = 5
    warmup: int = 2
    seed: int = 0
    lr: float = 1e-4
    device: str = "cpu"
    path: str | None = None
    max_bandwidth: str | None = None
    policy: str = "all"
    keep_last: int | None = None
    min_bytes: int | None = None
    prefetch_bytes: int | None = None
    num_threads: int | None = None
    #: Measure CPU memory (runs the child with ``MALLOC_MMAP_THRESHOLD_=65536``; see the module doc).
    measure_memory: bool = True
    #: Emit one event per step (the demo's live display); the result event is always sent.
    progress: bool = False
    #: Offload modes: alternate offloaded and paused steps (see :func:`gds_offload.bench.train.child.run_here`).
    paired: bool = False
    #: Train on token shards from this directory (:mod:`gds_offload.bench.train.data`), not synthetic tokens.
    data: str | None = None
    #: ``torch.set_num_threads`` in the child (None: torch's default); ``bench --nproc`` gives
    #: one process and each rank the same count, so their compute is comparable.
    torch_threads: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--spec has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


@dataclass
class RunResult:
    """What one mode measured. ``status`` is ``ok``, ``unavailable`` (the mode cannot run
    here; ``error`` says why) or ``error`` (it failed; ``error`` holds the last lines)."""

    mode: str
    status: Literal["ok", "unavailable", "error"] = "error"
    error: str = ""
    model: str = ""
    device: str = ""
    tokens_per_step: int = 0
    #: Every step's wall time, warm-up steps excluded (with ``paired``: the offloaded steps).
    step_s: list[float] = field(default_factory=list)
    #: ``paired`` offload modes: the paused steps, ``paired_keep_s[j]`` the partner of ``step_s[j]``.
    paired_keep_s: list[float] = field(default_factory=list)
    #: How long each measured step (offloaded and paused alike, in order) waited for its batch
    #: (``batch_fn``, outside the step's time): the input pipeline's stall, ~0 when it keeps up.
    input_wait_s: list[float] = field(default_factory=list)
    median_step_s: float | None = None
    tokens_per_s: float | None = None
    #: Peak memory over the whole run, first step included, above the baseline taken before
    #: it with the model and optimizer built (:mod:`gds_offload.bench.train.memory`).
    peak_activation_bytes: int | None = None
    #: How ``peak_activation_bytes`` was measured.
    memory_source: str = ""
    #: The baseline (RSS, or CUDA bytes allocated) the peak is counted from.
    base_bytes: int | None = None
    #: Loss of every step, warm-up included, in order.
    losses: list[float] = field(default_factory=list)
    #: ``float.hex`` of each loss: compare these for bit-identity.
    losses_hex: list[str] = field(default_factory=list)
    #: xxh3-64 of every parameter's bytes after the last step.
    params_digest: str = ""
    engine: str | None = None
    engine_reason: str | None = None
    gds: bool | None = None
    #: torch's intra-op threads in the child (``torch.get_num_threads()``; ``OMP_NUM_THREADS`` sets it).
    torch_threads: int | None = None
    #: ``OffloadStats.as_dict()`` over the measured steps (offload modes only).
    offload: dict[str, Any] | None = None
    #: Names of the layers the mode planned (offload) or checkpointed (recompute) by.
    layer_names: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    returncode: int | None = None
    #: Which round of an interleaved benchmark (``gds-offload bench --rounds``) this run belongs to.
    round: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_mode(mode: str) -> tuple[str, str | None]:
    """``"offload:posix" -> ("offload", "posix")``, ``"keep" -> ("keep", None)``.

    Raises:
        ValueError: an unknown mode (the message lists the known ones).
    """
    kind, _, engine = mode.partition(":")
    if kind in ("offload", "adaptive"):
        engine = engine or "auto"
        if engine not in _ENGINES:
            raise ValueError(f"mode {mode!r}: engine {engine!r} is unknown; expected {kind}:<{'|'.join(_ENGINES)}>")
        return kind, engine
    if kind in _SIMPLE_MODES and not engine:
        return kind, None
    raise ValueError(
        f"mode {mode!r} is unknown; expected keep, offload, offload:<{'|'.join(_ENGINES)}>, offload:*, "
        f"adaptive, adaptive:<engine>, recompute or save_on_cpu"
    )


def available_offload_engines(device: str, path: str | None) -> list[str]:
    """The engines that can run here: posix and host always, compat with a usable KvikIO,
    gds on a CUDA device where GPUDirect Storage works at ``path``."""
    from pathlib import Path

    engines = ["posix"]
    for name in ("compat", "gds"):
        if name == "gds" and not device.startswith("cuda"):
            continue
        try:
            choose_engine(name, Path(path) if path else default_spill_dir())
        except Exception:  # noqa: BLE001 - not usable here: leave it out
            continue
        engines.append(name)
    engines.append("host")
    return engines


def expand_modes(modes: list[str], device: str, path: str | None) -> list[str]:
    """Expand ``offload:*`` to every engine that runs here and drop duplicates (order kept).

    Raises:
        ValueError: an unknown mode.
    """
    out: list[str] = []
    for mode in modes:
        mode = mode.strip()
        if not mode:
            continue
        expanded = [f"offload:{e}" for e in available_offload_engines(device, path)] if mode == "offload:*" else [mode]
        for m in expanded:
            parse_mode(m)
            if m not in out:
                out.append(m)
    return out


def compare_losses(results: list[RunResult], reference: str = "keep") -> dict[str, bool | None]:
    """For each mode: are its losses (and final parameters) bit-identical to the reference's?

    The reference is ``keep`` when it ran, else the first mode that did. ``None`` for
    modes that did not run (or had nothing to compare).
    """
    ok = [r for r in results if r.status == "ok" and r.losses_hex]
    ref = next((r for r in ok if r.mode == reference), ok[0] if ok else None)
    out: dict[str, bool | None] = {}
    for r in results:
        if ref is None or r.status != "ok" or not r.losses_hex:
            out[r.mode] = None
        else:
            out[r.mode] = r.losses_hex == ref.losses_hex and r.params_digest == ref.params_digest
    return out


def paired_ratios(result: RunResult) -> list[float]:
    """Each pair's offloaded step time over its paused partner's (empty unless the run was paired)."""
    return [a / b for a, b in zip(result.step_s, result.paired_keep_s) if b]


def attach_kwargs(spec: RunSpec, engine: str, policy: str) -> dict[str, Any]:
    """The :func:`gds_offload.attach` keyword arguments of ``spec`` (its unset options left to attach's defaults)."""
    kw: dict[str, Any] = {"mode": engine, "policy": policy}
    for name in ("path", "max_bandwidth", "keep_last", "min_bytes", "prefetch_bytes", "num_threads"):
        value = getattr(spec, name)
        if value is not None:
            kw[name] = value
    return kw
