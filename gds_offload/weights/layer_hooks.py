"""The hooks of a :class:`~gds_offload.weights.stream.StreamedModel`, as a base class of it: a
streamed layer's forward pre-hook and hook, the pass through the decoder, a recompute's bind and
release, backward's copies out of the ring, and the layer-major team's hand-overs
(:mod:`gds_offload.weights.schedule`). Loading and the public API are :mod:`gds_offload.weights.stream`'s.

Hook contracts (both run on the thread that calls the model, and may block it):

* ``_pre(layer_module, args)``, a forward pre-hook on each streamed layer: waits for the
  layer's fill (issued earlier; on CUDA, a stream wait where the fill is a copy), or, if
  the layer is not the one predicted, waits for the fills in flight, drops them and
  fills it now (a *miss*); points every parameter of the layer at its slot (views, no
  copy); then starts filling the next layers into every free slot, in the order
  :mod:`gds_offload.weights.prefetch` predicts (up the layers and around to the first, for
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
(:mod:`gds_offload.weights.interrupts`) and deliver them where the ring is consistent; a
read that fails frees its slot only once it has finished; a forward that ends in any
exception (``KeyboardInterrupt`` too) leaves no layer bound. The next call is exact.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gds_offload.errors import ConfigError, OffloadError
from gds_offload.weights.interrupts import deliver, held
from gds_offload.weights.malloc import predictable_malloc, release_free
from gds_offload.weights.schedule import Team

if TYPE_CHECKING:
    from pathlib import Path

    from gds_offload.weights.backward import SavedWeights
    from gds_offload.weights.bind import Binding
    from gds_offload.weights.manifest import GroupEntry
    from gds_offload.weights.prefetch import Prefetch
    from gds_offload.weights.recompute import Recompute
    from gds_offload.weights.ring import Ring
    from gds_offload.weights.stream_stats import StreamStats
    from gds_offload.weights.turn import Turn

__all__ = ["LayerHooks"]


class LayerHooks:
    """The hook methods; :class:`~gds_offload.weights.stream.StreamedModel` sets the state they share."""

    binding: Binding
    _prefetch: Prefetch | None
    _ring: Ring | None
    _saved: SavedWeights | None
    _turn: Turn
    _team: Team[Any] | None
    _streamed: list[GroupEntry]
    _views: list[list[list[tuple[str, torch.Tensor]]]]
    _stats: StreamStats
    _recompute: Recompute
    _closed: bool
    _dirs: list[Path]
    _layer_turn: bool
    _started: dict[int, float]
    _slot_version: int

    # -- hooks ----------------------------------------------------------------------------
    # Each runs with stop signals held (interrupts.held) and delivers them only where the ring is
    # consistent: its first line, and the waits for reads (which change nothing until they return).
    def _run_pass(self, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The decoder's forward (:class:`~gds_offload.weights.turn.PassForward`): one pass at a
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
                raise OffloadError(f"the StreamedModel of {self._dirs[0]} is closed; load the store again (load_streamed)")
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
            self._stats.stall_s += time.perf_counter() - start
        self._prefetch.take(fill)
        for name, tensor in self._views[pos][fill.slot]:
            self.binding.place(name, tensor)
        self._slot_version = self._ring.buffers[fill.slot]._version  # shared by every view of the slot
        self._stats.loads[pos] += 1
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
        micro-batches (:mod:`gds_offload.weights.schedule`); their results, in order.

        Raises:
            OffloadError: another thread is running the model. Whatever a call raised.
        """
        if self._closed:
            raise OffloadError(f"the StreamedModel of {self._dirs[0]} is closed; load the store again (load_streamed)")
        predictable_malloc()  # the members' freed activations must leave the resident set (see malloc.py)
        team: Team[Any] = Team(calls, seeds=seeds)
        with held():
            self._turn.enter(wait=False)
        try:
            self._team = team
            results = team.run(started=self._turn.admit)
            self._stats.teams += 1
            self._stats.team_micro_batches += len(calls)
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
                self._stats.compute_s[pos] += time.perf_counter() - started
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
        <gds_offload.weights.prefetch.Prefetch.lend>`), and how it got there; ``None``: fetch or copy it instead."""
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
