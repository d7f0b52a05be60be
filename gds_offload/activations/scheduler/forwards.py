"""Which forward each thread is running, and when each forward's backward pass ends.

A :class:`~gds_offload.activations.planning.profile.ForwardRecord` lives from the root forward pre-hook until
the end of the backward pass that consumed it. Each thread has its own current forward,
so several threads may run forward and backward on one attached model at once.

A backward pass is noticed at the first unpack of one of the forward's tensors; a
callback queued on autograd's engine then runs when that pass ends. A pass that ends
while its forward is still running (``torch.autograd.grad`` inside forward, as in a
gradient penalty) does not end the forward.

Threads: :meth:`Forwards.begin`, :meth:`~Forwards.end` and :meth:`~Forwards.begin_layer`
run on the forward's thread; :meth:`~Forwards.note_backward` wherever backward runs.
Callers hold the scheduler's lock where the methods say so.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

from gds_offload.activations.planning.profile import Clock, ForwardRecord

__all__ = ["Forwards"]


class Forwards:
    """The live :class:`ForwardRecord` objects, by id and by thread.

    Args:
        lock: the scheduler's lock, which guards every record.
        on_done: called with a record whose backward pass ended, after it was removed
            (outside the lock).
    """

    def __init__(self, lock: threading.RLock, on_done: Callable[[ForwardRecord], None]) -> None:
        self._lock = lock
        self._on_done = on_done
        self._tls = threading.local()
        self._records: dict[int, ForwardRecord] = {}
        self._next_id = 0
        #: Layer calls the last finished forward made (the policy's plan follows it).
        self.layer_calls_last = 0

    def current(self) -> ForwardRecord | None:
        """This thread's running forward, or None."""
        return getattr(self._tls, "forward", None)

    def get(self, forward_id: int) -> ForwardRecord | None:
        return self._records.get(forward_id)

    def records(self) -> Iterable[ForwardRecord]:
        return self._records.values()

    def begin(self, device: torch.device, param_storages: frozenset[int], resident_bytes: int) -> ForwardRecord:
        """Start this thread's forward (caller holds the lock)."""
        assert self.current() is None, "a forward is already running on this thread"
        fwd = ForwardRecord(self._next_id, Clock(device), param_storages, peak_resident_bytes=resident_bytes)
        fwd.begin_unit("<pre>")
        self._next_id += 1
        self._records[fwd.id] = fwd
        self._tls.forward = fwd
        return fwd

    def end(self) -> None:
        """This thread's forward returned (caller holds the lock)."""
        fwd = self.current()
        assert fwd is not None, "end of a forward that did not begin on this thread"
        self._tls.forward = None
        fwd.end()
        self.layer_calls_last = fwd.unit

    def begin_layer(self, name: str) -> None:
        """A layer call starts in this thread's forward; outside one (recomputation under
        checkpoint during backward) it is not a new unit."""
        fwd = self.current()
        if fwd is not None:
            with self._lock:
                fwd.begin_unit(name)

    def drop_unreached(self) -> None:
        """Forget forwards that ended with no handle left: their backward never ran
        (caller holds the lock)."""
        for fid in [f for f, r in self._records.items() if r.ended and r.live_handles == 0]:
            del self._records[fid]

    def note_backward(self, forward_id: int) -> None:
        """A backward pass unpacked a tensor of this forward: act when the pass ends."""
        with self._lock:
            fwd = self._records.get(forward_id)
            if fwd is None or fwd.backward_queued:
                return
            fwd.backward_queued = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._pass_ended(forward_id))
        except RuntimeError:  # unpacked outside a backward pass (e.g. grad_fn._saved_*)
            with self._lock:
                fwd.backward_queued = False

    def _pass_ended(self, forward_id: int) -> None:
        with self._lock:
            fwd = self._records.get(forward_id)
            if fwd is None:
                return
            fwd.backward_queued = False
            if not fwd.ended:
                return  # an inner backward inside the running forward
            del self._records[forward_id]
        self._on_done(fwd)

    def after_fork(self, lock: threading.RLock) -> None:
        """In a forked child: the parent's forwards are not this process's to finish."""
        self._lock = lock
        self._tls = threading.local()
        self._records.clear()
