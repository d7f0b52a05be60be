"""``gds-offload bench-plan --workload finetune``: the planner's LoRA fine-tuning against the
resident model and ordinary accumulation on the same streamed model, under a memory cap.

One run: the plan (:func:`gds_offload.weights.plan`, measured uncapped first, as ``gds-offload
plan`` is run before a job), then each mode in a child process of its own
(:mod:`gds_offload.bench.plan.finetune_child`), the streamed ones under the cap (cgroup v1,
page cache included, the weights' cache dropped first):

* ``planned``: the plan's micro-batch, ``per_load`` micro-batches per weight load, resident
  layers, slots and activation placement;
* ``naive``: the same micro-batches with ordinary accumulation (``slots=2``, no plan): every
  micro-batch reads every streamed layer in forward and in backward;
* ``resident`` (uncapped): the same micro-batches, ordinary accumulation: the ceiling and the
  reference the other modes' losses and adapters must equal bit for bit.

Each mode runs the first ``steps`` optimizer steps of the workload: every step has the same shape,
so its rate is the workload's (the result says how many ran).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gds_offload.bench import procs
from gds_offload.bench.cgroup import check_limit, remove_stale_groups
from gds_offload.bench.docs.stale import exercised_paths
from gds_offload.bench.weights.bench import DEFAULT_MODEL, TINY, BenchModel, child_env, prepare, weight_files
from gds_offload.bench.weights.drive import evict
from gds_offload.units import format_bytes
from gds_offload.weights.planning.planner import Finetune
from gds_offload.weights.run.plan import plan

__all__ = ["MODES", "finetune_document", "planner_targets", "run_bench_finetune"]

CHILD = "gds_offload.bench.plan.finetune_child"
MODES = ("planned", "naive", "resident")

#: The issue's targets: (name, summary key, need, the mode whose ceiling bounds it).
TARGETS = (
    ("planned / resident (same micro-batches)", "planned_over_resident", 0.8, None),
    ("planned / streamed-naive (ordinary accumulation)", "planned_over_naive", 2.0, "naive"),
)


def _child(spec: dict[str, Any], *, memory_limit: int | None, timeout_s: float, say: Callable[[str], None]) -> dict[str, Any]:
    evict(weight_files(Path(spec["checkpoint"]), Path(spec["store"])))
    run = procs.run_child(procs.child_command(CHILD, json.dumps(spec)), env=child_env(), memory_limit=memory_limit, timeout_s=timeout_s)
    ev = run.last("result")
    if ev is None:
        say(f"{spec['mode']}: {run.failure()}")
        out: dict[str, Any] = {"mode": spec["mode"], "error": run.failure()}
    else:
        out = dict(ev["result"])
    if run.cap is not None:
        out["cap_peak_bytes"] = run.cap.peak_bytes
        out["cap_failcnt"] = run.cap.failcnt
    out["wall_s"] = run.wall_s
    return out


def run_bench_finetune(
    *, workdir: Path, memory_limit: int, workload: Finetune, steps: int, modes: tuple[str, ...], tiny: bool, checkpoint: Path | None,
    say: Callable[[str], None], timeout_s: float = 7200,
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
    doc: dict[str, Any] = {"workload": asdict(workload), "memory_limit": memory_limit, "model": asdict(model), "steps_measured": steps, "results": {}}
    say("planning: measuring the model on this machine (uncapped), then choosing")
    t0 = time.perf_counter()
    chosen = plan(store, workload, memory=memory_limit, progress=lambda w: say(f"  plan: {w}"))
    doc["plan_s"] = time.perf_counter() - t0
    doc["plan"] = chosen.as_dict() | {"describe": chosen.describe()}
    say(f"plan ({doc['plan_s']:.0f} s): {chosen.describe()}")
    c = chosen.choice
    base = {"store": str(store), "checkpoint": str(ckpt), "workdir": str(workdir), "seq": workload.seq, "global_batch": workload.global_batch,
            "micro_batch": c.micro_batch, "steps": steps, "lora_r": workload.lora_r}  # fmt: skip
    results = doc["results"]
    for mode in (m for m in MODES if m in modes):
        capped = mode != "resident"
        say(f"{mode}: {steps} optimizer step(s) of {workload.global_batch} x {workload.seq} tokens in micro-batches of {c.micro_batch}"
            f"{', capped' if capped else ' (uncapped)'}")  # fmt: skip
        spec = base | {"mode": mode}
        if mode == "planned":
            spec |= {"plan": chosen.as_dict(), "per_load": c.per_load, "slots": c.slots, "offload_activations": c.offload_activations}
        elif mode == "naive":
            spec |= {"offload_activations": c.offload_activations}
        results[mode] = _child(spec, memory_limit=memory_limit if capped else None, timeout_s=timeout_s, say=say)
    ref = results.get("resident", {})
    for mode in ("planned", "naive"):
        r = results.get(mode)
        if r and r.get("losses") and ref.get("losses"):
            r["exact"] = r["losses"] == ref["losses"] and r["adapters_xxh3"] == ref["adapters_xxh3"]
    doc["summary"] = summarize(doc)
    return doc


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Ratios of the planned mode to the others, and the planner's accuracy."""
    r = doc["results"]
    planned = r.get("planned", {})
    out: dict[str, Any] = {"plan_s": doc.get("plan_s")}
    tps = planned.get("tokens_per_s")
    if not tps:
        return out
    for mode, res in r.items():
        if mode != "planned" and res.get("tokens_per_s"):
            out[f"planned_over_{mode}"] = tps / res["tokens_per_s"]
    pred = planned.get("predicted") or {}
    if pred.get("tokens_per_s"):
        out["predicted_over_measured_tokens_per_s"] = pred["tokens_per_s"] / tps
    if pred.get("peak_bytes") and planned.get("cap_peak_bytes"):
        out["predicted_over_measured_peak"] = pred["peak_bytes"] / planned["cap_peak_bytes"]
    return out


def finetune_document(doc: dict[str, Any], *, title: str | None, command: str, commit: str | None, machine: dict[str, Any],
                      started: float) -> dict[str, Any]:  # fmt: skip
    """The result file: what ran, a table of the modes, and the targets with their bounds."""
    r, s, w, m = doc["results"], doc["summary"], doc["workload"], doc["model"]
    resident = (r.get("resident") or {}).get("tokens_per_s")
    targets = []
    for name, key, need, other in TARGETS:
        value = s.get(key)
        t: dict[str, Any] = {"target": name, "need": need, "value": value, "met": None if value is None else value >= need}
        base = (r.get(other) or {}).get("tokens_per_s") if other else None
        if resident and base:
            t["ceiling"] = resident / base  # a streamer that cost nothing runs at the resident model's rate
        targets.append(t)
    targets.extend(planner_targets(s, doc.get("plan_s")))
    about = (f"LoRA (rank {w['lora_r']}, every linear layer, PEFT) on a {m['layers']}-layer Llama-shaped model (hidden {m['hidden']}, "
             f"{m['dtype']}, random weights): {w['sequences']} sequences of {w['seq']} tokens, {w['global_batch']} per AdamW step; each mode ran "
             f"the first {doc['steps_measured']} step(s) (every step has the same shape). Streamed modes under a {format_bytes(doc['memory_limit'])} "
             f"memory cap (cgroup v1, page cache included, the weights' cache dropped before each child); resident uncapped, on the same "
             f"micro-batches. The plan: {doc['plan']['describe']}.")  # fmt: skip
    return {"kind": "table", "title": title or "Balance Beam's planner: layer-major LoRA fine-tuning under a memory cap (cpu)", "about": about,
            "command": command, "commit": commit, "exercises": exercised_paths("bench-plan"), "machine": machine, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "wall_s": time.time() - started, "table": _table(doc), "targets": targets, **doc}  # fmt: skip


def planner_targets(summary: dict[str, Any], plan_s: float | None) -> list[dict[str, Any]]:
    """The issue's targets on the planner itself: its predictions against the planned mode's
    measurements (each shown as ``1 - |p/m - 1|``, so the need reads as the tolerance), and its time."""
    targets = []
    for key, what, within in (("predicted_over_measured_tokens_per_s", "tok/s", 0.2), ("predicted_over_measured_peak", "peak", 0.15)):
        ratio = summary.get(key)
        if ratio:
            targets.append({"target": f"predicted {what} within {within:.0%} of measured (1 - |p/m - 1|)", "need": 1 - within,
                            "value": 1 - abs(ratio - 1), "met": abs(ratio - 1) <= within})  # fmt: skip
    if plan_s:
        targets.append({"target": "gds-offload plan answers in under 60 s (60 s / its time)", "need": 1.0, "value": 60 / plan_s, "met": plan_s < 60})
    return targets


def _cell(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table(doc: dict[str, Any]) -> dict[str, Any]:
    cols = ["mode", "shape", "tok/s", "s/step", "peak (cap group)", "predicted tok/s", "predicted peak", "store read/step",
            "activations written/step", "exact", "planned x"]  # fmt: skip
    planned = (doc["results"].get("planned") or {}).get("tokens_per_s")
    rows = []
    for mode, res in doc["results"].items():
        if not res.get("tokens_per_s"):
            rows.append([mode, "-", (res.get("error") or "-")[:60], *["-"] * (len(cols) - 3)])
            continue
        shape = f"{res['per_load']} x {res['micro_batch']} per load" if mode == "planned" else f"1 x {res['micro_batch']} per load"
        if res.get("resident_layers") is not None:
            shape += f", {res['resident_layers']} res, {res.get('slots')} slots"
        if res.get("offload_activations"):
            shape += ", activations offloaded"
        pr = res.get("predicted") or {}
        rows.append([mode, shape, _cell(res["tokens_per_s"]), _cell(res["total_s"] / res["steps"], "{:.1f}"),
                     format_bytes(res.get("cap_peak_bytes") or res.get("peak_rss_bytes")), _cell(pr.get("tokens_per_s")),
                     format_bytes(pr.get("peak_bytes")), format_bytes(res.get("bytes_read_per_step")),
                     format_bytes(res.get("activation_bytes_written_per_step")), {True: "yes", False: "NO", None: "-"}[res.get("exact")],
                     _cell(planned / res["tokens_per_s"]) if planned else "-"])  # fmt: skip
    return {"columns": cols, "rows": rows}
