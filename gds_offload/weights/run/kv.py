"""Where the KV cache of each micro-batch lives: device memory, or the drive (per layer,
read back just before the layer needs it, through the project's engines).

A layer-major team (:mod:`gds_offload.weights.streaming.team`) runs ``n`` micro-batches' generation
side by side, so their KV caches together may not fit in memory even when one micro-batch's
would. :class:`KVPool` keeps each ``(micro-batch, layer)`` cache in a region of an unnamed
spill file; :class:`PlacedCache` is the Hugging Face ``Cache`` a micro-batch's ``generate``
uses (``past_key_values=pool.cache(i)``), one :class:`PlacedLayer` per decoder layer:

* ``update(k_new, v_new)`` (the attention's call) takes the layer's past keys and values
  (read ahead, or read now), returns ``cat([past, new], dim=-2)`` as ``DynamicLayer`` does,
  writes the new positions to the drive, and keeps nothing but a meta tensor of the shape
  (memory holds one micro-batch-layer's cache at a time, plus the one read ahead);
* then it starts reading the cache the team needs next: the next micro-batch's at this layer,
  or, after the last micro-batch, the first one's at the next layer.

On the drive a region is time-major: one 4 KiB-aligned *record* per position holding that
position's keys and values for the whole micro-batch (``[2, batch, kv_heads, head_dim]``), so
a decode step appends one record and a layer's past is one read. Values are bytes moved, never
computed: the keys and values a layer sees equal ``DynamicLayer``'s bit for bit, so are its outputs.

Not supported on the drive (:class:`ConfigError` when the pool is made or the method called):
sliding-window and linear-attention layers, beam search (``reorder_cache``), ``crop``.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from gds_offload.errors import ConfigError, OffloadError, SpillSpaceError
from gds_offload.io.base import Engine, IOFuture
from gds_offload.io.layout import Slot, align_up
from gds_offload.io.spill import SpillStore, free_bytes
from gds_offload.runtime.interrupts import wait_done
from gds_offload.weights.store.files import aligned_host_buffer

__all__ = ["KVShape", "KVPool", "PlacedCache", "PlacedLayer", "kv_shape"]


@dataclass(frozen=True)
class KVShape:
    """One micro-batch's KV cache: ``layers`` × ``[batch, kv_heads, positions, head_dim]`` keys and values."""

    layers: int
    batch: int
    kv_heads: int
    head_dim: int
    max_positions: int
    dtype: torch.dtype

    @property
    def position_nbytes(self) -> int:
        """Keys and values of one position for the whole micro-batch, in memory."""
        return 2 * self.batch * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def record_nbytes(self) -> int:
        """One position's record on the drive (4 KiB-aligned)."""
        return align_up(self.position_nbytes)

    @property
    def layer_nbytes(self) -> int:
        """One layer's cache at ``max_positions``, in memory."""
        return self.max_positions * self.position_nbytes

    @property
    def nbytes(self) -> int:
        """The whole micro-batch's cache at ``max_positions``, in memory."""
        return self.layers * self.layer_nbytes

    @property
    def drive_nbytes(self) -> int:
        """The whole micro-batch's cache at ``max_positions``, on the drive (whole records)."""
        return self.layers * self.max_positions * self.record_nbytes


def kv_shape(config: Any, *, batch: int, max_positions: int, dtype: torch.dtype) -> KVShape:
    """The :class:`KVShape` of a Hugging Face decoder ``config``'s cache.

    Raises:
        ConfigError: the config has sliding-window or linear-attention layers (their caches are not full-length).
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types - {"full_attention"} or getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        raise ConfigError(
            f"{type(text).__name__} has {'/'.join(sorted(types))} layers or a sliding window: a KV cache on the drive "
            f"holds full-attention layers only; use kv='device'"
        )
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return KVShape(text.num_hidden_layers, batch, kv_heads, head_dim, max_positions, dtype)


class KVPool:
    """The drive-resident KV caches of ``shapes`` (one per micro-batch, in team order).

    Args:
        shapes: each micro-batch's cache shape.
        engine: reads and writes the regions (posix ``O_DIRECT`` on the CPU; on a GPU the engine
            moves device memory: GDS straight from the drive, or through pinned staging).
        directory: where the unnamed spill file goes (a private directory, checked as
            :func:`~gds_offload.attach` checks its own).
        device: where the keys and values are computed and used.

    Raises:
        SpillSpaceError: the drive has no room for every region at ``max_positions`` (checked
            before any is reserved, from the free space ``statvfs`` reports).

    Every method runs on the team member whose turn it is (one at a time); reads and writes
    complete on the engine's threads. :meth:`close` waits for them and deletes the file.
    """

    def __init__(self, shapes: list[KVShape], *, engine: Engine, directory: str | Path, device: torch.device) -> None:
        if not shapes:
            raise ConfigError("a KV pool needs at least one micro-batch")
        self.shapes, self.engine, self.device = shapes, engine, device
        self._store = SpillStore([Path(directory)], create=True)
        self._lock = threading.Lock()
        try:
            need, free = sum(s.drive_nbytes for s in shapes), free_bytes(Path(directory))
            if need > free:  # before fallocate takes what there is
                raise SpillSpaceError(f"{need} bytes of KV caches ({len(shapes)} micro-batches, up to {max(s.max_positions for s in shapes)} "
                                      f"positions each) do not fit in {directory}: {free} bytes free there")  # fmt: skip
            self._regions = {(i, k): self._store.allocate(s.max_positions * s.record_nbytes) for i, s in enumerate(shapes) for k in range(s.layers)}
        except BaseException:
            self._store.close()
            raise
        self._lengths = dict.fromkeys(self._regions, 0)
        # Writes in the order issued, each with the buffer it reads from (live until the write is done).
        # Finished ones are dropped at every append, whichever region they wrote: kept until their
        # own region's next touch, a full pass later, a prefill's writes of every micro-batch and
        # layer would all be held at once (at 8 x 64 sequences and 16 positions a chunk, 384 MiB).
        self._writes: deque[tuple[tuple[int, int], IOFuture, torch.Tensor]] = deque()
        self._failed: dict[tuple[int, int], BaseException] = {}  # regions a write failed to
        self._ahead: tuple[tuple[int, int], int, IOFuture, torch.Tensor] | None = None  # (key, positions, read, buffer)
        self._closed = False
        #: Bytes read from and written to the drive.
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def file_nbytes(self) -> int:
        """Drive space the regions take."""
        return self._store.file_bytes()

    def cache(self, member: int) -> PlacedCache:
        """The ``Cache`` micro-batch ``member``'s ``generate`` uses."""
        return PlacedCache(self, member)

    # -- for PlacedLayer ----------------------------------------------------------------------
    def past(self, member: int, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values stored for ``(member, layer)`` as strided views ``[batch, kv_heads,
        positions, head_dim]`` of a buffer valid until the next :meth:`past`; ``None`` if empty."""
        key = (member, layer)
        n = self._lengths[key]
        if n == 0:
            return None
        ahead = self._ahead
        if ahead is not None and ahead[0] == key and ahead[1] == n:
            self._ahead = None
            future, buf = ahead[2], ahead[3]
        else:
            future, buf = self._read(key, n)
        wait_done(future)
        failure = future.error()
        if failure is not None:
            raise OffloadError(f"reading the KV cache of micro-batch {member}, layer {layer} from the drive failed: {failure}") from failure
        return self._unpack(self.shapes[member], buf, n)

    def append(self, member: int, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write new positions (``[batch, kv_heads, new, head_dim]``) after the stored ones."""
        key = (member, layer)
        s = self.shapes[member]
        new, start = keys.shape[-2], self._lengths[key]
        if start + new > s.max_positions:
            raise OffloadError(
                f"micro-batch {member}, layer {layer}: {start + new} positions in a KV region sized for {s.max_positions}; "
                f"raise max_new_tokens' planned length"
            )
        self._reap_writes()
        buf = aligned_host_buffer(new * s.record_nbytes)
        rec = buf[: new * s.record_nbytes].view(new, s.record_nbytes)[:, : s.position_nbytes].view(s.dtype)
        rec = rec.view(new, 2, s.batch, s.kv_heads, s.head_dim)
        rec[:, 0].copy_(keys.permute(2, 0, 1, 3))
        rec[:, 1].copy_(values.permute(2, 0, 1, 3))
        region = self._regions[key]
        slot = Slot(region.file, region.offset + start * s.record_nbytes, new * s.record_nbytes)
        future = self.engine.write(buf[: new * s.record_nbytes], slot)
        self._writes.append((key, future, buf))
        self._lengths[key] = start + new
        self.bytes_written += new * s.record_nbytes

    @property
    def write_nbytes_held(self) -> int:
        """Bytes of buffers held for writes not yet known to be done (what the pool holds beyond
        the cache read back and the one read ahead)."""
        return sum(buf.numel() for _, _, buf in self._writes)

    def length(self, member: int, layer: int) -> int:
        return self._lengths[(member, layer)]

    def read_ahead(self, member: int, layer: int) -> None:
        """Start reading what the team needs after ``(member, layer)``: the next member's cache of
        this layer, or after the last member the first one's of the next layer (of the next step)."""
        n_members = len(self.shapes)
        nxt = (member + 1, layer) if member + 1 < n_members else (0, (layer + 1) % self.shapes[0].layers)
        positions = self._lengths[nxt]
        if positions == 0 or (self._ahead is not None and self._ahead[0] == nxt):
            return
        future, buf = self._read(nxt, positions)
        self._ahead = (nxt, positions, future, buf)

    def close(self) -> None:
        """Wait for the reads and writes in flight; delete the spill file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._ahead is not None:
            self._ahead[2].error()
            self._ahead = None
        for _, future, _ in self._writes:
            future.error()
        self._writes.clear()
        self._store.close()

    # -- internals ----------------------------------------------------------------------------
    def _read(self, key: tuple[int, int], positions: int) -> tuple[IOFuture, torch.Tensor]:
        self._wait_writes(key)
        s = self.shapes[key[0]]
        nbytes = positions * s.record_nbytes
        buf = aligned_host_buffer(nbytes) if self.device.type == "cpu" else _device_buffer(nbytes, self.device)
        region = self._regions[key]
        self.bytes_read += nbytes
        return self.engine.read(buf[:nbytes], Slot(region.file, region.offset, nbytes)), buf

    def _wait_writes(self, key: tuple[int, int]) -> None:
        """Wait for ``key``'s writes (a read after a write of the same region sees it); raise the first failure."""
        for k, future, _ in self._writes:
            if k == key:
                wait_done(future)
                self._settle(k, future)
        self._raise_if_failed(key)
        self._reap_writes()

    def _reap_writes(self) -> None:
        """Drop the finished writes from the front of the queue (writes finish about in the order
        issued); raise a failed one's error."""
        while self._writes and self._writes[0][1].done():
            key, future, _ = self._writes.popleft()
            self._settle(key, future)

    def _settle(self, key: tuple[int, int], future: IOFuture) -> None:
        """Record a finished write's failure against its region, and raise it."""
        failure = future.error()
        if failure is not None:
            self._failed.setdefault(key, failure)
        self._raise_if_failed(key)

    def _raise_if_failed(self, key: tuple[int, int]) -> None:
        failure = self._failed.get(key)
        if failure is not None:  # once a write failed, the region is never read back as if whole
            raise OffloadError(f"writing the KV cache of micro-batch {key[0]}, layer {key[1]} to the drive failed: {failure}") from failure

    def _unpack(self, s: KVShape, buf: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        rec = buf[: positions * s.record_nbytes].view(positions, s.record_nbytes)[:, : s.position_nbytes].view(s.dtype)
        rec = rec.view(positions, 2, s.batch, s.kv_heads, s.head_dim)
        keys, values = rec[:, 0].permute(1, 2, 0, 3), rec[:, 1].permute(1, 2, 0, 3)
        if keys.device != self.device:
            keys, values = keys.to(self.device), values.to(self.device)
        return keys, values


def _device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8, device=device)
    skip = -raw.data_ptr() % 4096
    return raw[skip : skip + nbytes]


class PlacedLayer(DynamicLayer):
    """One decoder layer's cache of one micro-batch, kept in a :class:`KVPool` (see the module doc).

    A ``DynamicLayer`` for what attention and ``generate`` use: ``update``, ``get_seq_length``,
    ``get_mask_sizes``, ``get_max_length``, and ``keys``/``values`` as meta tensors of the
    current shape (never the values: they are on the drive).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, pool: KVPool, member: int, layer: int) -> None:
        super().__init__()
        self._pool, self._member, self._layer = pool, member, layer
        s = pool.shapes[member]
        self.device = pool.device
        self.keys = torch.empty(s.batch, s.kv_heads, 0, s.head_dim, dtype=s.dtype, device="meta")
        self.values = self.keys
        self.is_initialized = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        past = self._pool.past(self._member, self._layer)
        empty = torch.tensor([], dtype=key_states.dtype, device=key_states.device)
        # As DynamicLayer: cat([past, new]) (its first update concatenates onto an empty tensor).
        keys = torch.cat([empty if past is None else past[0], key_states], dim=-2)
        values = torch.cat([empty if past is None else past[1], value_states], dim=-2)
        self._pool.append(self._member, self._layer, key_states, value_states)
        self._pool.read_ahead(self._member, self._layer)
        self.keys = torch.empty(keys.shape, dtype=keys.dtype, device="meta")
        self.values = self.keys
        self.is_initialized = True
        return keys, values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self._pool.length(self._member, self._layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        """Already off the device."""

    def prefetch(self) -> None:
        """The pool reads ahead by itself."""

    def reset(self) -> None:
        raise ConfigError("a KV cache on the drive cannot be reset; start a new generate_many")

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise ConfigError("beam search reorders the KV cache, which a cache on the drive does not support; use kv='device'")

    def crop(self, tokens_to_remove: int) -> None:
        raise ConfigError("cropping a KV cache on the drive (assisted generation) is not supported; use kv='device'")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ConfigError("expanding a KV cache on the drive (num_return_sequences > 1) is not supported; use kv='device'")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ConfigError("selecting rows of a KV cache on the drive is not supported; use kv='device'")


class PlacedCache(Cache):
    """A micro-batch's Hugging Face ``Cache`` whose layers live in a :class:`KVPool`."""

    def __init__(self, pool: KVPool, member: int) -> None:
        layers: list[Any] = [PlacedLayer(pool, member, k) for k in range(pool.shapes[member].layers)]
        super().__init__(layers=layers)

    def __iter__(self) -> Iterator[Any]:
        raise ConfigError("a KV cache on the drive cannot be iterated as tensors; use kv='device'")
