"""Balance Beam's planner: from a measured :class:`Profile` of the model on this machine, the shape
that makes compute per weight load cover the read: :func:`choose` (and :func:`plan`, which measures first).

A streamed layer costs a read of its bytes per weight load; ``n`` micro-batches of ``b``
sequences computing it meanwhile hide that read when ``n × compute(b) >= read``. Larger ``n × b``
amortises better but holds more memory: hidden states of every sequence in flight, their KV caches
(or, with the caches on the drive, more drive traffic), and each micro-batch's transient
activations. :func:`choose` searches micro-batch size ``b``, micro-batches per load ``n``, leading
layers kept resident, ring slots and KV placement, predicts each point's time and peak memory
from the profile (no hand-set constants: every rate and size is measured or read from the store
and the config), and returns a frozen :class:`Plan`: the fastest point that fits, what bounds it,
and every alternative with why it lost.

The time model, per streamed layer and step of a wave of ``n`` micro-batches (``slots >= 2``
overlaps a layer's reads with the previous layer's compute; ``slots = 1`` does not):

* compute ``C = n · t(b)``: the profile's per-layer forward time at ``b`` sequences (prefill:
  ``b · prompt_len`` tokens; a decode step: ``b`` tokens at the mean context);
* drive ``D = (layer bytes + n · KV bytes read + n · KV bytes written) / read rate``;
* the step takes ``max(C, D)`` per streamed layer (``C + D`` with one slot), ``C`` (+ KV traffic)
  per resident layer, plus ``n`` times the head.

The memory model (peak, on the model's device; on the CPU, the process's resident memory):
the measured base (process, resident group), the resident layers, the ring, the KV caches
(all of them in memory, or a few micro-batch-layers' worth when on the drive), every sequence's
hidden state between layers, and one micro-batch's measured transient peak inside a layer.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from gds_offload.errors import ConfigError
from gds_offload.units import format_bytes, parse_bytes
from gds_offload.weights.options import KVPlacement

__all__ = ["Choice", "Estimate", "Fit", "Generate", "Plan", "Profile", "check_feasible", "choose", "estimate", "plan"]

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
class Fit:
    """Seconds of one layer's forward as ``fixed + per_row · rows`` (rows: tokens of a prefill, sequences of a decode step)."""

    fixed: float
    per_row: float

    def __call__(self, rows: float) -> float:
        return max(self.fixed + self.per_row * rows, 0.0)

    @classmethod
    def through(cls, points: list[tuple[float, float]]) -> Fit:
        """Least squares through ``(rows, seconds)`` points (one point: a line through the origin)."""
        if not points:
            raise ConfigError("a time fit needs at least one measured point")
        if len(points) == 1:
            rows, s = points[0]
            return cls(0.0, s / rows)
        n = len(points)
        mx = sum(p[0] for p in points) / n
        my = sum(p[1] for p in points) / n
        var = sum((p[0] - mx) ** 2 for p in points)
        slope = sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else my / mx
        return cls(max(my - slope * mx, 0.0), max(slope, 0.0))


@dataclass(frozen=True)
class Profile:
    """What the planner knows of the model on this machine (measured by :mod:`gds_offload.weights.measure`,
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
    base_nbytes: int  #: memory of the process with the resident group loaded, before any forward (ring excluded)
    prefill: Fit  #: one layer's prefill time against tokens
    decode: Fit  #: one layer's decode-step time against sequences (at the workload's mean context)
    head: Fit  #: the head's time against sequences (one position each)
    prefill_transient_nbytes: float  #: one micro-batch's peak inside a layer, per prefill token
    decode_transient_nbytes: float  #: the same per decode sequence
    write_Bps: float = 0.0  #: the drive's write rate (0: same as read_Bps)
    measured: dict[str, Any] = field(default_factory=dict, compare=False)  #: raw points, for the record

    def scaled(self, compute: float) -> Profile:
        """This profile with every compute time multiplied by ``compute`` (a busier or idler machine)."""
        def s(f: Fit) -> Fit:
            return Fit(f.fixed * compute, f.per_row * compute)

        return replace(self, prefill=s(self.prefill), decode=s(self.decode), head=s(self.head))


@dataclass(frozen=True)
class Choice:
    """One point of the search: ``per_load`` micro-batches of ``micro_batch`` sequences per weight
    load; the prompts prefilled ``prefill_chunk`` positions per forward (``None``: whole)."""

    micro_batch: int
    per_load: int
    resident_layers: int
    slots: int
    kv: KVPlacement
    prefill_chunk: int | None = None

    @property
    def in_flight(self) -> int:
        """Sequences per weight load."""
        return self.micro_batch * self.per_load


@dataclass(frozen=True)
class Estimate:
    """A choice's predicted cost for a workload."""

    choice: Choice
    tokens_per_s: float  #: generated tokens over the whole workload's time
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


@dataclass(frozen=True)
class Plan:
    """The planner's answer (see the module doc). ``load_streamed(..., plan=plan)`` applies
    ``slots`` and ``resident_layers``; ``generate_many(..., plan=plan)`` the rest."""

    workload: Generate
    memory_nbytes: int
    profile: Profile
    predicted: Estimate
    #: The best point for each micro-batch size and KV placement, and why it lost to the choice.
    alternatives: tuple[tuple[Estimate, str], ...]
    #: For each KV placement and number of sequences per weight load: the best tokens/s there and
    #: whether it fits (the weight side's counterpart of the recompute-offload-keep curve).
    curve: tuple[tuple[str, int, float, bool], ...] = ()

    @property
    def choice(self) -> Choice:
        return self.predicted.choice

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["choice"] = asdict(self.choice)
        return _jsonable(out)

    def describe(self) -> str:
        """One line: the choice, its prediction and its bound."""
        c, e = self.choice, self.predicted
        chunk = f", prefill {c.prefill_chunk} positions at a time" if c.prefill_chunk else ""
        return (
            f"{c.per_load} micro-batches of {c.micro_batch} per weight load, {c.resident_layers} layers resident, "
            f"{c.slots} slots, KV on the {c.kv.value}{chunk}: {e.tokens_per_s:.1f} tok/s predicted, peak "
            f"{format_bytes(e.peak_nbytes)} of {format_bytes(self.memory_nbytes)}, {e.bound}-bound"
        )


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, KVPlacement):
        return x.value
    return x


def estimate(profile: Profile, workload: Generate, choice: Choice, memory_nbytes: int) -> Estimate:
    """``choice``'s predicted time, peak memory and bound for ``workload`` (see the module doc)."""
    p, w, c = profile, workload, choice
    streamed = p.layers - c.resident_layers
    write_Bps = p.write_Bps or p.read_Bps
    drive_kv = c.kv is KVPlacement.DRIVE
    chunk = min(c.prefill_chunk or w.prompt_len, w.prompt_len)
    acc = _Cost()
    full, last = divmod(w.prompts, c.in_flight)
    for seqs, times in ((c.in_flight, full), (last, 1)):
        if seqs == 0 or times == 0:
            continue
        wave = _Cost()
        n = math.ceil(seqs / c.micro_batch)
        b = seqs / n  # the wave's micro-batches, evenly filled
        done = 0
        while done < w.prompt_len:  # the prefill, a chunk of positions per forward
            step = min(chunk, w.prompt_len - done)
            kv_r = seqs * done * p.kv_record_nbytes if drive_kv else 0
            kv_w = seqs * step * p.kv_record_nbytes if drive_kv else 0
            wave.step(p, streamed, c, compute=n * p.prefill(b * step), head=n * p.head(b), kv_r=kv_r, kv_w=kv_w, write_Bps=write_Bps, phase="prefill")
            done += step
        for step in range(1, w.new_tokens):
            ctx = w.prompt_len + step
            kv_r = seqs * ctx * p.kv_record_nbytes if drive_kv else 0
            kv_w = seqs * p.kv_record_nbytes if drive_kv else 0
            wave.step(p, streamed, c, compute=n * p.decode(b), head=n * p.head(b), kv_r=kv_r, kv_w=kv_w, write_Bps=write_Bps, phase="decode")
        acc.add(wave, times)
    peak = peak_nbytes(p, w, c)
    bound: Bound = "compute" if acc.compute >= acc.drive else "drive"
    total = acc.prefill_s + acc.decode_s
    return Estimate(c, w.prompts * w.new_tokens / total if total else 0.0, acc.prefill_s, acc.decode_s, peak, bound,
                    peak <= HEADROOM * memory_nbytes, acc.read, acc.written, acc.compute * streamed / p.layers)  # fmt: skip


class _Cost:
    """Time and traffic summed over the steps of a workload (:func:`estimate`)."""

    def __init__(self) -> None:
        self.prefill_s = self.decode_s = self.compute = self.drive = 0.0
        self.read = self.written = 0

    def add(self, other: _Cost, times: int) -> None:
        for name in ("prefill_s", "decode_s", "compute", "drive", "read", "written"):
            setattr(self, name, getattr(self, name) + times * getattr(other, name))

    def step(self, p: Profile, streamed: int, c: Choice, *, compute: float, head: float, kv_r: float, kv_w: float,
             write_Bps: float, phase: str) -> None:  # fmt: skip
        """One pass of a wave through every layer: ``compute`` seconds per layer, ``kv_r``/``kv_w``
        bytes of KV per layer moved, the layer's weights read for each streamed one."""
        kv_s = kv_r / p.read_Bps + kv_w / write_Bps
        drive = p.layer_nbytes / p.read_Bps + kv_s
        t = _layers(streamed, c.resident_layers, compute, drive, kv_s, c.slots) + head
        if phase == "prefill":
            self.prefill_s += t
        else:
            self.decode_s += t
        self.read += int(streamed * p.layer_nbytes + p.layers * kv_r)
        self.written += int(p.layers * kv_w)
        self.compute += p.layers * compute
        self.drive += streamed * drive


def _layers(streamed: int, resident: int, compute: float, drive: float, kv_s: float, slots: int) -> float:
    """One step through every layer: streamed layers overlap their reads with compute when the ring
    has a slot to read into while a layer computes; resident layers still move their KV."""
    per_streamed = max(compute, drive) if slots >= 2 else compute + drive
    return streamed * per_streamed + resident * max(compute, kv_s)


def peak_nbytes(p: Profile, w: Generate, c: Choice) -> int:
    """The predicted peak memory of ``c`` (see the module doc)."""
    b = c.micro_batch
    seqs = min(w.prompts, c.in_flight)
    positions = w.prompt_len + w.new_tokens
    chunk = min(c.prefill_chunk or w.prompt_len, w.prompt_len)
    weights = p.base_nbytes + c.resident_layers * p.layer_nbytes + min(c.slots, p.layers - c.resident_layers) * p.layer_nbytes
    if c.kv is KVPlacement.DEVICE:
        # Every sequence's cache, plus the copy torch.cat makes of one micro-batch-layer's as it grows.
        kv = seqs * positions * p.layers * p.kv_nbytes + b * positions * p.kv_nbytes
    else:
        # The micro-batch-layer read back, its cat with the new positions, and the next one read ahead.
        kv = 3 * b * positions * p.kv_record_nbytes
    prefill = seqs * chunk * p.hidden_nbytes + p.prefill_transient_nbytes * b * chunk
    decode = seqs * p.hidden_nbytes + p.decode_transient_nbytes * b
    return int(weights + kv + max(prefill, decode) + seqs * p.logits_nbytes)


def _shapes(workload: Generate, *, kv: tuple[KVPlacement, ...], max_slots: int = 3) -> list[Choice]:
    """Every searched point with no resident layer (:func:`choose` then keeps as many as fit)."""
    sizes = sorted({2**i for i in range(0, 12) if 2**i <= workload.prompts} | {workload.prompts})
    chunks = sorted({None, *(workload.prompt_len // 2**i for i in range(1, 8) if workload.prompt_len // 2**i >= 1)}, key=lambda x: x or 0)
    out = []
    for b in sizes:
        loads = sorted({2**i for i in range(0, 14) if b * 2**i <= workload.prompts} | {math.ceil(workload.prompts / b)})
        for n in loads:
            for slots in range(1, max_slots + 1):
                for placement in kv:
                    for chunk in chunks:
                        out.append(Choice(b, n, 0, slots, placement, chunk))
    return out


def _most_resident(profile: Profile, workload: Generate, choice: Choice, usable: float) -> Choice | None:
    """``choice`` with as many leading layers resident as fit ``usable`` bytes (more is never slower:
    the same compute, fewer reads), or ``None`` if even none fit."""
    best = None
    for r in range(profile.layers + 1):
        c = replace(choice, resident_layers=r, slots=1 if r == profile.layers else choice.slots)
        if peak_nbytes(profile, workload, c) > usable:
            break
        best = c
    return best


def choose(
    profile: Profile, workload: Generate, memory: int, *, kv: tuple[KVPlacement, ...] = tuple(KVPlacement),
    ring: tuple[int, int] | None = None,
) -> Plan:  # fmt: skip
    """The fastest choice for ``workload`` that fits ``memory`` bytes (see the module doc); among
    those within 1% of it, the simplest (KV in memory, fewest micro-batches per load, smallest peak).
    ``ring``: ``(resident_layers, slots)`` of a model already loaded (only the rest is chosen).
    Deterministic: a function of its arguments only.

    Raises:
        ConfigError: no choice fits ``memory`` (the message names the smallest one and what it needs).
    """
    if not isinstance(workload, Generate):
        raise ConfigError(f"workload={workload!r}: the planner plans gds_offload.weights.planner.Generate workloads")
    usable = HEADROOM * memory
    estimates = []
    for shape in _shapes(workload, kv=kv):
        if ring is not None:
            if shape.slots != 1:
                continue
            c: Choice | None = replace(shape, resident_layers=ring[0], slots=ring[1])
        else:
            c = _most_resident(profile, workload, shape, usable)
        estimates.append(estimate(profile, workload, c if c is not None else shape, memory))
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        least = min(estimates, key=lambda e: e.peak_nbytes)
        raise ConfigError(
            f"memory={format_bytes(memory)} is too small for {workload}: the smallest plan ({least.choice.per_load} x "
            f"{least.choice.micro_batch} sequences, KV on the {least.choice.kv.value}) needs {format_bytes(least.peak_nbytes)} "
            f"(the model's base and resident group alone take {format_bytes(profile.base_nbytes)}, a layer "
            f"{format_bytes(profile.layer_nbytes)}); give at least {format_bytes(math.ceil(least.peak_nbytes / HEADROOM))}"
        )
    best = _simplest_of_the_fastest(fitting)
    if best.bound == "drive" and _larger_would_not_fit(best, estimates):
        best = replace(best, bound="memory")
    alternatives = []
    for key in sorted({(e.choice.micro_batch, e.choice.kv) for e in estimates}, key=lambda k: (k[0], k[1].value)):
        group = [e for e in estimates if (e.choice.micro_batch, e.choice.kv) == key]
        ok = [e for e in group if e.fits]
        alt = max(ok, key=lambda e: (e.tokens_per_s, -e.peak_nbytes)) if ok else min(group, key=lambda e: e.peak_nbytes)
        if alt.choice == best.choice:
            continue
        why = (
            f"slower: {alt.tokens_per_s:.1f} tok/s ({alt.bound}-bound)" if alt.fits
            else f"over memory: needs {format_bytes(alt.peak_nbytes)} of {format_bytes(int(HEADROOM * memory))} usable"
        )  # fmt: skip
        alternatives.append((alt, why))
    curve = []
    for placement in kv:
        for seqs in sorted({e.choice.in_flight for e in estimates}):
            at = [e for e in estimates if e.choice.kv == placement and e.choice.in_flight == seqs]
            ok = [e for e in at if e.fits]
            if at:
                top = max(ok or at, key=lambda e: e.tokens_per_s)
                curve.append((placement.value, seqs, top.tokens_per_s, bool(ok)))
    return Plan(workload, memory, profile, best, tuple(alternatives), tuple(curve))


#: Plans within this share of the fastest count as as fast: the predictions are not finer than that.
TIE = 0.01


def _simplest_of_the_fastest(fitting: list[Estimate]) -> Estimate:
    """Among the plans within :data:`TIE` of the fastest: KV caches in memory (no drive traffic to go
    wrong), then the fewest micro-batches per load (fewer threads), then the smallest peak."""
    top = max(e.tokens_per_s for e in fitting)
    near = [e for e in fitting if e.tokens_per_s >= (1 - TIE) * top]
    return min(near, key=lambda e: (e.choice.kv is not KVPlacement.DEVICE, e.choice.per_load, e.peak_nbytes, -e.tokens_per_s))


def _larger_would_not_fit(best: Estimate, estimates: list[Estimate]) -> bool:
    """Every choice with more sequences per load, the rest alike, is over memory."""
    c = best.choice
    larger = [e for e in estimates if e.choice.in_flight > c.in_flight and e.choice.kv == c.kv and e.choice.slots == c.slots]
    return bool(larger) and not any(e.fits for e in larger)


def plan(
    store: str | os.PathLike[str],
    workload: Generate,
    *,
    memory: int | str,
    device: str = "cpu",
    engine: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Measure the model in ``store`` on this machine (:func:`~gds_offload.weights.measure.measure`,
    in a child process) and choose the fastest shape for ``workload`` under ``memory`` bytes
    (``"1.2GiB"``): :func:`choose`. Checks what it can before measuring.

    Raises:
        ConfigError: ``memory`` below what any plan needs (before measuring when the store alone
            shows it), a workload longer than the model's positions, or no plan that fits.
    """
    from gds_offload.weights.measure import measure

    limit = parse_bytes(memory, name="memory")
    check_feasible(store, workload, limit)
    return choose(measure(store, workload, device=device, engine=engine, progress=progress), workload, limit)


def check_feasible(store: str | os.PathLike[str], workload: Generate, memory: int) -> None:
    """What can be refused without measuring: a workload longer than the model's positions, and a
    ``memory`` below this process's own resident memory plus the resident group and one layer.

    Raises:
        ConfigError: either, naming what is needed.
    """
    from gds_offload.weights.manifest import read_manifest

    m = read_manifest(store)
    config = _read_config(Path(store))
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    need = workload.prompt_len + workload.new_tokens
    if isinstance(limit, int) and need > limit:
        raise ConfigError(f"the workload needs {need} positions ({workload.prompt_len} + {workload.new_tokens}) but the model in {store} "
                          f"has {limit}; shorten --prompt-len or --new-tokens")  # fmt: skip
    if not m.layers:
        raise ConfigError(f"{store} holds no layers to stream; load it resident instead")
    floor = _own_rss() + (m.resident.padded_nbytes if m.resident else 0) + max(g.padded_nbytes for g in m.layers)
    if memory * HEADROOM < floor:
        raise ConfigError(
            f"memory={format_bytes(memory)} is below what any plan needs: this process ({format_bytes(_own_rss())}), the resident "
            f"group and one layer need {format_bytes(floor)}; give at least {format_bytes(math.ceil(floor / HEADROOM))}"
        )


def _read_config(store: Path) -> dict[str, Any]:
    try:
        with open(store / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return text if isinstance(text, dict) else {}


def _own_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
