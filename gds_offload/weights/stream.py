"""Streaming a model's layers from a weight store for inference: :func:`load_streamed`.

The resident group (embeddings, final norm, ``lm_head``) and the first
``resident_layers`` layers are read once and become the model's tensors, on ``device``.
Every other layer lives on the drive (``tier="drive"``) or in host memory (``tier="host"``
on a GPU) and, for its forward only, in one of ``slots`` preallocated ring buffers on
``device``, each the size of the largest layer (:mod:`gds_offload.weights.ring`: how a
slot is filled and what orders a layer's kernels after its fill and before the slot's
next fill, on the CPU and on CUDA).

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

``tier="host"`` on the CPU: every layer is read once, at load, into host memory, and the
parameters point straight at it (a copy into a ring would only move bytes the model can
use where they are); nothing happens per forward.

With grad mode on, a streamed layer's forward also runs under saved-tensor hooks
(:mod:`gds_offload.weights.backward`): the weights autograd saves are read again for
backward (or copied out of the slots still holding the forward's last layers) instead of
pointing into a slot that is refilled, so gradients to the inputs and
to trainable resident tensors equal the resident model's. The post-hook is registered with
``always_call=True``, so a forward that raises still pops them and frees the slot. Hugging
Face gradient checkpointing recomputes a layer without its module hooks: the layer's
checkpointing function is wrapped to bind it then (:mod:`gds_offload.weights.recompute`).

.. warning:: One forward at a time; streamed parameters are frozen
   The hooks keep one prediction of the next layer, so two threads running the model at
   once are not supported. A streamed layer's parameters are meta tensors outside its
   forward, and ``requires_grad=False`` during it: they are never trained.
"""
from __future__ import annotations

import functools
import os
import time
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from gds_offload.errors import ConfigError, OffloadError
from gds_offload.io.base import Engine
from gds_offload.io.posix import PosixEngine
from gds_offload.io.select import validate_mode
from gds_offload.units import parse_bytes
from gds_offload.weights.adapters import unwrap
from gds_offload.weights.backward import SavedWeights
from gds_offload.weights.bind import Binding, bind, rebuild_meta_buffers, view_of
from gds_offload.weights.budget import plan_residency
from gds_offload.weights.manifest import GroupEntry, check_config, read_manifest
from gds_offload.weights.prefetch import Prefetch
from gds_offload.weights.recompute import Recompute
from gds_offload.weights.ring import Ring, make_read_engine, make_ring, wait_read
from gds_offload.weights.storefile import StoreFiles, aligned_host_buffer, read_group, resolve_dirs
from gds_offload.weights.stream_stats import StreamStats

__all__ = ["load_streamed", "StreamedModel", "StreamStats", "Tier"]

Tier = Literal["drive", "host"]
#: Engine threads for the reads on the CPU (a layer is split into 8 MiB chunks over them).
#: Half the posix engine's default, since these reads compete with the model for a small
#: VM's cores. On a GPU the engine's own default applies (KvikIO: 16).
DEFAULT_THREADS = 4


def load_streamed(
    model: nn.Module,
    store: str | os.PathLike[str] | list[str | os.PathLike[str]],
    *,
    device: str | torch.device = "cpu",
    tier: Tier = "drive",
    slots: int = 2,
    resident_layers: int | None = None,
    max_memory: int | str | None = None,
    verify: bool = False,
    engine: str = "auto",
    num_threads: int | None = None,
) -> StreamedModel:
    """Give a model skeleton (built on the meta device) its weights from a store, streaming its layers.

    Args:
        model: the skeleton, e.g. ``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``
            or under ``accelerate.init_empty_weights()``. Changed in place: resident tensors
            become real on ``device``, streamed layers get hooks.
        store: the store's directory (a list, in conversion order, if it was striped).
        device: where the model computes: ``"cpu"`` or a CUDA device.
        tier: ``"drive"``: layers are read from the store for every forward; ``"host"``: all
            layers are read once into host memory (pinned, and copied into the ring on a GPU).
        slots: ring buffers for streamed layers (``>= 1``; 2 overlaps one fill with one layer's
            compute; capped at the number of streamed layers).
        resident_layers: how many of the first layers to keep on ``device`` like the resident group
            (default 0, or what ``max_memory`` allows).
        max_memory: bytes (or ``"6GiB"``) of ``device`` memory for weights: the resident group, the
            ring, and as many leading layers as fit beside them
            (:func:`~gds_offload.weights.budget.plan_residency`; activations and the KV cache are
            not counted). With ``tier="host"`` on the CPU every layer is held, and must fit.
        verify: check each group's xxh3-64 after every read (:class:`StoreCorruptError` names the layer).
        engine: the reads' engine: ``auto`` (CPU: posix; GPU: gds where usable, else KvikIO
            compat, else posix), ``gds``, ``compat``, ``posix``.
        num_threads: engine threads doing the reads (``None``: 4 on the CPU, the engine's default on a GPU).

    Returns:
        A :class:`StreamedModel`; close it (or use it as a context manager) to stop the reads.

    Raises:
        ConfigError: a bad argument, or no CUDA for a CUDA device. ConfigMismatchError: the model's
            config is not the store's. WeightsMismatchError: missing, extra or mis-shaped tensors (all listed).
        StoreFormatError: no store, or a damaged one. StoreCorruptError: a group read at load fails its checksum.
        GDSUnavailableError: ``engine="gds"`` where GPUDirect Storage does not work.
    """
    budget = None if max_memory is None else parse_bytes(max_memory, name="max_memory")
    return StreamedModel(model, store, device=device, tier=tier, slots=slots, resident_layers=resident_layers,
                         max_memory=budget, verify=verify, engine=engine, num_threads=num_threads)  # fmt: skip


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is not a torch device ({exc}); use 'cpu' or 'cuda'") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"device={dev}: weights stream into host memory ('cpu') or a GPU ('cuda'); {dev.type} is not supported")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={dev}: needs an NVIDIA GPU, but torch.cuda.is_available() is False; use device='cpu'")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


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
        resident_layers: int | None,
        max_memory: int | None,
        verify: bool,
        engine: str,
        num_threads: int | None,
    ) -> None:
        # Validate first.
        dev = _resolve_device(device)
        validate_mode(engine)
        if tier not in ("drive", "host"):
            raise ConfigError(f"tier={tier!r}: expected 'drive' (read layers from the store every forward) or 'host' (keep them in memory)")
        if slots < 1 or (num_threads is not None and num_threads < 1):
            raise ConfigError(f"slots={slots}, num_threads={num_threads}: both must be at least 1")
        first = store[0] if isinstance(store, (list, tuple)) else store
        manifest = read_manifest(first)
        layers = manifest.layers
        plan = plan_residency(manifest.resident, layers, slots=slots, max_memory=max_memory, resident_layers=resident_layers,
                              hold_all=tier == "host" and dev.type == "cpu")  # fmt: skip
        base, adapters = unwrap(model)  # a PeftModel: its transformers model, and the LoRA adapters on it
        check_config(base, manifest, Path(first))
        self.binding: Binding = bind(base, manifest, where=str(first), rename=adapters.store_name)
        self.model, self.manifest, self.verify, self.device = model, manifest, verify, dev
        self._dirs = resolve_dirs(store, manifest)
        # Allocate.
        in_memory = layers[: plan.resident_layers]
        self._streamed: list[GroupEntry] = layers[len(in_memory) :]
        self._files = StoreFiles(self._dirs, manifest)
        self._res: list[Any] = [self._files]  # closed in reverse order by the finalizer
        self._finalizer = weakref.finalize(self, _shutdown, self._res)
        self._hooks: list[Any] = []
        self._slot_version = 0
        self._recompute = Recompute(self._bind_for_recompute, self._release_after_recompute)
        self._closed = False
        self._ring: Ring | None = None
        self._saved: SavedWeights | None = None
        self._prefetch: Prefetch | None = None
        try:
            self._loader = PosixEngine(num_threads=num_threads or DEFAULT_THREADS, read_pool_bytes=0)
            self._res.append(self._loader)
            reads: Engine = self._loader
            if self._streamed and tier == "drive" and (dev.type != "cpu" or engine != "auto"):
                reads = make_read_engine(engine, dev, self._dirs[0], num_threads)
                self._res.append(reads)
            resident_nbytes = self._load_resident(([manifest.resident] if manifest.resident else []) + in_memory)
            rebuild_meta_buffers(base, dev)
            _move_free_buffers(base, dev)
            adapters.materialize(dev)
            self._ring = make_ring(tier=tier, device=dev, engine=reads, files=self._files, groups=self._streamed,
                                   slots=slots, verify=verify, load=self._read_arena)  # fmt: skip
            if self._ring is not None:
                self._res.append(self._ring)
            ring = self._ring.buffers if self._ring else []
            self._views = [[self._slot_views(g, buf) for buf in ring] for g in self._streamed]
            self._stats = StreamStats(
                tier=tier,
                device=str(dev),
                ring=self._ring.kind if self._ring else "none",
                engine=reads.description,
                direct=self._files.direct,
                slots=len(ring),
                slot_nbytes=ring[0].numel() if ring else 0,
                streamed_layers=[g.name for g in self._streamed],
                resident_layers=[g.name for g in in_memory],
                resident_nbytes=resident_nbytes,
                host_nbytes=self._ring.host_nbytes if self._ring else 0,
                loads=[0] * len(self._streamed),
                reads=[0] * len(self._streamed),
            )
            # Register.
            for pos, g in enumerate(self._streamed):
                layer = base.get_submodule(g.name)
                self._hooks.append(layer.register_forward_pre_hook(functools.partial(self._pre, pos)))
                self._hooks.append(layer.register_forward_hook(functools.partial(self._post, pos), always_call=True))
            if self._ring is not None:
                self._prefetch = Prefetch(self._ring, self._streamed, self._stats)
                self._saved = SavedWeights(self._ring, self._streamed, str(self._dirs[0]), held=self._prefetch.copy_held)
                self._prefetch.fill()  # the first forward's first layers start now
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
        again = list(self._saved.reads) if self._saved else []
        copied = list(self._saved.copies) if self._saved else []
        return StreamStats(**(asdict(s) | {"loads": list(s.loads), "reads": list(s.reads), "backward_reads": again, "backward_copies": copied}))

    def settle(self) -> None:
        """Block until the fills in flight (the next forward's first layers, prefetched after the
        last layer) have landed. They stay for that forward, which reports any read error; the
        drive is idle afterwards until the next forward starts (e.g. before timing something else)."""
        if self._prefetch is not None:
            self._prefetch.settle()

    def close(self) -> None:
        """Wait for fills in flight (and, on CUDA, for the device), remove the hooks, close the
        engines and files. Idempotent. Streamed layers are left with meta parameters; resident
        tensors stay in the model."""
        if self._closed:
            return
        self._closed = True
        if self._saved is not None:
            self._saved.exit()
            self._saved.close()
        if self._prefetch is not None:
            self._prefetch.drain()
            if self._prefetch.current is not None:
                self._unbind(*self._prefetch.current)
                self._prefetch.current = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._recompute.restore()
        self._finalizer()

    def __enter__(self) -> StreamedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loading --------------------------------------------------------------------------
    def _read_arena(self, groups: list[GroupEntry]) -> tuple[torch.Tensor, dict[str, int]]:
        """Read ``groups`` into one page-aligned host arena: ``(arena, offset of each group in it)``."""
        bases, total = {}, 0
        for g in groups:
            bases[g.name] = total
            total += g.padded_nbytes
        arena = aligned_host_buffer(total)
        futures = [read_group(self._loader, self._files, g, arena[bases[g.name] :], verify=self.verify) for g in groups]
        for g, f in zip(groups, futures):
            wait_read(g, f)
        return arena, bases

    def _load_resident(self, groups: list[GroupEntry]) -> int:
        """Read ``groups``, put them on the device and bind their tensors there; returns the bytes."""
        if not groups:
            return 0
        arena, bases = self._read_arena(groups)
        if self.device.type != "cpu":
            arena = arena.to(self.device)
        for g in groups:
            for name in self.binding.by_group.get(g.name, []):
                buf = arena[bases[g.name] :]
                self.binding.place(name, self.binding.as_parameter(name, view_of(buf, self.binding.entries[name], g.offset)))
        return arena.numel()

    def _slot_views(self, g: GroupEntry, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        # Made once, at load (outside any inference_mode), and reused every forward.
        return [(n, self.binding.as_parameter(n, view_of(buf, self.binding.entries[n], g.offset))) for n in self.binding.by_group.get(g.name, [])]

    # -- hooks ----------------------------------------------------------------------------
    def _pre(self, pos: int, module: nn.Module, args: Any, *, recompute: bool = False) -> None:
        if self._closed:
            raise OffloadError(f"the StreamedModel of {self._dirs[0]} is closed; load the store again (load_streamed)")
        assert self._prefetch is not None and self._ring is not None and self._saved is not None, "a streamed layer without a ring"
        if self._prefetch.current is not None:  # the previous layer's forward raised: its post-hook never ran
            self._release()
        checkpointed = not recompute and torch.is_grad_enabled() and module.training and getattr(module, "gradient_checkpointing", False)
        if checkpointed:
            self._recompute.wrap(pos, module)  # backward will run this layer's forward without our hooks
        # Recomputes go down the layers, as backward does; a recompute, and a forward with grad mode
        # on (its backward, or a checkpointed forward's recompute), are each followed by a pass the other way.
        p = self._prefetch.take(pos, direction=-1 if recompute else 1, turns=recompute or torch.is_grad_enabled())
        if not p.held:
            try:
                start = time.perf_counter()
                self._ring.wait(self._streamed[pos], p)
                self._stats.stall_s += time.perf_counter() - start
            except BaseException:
                self._prefetch.abandon(p)
                raise
        for name, tensor in self._views[pos][p.slot]:
            self.binding.place(name, tensor)
        self._slot_version = self._ring.buffers[p.slot]._version  # shared by every view of the slot
        self._stats.loads[pos] += 1
        if pos == 0:
            self._saved.clear()  # a new forward: the last backward's layers are done with
        if torch.is_grad_enabled():
            self._saved.enter(pos, p.slot, clone=recompute)  # last: if it raises, the post-hook still frees the slot

    def _bind_for_recompute(self, pos: int, module: nn.Module) -> bool:
        assert self._prefetch is not None, "a recompute without a ring"
        current = self._prefetch.current
        if current is not None and current[0] == pos:
            return False  # the original forward: the pre-hook bound it
        self._pre(pos, module, (), recompute=True)
        return True

    def _release_after_recompute(self, pos: int, module: nn.Module) -> None:
        self._post(pos, module, (), None)

    def _post(self, pos: int, module: nn.Module, args: Any, output: Any) -> None:
        # Also runs when the forward raised (always_call): output is None then.
        assert self._prefetch is not None, "a streamed layer without a ring"
        current = self._prefetch.current
        if current is None or current[0] != pos:
            return
        changed = not self._release()
        if changed and output is not None:
            # The resident model would keep the change; the next read of this layer would not.
            raise OffloadError(
                f"{self._streamed[pos].describe()} changed its streamed parameters or buffers in place during its forward "
                f"(e.g. BatchNorm running statistics in train mode); streamed weights are read-only. Put that module in "
                f"eval mode, or keep the layer resident (resident_layers= or max_memory=)"
            )

    def _release(self) -> bool:
        """Take the current layer's weights out and hand its slot back; ``False`` if its forward
        changed the slot's bytes (its version counter moved)."""
        assert self._prefetch is not None and self._prefetch.current is not None and self._ring is not None, "release without a current layer"
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


def _shutdown(resources: list[Any]) -> None:
    for r in reversed(resources):  # ring (waits for the device), engines, then the files
        r.close()


def _move_free_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (not in any store: rotary ``inv_freq``) left on another device go to ``device``."""
    for mod in model.modules():
        for leaf, b in mod._buffers.items():
            if b is not None and not b.is_meta and b.device != device and leaf in mod._non_persistent_buffers_set:
                mod._buffers[leaf] = b.to(device)
