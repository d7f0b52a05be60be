"""The counters of a :class:`~gds_offload.weights.run.model.StreamedModel` (``stats()``): what its
ring filled, reused and missed, how long the model waited, and what backward read again."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gds_offload.units import format_bytes

__all__ = ["StreamStats"]


@dataclass
class StreamStats:
    """Counters of one :class:`~gds_offload.weights.run.model.StreamedModel`. Lists are per streamed layer, in layer order."""

    tier: str
    device: str
    #: How slots are filled: ``host`` (engine reads into host memory), ``device`` (engine reads
    #: into device memory), ``pinned`` (copies from pinned host memory), ``none`` (nothing streamed).
    ring: str
    engine: str
    direct: bool
    slots: int
    slot_nbytes: int
    streamed_layers: list[str]
    resident_layers: list[str]
    #: Memory on ``device`` holding resident tensors (on the CPU with ``tier="host"``: every layer too).
    resident_nbytes: int
    #: Pinned host memory holding the streamed layers (``tier="host"`` on a GPU).
    host_nbytes: int = 0
    #: Times each layer's parameters were made real for a forward.
    loads: list[int] = field(default_factory=list)
    #: Fills issued for each layer (one per forward, plus the ones prefetched for the next, and backward's reads into a slot).
    reads: list[int] = field(default_factory=list)
    #: Bytes of layers filled into slots (read from the store, or copied from the host tier).
    bytes_read: int = 0
    #: Wall time with at least one of those fills' reads in flight: ``bytes_read / read_s`` is the
    #: drive's rate as a run sees it, beside the compute (fills from the host tier are not counted).
    read_s: float = 0.0
    #: Layer calls that were not the predicted next layer (their fill was not ready).
    misses: int = 0
    #: Prefetched reads dropped by a miss.
    wasted_reads: int = 0
    #: Layer forwards that found the layer still in a slot, with no read (at a turn: a checkpoint's
    #: recompute after its forward, the next forward after the recompute; or all streamed layers fit the ring).
    #: Backward's copies out of a slot are ``backward_copies``.
    reused: int = 0
    #: Time the model's thread waited for fills in the pre-hooks (a CUDA stream wait costs none).
    stall_s: float = 0.0
    #: Time each layer's forwards took, from its pre-hook's end to its post-hook (every micro-batch's,
    #: in a layer-major team; on CUDA the time to queue its kernels, not to run them).
    compute_s: list[float] = field(default_factory=list)
    #: Times each layer was read again for backward (the weights autograd saved from it).
    backward_reads: list[int] = field(default_factory=list)
    #: Times backward copied a layer out of the slot still holding it (at the turn after a forward) instead
    #: (a ring that cannot lend its slots to backward, or a backward with ``create_graph=True``).
    backward_copies: list[int] = field(default_factory=list)
    #: Times backward computed from a layer left in its slot by the forward before, with no read or copy.
    backward_held: list[int] = field(default_factory=list)
    #: Slots given a new buffer because a tensor backward made from them outlived its layer's backward.
    renewed_slots: int = 0
    #: Layer-major waves (``generate_many``): teams of micro-batches that shared each weight load, and their micro-batches.
    teams: int = 0
    team_micro_batches: int = 0
    #: Why ``generate_many`` planned again mid-run (measured compute off the plan by more than 25%), one line each.
    replans: list[str] = field(default_factory=list)
    #: KV caches on the drive (``generate_many(kv="drive")``): bytes read back and written.
    kv_bytes_read: int = 0
    kv_bytes_written: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        """A few lines with units (``print(lm.stats())``); ``repr`` and the fields stay for programs."""
        direct = ", O_DIRECT" if self.direct else ""
        lines = [f"gds_offload weights: {len(self.streamed_layers)} layers streamed, {len(self.resident_layers)} resident, on "
                 f"{self.device}; tier {self.tier}, engine {self.engine}{direct}; ring of {self.slots} slot"
                 f"{'' if self.slots == 1 else 's'} x {format_bytes(self.slot_nbytes)} ({self.ring})"]
        host = f", {format_bytes(self.host_nbytes)} pinned on the host" if self.host_nbytes else ""
        lines.append(f"  memory: {format_bytes(self.resident_nbytes)} resident{host}, "
                     f"{format_bytes(self.slots * self.slot_nbytes)} in the ring")
        lines.append(f"  reads: {format_bytes(self.bytes_read)} in {sum(self.reads)} fills for {sum(self.loads)} layer loads; "
                     f"{self.reused} reused, {self.misses} missed ({self.wasted_reads} reads wasted); waited "
                     f"{self.stall_s:.2f} s for them, computed {sum(self.compute_s):.2f} s")
        if any(self.backward_reads) or any(self.backward_copies) or any(self.backward_held):
            lines.append(f"  backward: {sum(self.backward_reads)} layers read again, {sum(self.backward_copies)} copied "
                         f"out of a slot, {sum(self.backward_held)} used where they lay")
        if self.teams:
            lines.append(f"  layer-major: {self.teams} waves of {self.team_micro_batches} micro-batches in all; "
                         f"{len(self.replans)} re-plan{'' if len(self.replans) == 1 else 's'}")
        if self.kv_bytes_read or self.kv_bytes_written:
            lines.append(f"  KV cache on the drive: {format_bytes(self.kv_bytes_read)} read, {format_bytes(self.kv_bytes_written)} written")
        return "\n".join(lines)
