"""Counters the offloader reports: :class:`OffloadStats` and its per-layer rows."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gds_offload.units import format_bytes

__all__ = ["OffloadStats", "LayerStats"]


@dataclass
class LayerStats:
    """One unit (a layer call, or ``<pre>``: what runs before the first layer). Bytes after deduplication."""

    name: str
    bytes_packed: int = 0
    bytes_offloaded: int = 0
    bytes_kept: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0


@dataclass
class OffloadStats:
    """What the offloader did since :func:`attach` (or the last ``stats(reset=True)``).

    Byte counters count each storage once per step unless named otherwise.

    What the offloader makes the process hold in memory: the saved activations it keeps, those
    writes in flight hold and those read back (``*_resident_bytes`` and the three peaks under
    them, in tensor bytes), and the engine's buffers: read buffers (``*_read_buffer_bytes``,
    whole pages; a read-back tensor counts there until autograd frees it, past the unpack that
    ends its count in ``loaded``, and idle buffers kept for the next reads) and staging or bounce
    buffers (``staging_bytes``). Each peak is at its own moment: their sum bounds the
    offloader's share of the process's peak, it is not that peak.

    Left out, and held by the process all the same: parameter gradients and backward's
    temporaries, which every mode has with or without offloading, and which peak where
    backward ends (with offloading, that is where a step's memory peaks, and they are most of
    a bench's peak activation memory beyond these counters); memory the allocators keep
    after it is freed (glibc's heap, torch's caching allocators); and the spill files, which
    are on the drive (``spill_file_bytes``).
    """

    engine: str
    engine_reason: str
    gds: bool
    steps: int = 0
    #: Ranks these counters cover: 1, or the job's world size for ``stats(all_ranks=True)``
    #: (see :mod:`gds_offload.activations.rank_stats` for how each counter combines).
    ranks: int = 1
    #: All activation bytes autograd saved through the hooks (parameters excluded).
    bytes_packed: int = 0
    #: Bytes saved again (same storage, or another view of it) and not stored twice.
    bytes_deduplicated: int = 0
    #: Bytes written to storage.
    bytes_offloaded: int = 0
    #: Bytes kept resident by policy (last layers, plan) or size (under min_bytes).
    bytes_kept: int = 0
    #: Of ``bytes_kept``: storages smaller than ``min_bytes``.
    bytes_small: int = 0
    #: Bytes served from memory at unpack because the write was still in flight or the data resident.
    bytes_forwarded: int = 0
    bytes_read: int = 0
    #: Bytes that could not be written (drive full, I/O error) and stayed resident instead.
    bytes_fallback: int = 0
    #: Tensors autograd saved that cannot be offloaded (sparse, nested, quantized, subclasses): kept as they are.
    bytes_unsupported: int = 0
    #: Largest total of saved-activation bytes the scheduler held in memory at once.
    peak_resident_bytes: int = 0
    resident_bytes: int = 0
    #: The peak of each part of the resident bytes: kept (never written), held by writes in
    #: flight, and read back ahead of backward (or still in memory when backward came).
    peak_kept_bytes: int = 0
    peak_writing_bytes: int = 0
    peak_loaded_bytes: int = 0
    #: Host memory of the engine's read buffers (``posix``, ``compat``): now, and the most at
    #: once; of it, the idle buffers now (kept for reads still to come; none once backward
    #: has nothing left to read). Whole pages: a tensor's buffer holds up to a page more.
    read_buffer_bytes: int = 0
    peak_read_buffer_bytes: int = 0
    idle_buffer_bytes: int = 0
    #: Host memory of the engine's staging (pinned) and bounce buffers, held until ``detach()``.
    staging_bytes: int = 0
    #: The bound on bytes held by writes in flight (``attach(write_window=...)``, or derived).
    write_window_bytes: int = 0
    #: Engine wall time with a write (read) in flight.
    write_s: float = 0.0
    read_s: float = 0.0
    #: Time the training thread was blocked waiting for I/O: reads in backward, and the
    #: write window in forward (``write_wait_s`` of it).
    io_wait_s: float = 0.0
    write_wait_s: float = 0.0
    #: Unpacks that had to wait for a read.
    stalls: int = 0
    #: Reads backward issued itself when it unpacked a tensor that no read-ahead had
    #: requested (every read with ``prefetch_bytes=0``; none when the read-ahead keeps up).
    reads_at_unpack: int = 0
    spill_file_bytes: int = 0
    layers: list[LayerStats] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def io_hidden(self) -> float | None:
        """The share of the drive's busy time the training thread did not wait for:
        ``1 - io_wait_s / (write_s + read_s)``, in [0, 1]; ``None`` before any I/O."""
        busy = self.write_s + self.read_s
        return None if busy <= 0 else min(1.0, max(0.0, 1.0 - self.io_wait_s / busy))

    def __str__(self) -> str:
        """A few lines with units (``print(off.stats())``); ``repr`` and the fields stay for programs."""
        steps = max(self.steps, 1)

        def per_step(n: int) -> str:
            return format_bytes(n / steps)

        ranks = f" on {self.ranks} ranks" if self.ranks > 1 else ""
        lines = [f"gds_offload: {self.steps} step{'' if self.steps == 1 else 's'}{ranks}, engine {self.engine} "
                 f"({'GDS' if self.gds else 'no GDS'})"]
        small = f", {per_step(self.bytes_small)} of it under min_bytes" if self.bytes_small else ""
        lines.append(f"  per step: {per_step(self.bytes_packed)} saved for backward; {per_step(self.bytes_offloaded)} offloaded, "
                     f"{per_step(self.bytes_deduplicated)} deduplicated, {per_step(self.bytes_kept)} kept in memory{small}")
        lines.append(f"  memory: peak {format_bytes(self.peak_resident_bytes)} of saved activations held "
                     f"(now {format_bytes(self.resident_bytes)}); spill file {format_bytes(self.spill_file_bytes)}")
        hidden = self.io_hidden()
        hid = "" if hidden is None else f" ({hidden:.0%} hidden behind compute)"
        lines.append(f"  I/O: {per_step(self.bytes_read)} read back per step; writing {self.write_s:.2f} s, reading "
                     f"{self.read_s:.2f} s; waited {self.io_wait_s:.2f} s{hid}, {self.stalls} stall{'' if self.stalls == 1 else 's'}")
        if self.bytes_fallback:
            lines.append(f"  {format_bytes(self.bytes_fallback)} could not be written and stayed in memory (bytes_fallback)")
        return "\n".join(lines)
