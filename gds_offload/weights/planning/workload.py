"""What the planner works with (:mod:`gds_offload.weights.planning.planner`): the workloads, the measured
:class:`Profile` of a model on a machine, a point of the search (:class:`Choice`) and its
predicted cost (:class:`Estimate`). Frozen: configuration and measurements, not state."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from gds_offload.errors import ConfigError
from gds_offload.weights.planning.options import KVPlacement

__all__ = ["profile_from", "smallest_chunk", "Bound", "Choice", "Estimate", "Finetune", "Fit", "Generate", "HEADROOM", "Profile", "Workload"]

Bound = Literal["compute", "drive", "memory"]
#: The share of ``memory`` a plan may fill: the rest is headroom for what the model cannot predict
#: (allocator caching, fragmentation), so that no run meets the cap.
HEADROOM = 0.9


@dataclass(frozen=True)
class Generate:
    """Generation over ``prompts`` prompts of ``prompt_len`` tokens, ``new_tokens`` each."""

    prompts: int
    prompt_len: int
    new_tokens: int
    kind: Literal["generate"] = "generate"

    def __post_init__(self) -> None:
        for name in ("prompts", "prompt_len", "new_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: must be an int >= 1")


@dataclass(frozen=True)
class Finetune:
    """LoRA fine-tuning on ``sequences`` sequences of ``seq`` tokens, ``global_batch`` per optimizer
    step (accumulated over micro-batches), adapters of rank ``lora_r``."""

    sequences: int
    seq: int
    global_batch: int
    lora_r: int = 8
    kind: Literal["finetune"] = "finetune"

    def __post_init__(self) -> None:
        for name in ("sequences", "seq", "global_batch", "lora_r"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: must be an int >= 1")

    @property
    def steps(self) -> int:
        return -(-self.sequences // self.global_batch)


Workload = Generate | Finetune


@dataclass(frozen=True)
class Fit:
    """Seconds of one layer's forward against rows (tokens of a prefill, sequences of a decode step).

    With ``knots`` (the measured points, by rows), the line through the two nearest of them: a
    forward's cost per row changes with its size (how well a GEMM of that many rows uses the cores),
    so a line through small sizes misprices the large micro-batches a plan runs.
    Without, ``fixed + per_row · rows``. ``fixed`` and ``per_row`` are always the least-squares line.
    """

    fixed: float
    per_row: float
    knots: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        # From JSON the knots come as lists; kept as sorted tuples so that equal fits compare equal.
        object.__setattr__(self, "knots", tuple(sorted((float(r), float(t)) for r, t in self.knots)))

    def __call__(self, rows: float) -> float:
        k = self.knots
        if len(k) < 2:
            return max(self.fixed + self.per_row * rows, 0.0)
        i = next((j for j in range(1, len(k) - 1) if rows <= k[j][0]), len(k) - 1)
        (r0, t0), (r1, t1) = k[i - 1], k[i]
        slope = max((t1 - t0) / (r1 - r0), 0.0) if r1 > r0 else 0.0
        return max(t0 + slope * (rows - r0), 0.0)

    @classmethod
    def through(cls, points: list[tuple[float, float]]) -> Fit:
        """Through ``(rows, seconds)`` points: the least-squares line (one point: a line through the
        origin), and the points as knots when there are three or more distinct sizes."""
        if not points:
            raise ConfigError("a time fit needs at least one measured point")
        knots = tuple(points) if len({r for r, _ in points}) >= 3 else ()
        if len(points) == 1:
            rows, s = points[0]
            return cls(0.0, s / rows)
        n = len(points)
        mx = sum(p[0] for p in points) / n
        my = sum(p[1] for p in points) / n
        var = sum((p[0] - mx) ** 2 for p in points)
        slope = sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else my / mx
        return cls(max(my - slope * mx, 0.0), max(slope, 0.0), knots)

    def scaled(self, factor: float) -> Fit:
        """Every time multiplied by ``factor``."""
        return Fit(self.fixed * factor, self.per_row * factor, tuple((r, t * factor) for r, t in self.knots))


@dataclass(frozen=True)
class Profile:
    """What the planner knows of the model on this machine (measured by :mod:`gds_offload.weights.run.measure`,
    or written by hand in tests). Bytes are per layer unless said otherwise."""

    device: str
    layers: int  #: decoder layers
    layer_nbytes: int  #: the largest layer, as read (padded)
    resident_nbytes: int  #: embeddings, final norm, head
    hidden_nbytes: int  #: one position's hidden state
    kv_nbytes: int  #: one position's keys and values, one layer
    kv_record_nbytes: int  #: the same, 4 KiB-aligned per micro-batch row group, on the drive (per sequence, rounded up)
    logits_nbytes: int  #: one sequence's logits for one position
    read_Bps: float  #: the engine's read rate from the store's drive
    base_nbytes: int  #: memory of the process with the resident group loaded, before any forward (ring excluded; on the CPU, anonymous memory: file pages are reclaimable)
    prefill: Fit  #: one layer's prefill time against tokens
    decode: Fit  #: one layer's decode-step time against sequences (at the workload's mean context)
    head: Fit  #: the head's time against sequences (one position each), as a decode step runs it
    prefill_transient_nbytes: float  #: one micro-batch's peak inside a layer, per prefill token
    decode_transient_nbytes: float  #: the same per decode sequence, at the last step's context (the longest)
    write_Bps: float = 0.0  #: the drive's write rate (0: same as read_Bps)
    #: One layer's forward of a prefill chunk after the first (positions on a cache of earlier ones)
    #: against tokens; ``None``: priced as a whole prompt's (:attr:`prefill`). Measured apart: attending
    #: to a cache and growing it cost per token what a whole prompt's causal forward does not.
    prefill_chunked: Fit | None = None
    #: One micro-batch's peak inside a layer per token of a prefill chunk, on the longest cache a
    #: chunk attends to (the last chunk's): it grows with the cache, unlike a whole prompt's per token.
    prefill_chunked_transient_nbytes: float = 0.0
    #: What each micro-batch of a layer-major team keeps beyond its tensors while it waits at a
    #: hand-over (per-thread caches of the math libraries), measured with four threads alive.
    member_nbytes: int = 0
    #: The head's time against sequences at the end of a prefill or a chunk of one: its input is the
    #: last position of a longer hidden state, a strided view, which a CPU's linear layer computes one
    #: sequence at a time (several times :attr:`head` on a large vocabulary). ``None``: :attr:`head`.
    prefill_head: Fit | None = None
    #: Seconds a layer's forward of one micro-batch takes beyond its compute when its KV cache is on
    #: the drive, against the bytes of keys and values it moves (past read, new positions written):
    #: buffers, packing, the engine's threads beside the compute. ``None``: bandwidth alone, hidden.
    kv_drive: Fit | None = None
    #: Fine-tuning (measured with LoRA adapters): one layer's forward with grad and its backward, against tokens.
    train_forward: Fit = Fit(0.0, 0.0)
    train_backward: Fit = Fit(0.0, 0.0)
    saved_nbytes: float = 0.0  #: what autograd saves per token and layer
    train_transient_nbytes: float = 0.0  #: one micro-batch's peak inside a layer's forward or backward, per token
    trainable_nbytes: int = 0  #: the adapters (their gradients and AdamW state are three times more)
    #: The head and loss of one micro-batch in training, per token: the peak over their forward and
    #: backward (logits, what the loss saves, their gradients). 0: the older estimate, three logits.
    head_train_nbytes: float = 0.0
    measured: dict[str, Any] = field(default_factory=dict, compare=False)  #: raw points, for the record

    def scaled(self, compute: float) -> Profile:
        """This profile with every compute time multiplied by ``compute`` (a busier or idler machine)."""

        chunked = self.prefill_chunked.scaled(compute) if self.prefill_chunked is not None else None
        prefill_head = self.prefill_head.scaled(compute) if self.prefill_head is not None else None
        kv_drive = self.kv_drive.scaled(compute) if self.kv_drive is not None else None
        return replace(self, prefill=self.prefill.scaled(compute), prefill_chunked=chunked, decode=self.decode.scaled(compute), head=self.head.scaled(compute),
                       prefill_head=prefill_head, kv_drive=kv_drive,
                       train_forward=self.train_forward.scaled(compute), train_backward=self.train_backward.scaled(compute))  # fmt: skip


@dataclass(frozen=True)
class Choice:
    """One point of the search: ``per_load`` micro-batches of ``micro_batch`` sequences per weight
    load; the prompts prefilled ``prefill_chunk`` positions per forward (``None``: whole)."""

    micro_batch: int
    per_load: int
    resident_layers: int
    slots: int
    kv: KVPlacement = KVPlacement.DEVICE
    prefill_chunk: int | None = None
    #: Fine-tuning: offload what autograd saves through ``gds_offload.attach`` (else keep it in memory).
    offload_activations: bool = False

    @property
    def in_flight(self) -> int:
        """Sequences per weight load."""
        return self.micro_batch * self.per_load


@dataclass(frozen=True)
class Estimate:
    """A choice's predicted cost for a workload."""

    choice: Choice
    tokens_per_s: float  #: generated tokens (fine-tuning: tokens trained on) over the whole workload's time
    prefill_s: float
    decode_s: float
    peak_nbytes: int
    bound: Bound  #: what limits it: the compute (reads hidden), the drive (compute waits), or memory
    fits: bool
    bytes_read: int  #: from the drive, weights and KV, over the workload
    bytes_written: int
    #: Compute the streamed layers do over the workload (what ``stats().compute_s`` measures).
    streamed_compute_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def smallest_chunk(prompt_len: int) -> int:
    """The prefill chunk the profile times a chunk on a cache at (:attr:`Profile.prefill_chunked`),
    and the smallest the planner chooses: it chooses no chunk it did not measure, and a smaller one
    only saves the activations of fewer positions while each chunk is one more pass through every
    layer and one more head on every sequence (:attr:`Profile.prefill_head`).
    """
    return max(prompt_len // 4, 1)


def profile_from(d: dict[str, Any]) -> Profile:
    """A :class:`Profile` from its JSON form (``asdict``)."""
    fields: dict[str, Any] = dict(d)
    for k in ("prefill", "prefill_chunked", "decode", "head", "prefill_head", "kv_drive", "train_forward", "train_backward"):
        if fields.get(k) is not None:
            fields[k] = Fit(**fields[k])
    return Profile(**fields)
