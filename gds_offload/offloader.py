"""``attach(model)``: wires the scheduler into a model's forward and backward.

Hooks installed (all removed by :meth:`Offloader.detach`):

* root forward pre-hook: enters ``torch.autograd.graph.saved_tensors_hooks`` with the
  scheduler's pack/unpack (only when grad mode is on: under ``no_grad`` nothing is saved);
* root forward hook (``always_call=True``, so an exception in forward still pops the
  hooks): leaves it, and marks the start of backward on the output's ``grad_fn``;
* per layer: a forward pre-hook (a new unit starts) and a forward hook that puts a
  pre-hook on the layer output's ``grad_fn``: when backward reaches that layer, the
  reads of the layers below are issued (prefetch);
* ``model.forward`` wrapped in an :class:`_InterruptGuard` (an instance attribute): the
  ``always_call`` hook above does not run for ``KeyboardInterrupt``/``SystemExit``, the
  guard pops the hooks then.

At interpreter exit, attached offloaders drop their queued transfers (exit never waits
for a write backlog; the unnamed spill files vanish with the process).

.. warning:: ``copy.deepcopy`` of an attached model fails (its hooks reference the
   offloader, which holds locks): copy the model before ``attach()`` or after ``detach()``.
"""
from __future__ import annotations

import atexit
import contextlib
import difflib
import functools
import os
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gds_offload.errors import ConfigError
from gds_offload.io import choose_engine, make_engine, validate_mode
from gds_offload.io.base import Engine
from gds_offload.layers import resolve_layers
from gds_offload.policy import Adaptive, Budget, OffloadAll, Plan, Policy
from gds_offload.ranks import PerRank, rank_path
from gds_offload.scheduler import Scheduler, SchedulerConfig
from gds_offload.stats import OffloadStats
from gds_offload.store import Slot, SpillStore, default_spill_dir
from gds_offload.units import parse_bandwidth, parse_bytes

__all__ = ["attach", "Offloader", "OffloadConfig", "DEFAULT_MIN_BYTES"]

#: Storages under this size stay in memory. Measured with ``gds-offload bench-io``:
#: below about 1 MiB per transfer the engines reach well under half of the drive's bandwidth.
DEFAULT_MIN_BYTES = 1 << 20

_POLICIES = ("all", "adaptive")


@dataclass(frozen=True)
class OffloadConfig:
    """Everything :func:`attach` was asked for, validated."""

    paths: tuple[Path, ...]
    mode: str
    policy: str | Budget
    min_bytes: int
    keep_last: int
    prefetch_bytes: int | None
    max_bandwidth: float | None
    on_error: Literal["fallback", "raise"]
    num_threads: int | None = None
    verify: bool = False
    write_window: int | None = None
    default_path: bool = field(default=False, compare=False)


@dataclass
class _ThreadState:
    """What one thread's forwards of the attached model are doing."""

    depth: int = 0
    ctx: torch.autograd.graph.saved_tensors_hooks | None = None
    paused: int = 0


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """Tensors inside a module output (tensor, tuple/list, dict, ``ModelOutput``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in(v)]
    return []


class Offloader:
    """An offloader attached to one model. Create with :func:`attach`.

    Use as a context manager to detach on exit::

        with gds_offload.attach(model) as off:
            model(x).sum().backward()
        print(off.stats())
    """

    def __init__(self, model: nn.Module, config: OffloadConfig, layers: Sequence[tuple[str, nn.Module]]) -> None:
        # Validate first, then allocate, then register.
        device = next((p.device.type for p in model.parameters()), None)
        choice = choose_engine(config.mode, config.paths[0], device)  # type: ignore[arg-type]
        self.config = config
        self.layer_names = [n for n, _ in layers]
        engine = make_engine(choice.engine, max_bandwidth=config.max_bandwidth, num_threads=config.num_threads)
        try:
            store = SpillStore(
                list(config.paths) if engine.needs_files else [],
                create_default=config.default_path,
            )
        except BaseException:
            engine.close()
            raise
        policy = _make_policy(config)
        self._stats = OffloadStats(engine=engine.name, engine_reason=choice.reason, gds=engine.uses_gds)
        self.engine = engine
        self.store = store
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.min_bytes, config.prefetch_bytes, config.on_error, verify=config.verify, write_window_bytes=config.write_window
            ),
            policy,
            engine,
            store,
            self._stats,
        )
        self._model_ref = weakref.ref(model)
        #: Per thread: nesting depth of the model's forward, the hooks context it entered, pauses.
        self._tls = threading.local()
        self._handles: list[RemovableHandle] = []
        self._attached = True
        self._handles.append(model.register_forward_pre_hook(self._root_pre))
        self._handles.append(model.register_forward_hook(self._root_post, always_call=True))
        for name, layer in layers:
            self._handles.append(layer.register_forward_pre_hook(lambda _m, _a, n=name: self.scheduler.begin_layer(n)))
            self._handles.append(layer.register_forward_hook(self._layer_post))
        # always_call forward hooks do not run when forward is left by a BaseException
        # (KeyboardInterrupt, SystemExit): this guard pops the hooks then. See _InterruptGuard.
        self._guard = _InterruptGuard(model.forward, self._abort_forward)
        self._had_forward_attr = "forward" in model.__dict__
        model.forward = self._guard
        model._gds_offloader = weakref.ref(self)  # type: ignore[assignment]  # attaching twice is refused
        self._pid = os.getpid()
        _LIVE.add(self)

    # ------------------------------------------------------------------ hooks
    def _thread(self) -> _ThreadState:
        st = getattr(self._tls, "state", None)
        if st is None:
            st = self._tls.state = _ThreadState()
        return st

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        st = self._thread()
        if not torch.is_grad_enabled() or (st.paused and not st.depth):
            return
        if st.depth:
            st.depth += 1  # the model calls itself: one forward
            return
        if os.getpid() != self._pid:
            self._after_fork()
        # Transactional: whatever raises below (hooks disabled by the caller or by torch.func,
        # a pending offload error) leaves the offloader exactly as it was.
        ctx = torch.autograd.graph.saved_tensors_hooks(self.scheduler.pack, self.scheduler.unpack)
        ctx.__enter__()  # first: where hooks are refused, PyTorch's own message is the one to see
        try:
            params = [p for p in module.parameters()] + [b for b in module.buffers()]
            self.scheduler.begin_forward(params, len(self.layer_names))
        except BaseException:
            ctx.__exit__(None, None, None)
            raise
        st.ctx, st.depth = ctx, 1

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        st = self._thread()
        if st.depth == 0:
            return
        st.depth -= 1
        if st.depth:
            return
        self._leave_forward(st)
        position = self.scheduler.current_position()
        self.scheduler.end_forward()
        if position is not None:
            self._on_backward_of(output, *position)

    def _leave_forward(self, st: _ThreadState) -> None:
        ctx, st.ctx, st.depth = st.ctx, None, 0
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _layer_post(self, module: nn.Module, args: Any, output: Any) -> None:
        position = self.scheduler.current_position()
        if position is not None:
            self._on_backward_of(output, *position)

    def _on_backward_of(self, output: Any, forward_id: int, unit: int) -> None:
        for t in _tensors_in(output):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(lambda _g, f=forward_id, u=unit: self.scheduler.on_unit_backward(f, u))
                return

    def _abort_forward(self) -> None:
        """Forward was interrupted (KeyboardInterrupt, SystemExit): pop the hooks, end the forward."""
        st = self._thread()
        if not st.depth:
            return
        self._leave_forward(st)
        if self.scheduler.current_position() is not None:
            self.scheduler.end_forward()

    def _after_fork(self) -> None:
        """The first forward in a forked child: a spill store and engine of its own.

        The child inherited the parent's spill file descriptor and a copy of its slot
        allocator; sharing them would let parent and child overwrite each other's slots.
        KvikIO's thread pool does not survive ``fork``, so a KvikIO engine becomes posix.
        """
        self._pid = os.getpid()
        name = self.engine.name
        if name in ("gds", "compat"):
            warnings.warn(
                f"gds_offload: this process was forked after attach(); KvikIO ({name}) does not survive fork, "
                "so this child offloads through the posix engine. Attach in the child, or start workers "
                "with the 'spawn' method, to keep KvikIO",
                RuntimeWarning,
                stacklevel=3,
            )
            name = "posix"
        self.store.forget()  # the child's copies of the descriptors; the parent's stay open
        engine = make_engine(name, max_bandwidth=self.config.max_bandwidth, num_threads=self.config.num_threads)  # type: ignore[arg-type]
        store = SpillStore(list(self.config.paths) if engine.needs_files else [])
        self.engine, self.store = engine, store
        self._stats.engine = engine.name
        self.scheduler.after_fork(engine, store)

    # ------------------------------------------------------------------ public
    def stats(self, *, reset: bool = False, all_ranks: bool = False) -> OffloadStats:
        """A snapshot of the counters. ``reset=True`` zeroes them (peaks included) after reading.

        ``all_ranks=True`` combines every rank's counters over torch.distributed's default
        process group (sums; the largest for peaks; see :mod:`gds_offload.rank_stats`). It
        is a collective: every rank must call it at the same point. Raises
        :class:`ConfigError` when no process group is initialised.
        """
        if all_ranks:
            from gds_offload.rank_stats import reduce_stats

            return reduce_stats(self.stats(reset=reset))
        live, layers = self.scheduler.snapshot()
        e = self.engine.stats()
        snap = replace(
            live,
            write_seconds=e.write_busy_seconds,
            read_seconds=e.read_busy_seconds,
            spill_file_bytes=self.store.file_bytes(),
            layers=layers,
        )
        if reset:
            fresh = OffloadStats(engine=live.engine, engine_reason=live.engine_reason, gds=live.gds)
            fresh.resident_bytes = fresh.peak_resident_bytes = live.resident_bytes
            fresh.write_window_bytes = live.write_window_bytes
            for k, v in vars(fresh).items():
                setattr(live, k, v)
        return snap

    def spilled(self) -> list[tuple[Slot, int]]:
        """Where the bytes are that only the drive holds now: ``(slot, nbytes)`` per live tensor
        storage. ``self.engine.data_offset(slot)`` is the file offset of the first byte."""
        return self.scheduler.spilled()

    def use_engine(self, engine: Engine) -> None:
        """Move bytes through ``engine`` from now on, e.g. a
        :class:`~gds_offload.io.faults.FaultyEngine` wrapping :attr:`engine`. Call it between
        steps, with no transfer in flight; the old engine is not closed (a wrapper owns it)."""
        self.synchronize()
        self.scheduler.use_engine(engine)
        self.engine = engine

    def synchronize(self) -> None:
        """Block until every write and read in flight has finished (successfully or not).

        After it returns, every offloaded tensor's bytes are on the drive, and tensors whose
        write finished before backward reached their layer are no longer in memory: the
        next backward reads them back. Tests use it to force that timing.
        """
        self.scheduler.wait_inflight()

    def plan(self) -> Plan:
        """The policy's current per-layer decision with its reasons (printable with ``rich.print``)."""
        return self.scheduler.policy.plan()

    @property
    def attached(self) -> bool:
        return self._attached

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards that *start* inside this block, on this thread, run as if nothing were attached.

        Autograd keeps what they save in memory, nothing is written, and they do not
        count in :meth:`stats` or feed the policy. Other threads' forwards, a forward
        already running when the block is entered, and graphs built before it, are still
        served by the offloader. Blocks nest. For an A/B comparison in one process
        (``gds-offload bench --paired``), a step that must not touch the drive, or a
        ``torch.func`` transform (which refuses saved-tensor hooks).
        """
        st = self._thread()
        st.paused += 1
        try:
            yield
        finally:
            st.paused -= 1

    def detach(self) -> None:
        """Remove every hook, wait for in-flight writes, release the spill store. Idempotent.

        Safe while a graph built with the offloader is still alive: tensors whose bytes
        are only on disk are read back into memory first, so its backward still works.
        """
        if not self._attached:
            return
        self._attached = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        st = self._thread()
        if st.depth:  # detach() called from inside forward
            self._leave_forward(st)
        model = self._model_ref()
        if model is not None and model.__dict__.get("forward") is self._guard:
            if self._had_forward_attr:
                model.forward = self._guard.forward
            else:
                del model.forward
        self.scheduler.wait_inflight()
        self.scheduler.materialize_all()
        self.engine.close()
        self.store.close()
        _LIVE.discard(self)
        if model is not None and getattr(model, "_gds_offloader", None) is not None:
            del model._gds_offloader

    def _close_at_exit(self) -> None:
        """Interpreter exit: cancel queued transfers so exit never waits for a write backlog (the
        unnamed spill files vanish with the process); transfers already running finish."""
        if not self._attached:
            return
        self._attached = False
        self.scheduler.stop()
        self.engine.abort()

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        return (
            f"Offloader(engine={self.engine.name!r}, paths={[str(p) for p in self.config.paths]}, "
            f"layers={len(self.layer_names)}, attached={self._attached})"
        )


def attach(
    model: nn.Module,
    *,
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | PerRank | None = None,
    mode: str = "auto",
    policy: str | Budget = "all",
    budget: int | str | None = None,
    min_bytes: int | str = DEFAULT_MIN_BYTES,
    keep_last: int = 1,
    layers: Sequence[nn.Module | str] | None = None,
    prefetch_bytes: int | str | None = None,
    max_bandwidth: float | str | None = None,
    on_error: Literal["fallback", "raise"] = "fallback",
    num_threads: int | None = None,
    verify: bool = False,
    write_window: int | str | None = None,
) -> Offloader:
    """Offload the activations ``model`` saves for backward to NVMe (or host memory).

    Args:
        model: any ``nn.Module``. Its repeated blocks (``ModuleList``/``Sequential`` of one
            type) are found automatically; override with ``layers``.
        path: spill directory, or a list of them (one per drive; tensors are striped).
            Default: ``$GDS_OFFLOAD_DIR``, else ``<tmp>/gds_offload-<uid>`` (created 0700).
            Per rank (:mod:`gds_offload.ranks`): ``{rank}``/``{local_rank}`` templates,
            :func:`~gds_offload.per_rank`, ``"auto"`` (the NVMe drive closest to the GPU);
            under torchrun/SLURM the default becomes ``<default>/rank<rank>``.
        mode: ``auto`` (GDS where usable, else KvikIO compat, else POSIX), ``gds``,
            ``compat``, ``posix`` or ``host``.
        policy: ``all``: offload every eligible tensor outside the last ``keep_last`` layers;
            ``adaptive``: measure a step, then offload the most that the drive can hide
            behind compute; a :class:`~gds_offload.policy.Budget`: keep peak activation
            memory under a target with the least I/O.
        budget: shorthand for ``policy=Budget(budget)`` (``"40GiB"``).
        min_bytes: storages smaller than this stay in memory (int or ``"1MiB"``).
        keep_last: number of last layer calls whose activations stay in memory
            (backward needs them first).
        layers: the blocks to plan by, as modules or qualified names.
        prefetch_bytes: bytes of reads issued ahead of the layer in backward; default: one
            layer ahead (``adaptive`` deepens it when the drive needs more time).
        max_bandwidth: cap the engine at this many bytes/s (``"200MB/s"``): imitate a slow
            drive, or leave bandwidth to other jobs.
        on_error: when a write fails (drive full, I/O error): ``fallback`` keeps the tensor
            in memory and warns once; ``raise`` raises :class:`OffloadError` at the next hook.
        num_threads: I/O threads of the engine (default: the engine's measured default).
        verify: checksum (xxh3-64) every spill slot after its write and check it after each
            read; a mismatch raises :class:`OffloadError` naming the layer, tensor, file and
            offset. Off by default: without it, bytes changed on disk go undetected
            (see :mod:`gds_offload.integrity`).

    Returns:
        The :class:`Offloader`; also a context manager that detaches on exit.

    Raises:
        ConfigError: bad arguments (the message names the argument and the fix).
        GDSUnavailableError: ``mode="gds"`` where GPUDirect Storage does not work.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise ConfigError(
            "attach() got a torch.compile'd module; saved-tensor hooks do not run inside compiled graphs. "
            "Attach to the uncompiled model (model._orig_mod), or compile only submodules inside its layers"
        )
    existing = getattr(model, "_gds_offloader", None)
    if existing is not None and existing() is not None and existing().attached:
        raise ConfigError("an offloader is already attached to this model; call .detach() on it first")
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"{type(model).__name__} has no parameters; attach() offloads activations of a trained model")
    validate_mode(mode)
    if budget is not None:
        if policy != "all":
            raise ConfigError(f"pass either budget={budget!r} or policy={policy!r}, not both")
        policy = Budget(budget)
    if not isinstance(policy, Budget) and policy not in _POLICIES:
        hint = difflib.get_close_matches(str(policy), _POLICIES, n=1)
        raise ConfigError(
            f"policy={policy!r} is unknown; expected one of {', '.join(_POLICIES)} or gds_offload.Budget('40GiB')"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    if on_error not in ("fallback", "raise"):
        raise ConfigError(f"on_error={on_error!r} is unknown; expected 'fallback' or 'raise'")
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 0:
        raise ConfigError(f"keep_last={keep_last!r} must be an int >= 0 (layers kept in memory at the end)")
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ConfigError(f"num_threads={num_threads!r} must be a positive int")
    path = rank_path(path, model=model)  # this rank's directories under torchrun/SLURM (gds_offload/ranks.py)
    default_path = path is None
    if path is None:
        paths: tuple[Path, ...] = (default_spill_dir(),)
    elif isinstance(path, (str, os.PathLike)):
        paths = (Path(path),)
    else:
        paths = tuple(Path(p) for p in path)
        if not paths:
            raise ConfigError("path=[] names no directory; pass a directory or a list of them")
    config = OffloadConfig(
        paths=paths,
        mode=mode,
        policy=policy,
        min_bytes=parse_bytes(min_bytes, name="min_bytes"),
        keep_last=keep_last,
        prefetch_bytes=None if prefetch_bytes is None else parse_bytes(prefetch_bytes, name="prefetch_bytes"),
        max_bandwidth=None if max_bandwidth is None else parse_bandwidth(max_bandwidth),
        on_error=on_error,
        num_threads=num_threads,
        verify=bool(verify),
        write_window=None if write_window is None else parse_bytes(write_window, name="write_window"),
        default_path=default_path,
    )
    return Offloader(model, config, resolve_layers(model, layers))



def _make_policy(config: OffloadConfig) -> Policy:
    if isinstance(config.policy, Budget):
        return config.policy
    if config.policy == "adaptive":
        return Adaptive(keep_last=config.keep_last)
    return OffloadAll(keep_last=config.keep_last)


class _InterruptGuard:
    """``model.forward`` while an offloader is attached: calls the real forward, and when a
    ``BaseException`` that is not an ``Exception`` (KeyboardInterrupt, SystemExit) leaves it,
    runs ``on_abort`` so the saved-tensor hooks are popped at once. (``always_call`` forward
    hooks cover ``Exception`` only.)

    Copying or pickling the model yields its plain forward (``__reduce__``), never the guard.
    """

    def __init__(self, forward: Any, on_abort: Any) -> None:
        self.forward = forward
        self._on_abort = on_abort
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.forward(*args, **kwargs)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._on_abort()
            raise

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _unguarded, (self.forward,)


def _unguarded(forward: Any) -> Any:
    return forward


#: Attached offloaders, stopped at interpreter exit.
_LIVE: weakref.WeakSet[Offloader] = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for off in list(_LIVE):
        try:
            off._close_at_exit()
        except Exception:  # noqa: BLE001 - exiting anyway; never mask the exit status
            pass


# threading's exit hooks run (last registered first) before concurrent.futures joins its
# workers, which would otherwise run every queued transfer first; atexit runs after that.
getattr(threading, "_register_atexit", atexit.register)(_close_all_at_exit)
