"""Generation over many prompts, layer-major: :func:`generate_many`.

The prompts are sorted by length and cut into *micro-batches* of ``micro_batch`` prompts,
each left-padded to its longest prompt (:func:`micro_batches`); ``per_load`` micro-batches at a
time form a *wave*, generated as one :class:`~gds_offload.weights.streaming.team.Team`: every
streamed layer is read once per step of the wave and serves all its micro-batches, in the
prefill and at every decode step. Each micro-batch's KV cache lives where ``kv`` says
(:mod:`gds_offload.weights.run.kv`).

The reference it equals bit for bit is the resident model generating the same micro-batches
one after another: for micro-batch ``j`` (in :func:`micro_batches`' order),
``torch.manual_seed(seed + j); model.generate(mb.input_ids, attention_mask=mb.attention_mask,
max_new_tokens=..., **kwargs)`` (the seed matters only for sampling). Micro-batch size matters:
a kernel may round differently for another batch shape, so the reference uses the same ``micro_batch``.
"""
from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache

from gds_offload.errors import ConfigError, SpillSpaceError
from gds_offload.io.directory import spill_dir_origin
from gds_offload.units import checked_int
from gds_offload.weights.planning.options import KVPlacement
from gds_offload.weights.planning.planner import Generate, Plan, as_plan, choose, estimate
from gds_offload.weights.run.kv import KVPool, KVShape, kv_shape

if TYPE_CHECKING:
    from gds_offload.weights.run.handle import StreamedHandle

__all__ = ["ManyOutput", "MicroBatch", "cache_argument", "generate_many", "micro_batches"]


@dataclass(frozen=True)
class MicroBatch:
    """Prompts ``indices`` (positions in the caller's list), left-padded into ``input_ids`` with ``attention_mask``."""

    indices: tuple[int, ...]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


@dataclass
class ManyOutput:
    """What :func:`generate_many` returns."""

    #: Each prompt's new tokens, in the caller's order (up to ``max_new_tokens``; fewer after an end token).
    tokens: list[torch.Tensor]
    #: The micro-batches, in the order they ran (the reference runs them in this order).
    micro_batches: list[MicroBatch]
    #: ``generate``'s own result for each micro-batch (a tensor, or a ``GenerateOutput`` with scores if asked for).
    outputs: list[Any]
    #: Each micro-batch's ``prefill_chunk_size`` (``None``: whole prompts); the reference passes the same.
    prefill_chunks: list[int | None]


def micro_batches(prompts: Sequence[Sequence[int] | torch.Tensor], micro_batch: int, *, pad_token_id: int) -> list[MicroBatch]:
    """``prompts`` sorted by length (longest first; ties in the caller's order) and cut into
    groups of ``micro_batch``, each left-padded with ``pad_token_id`` to its longest prompt.

    Raises:
        ConfigError: no prompts, an empty prompt, or a prompt that is not a sequence of token ids.
    """
    checked_int("micro_batch", micro_batch, low=1, what="prompts per micro-batch")
    if not prompts:
        raise ConfigError("prompts=[]: give at least one prompt (a list of token ids or a 1-D LongTensor)")
    rows = [_as_ids(p, i) for i, p in enumerate(prompts)]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out = []
    for start in range(0, len(order), micro_batch):
        idx = order[start : start + micro_batch]
        width = max(len(rows[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            n = len(rows[i])
            ids[r, width - n :] = rows[i]
            mask[r, width - n :] = 1
        out.append(MicroBatch(tuple(idx), ids, mask))
    return out


def _as_ids(prompt: Sequence[int] | torch.Tensor, i: int) -> torch.Tensor:
    t = prompt if isinstance(prompt, torch.Tensor) else torch.tensor(list(prompt), dtype=torch.long)
    if t.dim() != 1 or t.dtype not in (torch.long, torch.int32, torch.int64) or t.numel() == 0:
        raise ConfigError(f"prompts[{i}] must be a non-empty 1-D sequence of token ids (got {tuple(t.shape)} {t.dtype})")
    return t.long().cpu()


def generate_many(
    lm: StreamedHandle,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    *,
    max_new_tokens: int,
    plan: Plan | str | os.PathLike[str] | None = None,
    micro_batch: int | None = None,
    per_load: int | None = None,
    kv: str | KVPlacement | None = None,
    prefill_chunk: int | None = None,
    kv_path: str | Path | None = None,
    seed: int | None = None,
    pad_token_id: int | None = None,
    **generate_kwargs: Any,
) -> ManyOutput:
    """Generate ``max_new_tokens`` for every prompt, ``per_load`` micro-batches of ``micro_batch``
    prompts sharing each weight load (see the module doc for the schedule and the reference).

    Args:
        lm: a streamed Hugging Face causal LM.
        prompts: token ids, one sequence per prompt, of any lengths.
        plan: the shape to run (:func:`~gds_offload.weights.planning.planner.plan`, or the path of its JSON file:
            ``gds-offload plan --out``; default ``lm.plan``, the one ``load_streamed`` applied): its micro-batch size, micro-batches per load, KV placement and
            prefill chunk, unless given here.
        micro_batch: prompts per micro-batch (``b``; default 8); per_load: micro-batches per weight load (``n``; default 4).
        prefill_chunk: prefill this many positions per forward (Hugging Face's ``prefill_chunk_size``:
            less activation memory per micro-batch; the reference passes it too). ``None``: whole prompts.
        kv: ``"device"`` (default: Hugging Face's own cache, in memory), ``"host"`` (on CUDA,
            Hugging Face's ``DynamicCache(offloading=True)``: each layer's cache in host memory
            between uses; on the CPU the same as ``"device"``) or ``"drive"`` (each micro-batch-layer's
            cache in a spill file in ``kv_path``, read back just before the layer; default directory
            ``$GDS_OFFLOAD_DIR``, else ``<tmp>/gds_offload-<uid>``).
        seed: micro-batch ``j`` samples as ``torch.manual_seed(seed + j)`` would make it; ``None``: a
            base seed drawn from torch's generator (so ``torch.manual_seed`` before the call fixes it).
        pad_token_id: for left padding (default: the model's ``generation_config.pad_token_id``, else
            its ``eos_token_id``, else 0).
        generate_kwargs: passed to every micro-batch's ``generate`` (``do_sample``, ``top_k``, ...;
            ``output_scores=True, return_dict_in_generate=True`` to get scores in ``outputs``).

    Raises:
        ConfigError: bad arguments (before anything runs), beam search or several return sequences
            with ``kv="drive"``, a model whose cache the drive cannot hold.
        SpillSpaceError: ``kv="drive"`` on a drive without room for a wave's caches at prompt +
            ``max_new_tokens`` positions (the message says how many bytes, and what to change).
    """
    checked_int("max_new_tokens", max_new_tokens, low=1, what="tokens to generate per prompt")
    for bad in ("input_ids", "attention_mask", "past_key_values", "cache", "max_length", "prefill_chunk_size"):
        if bad in generate_kwargs:
            raise ConfigError(f"generate_many sets {bad} itself; pass prompts, max_new_tokens and prefill_chunk instead")
    chosen = as_plan(plan) if plan is not None else lm.plan
    # What the caller set by hand: a re-plan after a drift keeps it (Drift).
    fixed = Fixed(micro_batch is not None or per_load is not None or prefill_chunk is not None, None if kv is None else _placement(kv))
    if chosen is not None:
        c = chosen.choice
        micro_batch = c.micro_batch if micro_batch is None else micro_batch
        per_load = c.per_load if per_load is None else per_load
        kv = c.kv if kv is None else kv
        prefill_chunk = c.prefill_chunk if prefill_chunk is None else prefill_chunk
    micro_batch = 8 if micro_batch is None else micro_batch
    n = checked_int("per_load", 4 if per_load is None else per_load, low=1, what="micro-batches sharing each weight load")
    placement = _placement(KVPlacement.DEVICE if kv is None else kv)
    if prefill_chunk is not None:
        checked_int("prefill_chunk", prefill_chunk, low=1, what="positions per prefill forward")
        generate_kwargs = generate_kwargs | {"prefill_chunk_size": prefill_chunk}
    if placement is KVPlacement.DRIVE and (generate_kwargs.get("num_beams", 1) != 1 or generate_kwargs.get("num_return_sequences", 1) != 1):
        raise ConfigError("beam search and num_return_sequences > 1 reorder or expand the KV cache; with kv='drive' use num_beams=1, or kv='device'")
    model = lm.model
    pad = _pad_id(model) if pad_token_id is None else pad_token_id
    mbs = micro_batches(prompts, micro_batch, pad_token_id=pad)
    base = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
    why = _not_layer_major(lm)
    if why is not None and n > 1:
        warnings.warn(f"{why}: generating one micro-batch per weight load instead (per_load=1)", stacklevel=2)
        n = 1
    outputs: list[Any] = []
    chunks: list[int | None] = []
    done: list[MicroBatch] = []
    drift = Drift(lm, chosen, max_new_tokens, fixed) if chosen is not None else None
    while mbs:
        wave, mbs = mbs[:n], mbs[n:]
        before = sum(lm.stats().compute_s)
        outputs.extend(_wave(lm, wave, first=len(done), base_seed=base, max_new_tokens=max_new_tokens, pad=pad,
                             placement=placement, kv_path=kv_path, kwargs=generate_kwargs))  # fmt: skip
        done.extend(wave)
        chunks.extend([generate_kwargs.get("prefill_chunk_size")] * len(wave))
        if drift is not None and mbs:
            new = drift.check(wave, sum(lm.stats().compute_s) - before, [i for mb in mbs for i in mb.indices], prompts)
            if new is not None:  # the rest of the prompts, cut to the new plan's shape
                c = new.choice
                micro_batch, n, placement = c.micro_batch, c.per_load, c.kv
                generate_kwargs = {k: v for k, v in generate_kwargs.items() if k != "prefill_chunk_size"}
                if c.prefill_chunk is not None:
                    generate_kwargs["prefill_chunk_size"] = c.prefill_chunk
                rest = [i for mb in mbs for i in mb.indices]
                mbs = [MicroBatch(tuple(rest[j] for j in m.indices), m.input_ids, m.attention_mask)
                       for m in micro_batches([prompts[i] for i in rest], micro_batch, pad_token_id=pad)]  # fmt: skip
    mbs = done
    tokens: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * len(prompts)
    for mb, out in zip(mbs, outputs):
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        for r, i in enumerate(mb.indices):
            tokens[i] = seqs[r, mb.input_ids.shape[1] :].cpu()
    return ManyOutput(tokens, mbs, outputs, chunks)


def _wave(
    lm: StreamedHandle, wave: list[MicroBatch], *, first: int, base_seed: int, max_new_tokens: int, pad: int,
    placement: KVPlacement, kv_path: str | Path | None, kwargs: dict[str, Any],
) -> list[Any]:  # fmt: skip
    model: Any = lm.model
    device = lm.device
    pool = None
    if placement is KVPlacement.DRIVE:
        dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
        shapes = [kv_shape(model.config, batch=mb.input_ids.shape[0], max_positions=mb.input_ids.shape[1] + max_new_tokens, dtype=dtype) for mb in wave]
        try:
            pool = KVPool(shapes, engine=lm.kv_engine(), directory=kv_path or _default_dir(), device=device)
        except SpillSpaceError as exc:
            raise SpillSpaceError(_no_room(shapes, max_new_tokens, exc)) from exc

    def call(j: int, mb: MicroBatch) -> Any:
        extra: dict[str, Any] = {} if pool is None else {cache_argument(): pool.cache(j)}
        if placement is KVPlacement.HOST and device.type == "cuda":
            extra = {cache_argument(): DynamicCache(config=model.config, offloading=True)}
        return model.generate(mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device), max_new_tokens=max_new_tokens,
                              pad_token_id=pad, **extra, **kwargs)  # fmt: skip

    try:
        calls = [functools.partial(call, j, mb) for j, mb in enumerate(wave)]
        return lm.run_team(calls, seeds=[base_seed + first + j for j in range(len(wave))])
    finally:
        if pool is not None:
            lm.note_kv(pool.bytes_read, pool.bytes_written)
            pool.close()


def _no_room(shapes: list[KVShape], max_new_tokens: int, exc: SpillSpaceError) -> str:
    """What asked the drive for the room it lacks (``exc``), and what to change."""
    s = shapes[0]
    prompt = max(x.max_positions for x in shapes) - max_new_tokens
    return (f"kv='drive' reserves each micro-batch's KV cache on the drive up front, for its prompt + max_new_tokens positions "
            f"at {s.layers * s.record_nbytes} bytes per position ({s.layers} layers x {s.record_nbytes}-byte records of keys and values "
            f"of {s.batch} sequences): max_new_tokens={max_new_tokens} with prompts of up to {prompt} tokens asks for more than "
            f"the drive holds: {exc}. Give max_new_tokens what you will generate, or run fewer or "
            f"smaller micro-batches (per_load=, micro_batch=), a kv_path on a drive with room, or kv='device'")  # fmt: skip


def cache_argument() -> str:
    """``generate``'s argument for a cache object: ``cache`` from transformers 5.24 (``past_key_values`` is deprecated there)."""
    import transformers  # the model is a transformers model: already imported

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else "past_key_values"


#: Measured compute more than this share off the plan's prediction makes generate_many plan again.
DRIFT = 0.25


@dataclass(frozen=True)
class Fixed:
    """What a caller of :func:`generate_many` set by hand, which a re-plan keeps: the shape
    (``micro_batch``, ``per_load`` or ``prefill_chunk`` given), the KV placement (``kv`` given)."""

    shape: bool = False
    kv: KVPlacement | None = None


class Drift:
    """After each wave: the streamed layers' measured compute against the plan's prediction; off by
    more than :data:`DRIFT` (another job on the machine, a turbo clock), the rest is planned again
    with the profile's compute scaled by what was measured, the loaded ring kept (``stats().replans``).

    The scale is kept against the plan's own profile (as measured), and every prediction and
    re-plan uses that profile times the scale once. A re-plan keeps what the caller set by hand
    (:class:`Fixed`): its KV placement, and its shape (then only the drift is noted).
    """

    def __init__(self, lm: Any, plan: Plan, max_new_tokens: int, fixed: Fixed = Fixed()) -> None:
        self.lm, self.plan, self.max_new_tokens, self.fixed = lm, plan, max_new_tokens, fixed
        self.profile = plan.profile  # as measured; never a scaled copy
        self.scale = 1.0

    def check(self, wave: list[MicroBatch], measured_s: float, rest: list[int], prompts: Sequence[Any]) -> Plan | None:
        """The plan for the prompts ``rest`` after a wave whose streamed compute took ``measured_s``,
        or ``None`` to go on with the current one."""
        seqs = sum(mb.input_ids.shape[0] for mb in wave)
        w = Generate(seqs, max(mb.input_ids.shape[1] for mb in wave), self.max_new_tokens)
        predicted = estimate(self.profile.scaled(self.scale), w, self.plan.choice, self.plan.memory_nbytes).streamed_compute_s
        if predicted <= 0 or abs(measured_s / predicted - 1) <= DRIFT:
            return None
        self.scale *= measured_s / predicted
        what = f"compute measured {measured_s:.2f} s against {predicted:.2f} s planned ({measured_s / predicted:.2f}x)"
        if self.fixed.shape or self.fixed.kv is KVPlacement.HOST:
            self.lm.note_replan(f"{what}; kept the shape given to generate_many")
            return None
        c = self.plan.choice
        longest = max(len(prompts[i]) for i in rest)
        kv = (self.fixed.kv,) if self.fixed.kv is not None else (KVPlacement.DEVICE, KVPlacement.DRIVE)
        try:
            new = choose(self.profile.scaled(self.scale), Generate(len(rest), longest, self.max_new_tokens), self.plan.memory_nbytes,
                         kv=kv, ring=(c.resident_layers, c.slots))  # fmt: skip
        except ConfigError as exc:  # nothing else fits beside the loaded ring: go on as planned
            self.lm.note_replan(f"{what}; kept the plan ({exc})")
            return None
        self.lm.note_replan(f"{what}: the last {len(rest)} prompts run as {new.describe()}")
        self.plan = new
        return new


def _placement(kv: str | KVPlacement) -> KVPlacement:
    try:
        return KVPlacement(kv)
    except ValueError:
        raise ConfigError(f"kv={kv!r}: expected one of {', '.join(p.value for p in KVPlacement)}") from None


def _pad_id(model: Any) -> int:
    cfg = getattr(model, "generation_config", None)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(cfg, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0


def _not_layer_major(lm: StreamedHandle) -> str | None:
    """Why this model cannot run several micro-batches per weight load, or ``None``."""
    if not lm.stats().streamed_layers:
        return "every layer is resident (nothing is read per forward)"
    if getattr(lm.model.config, "is_encoder_decoder", False):
        return f"{type(lm.model).__name__} is an encoder-decoder model (only decoder-only models stream layer-major)"
    return None


def _default_dir() -> Path:
    return spill_dir_origin()[0]
