"""Streaming a model's layers from a weight store, for inference and LoRA fine-tuning: :func:`load_streamed`.

The resident group (embeddings, final norm, ``lm_head``) and the first
``resident_layers`` layers are read once and become the model's tensors, on ``device``.
Every other layer lives on the drive (``tier="drive"``) or in host memory (``tier="host"``
on a GPU) and, for its forward only, in one of ``slots`` preallocated ring buffers on
``device``, each the size of the largest layer (:mod:`gds_offload.weights.streaming.ring`: how a
slot is filled and what orders a layer's kernels after its fill and before the slot's
next fill, on the CPU and on CUDA).

The hooks' contracts, and the invariant that makes a streamed layer compute with exactly the bytes
the store holds for it, are the module doc of :mod:`gds_offload.weights.streaming.hooks`.

What the model becomes is what ``transformers``' ``from_pretrained`` of the store's checkpoint
returns: in eval mode (dropout off; call ``model.train()`` to train with it), with the
checkpoint's ``generation_config.json`` as ``generate``'s defaults
(:func:`~gds_offload.weights.store.config.generation_config`), and, for a store trained by
:class:`~gds_offload.weights.train.trainer.StreamedTrainer`, the weights of its last complete step
(``STORE/train/step.json``), as :func:`~gds_offload.weights.store.export.export` writes them;
``converted=True`` streams the converted weights.

``tier="host"`` on the CPU: every layer is read once, at load, into host memory, and the
parameters point straight at it (a copy into a ring would only move bytes the model can
use where they are); nothing happens per forward.

With grad mode on, a streamed layer's forward also runs under saved-tensor hooks
(:mod:`gds_offload.weights.streaming.backward`): autograd never keeps a view of a slot that is refilled.
On host slots backward computes from the ring's own slots, lent layer by layer as it goes down
(a slot is written again only once nothing holds it, else it gets a new buffer); otherwise the
weights it saved are read again or copied out of the ring. Gradients to the inputs and to
trainable resident tensors equal the resident model's. The post-hook is registered with
``always_call=True``, so a forward that raises still pops them and frees the slot. Hugging
Face gradient checkpointing recomputes a layer without its module hooks: the layer's
checkpointing function is wrapped to bind it then (:mod:`gds_offload.weights.streaming.recompute`).

.. warning:: One forward at a time; streamed parameters are frozen unless a trainer trains them
   The hooks keep one prediction of the next layer, so one forward runs at a time: a second
   thread calling the model meanwhile gets :class:`OffloadError` at once
   (:mod:`gds_offload.weights.streaming.turn`). A streamed layer's parameters are meta tensors outside
   its forward, and ``requires_grad=False`` during it, unless :meth:`StreamedModel.train_layers`
   (:class:`~gds_offload.weights.train.trainer.StreamedTrainer`) made them trainable: then each
   gradient is handed over as autograd accumulates it, and the trainer updates the store.

Layer-major teams (:meth:`StreamedModel.run_team`, under :meth:`StreamedModel.generate_many`
and :meth:`StreamedModel.accumulate`): several micro-batches, one thread each, run one at a
time and hand over at every streamed layer's pre-hook (:mod:`gds_offload.weights.streaming.team`);
the first member to reach layer ``k`` binds it, the others compute with the same slot, and the
first to reach layer ``k + 1`` releases ``k`` (every member has passed it by then). The team's
threads count as the model's one forward (:mod:`gds_offload.weights.streaming.turn`).
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gds_offload.errors import ConfigError, OffloadError
from gds_offload.io.base import Engine
from gds_offload.io.factory import make_engine
from gds_offload.io.release import release_when_collected
from gds_offload.node.choice import Choice, choose_engine
from gds_offload.runtime.interrupts import held
from gds_offload.weights.errors import StoreFormatError
from gds_offload.weights.planning.options import StreamOptions, Tier
from gds_offload.weights.planning.planner import Plan, as_plan
from gds_offload.weights.planning.residency import plan_residency
from gds_offload.weights.run.accumulate import accumulate
from gds_offload.weights.run.generation import ManyOutput, generate_many
from gds_offload.weights.store.advice import reconvert_command
from gds_offload.weights.store.config import check_config, generation_config
from gds_offload.weights.store.files import StoreFiles, resolve_dirs
from gds_offload.weights.store.manifest import TENSOR_ALIGN, GroupEntry, Manifest, read_manifest
from gds_offload.weights.store.steps import STEP_NAME, Generations, Step
from gds_offload.weights.streaming.adapters import unwrap
from gds_offload.weights.streaming.bind import Binding, bind, rebuild_meta_buffers
from gds_offload.weights.streaming.hooks import READ_PIECE, LayerStreamer
from gds_offload.weights.streaming.resident import load_resident, move_free_buffers, read_arena
from gds_offload.weights.streaming.ring import make_read_engine, make_ring
from gds_offload.weights.streaming.stats import StreamStats
from gds_offload.weights.streaming.turn import Turn, claim

__all__ = ["load_streamed", "StreamedModel", "StreamStats", "Tier"]

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
    slots: int | None = None,
    resident_layers: int | None = None,
    max_memory: int | str | None = None,
    verify: bool = False,
    engine: str = "auto",
    num_threads: int | None = None,
    plan: Plan | str | os.PathLike[str] | None = None,
    converted: bool = False,
    train_dir: str | os.PathLike[str] | None = None,
) -> StreamedModel:
    """Give a model skeleton (built on the meta device) its weights from a store, streaming its layers.

    Args:
        model: the skeleton, e.g. ``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``
            or under ``accelerate.init_empty_weights()``. Changed in place: resident tensors
            become real on ``device``, streamed layers get hooks; it is put in eval mode and
            given the checkpoint's generation config, as ``from_pretrained`` returns a model
            (see the module doc; ``model.train()`` before training with dropout).
        store: the store's directory (a list, in conversion order, if it was striped).
        device: where the model computes: ``"cpu"`` or a CUDA device.
        tier: ``"drive"``: layers are read from the store for every forward; ``"host"``: all
            layers are read once into host memory (pinned, and copied into the ring on a GPU).
        slots: ring buffers for streamed layers (``>= 1``; default 2, or the plan's: 2 overlaps one
            fill with one layer's compute; capped at the number of streamed layers).
        resident_layers: how many of the first layers to keep on ``device`` like the resident group
            (default 0, or what ``max_memory`` allows).
        max_memory: bytes (or ``"6GiB"``) of ``device`` memory for weights: the resident group, the
            ring, and as many leading layers as fit beside them
            (:func:`~gds_offload.weights.planning.residency.plan_residency`; activations and the KV cache are
            not counted). With ``tier="host"`` on the CPU every layer is held, and must fit.
        verify: check each group's xxh3-64 after every read (:class:`StoreCorruptError` names the layer).
        engine: the reads' engine: ``auto`` (CPU: posix; GPU: gds where usable, else KvikIO
            compat, else posix), ``gds``, ``compat``, ``posix``.
        num_threads: engine threads doing the reads (``None``: 4 on the CPU, the engine's default on a GPU).
        plan: a :class:`~gds_offload.weights.planning.planner.Plan` (:func:`~gds_offload.weights.planning.planner.plan`), or
            the path of the JSON file ``gds-offload plan --out`` wrote: its ``slots`` and
            ``resident_layers`` (an explicit argument that differs is refused), kept for
            :meth:`StreamedModel.generate_many`.
        converted: stream the converted weights even where ``STORE/train`` holds a training step.
        train_dir: the directory a :class:`~gds_offload.weights.train.trainer.StreamedTrainer` wrote
            (``state_dir``): its last complete step is streamed. Default ``STORE/train``, when it
            holds a step; otherwise the converted weights.

    Returns:
        A :class:`StreamedModel`; close it (or use it as a context manager) to stop the reads.

    Raises:
        ConfigError: a bad argument, no CUDA for a CUDA device, a ``train_dir`` given that holds no step.
        ConfigMismatchError: the model's config is not the store's. WeightsMismatchError: missing,
            extra or mis-shaped tensors (all listed).
        StoreFormatError: no store, or a damaged one (or a damaged training step). StoreCorruptError:
            a group read at load fails its checksum.
        GDSUnavailableError: ``engine="gds"`` where GPUDirect Storage does not work.
    """
    plan = as_plan(plan)
    if plan is not None:
        slots, resident_layers = plan.ring_shape(slots=slots, resident_layers=resident_layers, max_memory=max_memory)
    options = StreamOptions.from_kwargs(device=device, tier=tier, slots=2 if slots is None else slots, resident_layers=resident_layers,
                                        max_memory=max_memory, verify=verify, engine=engine, num_threads=num_threads,
                                        converted=converted, train_dir=train_dir)  # fmt: skip
    lm = StreamedModel(model, store, options)
    lm.plan = plan
    return lm


class StreamedModel:
    """A model whose layers stream from a weight store (see :func:`load_streamed`): a facade over
    its hook object (:class:`~gds_offload.weights.streaming.hooks.LayerStreamer`), which owns the
    ring's state; this object owns the store's files, the engines and the resident weights.

    Call it like the model (``handle(input_ids)``, ``handle.generate(...)``) or use ``handle.model``.
    """

    def __init__(
        self,
        model: nn.Module,
        store: str | os.PathLike[str] | list[str | os.PathLike[str]],
        options: StreamOptions,
    ) -> None:
        # Validate first.
        o = options
        dev = o.device
        first = store[0] if isinstance(store, (list, tuple)) else store
        self._turn = Turn(str(first))
        self._shut = False
        self._streamer: LayerStreamer | None = None
        manifest = read_manifest(first)
        if dev.type == "cuda" and manifest.tensor_align < TENSOR_ALIGN:
            warnings.warn(f"{first}: tensors start at multiples of {manifest.tensor_align} bytes (a store written before {TENSOR_ALIGN}); "
                          f"cuBLAS may pick other kernels for them than for the resident model's, so outputs may differ in the last "
                          f"bits. Convert it again for {TENSOR_ALIGN}-byte offsets: "
                          f"{reconvert_command(store if isinstance(store, (list, tuple)) else [first], manifest.source.get('checkpoint'))}", stacklevel=3)  # fmt: skip
        self._dirs = resolve_dirs(store, manifest)
        gens, step = _training_step(manifest, self._dirs, o)
        reading = _as_of(manifest, step)  # the groups with the checksums of the step read
        layers = reading.layers
        plan = plan_residency(reading.resident, layers, slots=o.slots, max_memory=o.max_memory, resident_layers=o.resident_layers,
                              hold_all=o.tier == "host" and dev.type == "cpu")  # fmt: skip
        base, adapters = unwrap(model)  # a PeftModel: its transformers model, and the LoRA adapters on it
        adapters.check_streamed(g.name for g in layers[plan.resident_layers :])
        claim(base, self, str(first))
        check_config(base, manifest.config_sha256, Path(first))
        self.binding: Binding = bind(base, manifest, where=str(first), rename=adapters.store_name)
        generating = getattr(base, "can_generate", None)
        defaults = generation_config(Path(first)) if callable(generating) and generating() else None
        self.model, self.manifest, self.verify, self.device = model, manifest, o.verify, dev
        #: The training step whose weights stream (0: the converted store's; see the module doc).
        self.step = step.step
        #: The plan :func:`load_streamed` applied (``generate_many`` takes its shape from it), or ``None``.
        self.plan: Plan | None = None
        # Allocate.
        in_memory = layers[: plan.resident_layers]
        streamed = layers[len(in_memory) :]
        self._layers = [base.get_submodule(g.name) for g in streamed]
        self._files = gens.files() if gens is not None else StoreFiles(self._dirs, manifest)
        self._res: list[Any] = [self._files]  # closed in reverse order by the finalizer
        self._finalizer = release_when_collected(self, _shutdown, self._res)
        self._kv_engine: Engine | None = None
        self._choices: dict[str, Choice] = {}
        try:
            self._loader = make_engine("posix", num_threads=o.num_threads or DEFAULT_THREADS, read_pool_bytes=0)
            self._res.append(self._loader)
            reads: Engine = self._loader
            if streamed and o.tier == "drive" and (dev.type != "cpu" or o.engine != "auto"):
                if o.engine == "host":
                    raise ConfigError("engine='host' keeps no files to read; for layers in host memory use tier='host'")
                reads = make_read_engine(self._engine_choice(o.engine), dev, o.num_threads)
                self._res.append(reads)
            resident = ([reading.resident] if reading.resident else []) + in_memory
            resident_nbytes = load_resident(self._loader, self._files, self.binding, resident, dev, verify=o.verify)
            rebuild_meta_buffers(base, dev)
            move_free_buffers(base, dev)
            adapters.materialize(dev)
            ring = make_ring(tier=o.tier, device=dev, engine=reads, files=self._files, groups=streamed,
                             slots=o.slots, verify=o.verify, load=self._read_arena)  # fmt: skip
            if ring is not None:
                self._res.append(ring)
            counters = StreamStats(
                tier=o.tier,
                device=str(dev),
                ring=ring.kind if ring else "none",
                engine=reads.description,
                direct=self._files.direct,
                slots=len(ring.buffers) if ring else 0,
                slot_nbytes=ring.buffers[0].numel() if ring and ring.buffers else 0,
                streamed_layers=[g.name for g in streamed],
                resident_layers=[g.name for g in in_memory],
                resident_nbytes=resident_nbytes,
                host_nbytes=ring.host_nbytes if ring else 0,
                loads=[0] * len(streamed),
                reads=[0] * len(streamed),
                compute_s=[0.0] * len(streamed),
            )
            self._streamer = LayerStreamer(self.binding, streamed, self._layers, ring, counters, self._turn, str(self._dirs[0]))
            parent = (manifest.layer_prefix or "").rpartition(".")[0]
            self._streamer.attach(base, base.get_submodule(parent) if parent else base)
            # As transformers' from_pretrained returns a model: dropout off, the checkpoint's generation defaults.
            model.eval()
            if defaults is not None:
                base.generation_config = defaults
        except BaseException:
            self.close()
            raise

    # -- public ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``self.model.generate(...)`` (Hugging Face models)."""
        return self.model.generate(*args, **kwargs)  # type: ignore[operator]

    def generate_many(self, prompts: Any, **kwargs: Any) -> ManyOutput:
        """Generation over many prompts, several micro-batches per weight load:
        :func:`gds_offload.weights.run.generation.generate_many` (its arguments and reference)."""
        return generate_many(self, prompts, **kwargs)

    def accumulate(self, batches: Any, **kwargs: Any) -> list[torch.Tensor]:
        """Gradient accumulation, several micro-batches per weight load in forward and backward:
        :func:`gds_offload.weights.run.accumulate.accumulate` (its arguments and reference)."""
        return accumulate(self, batches, **kwargs)

    def run_team(self, calls: Sequence[Callable[[], Any]], *, seeds: Sequence[int | None] | None = None) -> list[Any]:
        """Run ``calls`` (each a micro-batch's whole computation on this model, e.g. its
        ``generate``) layer-major: every streamed layer is bound once per round of the
        micro-batches (:mod:`gds_offload.weights.streaming.team`); their results, in order.

        Raises:
            OffloadError: another thread is running the model, or it is closed. Whatever a call raised.
        """
        return self._hooks().run_team(calls, seeds=seeds)

    def kv_engine(self) -> Engine:
        """The engine that moves KV caches to and from the drive (made at first use, closed with the model)."""
        if self._kv_engine is None:
            mode = "posix" if self.device.type == "cpu" else self._engine_choice("auto").engine
            self._kv_engine = make_engine(mode)
            self._res.insert(1, self._kv_engine)  # closed after the ring, before the files
        return self._kv_engine

    def layer_modules(self) -> list[nn.Module]:
        """The streamed layers, in order."""
        return list(self._layers)

    def read_layers(self, count: int, *, piece_nbytes: int = READ_PIECE) -> tuple[int, float]:
        """Read the first ``count`` streamed layers from the store through the ring's engine, one
        after another, into one buffer of the ring's kind outside the ring (touched once before, as
        a slot is); ``(bytes, seconds)``. The ring's fills are settled first, so the drive does
        nothing else meanwhile. A layer larger than ``piece_nbytes`` is read in aligned pieces of
        that size into a buffer of that size: the bytes are discarded, and a buffer of a whole
        layer would raise this process's peak by a layer beyond what a run holds.

        Raises:
            ConfigError: nothing is read from the drive per forward (``tier="host"``, or none streamed).
        """
        return self._hooks().read_layers(count, piece_nbytes=piece_nbytes)

    def train_layers(self, on_grad: Callable[[int, str, torch.Tensor], None]) -> None:
        """Make the streamed layers' parameters trainable (for
        :class:`~gds_offload.weights.train.trainer.StreamedTrainer`): from now on each forward binds them as
        ``nn.Parameter(requires_grad=True)`` views of their slot, and after autograd accumulates a
        gradient into one, ``on_grad(pos, store_name, grad)`` takes it (the parameter's ``.grad``
        is then reset): gradients leave the slot's parameters as soon as they exist.

        Raises:
            ConfigError: nothing is read per forward (``tier="host"`` on the CPU, every layer resident).
        """
        self._hooks().train_layers(on_grad)

    def use_files(self, files: StoreFiles, *, step: int | None = None) -> StoreFiles:
        """Read the streamed layers from ``files`` (same layout, new bytes: training step ``step``'s,
        which :attr:`step` then says) from now on; returns the files read until now (the caller
        closes them). Waits for the fills in flight and forgets what every slot holds."""
        old = self._hooks().use_files(files)
        self._files = files
        self._res[self._res.index(old)] = files
        if step is not None:
            self.step = step
        return old

    def note_replan(self, why: str) -> None:
        """Record that ``generate_many`` planned again, and why (``stats().replans``)."""
        self._hooks().counters.replans.append(why)

    def note_kv(self, bytes_read: int, bytes_written: int) -> None:
        """Count KV-cache traffic (by :func:`~gds_offload.weights.run.generation.generate_many`)."""
        counters = self._hooks().counters
        counters.kv_bytes_read += bytes_read
        counters.kv_bytes_written += bytes_written

    def stats(self) -> StreamStats:
        """A copy of the counters."""
        return self._hooks().stats()

    @property
    def store_dirs(self) -> list[Path]:
        """The store's directories (one, or the striped ones in conversion order)."""
        return list(self._dirs)

    @property
    def closed(self) -> bool:
        """:meth:`close` has been called."""
        return self._streamer is None or self._streamer.closed

    def settle(self) -> None:
        """Block until the fills in flight (the next forward's first layers, prefetched after the
        last layer) have landed. They stay for that forward, which reports any read error; the
        drive is idle afterwards until the next forward starts (e.g. before timing something else)."""
        self._hooks().settle()

    def close(self) -> None:
        """Wait for fills in flight (and, on CUDA, for the device), remove the hooks, close the
        engines and files. Idempotent; waits for a forward running on another thread to end.
        Streamed layers are left with meta parameters, and calling them raises
        :class:`OffloadError` saying the model was closed; resident tensors stay in the model."""
        if self._shut:
            return
        with held(), self._turn.holding(wait=True):
            if self._streamer is not None:
                self._streamer.detach()
            if self._finalizer.detach() is not None:
                _shutdown(self._res)
            self._shut = True

    @property
    def engine(self) -> Engine | None:
        """The engine reading the streamed layers from the store (``None``: nothing is read per forward)."""
        return self._streamer.engine if self._streamer is not None else None

    def use_engine(self, engine: Engine) -> None:
        """Read the streamed layers through ``engine`` from now on, e.g. a
        :class:`~gds_offload.io.faults.FaultyEngine` wrapping :attr:`engine` (which then owns,
        and closes, the old one). Waits for the fills in flight and for a forward on another thread.

        Raises:
            ConfigError: nothing is read per forward here (``tier="host"``, or no streamed layer).
        """
        old = self._hooks().use_engine(engine)
        self._res[self._res.index(old)] = engine

    def __enter__(self) -> StreamedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loading --------------------------------------------------------------------------
    def _hooks(self) -> LayerStreamer:
        if self._streamer is None:
            raise OffloadError(f"the StreamedModel of {self._dirs[0]} failed to load; load the store again (load_streamed)")
        return self._streamer

    def _engine_choice(self, mode: str) -> Choice:
        """What ``mode`` resolves to for this model's store and device: the node's probes run once
        per mode, for the ring's reads and the KV caches alike."""
        if mode not in self._choices:
            self._choices[mode] = choose_engine(mode, self._dirs[0], device=self.device.type)  # type: ignore[arg-type]  # validated by choose_engine
        return self._choices[mode]

    def _read_arena(self, groups: list[GroupEntry]) -> tuple[torch.Tensor, dict[str, int]]:
        return read_arena(self._loader, self._files, groups, verify=self.verify)


def _training_step(manifest: Manifest, dirs: list[Path], o: StreamOptions) -> tuple[Generations | None, Step]:
    """The training step to stream (see the module doc) and its directory's generations
    (``None``: the converted store's files are read).

    Raises:
        ConfigError: ``train_dir`` holds no step. StoreFormatError: a damaged ``step.json``.
    """
    if o.converted:
        return None, Step()
    root = o.train_dir if o.train_dir is not None else dirs[0] / "train"
    try:
        gens = Generations(root, manifest, dirs)
    except StoreFormatError as exc:
        raise type(exc)(f"{exc}; or stream the converted weights: load_streamed(..., converted=True)") from exc
    if gens.current.generation is None:
        if o.train_dir is not None:
            raise ConfigError(f"train_dir={o.train_dir} holds no training step (no {STEP_NAME}); pass the directory "
                              "StreamedTrainer(state_dir=...) wrote, or leave train_dir out")  # fmt: skip
        return None, gens.current
    return gens, gens.current


def _as_of(manifest: Manifest, step: Step) -> Manifest:
    """``manifest`` with each group's checksum that of ``step`` (``verify=True`` checks a trained step's bytes)."""
    if step.generation is None:
        return manifest
    return replace(manifest, groups=[replace(g, xxh3_64=step.groups[g.name]) for g in manifest.groups])


def _shutdown(resources: list[Any]) -> None:
    for r in reversed(resources):  # ring (waits for the device), engines, then the files
        r.close()
