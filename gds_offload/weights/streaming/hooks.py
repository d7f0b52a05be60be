"""The hook object of a streamed model, :class:`LayerStreamer`, shaped as Accelerate's ``ModelHook``:
it owns the state its hooks share (the ring, what fills which slot next, the weights backward
saved, the slots' views, the team running, the counters) and has an explicit life:

* construction: the views of every slot, the prefetcher and the saved-tensor hooks, over a
  ring that :mod:`gds_offload.weights.run.model` made (nothing is registered yet);
* :meth:`LayerStreamer.attach`: a forward pre-hook and hook on each streamed layer, the pass
  through the decoder wrapped, the first fills issued;
* the hooks (below), a layer-major team (:meth:`LayerStreamer.run_team`), and the operations that
  change what the ring reads (:meth:`~LayerStreamer.use_files`, :meth:`~LayerStreamer.use_engine`,
  :meth:`~LayerStreamer.train_layers`), each with the model's turn held;
* :meth:`LayerStreamer.detach`: fills drained, hooks removed, the decoder's forward given back and
  the layers guarded (a call after raises ``OffloadError``). The ring, engines and files are the
  owner's to close.

:class:`~gds_offload.weights.run.model.StreamedModel` is the public facade over it.

Hook contracts (both run on the thread that calls the model, and may block it):

* ``_pre(layer_module, args)``, a forward pre-hook on each streamed layer: waits for the
  layer's fill (issued earlier; on CUDA, a stream wait where the fill is a copy), or, if
  the layer is not the one predicted, waits for the fills in flight, drops them and
  fills it now (a *miss*); points every parameter of the layer at its slot (views, no
  copy); then starts filling the next layers into every free slot, in the order
  :mod:`gds_offload.weights.streaming.prefetch` predicts (up the layers and around to the first, for
  the next decode step; after a forward with grad mode on, the last layers stay for its
  backward, or for a checkpointed forward's recompute, which goes down them).
* ``_post(layer_module, args, output)``, a forward hook: puts the meta placeholders back
  (a layer's parameters are real only during its forward), releases its slot (on CUDA:
  records an event after the layer's queued kernels) and fills it with the next layer,
  or keeps the layer there when the next pass starts with it.

Invariant: a slot is written only while no layer's parameters view it and, on CUDA,
only after the kernels of the last layer that used it have finished, so a layer always
computes with exactly the bytes the store holds for it (``torch.equal`` to the resident
model's outputs). With ``verify`` each read's xxh3-64 is checked on the engine thread
before the layer may use it. A layer whose forward changes its streamed tensors in place
(their version counter moved: BatchNorm statistics in train mode) raises ``OffloadError``
after it: the resident model would keep the change, the store cannot.

Interruptions: the hooks and the pass through the decoder hold stop signals
(:mod:`gds_offload.runtime.interrupts`) and deliver them where the ring is consistent; a
read that fails frees its slot only once it has finished; a forward that ends in any
exception (``KeyboardInterrupt`` too) leaves no layer bound. The next call is exact.
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gds_offload.errors import ConfigError, OffloadError
from gds_offload.runtime.interrupts import deliver, held
from gds_offload.runtime.malloc import predictable_malloc, release_free
from gds_offload.weights.streaming.backward import SavedWeights
from gds_offload.weights.streaming.prefetch import Prefetch
from gds_offload.weights.streaming.recompute import Recompute
from gds_offload.weights.streaming.ring import HostRing, Ring
from gds_offload.weights.streaming.stats import StreamStats
from gds_offload.weights.streaming.team import Team
from gds_offload.weights.streaming.turn import PassForward, Turn, guard_closed

if TYPE_CHECKING:
    from gds_offload.io.base import Engine
    from gds_offload.weights.store.files import StoreFiles
    from gds_offload.weights.store.manifest import GroupEntry
    from gds_offload.weights.streaming.bind import Binding

__all__ = ["LayerStreamer"]

#: :meth:`LayerStreamer.read_layers` reads a larger layer in pieces of this size (each many engine
#: tasks: the drive's rate, without a second buffer the size of a layer).
READ_PIECE = 64 << 20


class LayerStreamer:
    """The hooks of a streamed model and the state they share (see the module doc).

    Args:
        binding: the skeleton's parameters and the store's tensors (:mod:`~gds_offload.weights.streaming.bind`).
        streamed: the streamed layers' groups, in order; ``layers``: their modules.
        ring: their ring (``None``: nothing is read per forward; the hooks are never attached).
        counters: the model's :class:`StreamStats`, which the hooks update.
        turn: the model's :class:`Turn` (one forward at a time); ``where``: the store, for messages.
    """

    def __init__(self, binding: Binding, streamed: list[GroupEntry], layers: list[nn.Module], ring: Ring | None,
                 counters: StreamStats, turn: Turn, where: str) -> None:  # fmt: skip
        self.binding = binding
        self.counters = counters
        self._streamed, self._layers, self._ring, self._turn, self._where = streamed, layers, ring, turn, where
        self._closed = False
        self._handles: list[Any] = []
        self._slot_version = 0
        self._layer_turn = False  # the current layer took the turn itself (called outside a pass)
        self._started: dict[int, float] = {}  # thread -> when its current layer's forward began
        self._team: Team[Any] | None = None  # the layer-major team running, if any
        self._pass: PassForward | None = None
        self._base: nn.Module | None = None
        self._on_grad: Callable[[int, str, torch.Tensor], None] | None = None  # train_layers'
        self._recompute = Recompute(self._bind_for_recompute, self._release_after_recompute)
        buffers = ring.buffers if ring is not None else []
        self._views = [[self._slot_views(g, buf) for buf in buffers] for g in streamed]
        self._prefetch: Prefetch | None = None
        self._saved: SavedWeights | None = None
        if ring is not None:
            self._prefetch = Prefetch(ring, streamed, counters, on_renew=self._renew_views)
            self._saved = SavedWeights(ring, streamed, where, held=self._copy_held, on_layer=self._backward_layer, lend=self._lend)

    # -- life -----------------------------------------------------------------------------
    def attach(self, base: nn.Module, decoder: nn.Module) -> None:
        """Register the hooks on the streamed layers, wrap ``decoder``'s forward (the module that
        runs them: one pass at a time) and issue the first forward's first fills. ``base``, the
        model, gets the closed guard at :meth:`detach`. Nothing to do without a ring."""
        self._base = base
        for pos, layer in enumerate(self._layers):
            self._handles.append(layer.register_forward_pre_hook(functools.partial(self._pre, pos)))
            self._handles.append(layer.register_forward_hook(functools.partial(self._post, pos), always_call=True))
        if self._prefetch is not None:
            self._pass = PassForward(decoder, self._run_pass)
            self._prefetch.fill()

    def detach(self) -> None:
        """Refuse every hook from now on, wait for the fills in flight, take out a layer still
        bound, remove the hooks and give the decoder its forward back; calling a streamed layer
        afterwards raises :class:`OffloadError`. The caller holds the turn. Idempotent."""
        self._closed = True
        if self._saved is not None:
            self._saved.exit()
            self._saved.close()
        if self._prefetch is not None:
            self._prefetch.drain()
            if self._prefetch.current is not None:
                self._unbind(*self._prefetch.current)
                self._prefetch.current = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._pass is not None and self._base is not None:
            self._pass.restore()
            self._pass = None
            guard_closed(self._base, self._layers, self._where)
        self._recompute.restore()

    @property
    def closed(self) -> bool:
        """:meth:`detach` has run."""
        return self._closed

    # -- what the ring reads ----------------------------------------------------------------
    @property
    def engine(self) -> Engine | None:
        """The engine the ring reads through (``None``: nothing is read per forward)."""
        return getattr(self._ring, "engine", None)

    def settle(self) -> None:
        """Block until the fills in flight have landed (they stay for the next forward)."""
        if self._prefetch is not None:
            self._prefetch.settle()

    def use_files(self, files: StoreFiles) -> StoreFiles:
        """Read the streamed layers from ``files`` from now on; the files read until now.

        Raises:
            ConfigError: nothing is read from the drive per forward.
        """
        ring = self._ring
        if not isinstance(ring, HostRing) or self._prefetch is None:
            raise ConfigError("this StreamedModel reads nothing from the drive per forward: no files to replace")
        with held(), self._turn.holding(wait=True):
            self._prefetch.drain()
            old, ring.files = ring.files, files
            self._prefetch.forget()
        return old

    def use_engine(self, engine: Engine) -> Engine:
        """Read the streamed layers through ``engine`` from now on; the engine read through until now.

        Raises:
            ConfigError: nothing is read per forward.
        """
        old = self.engine
        if old is None or self._prefetch is None:
            raise ConfigError("this StreamedModel reads nothing per forward (tier='host', or every layer resident): no engine to replace")
        with held(), self._turn.holding(wait=True):
            self._prefetch.drain()
            self._ring.engine = engine  # type: ignore[union-attr]
            self.counters.engine = engine.description
            self._prefetch.restart()  # the next forward's first layers, through the new engine
        return old

    def train_layers(self, on_grad: Callable[[int, str, torch.Tensor], None]) -> None:
        """Bind the streamed layers' parameters as trainable views from now on, each gradient handed
        to ``on_grad(pos, store_name, grad)`` (see :meth:`StreamedModel.train_layers
        <gds_offload.weights.run.model.StreamedModel.train_layers>`).

        Raises:
            ConfigError: nothing is read per forward.
        """
        if not isinstance(self._ring, HostRing) or self._prefetch is None:
            raise ConfigError("training streamed layers needs tier='drive' (tier='host' on the CPU holds every layer in one arena) "
                              "and at least one streamed layer")  # fmt: skip
        with held(), self._turn.holding(wait=True):
            self._prefetch.end_lend()
            self._prefetch.drain()
            self._prefetch.check_lent()  # the views made next count in the slots' use
            self._on_grad = on_grad
            self._views = [[self._slot_views(g, buf, functools.partial(on_grad, pos)) for buf in self._ring.buffers]
                           for pos, g in enumerate(self._streamed)]  # fmt: skip
            self._prefetch.restart()

    def read_layers(self, count: int, *, piece_nbytes: int = READ_PIECE) -> tuple[int, float]:
        """Read the first ``count`` streamed layers from the drive, discarding the bytes:
        ``(bytes, seconds)`` (see :meth:`StreamedModel.read_layers
        <gds_offload.weights.run.model.StreamedModel.read_layers>`).

        Raises:
            ConfigError: nothing is read from the drive per forward.
        """
        ring = self._ring
        if ring is None or not self._streamed or not isinstance(ring, HostRing):
            raise ConfigError("this StreamedModel reads no layer from the drive per forward (tier='host', or none streamed)")
        with held(), self._turn.holding(wait=True):
            self.settle()
            return ring.time_reads(self._streamed[:count], piece_nbytes)

    def stats(self) -> StreamStats:
        """A copy of the counters, backward's included."""
        s = self.counters
        again = list(self._saved.reads) if self._saved else []
        copied = list(self._saved.copies) if self._saved else []
        kept = list(self._saved.held) if self._saved else []
        return StreamStats(**(asdict(s) | {"loads": list(s.loads), "reads": list(s.reads), "compute_s": list(s.compute_s),
                                           "replans": list(s.replans), "backward_reads": again, "backward_copies": copied,
                                           "backward_held": kept}))  # fmt: skip

    def _renew_views(self, slot: int) -> None:
        """The ring gave ``slot`` a new buffer (:meth:`Ring.renew <gds_offload.weights.streaming.ring.Ring.renew>`): views of it, for binding and for the saved-tensor hooks."""
        assert self._ring is not None and self._saved is not None, "a slot renewed without a ring"
        buf = self._ring.buffers[slot]
        for pos, g in enumerate(self._streamed):
            self._views[pos][slot] = self._slot_views(g, buf, None if self._on_grad is None else functools.partial(self._on_grad, pos))
        self._saved.renew(slot)

    def _slot_views(self, g: GroupEntry, buf: torch.Tensor, on_grad: Callable[[str, torch.Tensor], None] | None = None) -> list[tuple[str, torch.Tensor]]:
        # Made once, at load (outside any inference_mode), and reused every forward.
        return self.binding.views_of(g, buf, on_grad)

    # -- hooks ----------------------------------------------------------------------------
    # Each runs with stop signals held (interrupts.held) and delivers them only where the ring is
    # consistent: its first line, and the waits for reads (which change nothing until they return).
    def _run_pass(self, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The decoder's forward (:class:`~gds_offload.weights.streaming.turn.PassForward`): one pass at a
        time; however it ends (``KeyboardInterrupt`` too), no layer is left bound."""
        with held():
            self._turn.enter(wait=False)
            try:
                return forward(*args, **kwargs)
            finally:
                self._end_layer()
                self._turn.exit()

    def _pre(self, pos: int, module: nn.Module, args: Any, *, recompute: bool = False) -> None:
        with held():
            deliver()
            if self._closed:
                raise OffloadError(f"the StreamedModel of {self._where} is closed; load the store again (load_streamed)")
            team = self._team
            if team is not None and team.member():
                team.arrive()  # the next micro-batch runs; this one resumes on its turn
                self._bind_shared(pos, module)
                self._started[threading.get_ident()] = time.perf_counter()
                return
            if not self._turn.owned():  # a layer called on its own, or a recompute on backward's thread
                self._turn.enter(wait=recompute)
                self._layer_turn = True
            try:
                self._bind(pos, module, recompute=recompute)
            except BaseException as exc:
                # torch runs the post-hook after an Exception only, and it frees nothing unless a layer is bound.
                if not isinstance(exc, Exception) or self._prefetch is None or self._prefetch.current is None:
                    self._end_layer()
                raise
            self._started[threading.get_ident()] = time.perf_counter()

    def _bind(self, pos: int, module: nn.Module, *, recompute: bool) -> None:
        """The pre-hook's work, on the thread holding the turn: wait for layer ``pos``'s fill and bind it."""
        assert self._prefetch is not None and self._ring is not None and self._saved is not None, "a streamed layer without a ring"
        self._end_layer(keep_turn=True)  # the previous layer's forward raised: its post-hook never ran
        checkpointed = not recompute and torch.is_grad_enabled() and module.training and getattr(module, "gradient_checkpointing", False)
        if checkpointed:
            self._recompute.wrap(pos, module)  # backward will run this layer's forward without our hooks
        # Recomputes go down the layers, as backward does; a recompute, and a forward with grad mode
        # on (its backward, or a checkpointed forward's recompute), are each followed by a pass the other way.
        fill = self._prefetch.next_fill(pos, direction=-1 if recompute else 1, turns=recompute or torch.is_grad_enabled())
        if not fill.held:
            start = time.perf_counter()
            try:
                self._ring.wait(self._streamed[pos], fill)
            except BaseException:
                if self._ring.failed(fill):  # read again next time; a read still running keeps its slot
                    self._prefetch.discard(fill)
                raise
            self.counters.stall_s += time.perf_counter() - start
        self._prefetch.take(fill)
        for name, tensor in self._views[pos][fill.slot]:
            self.binding.place(name, tensor)
        self._slot_version = self._ring.buffers[fill.slot]._version  # shared by every view of the slot
        self.counters.loads[pos] += 1
        if pos == 0:
            self._saved.clear()  # a new forward: the last backward's layers are done with
        if torch.is_grad_enabled():
            self._saved.enter(pos, fill.slot, clone=recompute)  # last: if it raises, the post-hook still frees the slot

    def _bind_shared(self, pos: int, module: nn.Module) -> None:
        """A team member's pre-hook, on its turn: layer ``pos`` is bound once per round, by the
        first member to reach it, and stays bound until the round of the next layer begins."""
        assert self._prefetch is not None and self._saved is not None, "a streamed layer without a ring"
        if torch.is_grad_enabled() and getattr(module, "gradient_checkpointing", False) and module.training:
            raise ConfigError("layer-major micro-batches with gradient checkpointing are not supported; turn checkpointing off "
                              "(the team already reads each layer once per round) or use one micro-batch per load")  # fmt: skip
        current = self._prefetch.current
        if current is not None and current[0] == pos and not self._prefetch.lending:
            if torch.is_grad_enabled():
                self._saved.enter(pos, current[1])  # this member's saved weights, for its own backward
            return  # an earlier member of this round bound it: the same weights, no read
        if current is not None:
            self._release()  # the previous layer's round is over: every member has passed it
        self._bind(pos, module, recompute=False)

    def _backward_layer(self, pos: int) -> None:
        """A backward first needs layer ``pos``: a team member hands over (its backward of the layer
        runs in the members' order, all on one read of it); the forward's last bound layer, which
        every member has passed by then, is put back in the ring for the backward to copy."""
        team = self._team
        if team is None or not team.member():
            return
        team.arrive()
        with held():
            # A layer lent to backward stays for the members behind this one; the next lend puts it back.
            if self._prefetch is not None and self._prefetch.current is not None and not self._prefetch.lending:
                self._release()

    def run_team(self, calls: Sequence[Callable[[], Any]], *, seeds: Sequence[int | None] | None = None) -> list[Any]:
        """Run ``calls`` (each a micro-batch's whole computation on this model, e.g. its
        ``generate``) layer-major: every streamed layer is bound once per round of the
        micro-batches (:mod:`gds_offload.weights.streaming.team`); their results, in order.

        Raises:
            OffloadError: another thread is running the model. Whatever a call raised.
        """
        if self._closed:
            raise OffloadError(f"the StreamedModel of {self._where} is closed; load the store again (load_streamed)")
        predictable_malloc()  # the members' freed activations must leave the resident set (see malloc.py)
        team: Team[Any] = Team(calls, seeds=seeds)
        with held():
            self._turn.enter(wait=False)
        try:
            self._team = team
            results = team.run(started=self._turn.admit)
            self.counters.teams += 1
            self.counters.team_micro_batches += len(calls)
            return results
        finally:
            with held():
                self._team = None
                self._turn.dismiss()
                self._end_layer()  # the last round's layer
                self._turn.exit()
            release_free()  # the wave's freed heap goes back: the next wave's peak is its own

    def _bind_for_recompute(self, pos: int, module: nn.Module) -> bool:
        assert self._prefetch is not None, "a recompute without a ring"
        current = self._prefetch.current
        if self._turn.owned() and current is not None and current[0] == pos:
            return False  # the original forward: the pre-hook bound it
        self._pre(pos, module, (), recompute=True)
        return True

    def _release_after_recompute(self, pos: int, module: nn.Module) -> None:
        self._post(pos, module, (), None)

    def _post(self, pos: int, module: nn.Module, args: Any, output: Any) -> None:
        # Also runs when the forward raised an Exception (always_call): output is None then.
        with held():
            assert self._prefetch is not None, "a streamed layer without a ring"
            current = self._prefetch.current
            if not self._turn.owned() or current is None or current[0] != pos:
                return  # not this thread's layer (its pre-hook was refused), or already released
            started = self._started.pop(threading.get_ident(), None)
            if started is not None:
                self.counters.compute_s[pos] += time.perf_counter() - started
            if self._team is not None and self._team.member():
                # This member's hooks; the layer stays bound for the others. A member cancelled at its
                # hand-over (its pre-hook raised TeamCancelled) pushed none, and another may be computing.
                if started is not None and self._saved is not None:
                    self._saved.exit()
                return
            changed = not self._release()
            self._end_layer()
        if changed and output is not None:
            # The resident model would keep the change; the next read of this layer would not.
            raise OffloadError(
                f"{self._streamed[pos].describe()} changed its streamed parameters or buffers in place during its forward "
                f"(e.g. BatchNorm running statistics in train mode); streamed weights are read-only. Put that module in "
                f"eval mode, or keep the layer resident (resident_layers= or max_memory=)"
            )

    def _end_layer(self, *, keep_turn: bool = False) -> None:
        """Take out a layer still bound (its post-hook did not run), and give back the turn a layer
        called on its own took (unless ``keep_turn``: the next layer's pre-hook holds it now).
        A team member's pass leaves the layer to the team (:meth:`run_team` takes it out)."""
        if self._team is not None and self._team.member():
            return
        if self._prefetch is not None and self._prefetch.current is not None:
            self._release()
        if self._saved is not None:
            self._saved.exit()
        if self._layer_turn and not keep_turn:
            self._layer_turn = False
            self._turn.exit()

    def _release(self) -> bool:
        """Take the current layer's weights out and hand its slot back; ``False`` if its forward
        changed the slot's bytes (its version counter moved)."""
        assert self._prefetch is not None and self._prefetch.current is not None and self._ring is not None, "release without a current layer"
        if self._prefetch.lending:  # a backward's: never bound, never written
            self._prefetch.end_lend()
            return True
        pos, slot = self._prefetch.current
        if self._saved is not None:
            self._saved.exit()
        self._unbind(pos, slot)
        intact = self._ring.buffers[slot]._version == self._slot_version
        self._prefetch.put_back(intact=intact)
        return intact

    def _unbind(self, pos: int, slot: int) -> None:
        for name, _ in self._views[pos][slot]:
            self.binding.restore(name)

    def _lend(self, pos: int) -> tuple[torch.Tensor, str | None] | None:
        """For backward (any thread): the ring slot holding layer ``pos``, lent (:meth:`Prefetch.lend
        <gds_offload.weights.streaming.prefetch.Prefetch.lend>`), and how it got there; ``None``: fetch or copy it instead."""
        assert self._prefetch is not None, "a backward lend without a ring"
        with held():
            if not self._turn.try_enter():
                return None  # another thread's forward has the ring
            try:
                return self._prefetch.lend(pos)
            finally:
                self._turn.exit()

    def _copy_held(self, pos: int) -> torch.Tensor | None:
        """For backward (any thread): layer ``pos`` copied out of the slot still holding it, or ``None``."""
        assert self._prefetch is not None, "a backward copy without a ring"
        with held():
            if not self._turn.try_enter():
                return None  # another thread's forward has the ring: read the layer from the store
            try:
                return self._prefetch.copy_held(pos)
            finally:
                self._turn.exit()
