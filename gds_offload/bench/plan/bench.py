"""``gds-offload bench-plan``: Balance Beam's planner against today's API, the resident model and the
peers users would pick, on the weights benchmark's 12-layer model under a memory cap.

One run, every mode in a child process of its own (:mod:`gds_offload.bench.plan.child`),
the capped ones under the cap (cgroup v1, page cache included, the weights' cache dropped first):

* ``planned``: :func:`gds_offload.weights.plan` (measured here first, uncapped, as ``gds-offload
  plan`` is run before a job) applied to the whole workload; its prediction beside the
  measurement, and its first micro-batches' tokens checked against the resident model run on
  the same micro-batches (``exact``);
* ``naive``: ``load_streamed(slots=2)`` and ``generate`` in batches of 8 (what a user does without a plan);
* ``resident`` (uncapped: the ceiling, this machine's compute): a short probe at several batch
  sizes, then the workload at the best;
* the peers (:mod:`gds_offload.bench.weights.peers_run`), each at its best feasible batch under the cap;
* a measured sweep of configurations (micro-batch, per load, resident layers, slots, KV placement)
  on a smaller workload of the same shape, against the planner's choice for that workload.

Slow modes run the first ``subset`` prompts: every batch of such a mode has the same shape, so
its rate is the whole workload's; the result says how many prompts each mode ran.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gds_offload.bench import procs
from gds_offload.bench.cgroup import check_limit, remove_stale_groups
from gds_offload.bench.plan.child import workload_prompts
from gds_offload.bench.weights.bench import DEFAULT_MODEL, TINY, BenchModel, child_env, prepare, weight_files
from gds_offload.bench.weights.drive import evict
from gds_offload.bench.weights.peers_run import BATCHES, best_batch, run_peer
from gds_offload.weights.planning.cost import estimate
from gds_offload.weights.planning.options import KVPlacement
from gds_offload.weights.planning.planner import Choice, Generate, Plan, choose
from gds_offload.weights.run.plan import plan

__all__ = ["MODES", "child_result", "exact_tokens", "resident_best", "run_bench_plan", "summarize", "sweep_points"]

CHILD = "gds_offload.bench.plan.child"
MODES = ("planned", "naive", "resident", "sweep")
#: Batch sizes the resident model is probed at (a few decode steps each) before its full run.
RESIDENT_PROBES = (16, 32, 64, 128, 256, 512)  # up to the workload's prompts; it stops where a batch is slower
#: The sweep measures at least this many configurations.
SWEEP_POINTS = 12


def child_result(spec: dict[str, Any], *, memory_limit: int | None, timeout_s: float, say: Callable[[str], None]) -> dict[str, Any]:
    """One mode in its own process (under ``memory_limit`` if given) after dropping the weights' page cache."""
    evict(weight_files(Path(spec["checkpoint"]), Path(spec["store"])))
    run = procs.run_child(procs.child_command(CHILD, json.dumps(spec)), env=child_env(), memory_limit=memory_limit, timeout_s=timeout_s)
    ev = run.last("result")
    if ev is None:
        say(f"{spec['mode']}: {run.failure()}")
        out: dict[str, Any] = {"mode": spec["mode"], "error": run.failure(), "returncode": run.returncode}
    else:
        out = dict(ev["result"])
    if run.cap is not None:
        out["cap_peak_bytes"] = run.cap.peak_bytes
        out["cap_failcnt"] = run.cap.failcnt
    out["wall_s"] = run.wall_s
    return out


def run_bench_plan(
    *, workdir: Path, memory_limit: int, prompts: int, prompt_len: int, new_tokens: int, subset: int, sweep_prompts: int,
    modes: tuple[str, ...], peers: tuple[str, ...], tiny: bool, checkpoint: Path | None, say: Callable[[str], None],
    timeout_s: float = 7200,
) -> dict[str, Any]:  # fmt: skip
    """Run the benchmark (see the module doc); the result document's measurements.

    Raises:
        ConfigError: a memory cap this machine cannot apply, or a workload no plan fits (before any child).
    """
    check_limit(memory_limit, name="--memory-limit")
    for line in remove_stale_groups():
        say(line)
    model: BenchModel = TINY if tiny else DEFAULT_MODEL
    say("preparing the checkpoint and the store")
    ckpt, store = prepare(model, workdir, checkpoint)
    base = {"store": str(store), "checkpoint": str(ckpt), "workdir": str(workdir), "prompts": prompts, "prompt_len": prompt_len,
            "new_tokens": new_tokens}  # fmt: skip
    workload = Generate(prompts, prompt_len, new_tokens)
    doc: dict[str, Any] = {"workload": asdict(workload), "memory_limit": memory_limit, "model": asdict(model), "results": {}}
    say("planning: measuring the model on this machine (uncapped), then choosing")
    t0 = time.perf_counter()
    chosen = plan(store, workload, memory=memory_limit, progress=lambda w: say(f"  plan: {w}"))
    doc["plan_s"] = time.perf_counter() - t0
    doc["plan"] = chosen.as_dict() | {"describe": chosen.describe()}
    say(f"plan ({doc['plan_s']:.0f} s): {chosen.describe()}")
    results = doc["results"]
    if "planned" in modes:
        say("planned: the whole workload, capped")
        results["planned"] = child_result(base | {"mode": "planned", "measure_prompts": prompts, "plan": chosen.as_dict()},
                                    memory_limit=memory_limit, timeout_s=timeout_s, say=say)  # fmt: skip
        results["planned"]["exact"] = exact_tokens(results["planned"], base, timeout_s=timeout_s, say=say)
    if "naive" in modes:
        say(f"naive: batches of 8, slots=2, the first {subset} prompts, capped")
        results["naive"] = child_result(base | {"mode": "naive", "measure_prompts": subset, "batch": 8}, memory_limit=memory_limit,
                                  timeout_s=timeout_s, say=say)  # fmt: skip
    if "resident" in modes:
        results["resident"], doc["resident_probes"] = resident_best(base, prompts, new_tokens, timeout_s=timeout_s, say=say)
    for peer in peers:
        results[peer] = _peer(peer, ckpt, workdir, subset, prompt_len, new_tokens, memory_limit, timeout_s=timeout_s, say=say)
    if "sweep" in modes:
        doc["sweep_plan"], doc["sweep"] = _sweep(chosen, base, sweep_prompts, memory_limit, timeout_s=timeout_s, say=say)
    doc["summary"] = summarize(doc)
    return doc


def _peer(peer: str, ckpt: Path, workdir: Path, subset: int, prompt_len: int, new_tokens: int, memory_limit: int, *,
          timeout_s: float, say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """``peer`` at its best feasible batch under the cap (:func:`~gds_offload.bench.weights.peers_run.best_batch`:
    probes upward until it runs out of memory or slows), then the first ``subset`` prompts at that batch."""
    vocab = int(json.loads((ckpt / "config.json").read_text())["vocab_size"])
    prompts = [p.tolist() for p in workload_prompts(vocab, subset, prompt_len)]
    say(f"{peer}: its best batch under the cap, on the first {subset} prompts")
    search = best_batch(peer, checkpoint=ckpt, workdir=workdir, prompts=prompts, max_new_tokens=new_tokens, memory_limit=memory_limit,
                        batches=tuple(b for b in BATCHES if b <= subset), timeout_s=timeout_s, say=lambda t: say(f"  {peer}: {t}"))  # fmt: skip
    probes = [{"batch": p.batch, "status": p.result.status, "est_tokens_per_s": p.est_tokens_per_s, "error": p.result.error} for p in search.points]
    if search.best is None:
        return {"mode": peer, "error": f"no batch ran: {search.stopped}", "probes": probes}
    say(f"{peer}: the first {subset} prompts at batch {search.best.batch}")
    r = run_peer(peer, checkpoint=ckpt, workdir=workdir, prompts=prompts, max_new_tokens=new_tokens, batch=search.best.batch,
                 memory_limit=memory_limit, timeout_s=timeout_s)  # fmt: skip
    out = r.as_dict()
    out.pop("tokens", None)
    out |= {"mode": peer, "prompts_measured": subset, "probes": probes, "stopped": search.stopped, "cap_peak_bytes": r.cgroup_peak_bytes}
    if r.status != "ok":
        out["error"] = f"{r.status}: {r.error}"
    return out


def exact_tokens(planned: dict[str, Any], base: dict[str, Any], *, timeout_s: float, say: Callable[[str], None]) -> bool | None:
    """The resident model on the planned run's first micro-batches (same padding, same prefill
    chunk): ``True`` when every token is equal; ``None`` when the planned run failed."""
    check = planned.get("check") or []
    if not check:
        return None
    say("exactness: the resident model on the planned run's first micro-batches")
    ref = child_result(base | {"mode": "reference", "measure_prompts": 0, "reference": [[c["ids"], c["mask"], c["chunk"]] for c in check]},
                 memory_limit=None, timeout_s=timeout_s, say=say)  # fmt: skip
    want = ref.get("reference_tokens") or []
    return len(want) == len(check) and all(c["tokens"] == w for c, w in zip(check, want))


def resident_best(base: dict[str, Any], prompts: int, new_tokens: int, *, timeout_s: float,
              say: Callable[[str], None]) -> tuple[dict[str, Any], dict[int, float]]:  # fmt: skip
    """The resident model's best batch (probes: its prefill and 4 tokens at each size, projected
    to the workload), then the whole workload at it."""
    probes: dict[int, float] = {}
    for b in (p for p in RESIDENT_PROBES if p <= prompts):
        say(f"resident: probing batch {b} (uncapped)")
        r = child_result(base | {"mode": "resident", "measure_prompts": b, "batch": b, "new_tokens": min(new_tokens, 4)},
                   memory_limit=None, timeout_s=timeout_s, say=say)  # fmt: skip
        if "error" in r or not r.get("decode_s"):
            break
        step = r["decode_s"] / max(r["new_tokens"] - 1, 1)
        probes[b] = prompts * new_tokens / ((r["prefill_s"] + (new_tokens - 1) * step) * math.ceil(prompts / b))
        if len(probes) >= 2 and probes[b] < 0.97 * max(probes.values()):
            break  # slower than a smaller batch: larger ones will not win
    best = max(probes, key=lambda k: probes[k]) if probes else 8
    say(f"resident: the workload at batch {best} (uncapped)")
    out = child_result(base | {"mode": "resident", "measure_prompts": prompts, "batch": best}, memory_limit=None, timeout_s=timeout_s, say=say)
    return out, probes


def _sweep(chosen: Plan, base: dict[str, Any], sweep_prompts: int, memory_limit: int, *, timeout_s: float,
           say: Callable[[str], None]) -> tuple[dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
    """The planner's choice for the smaller workload, and every point of :func:`sweep_points` measured under the cap."""
    small = Generate(sweep_prompts, chosen.workload.prompt_len, chosen.workload.new_tokens)  # type: ignore[union-attr]
    small_plan = choose(chosen.profile, small, memory_limit)
    rows = []
    points = sweep_points(small_plan)
    for i, c in enumerate(points):
        say(f"sweep {i + 1}/{len(points)}: {c.per_load} x {c.micro_batch}, {c.resident_layers} resident, {c.slots} slots, KV {c.kv.value}"
            f"{f', chunk {c.prefill_chunk}' if c.prefill_chunk else ''}")  # fmt: skip
        shape = asdict(c) | {"kv": c.kv.value}
        r = child_result(base | {"mode": "sweep", "prompts": sweep_prompts, "measure_prompts": sweep_prompts, "choice": shape},
                   memory_limit=memory_limit, timeout_s=timeout_s, say=say)  # fmt: skip
        e = estimate(chosen.profile, small, c, memory_limit)
        r.setdefault("choice", shape)  # a child that died reported none
        r |= {"predicted_tokens_per_s": e.tokens_per_s, "predicted_peak_bytes": e.peak_nbytes, "predicted_fits": e.fits, "is_plan": c == small_plan.choice}
        rows.append(r)
    return small_plan.as_dict() | {"describe": small_plan.describe()}, rows


def sweep_points(small_plan: Plan, *, at_least: int = SWEEP_POINTS) -> list[Choice]:
    """Configurations around the plan: its choice, the choice with each knob moved one step
    (micro-batch, micro-batches per load, KV placement, resident layers, slots, prefill chunk), then
    the best alternatives it considered, until ``at_least`` distinct points (fewer only if the
    search space holds fewer)."""
    c, w = small_plan.choice, small_plan.workload
    prompts = getattr(w, "prompts", c.in_flight)
    pts = [c]
    for b in (c.micro_batch // 2, c.micro_batch * 2):
        if 1 <= b <= prompts:
            pts.append(replace(c, micro_batch=b, per_load=max(1, min(c.per_load, prompts // b))))
    for n in (c.per_load // 2, c.per_load * 2):
        if n >= 1 and n * c.micro_batch <= prompts:
            pts.append(replace(c, per_load=n))
    pts.append(replace(c, kv=KVPlacement.DRIVE if c.kv is KVPlacement.DEVICE else KVPlacement.DEVICE))
    pts.append(replace(c, resident_layers=max(0, c.resident_layers - 2)))
    if c.resident_layers + 2 <= small_plan.profile.layers:
        pts.append(replace(c, resident_layers=c.resident_layers + 2))
    pts.append(replace(c, slots=1 if c.slots > 1 else 2))
    pts.append(replace(c, prefill_chunk=None) if c.prefill_chunk else replace(c, per_load=1, micro_batch=8))
    pts.append(replace(c, per_load=1, micro_batch=min(8, prompts), kv=KVPlacement.DEVICE, resident_layers=0, slots=2))
    pts.extend(e.choice for e, _ in sorted(small_plan.alternatives, key=lambda a: -a[0].tokens_per_s))
    out: list[Choice] = []
    for p in pts:
        if p not in out:
            out.append(p)
    return out[: max(at_least, 1)]


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Ratios of the planned mode to the others (tokens/s over the workload), and the planner's accuracy."""
    r = doc["results"]
    planned = r.get("planned", {})
    tps = planned.get("tokens_per_s")
    out: dict[str, Any] = {"plan_s": doc.get("plan_s")}
    if tps:
        for mode, res in r.items():
            if mode != "planned" and res.get("tokens_per_s"):
                out[f"planned_over_{mode}"] = tps / res["tokens_per_s"]
        pred = planned.get("predicted", {})
        if pred.get("tokens_per_s"):
            out["predicted_over_measured_tokens_per_s"] = pred["tokens_per_s"] / tps
        if pred.get("peak_bytes") and planned.get("cap_peak_bytes"):
            out["predicted_over_measured_peak"] = pred["peak_bytes"] / planned["cap_peak_bytes"]
        gen = planned.get("generated") or 1
        out["bytes_read_per_token"] = planned.get("bytes_read", 0) / gen
        out["bytes_written_per_token"] = planned.get("bytes_written", 0) / gen
    sweep = [s for s in doc.get("sweep", []) if s.get("tokens_per_s")]
    if sweep:
        best = max(s["tokens_per_s"] for s in sweep)
        mine = next((s["tokens_per_s"] for s in sweep if s.get("is_plan")), None)
        out["sweep_measured"] = len(sweep)
        out["sweep_plan_over_best"] = mine / best if mine else None
        out["sweep_prediction_errors"] = [s["predicted_tokens_per_s"] / s["tokens_per_s"] - 1 for s in sweep]
    return out
