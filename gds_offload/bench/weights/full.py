"""``gds-offload bench-finetune --full``: full fine-tuning (every weight, AdamW) resident, streamed
from the drive by :class:`~gds_offload.weights.train.trainer.StreamedTrainer`, and under DeepSpeed's
ZeRO-Infinity, each mode in its own process (:mod:`gds_offload.bench.weights.full_child` says
what a child measures).

The parent prepares the same checkpoint and store as ``bench-weights``
(:func:`~gds_offload.bench.weights.bench.prepare`), drops their page cache before each child,
runs ``drive`` and ``deepspeed-infinity`` under the memory cap, ``resident`` uncapped (the
reference and the ceiling), and compares every mode's losses and final weights with resident's,
bit for bit. DeepSpeed's async_io and cpu_adam ops are loaded once outside the cap first, so
that no compiler runs under it.

Bytes moved per step are set against a minimum: the streamed layers' weights read twice
(forward, backward), and their weights and AdamW state (two tensors per weight) read and
written once: ``5 W`` read and ``3 W`` written for ``W`` bytes of streamed layers.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gds_offload.bench.docs.stale import exercised_paths
from gds_offload.bench.machine import describe_machine
from gds_offload.bench.weights.bench import BenchModel, ChildResult, ChildSpec, child_rows, prepare, run_rounds, summarize, weight_files
from gds_offload.bench.weights.drive import evict
from gds_offload.bench.weights.peer_loaders import build_deepspeed_ops
from gds_offload.units import format_bytes
from gds_offload.weights.store.manifest import read_manifest

__all__ = ["FULL_MODES", "FULL_CAPPED", "FullSpec", "FullResult", "full_document", "full_table", "full_targets", "run_full_bench"]

FULL_MODES = ("resident", "drive", "deepspeed-infinity")
#: The modes run under the memory cap.
FULL_CAPPED = ("drive", "deepspeed-infinity")
_LABELS = {"resident": "resident", "drive": "streamed-drive (StreamedTrainer)", "deepspeed-infinity": "DeepSpeed ZeRO-Infinity"}


@dataclass(frozen=True)
class FullSpec(ChildSpec):
    """One child's work: ``mode``'s optimizer steps at each micro-batch size in ``batch_sizes``."""

    batch_sizes: tuple[int, ...] = (1,)
    seq_len: int = 256
    #: Micro-batches per optimizer step (gradient accumulation), and per weight load (``drive``).
    micro_batches: int = 2
    per_load: int = 2
    #: Measured steps, after one not measured.
    steps: int = 2
    slots: int = 2
    lr: float = 1e-5
    weight_decay: float = 0.01
    seed: int = 0


@dataclass
class FullResult(ChildResult):
    """Steps of one mode at one micro-batch size (medians over the measured steps)."""

    micro_batches: int = 0
    step_s: float | None = None
    tokens_per_s: float | None = None
    read_bytes_per_step: int | None = None
    written_bytes_per_step: int | None = None
    #: Every step's losses, warm-up included (``float.hex``), and an xxh3 of every weight after them.
    losses: list[str] = field(default_factory=list)
    weights_xxh3: str | None = None
    #: The largest |loss - resident's loss| over the steps (parent).
    max_loss_diff: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)


def run_full_mode(spec: FullSpec, *, memory_limit: int | None, timeout_s: float = 7200) -> list[FullResult]:
    """Run one mode in a child (under the cap if given) after dropping the weights' page cache."""
    if spec.mode == "deepspeed-infinity":
        built, why = build_deepspeed_ops(("AsyncIOBuilder", "CPUAdamBuilder"))
        if not built:
            return [FullResult(spec.mode, b, status="error", error=why, micro_batches=spec.micro_batches) for b in spec.batch_sizes]
    evict(weight_files(Path(spec.checkpoint), Path(spec.store)))
    found, run = child_rows("gds_offload.bench.weights.full_child", spec, memory_limit=memory_limit, timeout_s=timeout_s)
    rows = [FullResult(**r) for r in found]
    done = {r.batch for r in rows}
    if run.returncode != 0:
        why = run.failure()
        if run.returncode == -9 and run.cap is not None and not run.timed_out:
            why = f"out of memory under a {format_bytes(run.cap.limit_bytes)} cap ({why})"
        rows += [FullResult(spec.mode, b, status="error", error=why, micro_batches=spec.micro_batches) for b in spec.batch_sizes if b not in done]
    for r in rows:
        if run.cap is not None:
            r.cgroup_limit_bytes, r.cgroup_peak_bytes = run.cap.limit_bytes, run.cap.peak_bytes
    return rows


def run_full_bench(base: FullSpec, modes: list[str], *, model: BenchModel, rounds: int = 1, memory_limit: int | None = None,
                   progress: Any = None, timeout_s: float = 7200) -> dict[str, Any]:  # fmt: skip
    """Prepare, run every mode ``rounds`` times (interleaved), compare with ``resident``. Returns a
    JSON-ready dict: ``model``, ``spec``, ``summary`` (per mode and micro-batch size: medians over
    rounds) and ``results`` (every row); a child still running after ``timeout_s`` is killed (its row an error)."""
    say = progress or (lambda text: None)
    say("preparing the checkpoint and the store")
    ckpt, store = prepare(model, Path(base.workdir))
    rows = run_rounds(modes, rounds, memory_limit=memory_limit, workdir=Path(base.workdir), say=say, capped=FULL_CAPPED,
                      run=lambda mode, limit: run_full_mode(replace(base, mode=mode, checkpoint=str(ckpt), store=str(store)), memory_limit=limit,
                                                            timeout_s=timeout_s))  # fmt: skip
    ref = {(r.round, r.batch): r for r in rows if r.mode == "resident" and r.status == "ok"}
    for r in rows:
        want = ref.get((r.round, r.batch))
        if r.status == "ok" and want is not None and r.mode != "resident":
            mine = [float.fromhex(x) for x in r.losses]
            theirs = [float.fromhex(x) for x in want.losses]
            r.max_loss_diff = max((abs(a - b) for a, b in zip(mine, theirs)), default=None)
            r.matches_resident = r.losses == want.losses and r.weights_xxh3 is not None and r.weights_xxh3 == want.weights_xxh3
    m = read_manifest(store)
    streamed = sum(g.nbytes for g in m.layers)
    return {
        "model": asdict(model) | {"checkpoint": str(ckpt), "store": str(store), "weights_nbytes": m.total_nbytes(), "layers_nbytes": streamed},
        "spec": {k: v for k, v in asdict(base).items() if k not in ("mode", "checkpoint", "store")}
        | {"memory_limit_bytes": memory_limit, "memory_limit_applies_to": [x for x in modes if x in FULL_CAPPED] if memory_limit else [],
           "rounds": rounds, "minimum_read_bytes_per_step": 5 * streamed, "minimum_written_bytes_per_step": 3 * streamed},  # fmt: skip
        "summary": {"full": _summarize(rows)},
        "results": [asdict(r) for r in rows],
    }


def _summarize(rows: list[FullResult]) -> list[dict[str, Any]]:
    out = summarize(rows, ("step_s", "tokens_per_s", "read_bytes_per_step", "written_bytes_per_step", "max_loss_diff", "peak_rss_bytes",
                           "cgroup_peak_bytes", "cgroup_limit_bytes"))  # fmt: skip
    for row in out:
        row["errors"] = sorted(set(row["errors"]))
    return out


def full_table(report: dict[str, Any]) -> dict[str, Any]:
    """The page's table: one row per mode and micro-batch size."""
    rows, spec = report["summary"]["full"], report["spec"]
    resident = {r["batch"]: r["tokens_per_s"] for r in rows if r["mode"] == "resident" and r["tokens_per_s"]}
    minimum = spec["minimum_read_bytes_per_step"] + spec["minimum_written_bytes_per_step"]
    cols = ["mode", "micro-batch", "train tok/s", "step", "x resident", "read / step", "written / step", "moved / minimum",
            "peak memory / cap", "losses, weights = resident"]  # fmt: skip
    out = []
    for r in rows:
        label = _LABELS.get(r["mode"], r["mode"])
        if not r["rounds_ok"]:
            # The first clause of each error (the child's last lines of output stay in the result file).
            out.append([label, str(r["batch"]), "failed", "-", "-", "-", "-", "-", "-", "; ".join(e.split(" (")[0] for e in r["errors"])[:200]])
            continue
        x = r["tokens_per_s"] / resident[r["batch"]] if resident.get(r["batch"]) else None
        peak = r["cgroup_peak_bytes"] or r["peak_rss_bytes"]
        cap = f" / {format_bytes(r['cgroup_limit_bytes'])}" if r["cgroup_limit_bytes"] else " (uncapped)"
        moved = (r["read_bytes_per_step"] or 0) + (r["written_bytes_per_step"] or 0)
        if r["mode"] == "resident":
            same = "(reference)"
        elif r["matches_resident"]:
            same = "yes (bit for bit)"
        else:
            same = "no" + (f": losses differ by up to {r['max_loss_diff']:.3g}" if r["max_loss_diff"] is not None else "")
        out.append([label, str(r["batch"]), f"{r['tokens_per_s']:.3g}", f"{r['step_s']:.1f} s", "-" if x is None else f"{x:.2f}",
                    format_bytes(r["read_bytes_per_step"] or 0), format_bytes(r["written_bytes_per_step"] or 0),
                    "-" if r["mode"] == "resident" else f"{moved / minimum:.2f}", (format_bytes(peak) if peak else "-") + cap, same])  # fmt: skip
    return {"columns": cols, "rows": out}


def full_document(report: dict[str, Any], *, started: float, workdir: Path, commit: str | None, title: str | None,
                  command: str | None) -> dict[str, Any]:  # fmt: skip
    """``bench-finetune --full``'s result file (``kind: "table"``)."""
    m, spec = report["model"], report["spec"]
    cap = f"a {format_bytes(spec['memory_limit_bytes'])} memory cap (page cache included)" if spec["memory_limit_bytes"] else "no memory cap"
    about = (f"Full fine-tuning (every weight) of a {m['layers']}-layer Llama-shaped model ({format_bytes(m['weights_nbytes'])} of {m['dtype']} "
             f"weights, random, from a safetensors checkpoint; about 4x that with gradients and AdamW state), AdamW (lr {spec['lr']:g}, weight "
             f"decay {spec['weight_decay']:g}; torch's fused kernel, DeepSpeed's DeepSpeedCPUAdam), {spec['micro_batches']} micro-batches of sequences of {spec['seq_len']} tokens per optimizer "
             f"step ({spec['per_load']} per weight load when streamed); one step not measured, then the median of {spec['steps']}. "
             f"streamed-drive and DeepSpeed under {cap}, resident uncapped; {spec['rounds']} round(s). Bytes are this process's storage reads "
             f"and writes (/proc/self/io); the minimum is the streamed layers' weights read twice and their weights and AdamW state read "
             f"and written once ({format_bytes(spec['minimum_read_bytes_per_step'])} read, {format_bytes(spec['minimum_written_bytes_per_step'])} "
             f"written). Losses (exact) and every final weight (xxh3) are compared with resident's.")  # fmt: skip
    return {
        "kind": "table",
        "title": title or "Full fine-tuning with streamed weights and optimizer state (cpu)",
        "about": about,
        "command": command or "gds-offload bench-finetune --full",
        "commit": commit,
        "exercises": exercised_paths("bench-finetune"),
        "machine": describe_machine(workdir).as_dict(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": time.time() - started,
        "table": full_table(report),
        "targets": full_targets(report),
        **report,
    }


def full_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 31's targets at the largest micro-batch streamed-drive ran, from the rows of ``report``
    (``met: None``, "not run", where a mode they compare with did not finish)."""
    rows = {(r["mode"], r["batch"]): r for r in report["summary"]["full"]}
    ok = [b for (mode, b), r in rows.items() if mode == "drive" and r["rounds_ok"]]
    if not ok:
        return []
    b = max(ok)
    drive, spec = rows[("drive", b)], report["spec"]

    def ratio(mode: str) -> float | None:
        other = rows.get((mode, b))
        return drive["tokens_per_s"] / other["tokens_per_s"] if other and other["rounds_ok"] and other["tokens_per_s"] else None

    moved = (drive["read_bytes_per_step"] or 0) + (drive["written_bytes_per_step"] or 0)
    minimum = spec["minimum_read_bytes_per_step"] + spec["minimum_written_bytes_per_step"]
    ds = rows.get(("deepspeed-infinity", b))
    ended = f"; DeepSpeed: {ds['errors'][0].split(' (')[0]}" if ds and not ds["rounds_ok"] and ds["errors"] else ""
    values = (
        (f"streamed / DeepSpeed ZeRO-Infinity train tok/s (same micro-batches and cap{ended})", 1.5, ratio("deepspeed-infinity")),
        ("streamed / resident train tok/s (same micro-batches)", 0.5, ratio("resident")),
        ("bytes moved per step within 1.2x the minimum (1.2 x minimum / moved)", 1.0, 1.2 * minimum / moved if moved else None),
        ("losses and final weights equal resident's (1: bit for bit)", 1.0, None if drive["matches_resident"] is None else float(drive["matches_resident"])),
    )  # fmt: skip
    return [{"target": name, "need": need, "value": v, "met": None if v is None else v >= need} for name, need, v in values]
