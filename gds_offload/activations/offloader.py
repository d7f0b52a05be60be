"""The :class:`Offloader`: wires the scheduler into a model's forward and backward.

The :class:`Offloader` and its hooks stay in one module: they share the per-thread forward
state and the ownership rules of the note below. The objects those rules rest on (the
forward guard, the finalizer that releases the engine and store) are in
:mod:`gds_offload.activations.lifetime`; :func:`~gds_offload.attach` (:mod:`gds_offload.activations.attach`)
checks the model and its layers and builds the offloader; its other arguments are checked
in :mod:`gds_offload.activations.config`.

Hooks installed (all removed by :meth:`Offloader.detach`):

* root forward pre-hook: enters ``torch.autograd.graph.saved_tensors_hooks`` with the
  scheduler's pack/unpack (only when grad mode is on: under ``no_grad`` nothing is saved);
* root forward hook (``always_call=True``, so an exception in forward still pops the
  hooks): leaves it, and marks the start of backward on the output's ``grad_fn``;
* per layer: a forward pre-hook (a new unit starts) and a forward hook that puts a
  pre-hook on the layer output's ``grad_fn``: when backward reaches that layer, and at
  each unpack, the reads of the tensors backward needs next are issued (prefetch);
* ``model.forward`` wrapped in an :class:`~gds_offload.activations.lifetime.InterruptGuard` (an
  instance attribute): the ``always_call`` hook above does not run for
  ``KeyboardInterrupt``/``SystemExit``, the guard pops the hooks then.

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

from gds_offload.activations.config import OffloadConfig
from gds_offload.activations.lifetime import InterruptGuard, release, release_finalizer
from gds_offload.activations.planning.policy import OffloadDecisions
from gds_offload.activations.rank_stats import reduce_stats
from gds_offload.activations.scheduler.core import Scheduler
from gds_offload.activations.scheduler.state import SchedulerConfig
from gds_offload.activations.stats import OffloadStats
from gds_offload.io.base import Engine
from gds_offload.io.factory import make_engine
from gds_offload.io.layout import Slot
from gds_offload.io.spill import SpillStore
from gds_offload.node.choice import choose_engine

__all__ = ["Offloader"]


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
        self._finalizer = release_finalizer(self, engine, store)
        self._had_forward_attr = "forward" in model.__dict__
        try:
            self._register(model, layers)
        except BaseException:
            self._unregister(model)
            self._finalizer.detach()
            release(engine, store)
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
        # (KeyboardInterrupt, SystemExit): this guard pops the hooks then. See InterruptGuard.
        self._guard = InterruptGuard(model.forward, self._abort_forward)
        model.forward = self._guard
        model._gds_offloader = weakref.ref(self)  # type: ignore[assignment]  # attaching twice is refused

    def _unregister(self, model: nn.Module | None) -> None:
        """Undo :meth:`_register` (whatever part of it ran): hooks, the forward guard, the back-reference."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        guard: InterruptGuard | None = getattr(self, "_guard", None)
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
        self._finalizer = release_finalizer(self, engine, store)
        self._stats.engine = engine.name
        self.scheduler.after_fork(engine, store)

    # ------------------------------------------------------------------ public
    def stats(self, *, reset: bool = False, all_ranks: bool = False) -> OffloadStats:
        """A snapshot of the counters. ``reset=True`` zeroes them (peaks included) after reading.

        ``all_ranks=True`` combines every rank's counters over torch.distributed's default
        process group (sums; the largest for peaks; see :mod:`gds_offload.activations.rank_stats`). It
        is a collective: every rank must call it at the same point. Raises
        :class:`ConfigError` when no process group is initialised.
        """
        if all_ranks:

            return reduce_stats(self.stats(reset=reset))
        live, layers = self.scheduler.snapshot()
        e = self.engine.stats()
        snap = replace(
            live,
            write_s=e.write_busy_s,
            read_s=e.read_busy_s,
            read_buffer_bytes=e.read_buffer_bytes,
            peak_read_buffer_bytes=e.peak_read_buffer_bytes,
            idle_buffer_bytes=e.idle_buffer_bytes,
            staging_bytes=e.staging_bytes,
            spill_file_bytes=self.store.file_bytes(),
            layers=layers,
        )
        if reset:
            self.engine.reset_peaks()
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
        self._finalizer = release_finalizer(self, engine, self.store)

    def synchronize(self) -> None:
        """Block until every write and read in flight has finished (successfully or not).

        After it returns, every offloaded tensor's bytes are on the drive, and tensors whose
        write finished before backward reached their layer are no longer in memory: the
        next backward reads them back. Tests use it to force that timing.
        """
        self.scheduler.wait_inflight()

    def plan(self) -> OffloadDecisions:
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
