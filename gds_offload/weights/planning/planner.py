"""Balance Beam's planner: from a measured :class:`Profile` of the model on this machine, the shape
that makes compute per weight load cover the read: :func:`choose` (and
:func:`~gds_offload.weights.run.measure.plan`, which measures first).

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
  ``b · chunk`` tokens, a whole prompt's forward for the first chunk and a chunk's on a cache for
  the others; a decode step: ``b`` tokens at the mean context), interpolated between the sizes
  measured (:class:`Fit`: a forward's cost per row changes with its size); the chunks searched
  are the profile's measured one and larger (:func:`~gds_offload.weights.planning.workload.smallest_chunk`);
  with the caches on the drive, plus what moving them adds to each micro-batch's forward, measured
  against the bytes moved (:attr:`~gds_offload.weights.planning.workload.Profile.kv_drive`);
* drive ``D = (layer bytes + n · KV bytes read + n · KV bytes written) / read rate``;
* the step takes ``max(C, D)`` per streamed layer (``C + D`` with one slot), ``C`` (+ KV traffic)
  per resident layer, plus ``n`` times the head: timed as a decode step feeds it, and, at the end
  of each prefill chunk, on the strided last position a prefill feeds it (on the CPU one product
  per sequence: each chunk costs its sequences' heads again, which a large vocabulary makes the
  larger part of a chunk's time).

The memory model (peak, on the model's device; on the CPU, the process's anonymous memory, which
a memory limit cannot reclaim): the measured base (process, resident group), the resident layers,
the ring, and the larger of two phases:

* the prefill's: the KV caches at the prompt's length; every sequence's hidden states for a chunk,
  two of them (a layer's input, and the embeddings the decoder's forward keeps); one
  micro-batch's measured transient peak inside a layer, at a chunk;
* the decode's: the same with the caches at full length and one position.

The KV caches are all in memory, or on the drive a few micro-batch-layers' worth (read back,
grown, read ahead, and the write in flight).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gds_offload.errors import ConfigError
from gds_offload.units import format_bytes
from gds_offload.weights.planning.cost import estimate, estimate_finetune, peak_finetune, peak_nbytes
from gds_offload.weights.planning.options import KVPlacement
from gds_offload.weights.planning.workload import HEADROOM, Choice, Estimate, Finetune, Fit, Generate, Profile, Workload, profile_from, smallest_chunk
from gds_offload.weights.store.manifest import read_manifest

__all__ = ["Choice", "Estimate", "Finetune", "Fit", "Generate", "Plan", "Profile", "as_plan", "at_least", "check_feasible", "check_floor", "choose", "estimate", "least_peak", "variant"]


@dataclass(frozen=True)
class Plan:
    """The planner's answer (see the module doc). ``load_streamed(..., plan=plan)`` applies
    ``slots`` and ``resident_layers``; ``generate_many(..., plan=plan)`` the rest."""

    workload: Workload
    memory_nbytes: int
    profile: Profile
    predicted: Estimate
    #: The best point for each micro-batch size and KV placement, and why it lost to the choice.
    alternatives: tuple[tuple[Estimate, str], ...]
    #: For each variant (:func:`variant`: KV placement, or activations kept or offloaded) and number of
    #: sequences per weight load: the best tokens/s there and whether it fits (the weight side's
    #: counterpart of the recompute-offload-keep curve).
    curve: tuple[tuple[str, int, float, bool], ...] = ()

    @property
    def choice(self) -> Choice:
        return self.predicted.choice

    def ring_shape(self, *, slots: int | None, resident_layers: int | None, max_memory: object) -> tuple[int, int]:
        """``(slots, resident_layers)`` for :func:`~gds_offload.weights.run.model.load_streamed`; an explicit argument must agree."""
        c = self.choice
        for name, given, planned in (("slots", slots, c.slots), ("resident_layers", resident_layers, c.resident_layers)):
            if given is not None and given != planned:
                raise ConfigError(f"{name}={given} differs from the plan's {name}={planned}; pass one or the other")
        if max_memory is not None:
            raise ConfigError("max_memory= and plan= both choose the resident layers; pass one or the other")
        return c.slots, c.resident_layers

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["choice"] = asdict(self.choice)
        return _jsonable(out)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """The plan :meth:`as_dict` (``gds-offload plan --out``) wrote."""
        def est(e: dict[str, Any]) -> Estimate:
            c = dict(e["choice"])
            c["kv"] = KVPlacement(c["kv"])
            return Estimate(**(e | {"choice": Choice(**c)}))

        w = d["workload"]
        workload: Workload = Finetune(**w) if w.get("kind") == "finetune" else Generate(**w)
        alternatives = tuple((est(e), why) for e, why in d.get("alternatives", []))
        curve = tuple((str(n), int(s), float(t), bool(f)) for n, s, t, f in d.get("curve", []))
        return cls(workload, d["memory_nbytes"], profile_from(d["profile"]), est(d["predicted"]), alternatives, curve)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """The plan ``gds-offload plan --out PATH`` wrote (or ``json.dump(plan.as_dict(), f)``).

        Raises:
            ConfigError: no such file, or one that is not such a plan (naming what is wrong).
        """
        label = f"plan={os.fspath(path)!r}"
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"{label} does not exist; write one with `gds-offload plan STORE --memory SIZE --out {os.fspath(path)}`") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{label} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
        try:
            doc = json.loads(text)
            return cls.from_dict(doc)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{label} is not JSON ({exc}); pass the file gds-offload plan --out wrote") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{label} is not a plan gds-offload plan --out wrote ({type(exc).__name__}: {exc})") from None

    def describe(self) -> str:
        """One line: the choice, its prediction and its bound."""
        c, e = self.choice, self.predicted
        chunk = f", prefill {c.prefill_chunk} positions at a time" if c.prefill_chunk else ""
        return (
            f"{c.per_load} micro-batches of {c.micro_batch} per weight load, {c.resident_layers} layers resident, "
            f"{c.slots} slots, {variant(self.workload, c)}{chunk}: {e.tokens_per_s:.1f} tok/s predicted, peak "
            f"{format_bytes(e.peak_nbytes)} of {format_bytes(self.memory_nbytes)}, {e.bound}-bound"
        )


def as_plan(plan: Plan | str | os.PathLike[str] | None) -> Plan | None:
    """``plan`` as a :class:`Plan`: one given, or the file :meth:`Plan.load` reads; ``None`` stays ``None``.

    Raises:
        ConfigError: a file that is not a plan, or a value that is neither.
    """
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    raise ConfigError(f"plan={plan!r} ({type(plan).__name__}) is not a plan; pass a Plan, or the path of the JSON file "
                      f"gds-offload plan --out wrote")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, KVPlacement):
        return x.value
    return x


def _estimate(profile: Profile, workload: Workload, choice: Choice, memory: int) -> Estimate:
    if isinstance(workload, Finetune):
        return estimate_finetune(profile, workload, choice, memory)
    return estimate(profile, workload, choice, memory)


def _peak(profile: Profile, workload: Workload, choice: Choice) -> int:
    return peak_finetune(profile, workload, choice) if isinstance(workload, Finetune) else peak_nbytes(profile, workload, choice)


def variant(workload: Workload, choice: Choice) -> str:
    """What the curve and the alternatives group by: the KV placement (generation), or where what
    autograd saves goes (fine-tuning)."""
    if isinstance(workload, Finetune):
        return "activations offloaded" if choice.offload_activations else "activations kept"
    return f"KV on the {choice.kv.value}"


def _shapes(workload: Workload, *, kv: tuple[KVPlacement, ...], max_slots: int = 3) -> list[Choice]:
    """Every searched point with no resident layer (:func:`choose` then keeps as many as fit)."""
    if isinstance(workload, Finetune):
        g = workload.global_batch
        return [Choice(b, n, 0, slots, offload_activations=off) for b in sorted({2**i for i in range(12) if 2**i <= g} | {g})
                for n in sorted({2**i for i in range(14) if b * 2**i <= g} | {math.ceil(g / b)})
                for slots in range(1, max_slots + 1) for off in (False, True)]  # fmt: skip
    sizes = sorted({2**i for i in range(0, 12) if 2**i <= workload.prompts} | {workload.prompts})
    least = smallest_chunk(workload.prompt_len)  # no chunk smaller than the profile measured
    chunks = sorted({None, *(workload.prompt_len // 2**i for i in range(1, 8) if workload.prompt_len // 2**i >= least)}, key=lambda x: x or 0)
    out = []
    for b in sizes:
        loads = sorted({2**i for i in range(0, 14) if b * 2**i <= workload.prompts} | {math.ceil(workload.prompts / b)})
        for n in loads:
            for slots in range(1, max_slots + 1):
                for placement in kv:
                    for chunk in chunks:
                        out.append(Choice(b, n, 0, slots, placement, chunk))
    return out


def _most_resident(profile: Profile, workload: Workload, choice: Choice, usable: float) -> Choice | None:
    """``choice`` with as many leading layers resident as fit ``usable`` bytes (more is never slower:
    the same compute, fewer reads), or ``None`` if even none fit."""
    best = None
    for r in range(profile.layers + 1):
        c = replace(choice, resident_layers=r, slots=1 if r == profile.layers else choice.slots)
        if _peak(profile, workload, c) > usable:
            break
        best = c
    return best


def choose(
    profile: Profile, workload: Workload, memory: int, *, kv: tuple[KVPlacement, ...] = (KVPlacement.DEVICE, KVPlacement.DRIVE),
    ring: tuple[int, int] | None = None,
) -> Plan:  # fmt: skip
    """The fastest choice for ``workload`` that fits ``memory`` bytes (see the module doc); among
    those within 1% of it, the simplest (KV in memory, fewest micro-batches per load, smallest peak).
    ``ring``: ``(resident_layers, slots)`` of a model already loaded (only the rest is chosen).
    Deterministic: a function of its arguments only.

    Raises:
        ConfigError: no choice fits ``memory`` (the message names the smallest one and what it needs).
    """
    if not isinstance(workload, (Generate, Finetune)):
        raise ConfigError(f"workload={workload!r}: the planner plans Generate and Finetune workloads (gds_offload.weights)")
    if KVPlacement.HOST in kv:
        raise ConfigError("kv=host: the planner models the cache on the device or the drive, not host<->device copies; "
                          "pass kv='host' to generate_many by hand")
    usable = HEADROOM * memory
    estimates = []
    for shape in _shapes(workload, kv=kv):
        if ring is not None:
            if shape.slots != 1:
                continue
            c: Choice | None = replace(shape, resident_layers=ring[0], slots=ring[1])
        else:
            c = _most_resident(profile, workload, shape, usable)
        estimates.append(_estimate(profile, workload, c if c is not None else shape, memory))
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        least = min(estimates, key=lambda e: e.peak_nbytes)
        raise ConfigError(
            f"memory={format_bytes(memory)} is too small for {workload}: the smallest plan ({least.choice.per_load} x "
            f"{least.choice.micro_batch} sequences, {variant(workload, least.choice)}) needs {format_bytes(least.peak_nbytes)}, "
            f"counting this whole process (the base measured with the resident group loaded, {format_bytes(profile.base_nbytes)}; "
            f"a layer, {format_bytes(profile.layer_nbytes)}); give at least {at_least(least.peak_nbytes)}"
        )
    best = _simplest_of_the_fastest(fitting)
    if best.bound == "drive" and _larger_would_not_fit(best, estimates):
        best = replace(best, bound="memory")
    alternatives = []
    for key in sorted({(e.choice.micro_batch, variant(workload, e.choice)) for e in estimates}):
        group = [e for e in estimates if (e.choice.micro_batch, variant(workload, e.choice)) == key]
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
    for name in sorted({variant(workload, e.choice) for e in estimates}):
        for seqs in sorted({e.choice.in_flight for e in estimates}):
            at = [e for e in estimates if variant(workload, e.choice) == name and e.choice.in_flight == seqs]
            ok = [e for e in at if e.fits]
            if at:
                top = max(ok or at, key=lambda e: e.tokens_per_s)
                curve.append((name, seqs, top.tokens_per_s, bool(ok)))
    return Plan(workload, memory, profile, best, tuple(alternatives), tuple(curve))


#: Plans within this share of the fastest count as as fast: the predictions are not finer than that.
TIE = 0.01


def _simplest_of_the_fastest(fitting: list[Estimate]) -> Estimate:
    """Among the plans within :data:`TIE` of the fastest: KV caches in memory (no drive traffic to go
    wrong), then the fewest micro-batches per load (fewer threads), then the smallest peak."""
    top = max(e.tokens_per_s for e in fitting)
    near = [e for e in fitting if e.tokens_per_s >= (1 - TIE) * top]
    return min(near, key=lambda e: (e.choice.kv is not KVPlacement.DEVICE, e.choice.offload_activations, e.choice.per_load, e.peak_nbytes,
                                    -e.tokens_per_s))  # fmt: skip


def _larger_would_not_fit(best: Estimate, estimates: list[Estimate]) -> bool:
    """Every choice with more sequences per load, the rest alike, is over memory."""
    c = best.choice
    larger = [e for e in estimates if e.choice.in_flight > c.in_flight and e.choice.kv == c.kv and e.choice.slots == c.slots
              and e.choice.offload_activations == c.offload_activations]  # fmt: skip
    return bool(larger) and not any(e.fits for e in larger)


def check_feasible(store: str | os.PathLike[str], workload: Workload, memory: int) -> None:
    """What can be refused without measuring: a workload longer than the model's positions, a store
    with no layer to stream. (A ``memory`` too small is refused once the resident group is loaded,
    before anything is timed: :func:`check_floor`, called by :func:`~gds_offload.weights.run.measure.measure`.)

    Raises:
        ConfigError: either, naming what is needed.
    """
    m = read_manifest(store)
    config = _read_config(Path(store))
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    if isinstance(workload, Finetune):
        need, what, fix = workload.seq, f"{workload.seq} positions", "shorten --seq"
    else:
        need = workload.prompt_len + workload.new_tokens
        what, fix = f"{need} positions ({workload.prompt_len} + {workload.new_tokens})", "shorten --prompt-len or --new-tokens"
    if isinstance(limit, int) and need > limit:
        raise ConfigError(f"the workload needs {what} but the model in {store} has {limit}; {fix}")
    if not m.layers:
        raise ConfigError(f"{store} holds no layers to stream; load it resident instead")


def check_floor(config: dict[str, Any], workload: Workload, memory: int, *, layers: int, layer_nbytes: int, resident_nbytes: int,
                base_nbytes: int) -> None:  # fmt: skip
    """Refuse ``memory`` below what the smallest plan needs, before anything is timed: this whole
    process with the resident group loaded (``base_nbytes``, measured), a layer, and one sequence's
    activations (priced from ``config``, a model's text config, alone; fp32).

    Raises:
        ConfigError: naming what counts and the memory to give (:func:`at_least`).
    """
    least = least_peak(config, workload, layers=layers, layer_nbytes=layer_nbytes, resident_nbytes=resident_nbytes, base_nbytes=base_nbytes)
    if memory * HEADROOM < least:
        raise ConfigError(
            f"memory={format_bytes(memory)} is below what any plan needs: memory counts this whole process, and the smallest "
            f"plan needs about {format_bytes(least)}: this process with the resident group loaded ({format_bytes(base_nbytes)}), "
            f"a layer ({format_bytes(layer_nbytes)}) and one sequence's activations; give at least {at_least(least)}"
        )


def least_peak(config: dict[str, Any], workload: Workload, *, layers: int, layer_nbytes: int, resident_nbytes: int, base_nbytes: int,
               slots: int | None = None) -> float:  # fmt: skip
    """The smallest plan's peak (:func:`check_floor`'s rule), among plans of ``slots`` ring slots if given."""
    rough = _rough_profile(config, layers, layer_nbytes, resident_nbytes, base=base_nbytes)
    shapes = _shapes(workload, kv=(KVPlacement.DEVICE, KVPlacement.DRIVE))
    return min(_peak(rough, workload, c) for c in shapes if slots is None or c.slots == slots)


def at_least(peak: float) -> str:
    """The memory to give for a plan that peaks at ``peak`` bytes (the planner uses a share
    :data:`HEADROOM` of what it is given), rounded up to the MiB: giving exactly this fits."""
    mib = math.ceil(peak / HEADROOM / (1 << 20))
    return f"{mib} MiB"


def _rough_profile(config: dict[str, Any], layers: int, layer: int, resident: int, *, base: int) -> Profile:
    """A profile from the store alone (no timings, no transients; fp32 activations): enough to price
    the memory of the smallest plan before measuring."""
    hidden = int(config.get("hidden_size") or config.get("n_embd") or 0)
    heads = int(config.get("num_attention_heads") or config.get("n_head") or 1)
    head_dim = int(config.get("head_dim") or (hidden // heads if heads else 0))
    kv = 2 * int(config.get("num_key_value_heads") or heads) * head_dim * 4
    zero = Fit(0.0, 0.0)
    return Profile(device="cpu", layers=layers, layer_nbytes=layer, resident_nbytes=resident, hidden_nbytes=hidden * 4, kv_nbytes=kv,
                   kv_record_nbytes=kv, logits_nbytes=int(config.get("vocab_size") or 0) * 4, read_Bps=1e9, base_nbytes=base,
                   prefill=zero, decode=zero, head=zero, prefill_transient_nbytes=0.0, decode_transient_nbytes=0.0)  # fmt: skip


def _read_config(store: Path) -> dict[str, Any]:
    try:
        with open(store / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return text if isinstance(text, dict) else {}
