"""Streaming a model's layers from a weight store for inference: :func:`load_streamed`.

The resident group (embeddings, final norm, ``lm_head``) and the first
``resident_layers`` layers are read once into host memory and become the model's
tensors. Every other layer lives on the drive (``tier="drive"``) and, for its forward
only, in one of ``slots`` preallocated, page-aligned ring buffers, each the size of the
largest layer.

Hook contracts (both run on the thread that calls the model, and may block it):

* ``_pre(layer_module, args)``, a forward pre-hook on each streamed layer: waits for the
  layer's read (issued earlier), or, if the layer is not the one predicted, waits for the
  reads in flight, drops them and reads it now (a *miss*); points every parameter of the
  layer at its slot (views, no copy); then issues reads of the next layers, in layer
  order and wrapping around to the first streamed layer (the next decode step), into
  every free slot.
* ``_post(layer_module, args, output)``, a forward hook: puts the meta placeholders back
  (a layer's parameters are real only during its forward), frees its slot and fills it
  with the next read.

Invariant: a slot is written by a read only while no layer's parameters view it, so a
layer always computes with exactly the bytes the store holds for it (``torch.equal`` to
the resident model's outputs). Reads go through
:class:`~gds_offload.io.posix.PosixEngine` (``O_DIRECT`` ``pread`` on its thread pool, in
place into the slot). With ``verify`` each read's xxh3-64 is checked on the engine thread
before the layer may use it.

``tier="host"``: every layer is read once, at load, into host memory, and the parameters
point straight at it (on the CPU a copy into a ring would only move bytes the model can
use where they are); nothing happens per forward.

.. warning:: One forward at a time, inference only
   The hooks keep one prediction of the next layer, so two threads running the model at
   once, or autograd (parameters are created with ``requires_grad=False``), are not
   supported. A streamed layer's parameters are meta tensors outside its forward.
"""
from __future__ import annotations

import collections
import functools
import os
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from gds_offload.errors import ConfigError, OffloadError
from gds_offload.io.base import IOFuture
from gds_offload.io.posix import PosixEngine
from gds_offload.weights.bind import Binding, bind, rebuild_meta_buffers, view_of
from gds_offload.weights.errors import ConfigMismatchError, StoreCorruptError
from gds_offload.weights.manifest import GroupEntry, Manifest, canonical_config, config_fingerprint, read_manifest
from gds_offload.weights.storefile import StoreFiles, aligned_host_buffer, read_group, resolve_dirs

__all__ = ["load_streamed", "StreamedModel", "StreamStats", "Tier"]

Tier = Literal["drive", "host"]
#: Engine threads for the reads (a layer is split into 8 MiB chunks over them). Not tuned: half
#: the posix engine's default, since these reads compete with the model for a small VM's cores.
DEFAULT_THREADS = 4


@dataclass
class StreamStats:
    """Counters of one :class:`StreamedModel`. Lists are per streamed layer, in layer order."""

    tier: str
    engine: str
    direct: bool
    slots: int
    slot_nbytes: int
    streamed_layers: list[str]
    resident_layers: list[str]
    #: Host memory holding resident tensors (and, for ``tier="host"``, every layer).
    resident_nbytes: int
    #: Times each layer's parameters were made real for a forward.
    loads: list[int] = field(default_factory=list)
    #: Reads issued for each layer (one per forward, plus the ones prefetched for the next).
    reads: list[int] = field(default_factory=list)
    bytes_read: int = 0
    #: Layer calls that were not the predicted next layer (their read was not ready).
    misses: int = 0
    #: Prefetched reads dropped by a miss.
    wasted_reads: int = 0
    #: Time the model's thread waited for reads in the pre-hooks.
    stall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Pending:
    pos: int
    slot: int
    future: IOFuture


def load_streamed(
    model: nn.Module,
    store: str | os.PathLike[str] | list[str | os.PathLike[str]],
    *,
    device: str | torch.device = "cpu",
    tier: Tier = "drive",
    slots: int = 2,
    resident_layers: int = 0,
    verify: bool = False,
    num_threads: int = DEFAULT_THREADS,
) -> StreamedModel:
    """Give a model skeleton (built on the meta device) its weights from a store, streaming its layers.

    Args:
        model: the skeleton, e.g. ``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``
            or under ``accelerate.init_empty_weights()``. Changed in place: resident tensors
            become real, streamed layers get hooks.
        store: the store's directory (a list, in conversion order, if it was striped).
        device: where the model computes; only ``"cpu"`` in this version.
        tier: ``"drive"``: layers are read from the store for every forward; ``"host"``: all
            layers are read once into host memory.
        slots: ring buffers for streamed layers (``>= 1``; 2 overlaps one read with one layer's
            compute; capped at the number of streamed layers).
        resident_layers: how many of the first layers to keep in memory like the resident group.
        verify: check each group's xxh3-64 after every read (:class:`StoreCorruptError` names the layer).
        num_threads: engine threads doing the reads.

    Returns:
        A :class:`StreamedModel`; close it (or use it as a context manager) to stop the reads.

    Raises:
        ConfigError: a bad argument. ConfigMismatchError: the model's config is not the store's.
        WeightsMismatchError: missing, extra or mis-shaped tensors (all listed).
        StoreFormatError: no store, or a damaged one. StoreCorruptError: a group read at load fails its checksum.
    """
    return StreamedModel(model, store, device=device, tier=tier, slots=slots, resident_layers=resident_layers, verify=verify, num_threads=num_threads)


class StreamedModel:
    """A model whose layers stream from a weight store (see :func:`load_streamed`).

    Call it like the model (``handle(input_ids)``, ``handle.generate(...)``) or use ``handle.model``.
    """

    def __init__(
        self,
        model: nn.Module,
        store: str | os.PathLike[str] | list[str | os.PathLike[str]],
        *,
        device: str | torch.device,
        tier: Tier,
        slots: int,
        resident_layers: int,
        verify: bool,
        num_threads: int,
    ) -> None:
        # Validate first.
        device = torch.device(device)
        if device.type != "cpu":
            raise ConfigError(f"device={device}: this version streams into host memory only; use device='cpu' (GPU ring buffers through KvikIO are not built yet)")
        if tier not in ("drive", "host"):
            raise ConfigError(f"tier={tier!r}: expected 'drive' (read layers from the store every forward) or 'host' (keep them in memory)")
        if slots < 1 or num_threads < 1:
            raise ConfigError(f"slots={slots}, num_threads={num_threads}: both must be at least 1")
        first = store[0] if isinstance(store, (list, tuple)) else store
        manifest = read_manifest(first)
        layers = manifest.layers
        if not 0 <= resident_layers <= len(layers):
            raise ConfigError(f"resident_layers={resident_layers}: the store has {len(layers)} layers; use 0..{len(layers)}")
        _check_config(model, manifest, Path(first))
        self.binding: Binding = bind(model, manifest, where=str(first))
        self.model, self.manifest, self.verify = model, manifest, verify
        self._dirs = resolve_dirs(store, manifest)
        # Allocate.
        in_memory = layers if tier == "host" else layers[:resident_layers]
        self._streamed: list[GroupEntry] = [] if tier == "host" else layers[resident_layers:]
        self._files = StoreFiles(self._dirs, manifest)
        self._engine = PosixEngine(num_threads=num_threads, read_pool_bytes=0)
        self._finalizer = weakref.finalize(self, _shutdown, self._engine, self._files)
        self._hooks: list[Any] = []
        self._inflight: collections.deque[_Pending] = collections.deque()
        self._current: tuple[int, int] | None = None
        self._closed = False
        try:
            resident_nbytes = self._load_resident(([manifest.resident] if manifest.resident else []) + in_memory)
            rebuild_meta_buffers(model, device)
            slots = min(slots, max(1, len(self._streamed)))
            slot_nbytes = max((g.padded_nbytes for g in self._streamed), default=0)
            self._ring = [aligned_host_buffer(slot_nbytes) for _ in range(slots)] if self._streamed else []
            self._free = list(range(len(self._ring)))[::-1]
            self._views = [[self._slot_views(g, s) for s in range(len(self._ring))] for g in self._streamed]
            self._stats = StreamStats(
                tier=tier,
                engine=self._engine.description,
                direct=self._files.direct,
                slots=len(self._ring),
                slot_nbytes=slot_nbytes,
                streamed_layers=[g.name for g in self._streamed],
                resident_layers=[g.name for g in in_memory],
                resident_nbytes=resident_nbytes,
                loads=[0] * len(self._streamed),
                reads=[0] * len(self._streamed),
            )
            # Register.
            for pos, g in enumerate(self._streamed):
                layer = model.get_submodule(g.name)
                self._hooks.append(layer.register_forward_pre_hook(functools.partial(self._pre, pos)))
                self._hooks.append(layer.register_forward_hook(functools.partial(self._post, pos)))
            self._next_pos = 0
            self._fill()  # the first forward's first layers start reading now
        except BaseException:
            self.close()
            raise

    # -- public ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``self.model.generate(...)`` (Hugging Face models)."""
        return self.model.generate(*args, **kwargs)  # type: ignore[operator]

    def stats(self) -> StreamStats:
        """A copy of the counters."""
        s = self._stats
        return StreamStats(**(asdict(s) | {"loads": list(s.loads), "reads": list(s.reads)}))

    def close(self) -> None:
        """Wait for reads in flight, remove the hooks, close the engine and files. Idempotent.

        Streamed layers are left with meta parameters; resident tensors stay in the model.
        """
        if self._closed:
            return
        self._closed = True
        self._drain()
        if self._current is not None:
            self._unbind(*self._current)
            self._current = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._finalizer()

    def __enter__(self) -> StreamedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loading --------------------------------------------------------------------------
    def _load_resident(self, groups: list[GroupEntry]) -> int:
        """Read ``groups`` into one host arena and bind their tensors to it; returns its size."""
        bases, total = [], 0
        for g in groups:
            bases.append(total)
            total += g.padded_nbytes
        arena = aligned_host_buffer(total)
        futures = [read_group(self._engine, self._files, g, arena[b : b + g.padded_nbytes], verify=self.verify) for g, b in zip(groups, bases)]
        for g, f in zip(groups, futures):
            self._wait(g, f)
        for g, b in zip(groups, bases):
            buf = arena[b : b + g.padded_nbytes]
            for name in self.binding.by_group.get(g.name, []):
                self.binding.place(name, self.binding.as_parameter(name, view_of(buf, self.binding.entries[name], g.offset)))
        return total if groups else 0

    def _slot_views(self, g: GroupEntry, slot: int) -> list[tuple[str, torch.Tensor]]:
        # Made once, at load (outside any inference_mode), and reused every forward.
        return [(n, self.binding.as_parameter(n, view_of(self._ring[slot], self.binding.entries[n], g.offset))) for n in self.binding.by_group.get(g.name, [])]

    # -- hooks ----------------------------------------------------------------------------
    def _pre(self, pos: int, module: nn.Module, args: Any) -> None:
        if self._closed:
            raise OffloadError(f"the StreamedModel of {self._dirs[0]} is closed; load the store again (load_streamed)")
        if self._current is not None:  # the previous layer's forward raised: its post-hook never ran
            self._release()
        if not (self._inflight and self._inflight[0].pos == pos):
            if self._inflight:
                self._stats.misses += 1
                self._stats.wasted_reads += len(self._inflight)
                self._drain()
            self._next_pos = pos
            self._fill()
        p = self._inflight.popleft()
        try:
            start = time.perf_counter()
            self._wait(self._streamed[pos], p.future)
            self._stats.stall_s += time.perf_counter() - start
        except BaseException:
            self._free.append(p.slot)
            raise
        for name, tensor in self._views[pos][p.slot]:
            self.binding.place(name, tensor)
        self._current = (pos, p.slot)
        self._stats.loads[pos] += 1
        self._fill()

    def _post(self, pos: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._current is not None and self._current[0] == pos:
            self._release()
            self._fill()

    # -- the ring -------------------------------------------------------------------------
    def _fill(self) -> None:
        """Issue reads of the next layers (cyclic order) into the free slots."""
        n = len(self._streamed)
        while self._free:
            pos = self._next_pos
            if (self._current is not None and self._current[0] == pos) or any(p.pos == pos for p in self._inflight):
                return  # every streamed layer is in a slot or on its way
            slot = self._free.pop()
            g = self._streamed[pos]
            future = read_group(self._engine, self._files, g, self._ring[slot], verify=self.verify)
            self._inflight.append(_Pending(pos, slot, future))
            self._stats.reads[pos] += 1
            self._stats.bytes_read += g.nbytes
            self._next_pos = (pos + 1) % n

    def _release(self) -> None:
        assert self._current is not None, "release without a current layer"
        self._unbind(*self._current)
        self._free.append(self._current[1])
        self._current = None

    def _unbind(self, pos: int, slot: int) -> None:
        for name, _ in self._views[pos][slot]:
            self.binding.restore(name)

    def _drain(self) -> None:
        """Wait for every read in flight (they cannot be cancelled) and free their slots."""
        while self._inflight:
            p = self._inflight.popleft()
            try:
                p.future.wait()
            except Exception:  # noqa: BLE001 - a dropped read's error does not matter
                pass
            self._free.append(p.slot)

    def _wait(self, g: GroupEntry, future: IOFuture) -> None:
        try:
            future.wait()
        except StoreCorruptError:
            raise
        except OffloadError as exc:
            raise OffloadError(f"reading {g.describe()} from the weight store failed: {exc}") from exc


def _shutdown(engine: PosixEngine, files: StoreFiles) -> None:
    engine.close()
    files.close()


def _check_config(model: nn.Module, manifest: Manifest, store: Path) -> None:
    """Refuse a model whose config is not the one the store was converted from."""
    cfg = getattr(model, "config", None)
    if manifest.config_sha256 is None or cfg is None or not hasattr(cfg, "to_dict"):
        return
    if config_fingerprint(cfg) == manifest.config_sha256:
        return
    ours, theirs = canonical_config(cfg) or {}, {}
    saved = store / "config.json"
    if saved.is_file():
        theirs = canonical_config(saved) or {}
    diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    shown = ", ".join(f"{k}: model {ours.get(k)!r}, store {theirs.get(k)!r}" for k in diff[:6]) or "see the two configs"
    raise ConfigMismatchError(
        f"the model's config (sha256 {config_fingerprint(cfg)[:12]}...) is not the one the weight store at {store} was converted "
        f"from (sha256 {manifest.config_sha256[:12]}...): {shown}. Build the model from {saved} "
        f"(AutoConfig.from_pretrained({str(store)!r})), or convert this model's checkpoint"
    )
