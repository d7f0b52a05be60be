"""``attach(model)``: wires the scheduler into a model's forward and backward.

The :class:`Offloader`, its hooks and what keeps its engine and store alive stay in one
module: they share the per-thread forward state and the ownership rules of the note
below. Its arguments are checked in :mod:`gds_offload.config`.

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

Each thread has its own forward state (depth, hooks context, pauses), so threads may
train one attached model at once. The root pre-hook is transactional: if entering the
hooks or starting the forward raises (hooks disabled by the caller or by ``torch.func``),
nothing has changed. The first forward in a process forked after ``attach()`` gives the
child its own spill store and engine (see :meth:`Offloader._after_fork`).

At interpreter exit, attached offloaders drop their queued transfers (exit never waits
for a write backlog; the unnamed spill files vanish with the process).

.. note:: Who keeps what alive
   The model holds the offloader (its hooks and forward guard), and so does a forward's graph
   (the backward pre-hooks on its outputs), so backward still works after the model is
   dropped. The offloader holds the model through its forward guard (a cycle the collector
   frees); ``model._gds_offloader`` is a weak reference. The engine and the spill store are
   released by a ``weakref.finalize`` on the offloader whose callback holds them, not the
   offloader: a model dropped without ``detach()`` gives back its threads, descriptors and
   disk space when the collector frees it.

.. warning:: ``copy.deepcopy`` of an attached model fails (its hooks reference the
   offloader, which holds locks): copy the model before ``attach()`` or after ``detach()``.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gds_offload.config import DEFAULT_MIN_BYTES, OffloadConfig, OnError
from gds_offload.errors import ConfigError
from gds_offload.io import choose_engine, make_engine
from gds_offload.io.base import Engine
from gds_offload.layers import resolve_layers
from gds_offload.policy import Budget, Plan
from gds_offload.ranks import PerRank, rank_path
from gds_offload.scheduler import Scheduler, SchedulerConfig
from gds_offload.stats import OffloadStats
from gds_offload.store import Slot, SpillStore

__all__ = ["attach", "offloader_of", "Offloader"]


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
        choice = choose_engine(config.mode, config.paths[0], device)
        self.config = config
        self.layer_names = [n for n, _ in layers]
        engine = make_engine(choice.engine, max_bandwidth=config.max_bandwidth, num_threads=config.num_threads, strict=choice.strict)
        try:
            store = SpillStore(
                list(config.paths) if engine.needs_files else [],
                create=True,
                origin=config.origin,
            )
        except BaseException:
            engine.close()
            raise
        policy = config.make_policy()
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
        # The engine's threads and the spill file live as long as this offloader, no longer: a
        # model dropped without detach() releases them when the collector frees the offloader.
        # See the note on ownership in the module doc; the callback must not reference self.
        self._finalizer = _release_finalizer(self, engine, store)
        self._had_forward_attr = "forward" in model.__dict__
        try:
            self._register(model, layers)
        except BaseException:
            self._unregister(model)
            self._finalizer.detach()
            _release(engine, store)
            raise
        self._pid = os.getpid()
        _LIVE.add(self)

    def _register(self, model: nn.Module, layers: Sequence[tuple[str, nn.Module]]) -> None:
        self._handles.append(model.register_forward_pre_hook(self._root_pre))
        self._handles.append(model.register_forward_hook(self._root_post, always_call=True))
        for name, layer in layers:
            self._handles.append(layer.register_forward_pre_hook(lambda _m, _a, n=name: self.scheduler.begin_layer(n)))
            self._handles.append(layer.register_forward_hook(self._layer_post))
        # always_call forward hooks do not run when forward is left by a BaseException
        # (KeyboardInterrupt, SystemExit): this guard pops the hooks then. See _InterruptGuard.
        self._guard = _InterruptGuard(model.forward, self._abort_forward)
        model.forward = self._guard
        model._gds_offloader = weakref.ref(self)  # type: ignore[assignment]  # attaching twice is refused

    def _unregister(self, model: nn.Module | None) -> None:
        """Undo :meth:`_register` (whatever part of it ran): hooks, the forward guard, the back-reference."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        guard: _InterruptGuard | None = getattr(self, "_guard", None)
        if model is None:
            return
        installed: object = model.__dict__.get("forward")  # object: an Any here would widen guard below
        if guard is not None and installed is guard:
            if self._had_forward_attr:
                model.forward = guard.forward
            else:
                del model.forward
        ref = getattr(model, "_gds_offloader", None)
        if isinstance(ref, weakref.ref) and ref() in (self, None):
            # Modules that store attributes elsewhere (jit wrappers) may refuse ``del``: overwrite then.
            try:
                del model._gds_offloader
            except AttributeError:
                with contextlib.suppress(AttributeError, TypeError):
                    model._gds_offloader = None  # type: ignore[assignment]

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
        store = SpillStore(list(self.config.paths) if engine.needs_files else [], origin=self.config.origin)
        self._finalizer.detach()  # the parent's engine and store are the parent's to release
        self.engine, self.store = engine, store
        self._finalizer = _release_finalizer(self, engine, store)
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
        self._finalizer.detach()  # the new engine (which owns a wrapped one) is now the one to close
        self._finalizer = _release_finalizer(self, engine, self.store)

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
        st = self._thread()
        if st.depth:  # detach() called from inside forward
            self._leave_forward(st)
        model = self._model_ref()
        self._unregister(model)
        self.scheduler.wait_inflight()
        self.scheduler.materialize_all()
        self._finalizer.detach()
        self.engine.close()
        self.store.close()
        _LIVE.discard(self)

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
    on_error: OnError = "fallback",
    num_threads: int | None = None,
    verify: bool = False,
    write_window: int | str | None = None,
) -> Offloader:
    """Offload the activations ``model`` saves for backward to NVMe (or host memory).

    Args:
        model: any ``nn.Module``. Its repeated blocks (``ModuleList``/``Sequential`` of one
            type) are found automatically; override with ``layers``.
        path: spill directory, or a list of them (one per drive; tensors are striped); one
            that does not exist is created (0700, parents as needed). Default:
            ``$GDS_OFFLOAD_DIR``, else ``<tmp>/gds_offload-<uid>``, which must belong to you.
            Every directory passes :func:`~gds_offload.spill_dir.check_dir` (as in ``gds-check``).
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
        write_window: most bytes that writes in flight may hold in memory (int or ``"512MiB"``);
            when it is full, the pack hook waits for writes to finish (``stats().write_wait_seconds``).
            Default: twice the largest layer's offloaded bytes, at least 64 MiB. This bounds
            memory when the drive is slower than forward produces activations.

    Returns:
        The :class:`Offloader`; also a context manager that detaches on exit.

    Raises:
        ConfigError: bad arguments (the message names the argument and the fix).
        GDSUnavailableError: ``mode="gds"`` where GPUDirect Storage does not work.
    """
    _check_model(model)
    if _is_path_spec(path):  # anything else is refused by OffloadConfig.from_kwargs, with its own message
        path = rank_path(path, model=model)  # this rank's directories under torchrun/SLURM (gds_offload/ranks.py)
    config = OffloadConfig.from_kwargs(
        path=path, mode=mode, policy=policy, budget=budget, min_bytes=min_bytes, keep_last=keep_last,
        prefetch_bytes=prefetch_bytes, max_bandwidth=max_bandwidth, on_error=on_error, num_threads=num_threads,
        verify=verify, write_window=write_window,
    )
    return Offloader(model, config, resolve_layers(model, _checked_layers(layers)))


def offloader_of(model: nn.Module) -> Offloader | None:
    """The offloader attached to ``model`` now; ``None`` when none is (never attached, or detached)."""
    ref = getattr(model, "_gds_offloader", None)
    owner = ref() if isinstance(ref, weakref.ref) else None
    return owner if owner is not None and owner.attached else None


def _is_path_spec(path: Any) -> bool:
    """Whether ``path`` has a shape :func:`~gds_offload.ranks.rank_path` resolves (None, a
    directory, a list of them, :func:`~gds_offload.per_rank`)."""
    if path is None or isinstance(path, (str, os.PathLike, PerRank, dict)):  # a dict: rank_path points to per_rank
        return True
    return isinstance(path, (list, tuple)) and all(isinstance(p, (str, os.PathLike)) for p in path)


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise ConfigError(
            "attach() got a torch.compile'd module; saved-tensor hooks do not run inside compiled graphs. "
            "Attach to the uncompiled model (model._orig_mod), or compile only submodules inside its layers"
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise ConfigError(
            f"attach() got a TorchScript module ({type(model).__name__}, from torch.jit.script or torch.jit.trace); "
            "TorchScript runs forward as one graph, so the per-layer hooks the offloader plans by cannot be "
            "registered (script) or never run (trace). Offload the eager model: attach to the eager module, "
            "before scripting or tracing it"
        )
    if offloader_of(model) is not None:
        raise ConfigError("an offloader is already attached to this model; call .detach() on it first")
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"{type(model).__name__} has no parameters; attach() offloads activations of a trained model")


def _checked_layers(layers: Any) -> Any:
    """``layers=`` must be a sequence of modules or names, not one string (or other iterable)."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes, nn.Module)):
        kind = "a module" if isinstance(layers, nn.Module) else f"a {type(layers).__name__}"
        raise ConfigError(
            f"layers={layers!r} is {kind}, not a list; pass a list of modules or qualified names, e.g. "
            f"layers=[{layers!r}]" if isinstance(layers, str) else
            f"layers={type(layers).__name__} is {kind}, not a list; pass a list of modules or qualified names, "
            f"e.g. layers=list(model.blocks)"
        )
    if not isinstance(layers, Sequence):
        raise ConfigError(
            f"layers={layers!r} ({type(layers).__name__}) is not a list; pass a list of modules or qualified names"
        )
    return layers


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


def _release_finalizer(owner: Offloader, engine: Engine, store: SpillStore) -> weakref.finalize:
    """Close ``engine`` and ``store`` when ``owner`` is collected (never at interpreter exit:
    the process's descriptors close with it, and exit must not wait for a write backlog)."""
    fin = weakref.finalize(owner, _release_from_gc, engine, store)
    fin.atexit = False
    return fin


def _release(engine: Engine, store: SpillStore) -> None:
    """Wait for the engine's transfers, stop its threads, then close (and so delete) the spill files."""
    try:
        engine.close()
    finally:
        store.close()


def _release_from_gc(engine: Engine, store: SpillStore) -> None:
    """:func:`_release` for an offloader the collector freed. The collector may run on any
    thread, an engine worker included, which cannot join its own pool: off the main thread
    the release runs on a short-lived thread of its own."""
    if threading.current_thread() is threading.main_thread():
        _release(engine, store)
    else:
        threading.Thread(target=_release, args=(engine, store), name="gds_offload-release", daemon=True).start()


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
