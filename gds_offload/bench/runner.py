"""Train one model in one *mode* in a child process, and measure it.

Each mode runs in its own process (``python -m gds_offload.bench.runner --spec JSON``)
so that its memory peak is its own: nothing another mode allocated, cached or leaked
can raise or hide it. The parent (:func:`run_mode`) reads the child's progress as JSON
lines on its stdout and gets back a :class:`RunResult`; a child that fails, is killed
(out of memory) or times out becomes a result with ``status="error"``, never an
exception in the parent.

Modes:

* ``keep``: no offloader: autograd keeps every saved activation in memory.
* ``offload`` / ``offload:<engine>``: :func:`gds_offload.attach` with ``mode=<engine>``
  (``auto``, ``gds``, ``compat``, ``posix``, ``host``; plain ``offload`` is ``auto``).
* ``adaptive`` / ``adaptive:<engine>``: ``attach(policy="adaptive")``. Where this version
  of ``attach`` does not know that policy the row is ``status="unavailable"`` with the error.
* ``recompute``: activation checkpointing of every layer
  (``torch.utils.checkpoint.checkpoint(layer, ..., use_reentrant=False)``).
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (CUDA only).

One step is forward, backward, ``AdamW.step()`` and ``zero_grad(set_to_none=True)``.
The seed of step ``i`` (dropout masks) and its batch depend only on ``spec.seed`` and
``i``, so every mode computes the same losses unless a mode changes the numbers.

Peak activation memory: on CPU, the child's peak resident set (``VmHWM``) during the
measured steps minus its resident set after the warm-up steps (model, optimizer state
and engine buffers allocated). The child runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so
glibc returns freed large blocks to the OS and the resident set falls back between
steps; ``VmHWM`` is reset by writing ``5`` to ``/proc/self/clear_refs``. On CUDA:
``torch.cuda.max_memory_allocated()`` minus ``memory_allocated()`` after the warm-up.
Either way the figure also holds gradients and backward temporaries, the same for
every mode.

Paired runs (``RunSpec(paired=True)``, ``gds-offload bench --paired``): an offload mode's
child alternates offloaded steps with steps under :meth:`~gds_offload.Offloader.paused`
(no offloading), in ABBA order, and reports both (an odd count's last step is offloaded,
without a partner). Their ratio compares steps seconds
apart in one process, so a shared machine's slow spells, which last minutes and move a
mode's median by up to a third between processes (keep: 7.0, 9.5 and 8.1 s in the three
rounds of one ``bench --rounds 3`` on the 2-vCPU test VM), hit both sides alike.

.. note:: The allocator setting costs time
   Returning every large block makes each step fault its pages in again: on a 2-core
   VM every mode's steps took about 30 % longer than with glibc's defaults, while the
   ratios between modes stayed within a few percent (keep 2.75 -> 3.58 s, posix offload
   1.21x -> 1.24x keep, host offload 1.15x -> 1.13x). ``RunSpec(measure_memory=False)``
   (``--no-memory``) runs with the defaults and reports no memory peak. It cannot be
   switched inside one process: once glibc's heap holds large free blocks it serves
   later requests from them whatever the threshold (measured: ``mallopt`` plus
   ``malloc_trim`` after the warm-up left the peak of keep at 1.73 instead of 1.47 GiB).

.. note:: Bit-identical across processes
   Children run with ``MKL_CBWR=AUTO,STRICT`` (unless the environment sets ``MKL_CBWR``):
   MKL's conditional numerical reproducibility, strict mode. Without it, MKL's CPU kernels
   gave different last bits in different processes (one bench run of three modes on the
   2-core test VM ended with three different sets of weights). It does not remove every
   difference: in 6 of 30 non-keep rows of bench runs of the demo model, the last step
   still ended with other last bits, 5 of them with the very same weights, one of those a
   ``recompute`` row, which uses no offloader. So the rest is torch's or MKL's, and
   ``gds-offload demo`` re-checks in one process (:func:`exact_in_process`) before it
   blames the offloader.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

from gds_offload.bench.children import die_with_parent, reap, spawn

__all__ = [
    "RunSpec",
    "RunResult",
    "ModelSpec",
    "Workload",
    "run_mode",
    "run_here",
    "build_workload",
    "parse_mode",
    "available_offload_engines",
    "expand_modes",
    "compare_losses",
    "EVENT_PREFIX",
]

#: Lines of the child's stdout that carry events start with this; anything else is ignored.
EVENT_PREFIX = "@@gds_offload.bench "
#: Built-in model names (``gpt``: :mod:`gds_offload.bench.gpt`; the others: Hugging Face configs).
BUILTIN_MODELS = ("gpt", "llama", "gpt2")
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
    #: Offload modes: alternate offloaded and paused steps (see :func:`run_here`).
    paired: bool = False
    #: Train on token shards from this directory (:mod:`gds_offload.data.train`), not synthetic tokens.
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
    step_seconds: list[float] = field(default_factory=list)
    #: ``paired`` offload modes: the paused steps, ``paired_keep_seconds[j]`` the partner of ``step_seconds[j]``.
    paired_keep_seconds: list[float] = field(default_factory=list)
    median_step_s: float | None = None
    tokens_per_s: float | None = None
    #: Peak memory above the post-warm-up baseline (see the module doc).
    peak_activation_bytes: int | None = None
    #: How ``peak_activation_bytes`` was measured.
    memory_source: str = ""
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


@dataclass(frozen=True)
class ModelSpec:
    """What a user's model factory (``--model pkg.module:factory``) is called with."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int
    dropout: float
    seed: int
    device: str


@dataclass
class Workload:
    """A model and how to train it: ``loss_fn(model, batch_fn(step))`` is one step's loss."""

    model: Any
    batch_fn: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], Any]


# ---------------------------------------------------------------------- modes
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

    from gds_offload.io import choose_engine
    from gds_offload.store import default_spill_dir

    engines = ["posix"]
    for name in ("compat", "gds"):
        if name == "gds" and not device.startswith("cuda"):
            continue
        try:
            choose_engine(name, Path(path) if path else default_spill_dir())  # type: ignore[arg-type]
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


# ---------------------------------------------------------------------- parent side
#: Printed by ``bench`` and ``demo`` when modes disagree.
LOSSES_DIFFER_NOTE = (
    "modes run in separate processes with MKL_CBWR=AUTO,STRICT so that torch's CPU kernels give the same bits in "
    "each; a few runs of the demo model still differ in their last steps, with or without the offloader "
    "(see gds_offload.bench.runner). So an offload mode that differs is checked again in one process, 2 steps "
    "without and then with the offloader, where only the offloader can make a difference."
)


def in_process_verdict(exact: bool) -> str:
    """The line (rich markup) that reports :func:`exact_in_process`'s answer after a cross-process difference."""
    if exact:
        return ("[green]bit-identical in one process[/] (2 steps without, then with the offloader, every loss and "
                "gradient): the difference came from separate processes, not the offloader")
    return "[red]NOT bit-identical in one process: the offloader changed a result; please report it[/]"


def run_mode(
    spec: RunSpec,
    *,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    timeout_s: float | None = None,
    python: str | None = None,
    argv: list[str] | None = None,
) -> RunResult:
    """Run ``spec`` in a child process and return what it measured. Never raises for a
    failing child: a crash, a kill (out of memory) or a timeout is a ``status="error"`` row.

    Args:
        spec: the run.
        on_event: called on this thread with each progress event (``{"event": "setup"|"step", ...}``).
        timeout_s: kill the child after this many seconds.
        python: the interpreter (default: this one).
        argv: the command to start instead of this module's child: a launcher whose children
            emit the same events (``bench --nproc``: torchrun, see :mod:`gds_offload.bench.ranks_runner`).
    """
    cmd = argv or [python or sys.executable, "-m", "gds_offload.bench.runner", "--spec", spec.to_json()]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("MKL_CBWR", "AUTO,STRICT")  # see the module doc: bit-identical across processes
    if spec.measure_memory and not spec.device.startswith("cuda"):
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if spec.device.startswith("cuda"):
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    t0 = time.perf_counter()
    try:
        proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    except OSError as exc:
        return RunResult(spec.mode, "error", f"cannot start {cmd[0]}: {exc}", spec.model, spec.device)
    timer = None
    try:
        err_tail: collections.deque[str] = collections.deque(maxlen=40)
        reader = threading.Thread(target=lambda: err_tail.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        timed_out = threading.Event()
        if timeout_s:
            timer = threading.Timer(timeout_s, lambda: (timed_out.set(), proc.kill()))
            timer.daemon = True
            timer.start()
        result = _read_events(proc, on_event)
        rc = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        reap(proc)  # a no-op after wait(); on an exception (a stop signal) it stops the child first
    reader.join(timeout=5)
    wall = time.perf_counter() - t0
    if result is not None:
        result.pop("event", None)
        out = RunResult(**{k: v for k, v in result.items() if k in {f.name for f in fields(RunResult)}})
        out.returncode, out.wall_s = rc, wall
        return out
    if timed_out.is_set():
        why = f"timed out after {timeout_s:.0f} s (killed)"
    elif rc == -9:
        why = "killed by SIGKILL (out of memory? see `dmesg`)"
    elif rc < 0:
        why = f"killed by signal {-rc}"
    else:
        why = f"exit code {rc}"
    tail = "".join(err_tail).strip().splitlines()[-3:]
    detail = f"{why}: {' | '.join(tail)}" if tail else why
    return RunResult(spec.mode, "error", detail, spec.model, spec.device, spec.tokens_per_step, wall_s=wall, returncode=rc)


def _read_events(proc: subprocess.Popen[str], on_event: Callable[[dict[str, Any]], None] | None) -> dict[str, Any] | None:
    """Pass the child's progress events to ``on_event`` until its stdout ends; return its result event."""
    result: dict[str, Any] | None = None
    assert proc.stdout is not None, "stdout is a pipe"
    for line in proc.stdout:
        if not line.startswith(EVENT_PREFIX):
            continue
        try:
            event = json.loads(line[len(EVENT_PREFIX) :])
        except json.JSONDecodeError:
            continue
        if event.get("event") == "result":
            result = event
        elif on_event is not None:
            on_event(event)
    return result


# ---------------------------------------------------------------------- child side
def build_workload(spec: RunSpec) -> Workload:
    """The model of ``spec.model`` on ``spec.device`` with its batches and loss.

    ``gpt``: :mod:`gds_offload.bench.gpt`. ``llama`` / ``gpt2``: ``LlamaForCausalLM`` /
    ``GPT2LMHeadModel`` from a config of the requested size, random weights (nothing is
    downloaded), SDPA attention. ``pkg.module:factory``: see :func:`_user_workload`.

    Raises:
        ValueError: an unknown model name.
    """
    import torch

    if spec.data:
        from gds_offload.data.train import with_data

        return with_data(build_workload(replace(spec, data=None)), spec)
    torch.manual_seed(spec.seed)
    if spec.model == "gpt":
        from gds_offload.bench.gpt import GPTConfig, lm_loss, make_gpt, synthetic_batch

        cfg = GPTConfig(spec.layers, spec.hidden, spec.heads, spec.seq, spec.vocab, spec.dropout)
        model = make_gpt(cfg, seed=spec.seed, device=spec.device)
        return Workload(model, lambda i: synthetic_batch(cfg, spec.batch, spec.seed + 1 + i, device=spec.device), lm_loss)
    if spec.model in ("llama", "gpt2"):
        model = hf_model(spec.model, spec).to(spec.device)
        return Workload(model, lambda i: _hf_batch(spec, i), _output_loss)
    if ":" in spec.model:
        return _user_workload(spec)
    raise ValueError(
        f"model={spec.model!r} is unknown; expected {', '.join(BUILTIN_MODELS)} or 'pkg.module:factory' "
        f"(a function taking a ModelSpec and returning (model, batch_fn))"
    )


def hf_model(name: str, spec: RunSpec | ModelSpec) -> Any:
    """A Hugging Face ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` of the size in ``spec``, random weights."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        if name == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(
                vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=4 * spec.hidden,
                num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
                max_position_embeddings=spec.seq, attention_dropout=0.0, attn_implementation="sdpa",
            )
            return LlamaForCausalLM(cfg)
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=spec.vocab, n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
            n_positions=spec.seq, resid_pdrop=spec.dropout, embd_pdrop=spec.dropout, attn_pdrop=0.0,
            bos_token_id=spec.vocab - 1, eos_token_id=spec.vocab - 1, attn_implementation="sdpa",
        )
        return GPT2LMHeadModel(cfg)


def _hf_batch(spec: RunSpec, step: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(spec.seed + 1 + step)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=gen).to(spec.device)
    return {"input_ids": ids, "labels": ids}


def _output_loss(model: Any, batch: Any) -> Any:
    """The loss convention for HF models and user factories: call the model with the batch
    (``**dict``, ``*tuple`` or the object) and take the output itself when it is a tensor,
    else ``output.loss`` / ``output["loss"]``."""
    import torch

    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"the model returned {type(out).__name__} with no loss; return a scalar tensor or an object "
            f"with .loss, or return (model, batch_fn, loss_fn) from the factory"
        )
    return loss


def _user_workload(spec: RunSpec) -> Workload:
    """``--model pkg.module:factory``: the factory contract.

    ``factory(spec: ModelSpec)`` returns ``(model, batch_fn)`` or ``(model, batch_fn, loss_fn)``:

    * ``model``: an ``nn.Module`` already on ``spec.device``;
    * ``batch_fn(step: int)``: the batch of that step; must depend only on ``step`` (and
      ``spec.seed``), so every mode trains on the same data;
    * ``loss_fn(model, batch) -> scalar tensor``; without it the model is called with the
      batch (``**dict``, ``*tuple``, or the object) and its output is the loss, or has
      ``.loss`` / ``["loss"]`` (Hugging Face models with ``labels``).
    """
    module_name, _, attr = spec.model.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model={spec.model!r}: cannot import {attr!r} from {module_name!r} ({exc})") from exc
    made = factory(ModelSpec(spec.layers, spec.hidden, spec.heads, spec.seq, spec.vocab, spec.batch,
                             spec.dropout, spec.seed, spec.device))
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise TypeError(f"{spec.model} returned {type(made).__name__}; expected (model, batch_fn) or (model, batch_fn, loss_fn)")
    return Workload(made[0], made[1], made[2] if len(made) == 3 else _output_loss)


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(EVENT_PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> str:
    """Reset this process's ``VmHWM`` to its current RSS. Returns "" or why it failed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return ""
    except OSError as exc:
        return f"cannot reset VmHWM ({exc})"


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


def attach_kwargs(spec: RunSpec, engine: str, policy: str) -> dict[str, Any]:
    """The :func:`gds_offload.attach` keyword arguments of ``spec`` (its unset options left to attach's defaults)."""
    kw: dict[str, Any] = {"mode": engine, "policy": policy}
    for name in ("path", "max_bandwidth", "keep_last", "min_bytes", "prefetch_bytes", "num_threads"):
        value = getattr(spec, name)
        if value is not None:
            kw[name] = value
    return kw


def _offload_snapshot(off: Any) -> dict[str, Any]:
    s = off.stats()
    e = off.engine.stats()
    return {
        "resident_bytes": s.resident_bytes,
        "peak_resident_bytes": s.peak_resident_bytes,
        "bytes_offloaded": s.bytes_offloaded,
        "bytes_read": s.bytes_read,
        "io_wait_seconds": s.io_wait_seconds,
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


def paired_ratios(result: RunResult) -> list[float]:
    """Each pair's offloaded step time over its paused partner's (empty unless the run was paired)."""
    return [a / b for a, b in zip(result.step_seconds, result.paired_keep_seconds) if b]


def exact_in_process(spec: RunSpec, steps: int = 2) -> bool:
    """Whether ``spec``'s offload mode is bit-exact, decided in this one process.

    Trains ``steps`` steps of ``spec``'s model from the same weights twice here, without
    and then with :func:`gds_offload.attach` (``spec``'s engine and policy), and compares
    every loss and every gradient with ``torch.equal``. Comparing runs of separate
    processes can show kernel differences that are not the offloader's (see the module
    doc); this cannot. On CUDA both runs use deterministic kernels
    (:func:`~gds_offload.bench.determinism.deterministic_kernels`, which says what it
    excludes); an op without a deterministic CUDA kernel raises.
    """
    import contextlib

    import torch

    import gds_offload
    from gds_offload.bench.determinism import deterministic_kernels

    kind, engine = parse_mode(spec.mode)
    if kind not in ("offload", "adaptive"):
        raise ValueError(f"exact_in_process checks an offload mode, not {spec.mode!r}")
    policy = "adaptive" if kind == "adaptive" else spec.policy

    def train(offloaded: bool) -> list[torch.Tensor]:
        wl = build_workload(replace(spec, mode="keep"))
        model = wl.model
        model.train()
        off = gds_offload.attach(model, **attach_kwargs(spec, engine or "auto", policy)) if offloaded else None
        seen: list[torch.Tensor] = []
        try:
            for i in range(steps):
                torch.manual_seed(spec.seed * 1_000_003 + i)
                loss = wl.loss_fn(model, wl.batch_fn(i))
                loss.backward()
                seen.append(loss.detach().clone())
                seen.extend(p.grad.clone() for p in model.parameters() if p.grad is not None)
                model.zero_grad(set_to_none=True)
        finally:
            if off is not None:
                off.detach()
        return seen

    with deterministic_kernels() if spec.device.startswith("cuda") else contextlib.nullcontext():
        plain, offloaded = train(False), train(True)
    return len(plain) == len(offloaded) and all(torch.equal(a, b) for a, b in zip(plain, offloaded))


def run_here(
    spec: RunSpec,
    emit: Callable[[dict[str, Any]], None] = _emit,
    workload: Callable[[RunSpec], Workload] = build_workload,
) -> RunResult:
    """Run ``spec`` in this process (the child's job; call :func:`run_mode` instead).

    With ``spec.paired`` an offload mode alternates its measured steps between offloaded
    and :meth:`~gds_offload.Offloader.paused` ones (pairs in ABBA order): the paused steps
    go to ``paired_keep_seconds``, and the memory peak is that of the offloaded steps. With
    an odd ``spec.steps`` the last step is offloaded and unpaired (:func:`is_unpaired`).
    ``workload`` builds the model (``bench --nproc``: wrapped in DDP, each rank its batches).

    Raises:
        Unavailable: the mode cannot run here.
    """
    import torch

    kind, engine = parse_mode(spec.mode)
    if spec.warmup < 1 or spec.steps < 1:
        raise ValueError(f"need warmup >= 1 and steps >= 1, got warmup={spec.warmup} steps={spec.steps}")
    cuda = spec.device.startswith("cuda")
    # Modes are compared bit for bit across processes: ask torch for its deterministic kernels.
    torch.use_deterministic_algorithms(True, warn_only=True)
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    if kind == "save_on_cpu" and not cuda:
        raise Unavailable("save_on_cpu moves CUDA activations to host memory; it needs --device cuda")
    result = RunResult(spec.mode, model=spec.model, device=spec.device, tokens_per_step=spec.tokens_per_step,
                       torch_threads=torch.get_num_threads())
    wl = workload(spec)
    model = wl.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    off = None
    if kind in ("offload", "adaptive"):
        import gds_offload

        try:
            off = gds_offload.attach(model, **attach_kwargs(spec, engine or "auto", "adaptive" if kind == "adaptive" else spec.policy))
        except gds_offload.ConfigError as exc:
            raise Unavailable(str(exc)) from exc
        result.engine, result.engine_reason, result.gds = off.engine.name, off.stats().engine_reason, off.engine.uses_gds
        result.layer_names = list(off.layer_names)
    elif kind == "recompute":
        from gds_offload.layers import find_layers

        layers = find_layers(model)
        if not layers:
            raise Unavailable("recompute: no repeated layers found in the model to checkpoint")
        _checkpoint_layers(layers)
        result.layer_names = [n for n, _ in layers]
    saving = (lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)) if kind == "save_on_cpu" else contextlib.nullcontext
    emit({"event": "setup", "mode": spec.mode, "engine": result.engine, "engine_reason": result.engine_reason,
          "gds": result.gds, "layers": len(result.layer_names), "device": spec.device})

    # Every CUDA call names the device: without it, --device cuda:1 would time and measure GPU 0.
    gpu = torch.device(spec.device) if cuda else None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(gpu)

    def step(i: int) -> tuple[float, float]:
        batch = wl.batch_fn(i)
        sync()
        t0 = time.perf_counter()
        torch.manual_seed(spec.seed * 1_000_003 + i)
        with saving():
            loss = wl.loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return float(loss.detach()), time.perf_counter() - t0

    def record(i: int, phase: str, loss: float, dt: float) -> None:
        result.losses.append(loss)
        result.losses_hex.append(loss.hex())
        if spec.progress:
            ev: dict[str, Any] = {"event": "step", "phase": phase, "step": i, "loss": loss, "step_s": dt,
                                  "rss_bytes": _proc_status_bytes("VmRSS")}
            if off is not None:
                ev["offload"] = _offload_snapshot(off)
            emit(ev)

    try:
        for i in range(spec.warmup):
            record(i, "warmup", *step(i))
        gc.collect()
        sync()
        if cuda:
            result.base_bytes = torch.cuda.memory_allocated(gpu)
            torch.cuda.reset_peak_memory_stats(gpu)
            result.memory_source = "torch.cuda.max_memory_allocated - memory_allocated after warm-up"
        elif spec.measure_memory:
            result.base_bytes = _proc_status_bytes("VmRSS")
            why = _reset_hwm()
            result.memory_source = why or "VmHWM - VmRSS after warm-up (MALLOC_MMAP_THRESHOLD_=65536)"
        else:
            result.memory_source = "not measured (measure_memory=False: default allocator settings)"
        if off is not None:
            off.stats(reset=True)
        paired = spec.paired and off is not None
        hwm = result.memory_source.startswith("VmHWM")
        paired_peak = 0
        for i in range(spec.warmup, spec.warmup + spec.steps):
            offloaded = not paired or abba_first_half(i - spec.warmup) or is_unpaired(i - spec.warmup, spec.steps)
            if paired and offloaded:  # the peak of offloaded steps only
                if cuda:
                    torch.cuda.reset_peak_memory_stats(gpu)
                elif hwm:
                    _reset_hwm()
            with off.paused() if paired and not offloaded else contextlib.nullcontext():  # type: ignore[union-attr]
                loss, dt = step(i)
            if paired and offloaded:
                now = torch.cuda.max_memory_allocated(gpu) if cuda else _proc_status_bytes("VmHWM") if hwm else None
                paired_peak = max(paired_peak, now or 0)
            (result.step_seconds if offloaded else result.paired_keep_seconds).append(dt)
            record(i, "measure" if offloaded else "paused", loss, dt)
        if cuda:
            peak_abs: int | None = paired_peak if paired else torch.cuda.max_memory_allocated(gpu)
        else:
            peak_abs = (paired_peak if paired else _proc_status_bytes("VmHWM")) if hwm else None
        if peak_abs is not None and result.base_bytes is not None:
            result.peak_activation_bytes = peak_abs - result.base_bytes
        if off is not None:
            result.offload = off.stats().as_dict()
    finally:
        if off is not None:
            off.detach()
    result.median_step_s = statistics.median(result.step_seconds)
    result.tokens_per_s = spec.tokens_per_step / result.median_step_s if result.median_step_s else None
    result.params_digest = _params_digest(model)
    result.status = "ok"
    return result


def child_spec(argv: list[str] | None, module: str, description: str) -> RunSpec:
    """A child's only argument, ``--spec JSON``, read once the child is tied to its parent (:func:`die_with_parent`)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--spec", required=True, help="a RunSpec as JSON")
    args = parser.parse_args(argv)
    die_with_parent()
    return RunSpec.from_json(args.spec)


def main(argv: list[str] | None = None) -> int:
    """The child process: run the ``--spec`` and emit its result as the last event."""
    spec = child_spec(argv, "gds_offload.bench.runner", __doc__.splitlines()[0])
    t0 = time.perf_counter()
    try:
        result = run_here(spec)
    except Unavailable as exc:
        result = RunResult(spec.mode, "unavailable", f"unavailable: {exc}", spec.model, spec.device, spec.tokens_per_step)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as an error row
        traceback.print_exc()
        result = RunResult(spec.mode, "error", f"{type(exc).__name__}: {exc}", spec.model, spec.device, spec.tokens_per_step)
    result.wall_s = time.perf_counter() - t0
    _emit({"event": "result", **result.as_dict()})
    return 1 if result.status == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
