"""The life of one saved storage: :class:`Entry` and its :class:`State`, and the :class:`Handle`
autograd holds in place of each saved tensor.

::

    NEW ─▶ KEPT ─────────────────────────────────────────────────────────────▶ RELEASED
     │      ▲ write failed (fallback)          ▲ detach(): read back, slot freed   ▲
     └─▶ WRITING ─▶ ON_DRIVE ─▶ READING ─▶ LOADED ───────────────────────────────┤
            │                      │          ▲ (re-read once its bytes died)     │
            │                      └─▶ FAILED ─────────────────────────────────────┤
            └─ done while backward is near ─▶ LOADED (the source stays in memory) ─┘

Every transition goes through :meth:`Entry.move`, which refuses an illegal one (:class:`OffloadError`), so
the conditions that decide what an entry may do live in one table (:data:`_NEXT`), not
in flags spread over the scheduler. Bytes in memory are ``Entry.data``; which budget
they count against (kept, writing, loaded) follows from the state alone.

An entry is created for one *storage* the first time a tensor over it is saved in a
forward; further saves of the same storage in the same forward are deduplicated into
it only when they are provably the same bytes (see :meth:`Entry.may_share`).
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gds_offload.errors import OffloadError

if TYPE_CHECKING:
    from gds_offload.io.base import IOFuture
    from gds_offload.io.layout import Slot

__all__ = ["State", "Entry", "Handle", "version_root"]


class State(enum.Enum):
    #: Just saved; the policy has not placed it yet.
    NEW = "new"
    #: In memory by policy, size or fallback; never on the drive.
    KEPT = "kept"
    #: A write is in flight; the source bytes stay in memory until it ends.
    WRITING = "writing"
    #: The bytes are only on the drive.
    ON_DRIVE = "on_drive"
    #: A read into ``Entry.data`` is in flight.
    READING = "reading"
    #: In memory and on the drive: read back, or written while backward was already near.
    LOADED = "loaded"
    #: A read failed: the bytes cannot be restored; every unpack raises ``Entry.failure``.
    FAILED = "failed"
    #: No handle is left. The slot is freed once no transfer uses it.
    RELEASED = "released"


_NEXT: dict[State, frozenset[State]] = {
    State.NEW: frozenset({State.KEPT, State.WRITING}),
    State.KEPT: frozenset({State.RELEASED}),
    State.WRITING: frozenset({State.ON_DRIVE, State.LOADED, State.KEPT, State.RELEASED}),
    State.ON_DRIVE: frozenset({State.READING, State.RELEASED}),
    State.READING: frozenset({State.LOADED, State.FAILED, State.RELEASED}),
    State.LOADED: frozenset({State.READING, State.KEPT, State.RELEASED}),
    State.FAILED: frozenset({State.RELEASED}),
    State.RELEASED: frozenset(),
}

#: The memory budget an entry's in-memory bytes count against, by state.
_BUDGET: dict[State, str] = {
    State.NEW: "kept",
    State.KEPT: "kept",
    State.WRITING: "writing",
    State.READING: "loaded",
    State.LOADED: "loaded",
}


def version_root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``t`` uses: its view base, else itself.

    Views share their base's version counter; tensors that merely alias a storage
    (``unsafe_chunk``/``unsafe_split`` outputs, ``.data``, ``detach()``) do not, so two
    of them at the same version may hold different bytes.
    """
    base = t._base
    return base if base is not None else t


@dataclass(eq=False)
class Entry:
    """One storage's bytes, shared by every handle that saved a view of it in one forward."""

    nbytes: int
    device: torch.device
    forward_id: int
    unit: int
    #: Keeps the ``StorageImpl`` object (not its memory) alive, so its address identifies it.
    storage_ref: StorageWeakRef
    version: int
    #: The process generation (see ``Scheduler.after_fork``) whose store holds ``slot``.
    generation: int
    state: State = State.NEW
    #: Bytes in memory: the storage itself (KEPT, WRITING, LOADED after a write) or a read buffer.
    data: torch.Tensor | None = None
    #: ``data`` once every handle has unpacked it (autograd holds it then); re-unpacks use it.
    data_weak: weakref.ref[torch.Tensor] | None = None
    slot: Slot | None = None
    write: IOFuture | None = None
    read: IOFuture | None = None
    #: Live handles, and those of them not unpacked yet.
    handles: int = 0
    pending: int = 0
    #: Weak references to the version-counter roots of the tensors saved into this entry.
    roots: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    #: Bytes were served from memory while a write was in flight (counted once).
    forwarded: bool = False
    #: xxh3-64 of the bytes written (``verify=True`` only).
    checksum: int | None = None
    #: Why the bytes are lost (state FAILED).
    failure: str = ""
    #: The budget ``data`` is counted against (see :data:`_BUDGET`), or None.
    counted: str | None = None

    def move(self, new: State) -> None:
        """Change state; the table :data:`_NEXT` says which changes exist.

        Raises:
            OffloadError: ``new`` cannot follow the current state (a scheduler bug: the
                entry is left as it was). A raise, not an ``assert``: it holds under ``python -O``.
        """
        if new not in _NEXT[self.state]:
            allowed = ", ".join(sorted(s.name for s in _NEXT[self.state])) or "none (it is final)"
            raise OffloadError(
                f"saved-tensor entry of {self.nbytes} bytes (layer call {self.unit}) cannot go from {self.state.name} to "
                f"{new.name}; from {self.state.name} it may go to: {allowed}. This is a bug in gds_offload: please report it"
            )
        self.state = new

    @property
    def budget(self) -> str | None:
        """The budget this entry's bytes count against now, or None when none are held.

        ``"unread"``: the bytes are only on the drive and backward has yet to read them (no
        memory; counted so that the engine keeps no more idle read buffers than reads to come).
        A RELEASED entry holds bytes only while its write is still reading them."""
        if self.state is State.ON_DRIVE:
            return "unread"
        if self.data is None:
            return None
        return "writing" if self.state is State.RELEASED else _BUDGET.get(self.state)

    def bytes_in_memory(self) -> torch.Tensor | None:
        """The entry's bytes when they are in memory and complete, else None."""
        if self.state in (State.NEW, State.KEPT, State.WRITING):
            return self.data
        if self.state is State.LOADED:
            return self.data if self.data is not None else (self.data_weak() if self.data_weak else None)
        return None

    def may_share(self, root: torch.Tensor, version: int) -> bool:
        """Whether a tensor with version-counter ``root`` at ``version`` may use these bytes.

        Only a tensor on the same version counter, at the same version, is known to see the
        same bytes: equal versions on *different* counters prove nothing (``unsafe_chunk``
        outputs updated in place one after the other), and ``.data`` writes bump no counter.
        """
        if self.state in (State.FAILED, State.RELEASED) or version != self.version:
            return False
        return any(r() is root for r in self.roots)

    def add_root(self, root: torch.Tensor) -> None:
        if not any(r() is root for r in self.roots):
            self.roots.append(weakref.ref(root))


class Handle:
    """What autograd stores in place of a saved tensor; freed by autograd -> ``Scheduler.release``.

    Holds the view (offset, size, stride, dtype) to rebuild over the entry's bytes, and
    weak references to the saved tensor and its version-counter root, to refuse, as
    autograd does without hooks, a tensor changed in place after it was saved.
    """

    __slots__ = ("entry", "offset", "size", "stride", "dtype", "version", "producer", "refs", "unpacked", "release", "__weakref__")

    def __init__(self, entry: Entry, t: torch.Tensor, root: torch.Tensor, release: Any) -> None:
        self.entry = entry
        self.offset = t.storage_offset()
        self.size = t.size()
        self.stride = t.stride()
        self.dtype = t.dtype
        self.version = t._version
        #: The node that made ``t`` (name, sequence number): a saved output's is the node saving it.
        fn = t.grad_fn
        self.producer = (fn.name(), fn._sequence_nr()) if fn is not None else None
        self.refs = (weakref.ref(t),) if root is t else (weakref.ref(t), weakref.ref(root))
        self.unpacked = False
        self.release = release

    def check_version(self) -> None:
        """Raise autograd's errors for a saved tensor changed since it was saved: modified in
        place, or (saved as an input) detached in place."""
        t = self.refs[0]()
        if t is not None and self.producer is not None and t.grad_fn is None:
            node = torch._C._current_autograd_node()
            if node is not None and (node.name(), node._sequence_nr()) != self.producer:
                raise RuntimeError(
                    "Trying to use a saved tensor that has been detached in-place, i.e. with .detach_(). "
                    "This is not supported, please use out-of-place `.detach()` instead. (Checked by gds_offload.)"
                )
        for ref in self.refs:
            t = ref()
            if t is not None and t._version != self.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: [{t.type()} {list(self.size)}] is at version {t._version}; expected version "
                    f"{self.version} instead. (Checked by gds_offload: autograd does not check tensors saved "
                    "through saved-tensor hooks.) Hint: clone the tensor before changing it in place."
                )

    def __del__(self) -> None:
        release = self.release
        if release is not None:
            release(self)
