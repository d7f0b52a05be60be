"""Backward through streamed layers: the weights autograd saves are read again, not kept.

A streamed layer's parameters are views of a ring slot, and the next fills overwrite that
slot. A tensor autograd saves from them (a linear layer's weight, for its input's gradient)
would hold another layer's bytes by the time backward uses it, and nothing in PyTorch would
notice: the slot is written by reads, which no version counter sees. So while a streamed
layer runs with grad mode on, :class:`SavedWeights` pushes saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``):

* ``pack(tensor) -> Any``, on the forward's thread, for every tensor autograd saves during
  the layer's forward: a tensor whose storage is the layer's slot becomes a :class:`SlotRef`
  (the layer, the byte offset in it, dtype, size, stride; no bytes kept); any other tensor
  goes to the hooks that were active when the layer started (the activation offloader's,
  a checkpoint's), or is returned as it is.
* ``unpack(packed) -> Tensor``, on the thread running backward (it may block it): a
  :class:`SlotRef`'s view is rebuilt on its layer's bytes. Where the ring lends its slots
  (``lend``, :meth:`Prefetch.lend <gds_offload.weights.streaming.prefetch.Prefetch.lend>`: host slots,
  and a backward without ``create_graph``), those are the slot holding the layer: left there
  by the forward, or read into it while backward computed the layer above, as the next forward
  will use them; the slot is written again only once every tensor made from it is freed.
  Otherwise the layer is read again from the store (:meth:`Ring.fetch
  <gds_offload.weights.streaming.ring.Ring.fetch>`, into a buffer of its own), or copied into one out
  of the ring slot that still holds it after the forward (``held``,
  :meth:`Prefetch.copy_held <gds_offload.weights.streaming.prefetch.Prefetch.copy_held>`), and the read
  (or copy) of the layer below is started at the same time. (With ``create_graph=True`` the
  backward's own graph may keep the weights as long as it likes, so they get buffers of their own.)

Invariant: ``unpack(pack(t))`` equals ``t`` in every bit, size, stride, dtype and device:
the bytes are the store's, which the forward used (with ``verify``, checked again; a copied
layer's were checked when its slot was filled). Two fetched layers at most are held, the one backward is in and the next, until their views
are freed by autograd and the next forward (or :meth:`SavedWeights.clear`) drops them; a lent
layer is held in its slot until backward needs the next one, or the next forward begins.

.. note:: Gradients of the streamed layers' own parameters exist only under
   :class:`~gds_offload.weights.train.trainer.StreamedTrainer` (:meth:`StreamedModel.train_layers
   <gds_offload.weights.run.model.StreamedModel.train_layers>`); otherwise those parameters are
   frozen and gradients flow through them to the inputs and to trainable tensors elsewhere.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gds_offload.errors import ConfigError, OffloadError
from gds_offload.runtime.interrupts import held
from gds_offload.weights.store.manifest import GroupEntry
from gds_offload.weights.streaming.ring import Ring

__all__ = ["SavedWeights", "SlotRef"]

_Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


@dataclass(frozen=True, slots=True)
class SlotRef:
    """A saved tensor that views streamed layer ``pos``: ``offset`` bytes into its group."""

    pos: int
    offset: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Outer:
    """A tensor packed by the hooks that were active below ours, with their unpack."""

    unpack: Callable[[Any], torch.Tensor]
    packed: Any


class SavedWeights:
    """The saved-tensor hooks of a :class:`~gds_offload.weights.run.model.StreamedModel` (see the module doc).

    Args:
        ring: the ring whose slots hold the streamed layers (``ring.buffers``).
        groups: the streamed layers, in order (``pos`` indexes them).
        describe: names the model for errors (its store).
        held: a layer's bytes copied out of the slot still holding them, or ``None`` (read them).
        lend: ``lend(pos)``: the ring slot holding layer ``pos``, lent to backward, and how it got there
            (:meth:`Prefetch.lend <gds_offload.weights.streaming.prefetch.Prefetch.lend>`), asked at every unpack; or ``None``
            (the ring cannot lend, or a forward holds it): ``held`` and reads then.
        on_layer: ``on_layer(pos)``, on the thread running a backward, when that backward first needs
            layer ``pos`` (before its bytes are fetched): where a layer-major team hands over.
    """

    def __init__(
        self, ring: Ring, groups: list[GroupEntry], describe: str, *, held: Callable[[int], torch.Tensor | None],
        on_layer: Callable[[int], None] | None = None, lend: Callable[[int], tuple[torch.Tensor, str | None] | None] | None = None,
    ) -> None:  # fmt: skip
        self._ring, self._groups, self._describe, self._held, self._lend = ring, groups, describe, held, lend
        self._on_layer = on_layer
        self._last: dict[int, int] = {}  # thread -> the layer its backward last needed
        self._slots = _slot_map(ring)
        self._layer: tuple[int, int] | None = None  # (pos, slot) of the layer whose forward is running
        self._outer: _Hooks | None = None
        self._clone = False
        self._saved: set[int] = set()  # layers with tensors packed as SlotRef
        self._fetched: dict[int, Callable[[], torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._closed = False
        #: Layers read again for backward, and copied out of a slot instead, per streamed layer
        #: (:class:`StreamStats.backward_reads`, ``backward_copies``).
        self.reads = [0] * len(groups)
        self.copies = [0] * len(groups)
        #: Layers backward computed from where the forward left them (:class:`StreamStats.backward_held`).
        self.held = [0] * len(groups)

    @property
    def active(self) -> bool:
        return self._layer is not None

    def enter(self, pos: int, slot: int, *, clone: bool = False) -> None:
        """Push the hooks for layer ``pos``'s forward (it computes from ``slot``). ``clone``: pack
        the slot's views as copies handed to the hooks below, not as references (a checkpoint's
        recompute, :mod:`gds_offload.weights.streaming.recompute`, must see every tensor it saved before).

        Raises:
            ConfigError: saved-tensor hooks are disabled here (``torch.func`` transforms).
        """
        assert self._layer is None, "SavedWeights.enter inside a layer's forward"
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        try:
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        except RuntimeError as exc:
            raise ConfigError(
                f"backward through the streamed layers of {self._describe} needs saved-tensor hooks, and they are "
                f"disabled here ({exc}); run the model under torch.no_grad() or outside the transform"
            ) from exc
        self._layer, self._outer, self._clone = (pos, slot), outer, clone

    def exit(self) -> None:
        """Pop the hooks of :meth:`enter` (nothing if none are pushed)."""
        if self._layer is None:
            return
        self._layer, self._outer = None, None
        torch._C._autograd._pop_saved_tensors_default_hooks()

    def clear(self) -> None:
        """Drop the fetched layers held for backward (their views stay valid while autograd holds them)."""
        with self._lock:
            self._fetched.clear()
            self._last.clear()

    def renew(self, slot: int) -> None:
        """The ring gave ``slot`` a new buffer: tensors saved from it are the slot's from now on."""
        self._slots = _slot_map(self._ring)

    def close(self) -> None:
        """After this, backward through a layer saved earlier raises :class:`OffloadError`."""
        self._closed = True
        self.clear()

    # -- the hooks --------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        ptr = _storage_ptr(t)
        hit = None if ptr is None else self._slots.get(ptr)
        if hit is not None and self._clone:
            t, hit = t.clone(), None  # bit for bit, and outlives the slot's next fill
        if hit is None:
            return t if self._outer is None else _Outer(self._outer[1], self._outer[0](t))
        assert self._layer is not None, "pack hook outside a streamed layer's forward"
        pos, slot = self._layer
        if hit[0] != slot:
            raise OffloadError(
                f"a tensor saved for backward in {self._groups[pos].describe()} views the ring slot of another "
                f"layer ({tuple(t.shape)}, {t.dtype}), whose bytes are being replaced: a streamed layer's "
                f"parameters and their views are valid only during its own forward; clone them to keep them"
            )
        self._saved.add(pos)
        return SlotRef(pos, t.data_ptr() - hit[1], t.dtype, tuple(t.shape), tuple(t.stride()))

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        if not isinstance(packed, SlotRef):
            return packed
        typed = self._bytes(packed.pos).view(packed.dtype)
        return typed.as_strided(packed.size, packed.stride, typed.storage_offset() + packed.offset // typed.element_size())

    def _bytes(self, pos: int) -> torch.Tensor:
        """Layer ``pos``'s bytes, read again (or copied); starts reading (or copying) the layer below it.
        Stop signals are held while the lock is (a ``KeyboardInterrupt`` between acquiring it and
        arming its release would leave it held for good), and delivered during the read's wait."""
        if self._on_layer is not None:
            me = threading.get_ident()
            if self._last.get(me) != pos:
                self._last[me] = pos
                self._on_layer(pos)
        with held():
            return self._fetch(pos)()

    def _fetch(self, pos: int) -> Callable[[], torch.Tensor]:
        with self._lock:
            if self._closed:
                raise OffloadError(
                    f"backward needs the weights of {self._groups[pos].describe()}, but the StreamedModel of "
                    f"{self._describe} is closed; run backward before close()"
                )
            if pos in self._fetched:
                return self._fetched[pos]
            # Grad mode is on in backward only under create_graph=True, whose graph may keep the weights.
            lent = None if self._lend is None or torch.is_grad_enabled() else self._lend(pos)
            if lent is not None:
                slot, how = lent
                self._fetched.clear()  # not kept: once backward moves on, the slot may be written
                if how is not None:
                    (self.reads if how == "read" else self.held)[pos] += 1
                return _given(slot)
            wanted = [pos] + ([pos - 1] if pos - 1 in self._saved else [])
            for p in list(self._fetched):
                if p not in wanted:
                    del self._fetched[p]
            for p in wanted:
                if p in self._fetched:
                    continue
                buf = self._held(p)
                if buf is not None:
                    self._fetched[p] = _given(buf)
                    self.copies[p] += 1
                else:
                    self._fetched[p] = _once(self._ring.fetch(self._groups[p]))
                    self.reads[p] += 1
            return self._fetched[pos]


def _slot_map(ring: Ring) -> dict[int, tuple[int, int]]:
    """Storage pointer -> (slot, the slot's first byte): a slot is its own allocation."""
    return {b.untyped_storage().data_ptr(): (i, b.data_ptr()) for i, b in enumerate(ring.buffers)}


def _storage_ptr(t: torch.Tensor) -> int | None:
    if t.layout != torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None


def _given(buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: buf


def _once(wait: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``wait`` called once; later calls return its buffer, or raise its error again."""
    result: list[Any] = []

    def done() -> torch.Tensor:
        if not result:
            try:
                result.append(wait())
            except Exception as exc:  # a read's error; an interrupt (BaseException) leaves the wait to be done again
                result.append(exc)
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    return done
