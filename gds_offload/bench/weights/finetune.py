"""``gds-offload bench-finetune``: LoRA fine-tuning steps with the weights resident, streamed from
the drive or host memory, and under Accelerate's disk offload, each mode in its own process
(:mod:`gds_offload.bench.weights.finetune_child` says what a child measures).

The parent prepares the same checkpoint and store as ``bench-weights``
(:func:`~gds_offload.bench.weights.bench.prepare`), drops their page cache before each child, runs
the modes in :data:`~gds_offload.bench.weights.bench.CAPPED` under the memory cap
(:func:`~gds_offload.bench.procs.run_child`), and compares every mode's losses and
trained adapters with the resident mode's, bit for bit. A streamed step reads every
streamed layer twice: once for the forward, once more for backward (the weights autograd
saved, :mod:`gds_offload.weights.streaming.backward`), so a larger batch hides the reads behind more compute.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gds_offload.bench.docs.stale import exercised_paths
from gds_offload.bench.machine import describe_machine
from gds_offload.bench.weights.bench import CAPPED, BenchModel, ChildResult, ChildSpec, child_rows, prepare, run_rounds, summarize, weight_files
from gds_offload.bench.weights.drive import evict
from gds_offload.units import format_bytes
from gds_offload.weights.store.manifest import read_manifest

__all__ = ["FinetuneSpec", "StepResult", "finetune_document", "run_finetune_bench", "finetune_table", "MODES"]

MODES = ("resident", "drive", "host", "accelerate-disk")
_LABELS = {"resident": "resident", "drive": "streamed-drive", "host": "streamed-host", "accelerate-disk": "accelerate-disk"}


@dataclass(frozen=True)
class FinetuneSpec(ChildSpec):
    """One child's work: ``mode``'s LoRA steps at each of ``batch_sizes`` (sequences of ``seq_len``)."""

    batch_sizes: tuple[int, ...] = (1, 4, 8)
    seq_len: int = 16
    #: Measured AdamW steps per batch size (after one not measured).
    steps: int = 2
    rank: int = 8
    slots: int = 2
    #: Hugging Face gradient checkpointing (non-reentrant) in every mode: each layer recomputed in backward.
    checkpointing: bool = False
    seed: int = 0


@dataclass
class StepResult(ChildResult):
    """LoRA steps of one mode at one batch size; ``stall_s`` is per step."""

    #: Median time of one step (forward, backward, optimizer), and the tokens it trained on per second.
    step_s: float | None = None
    tokens_per_s: float | None = None
    #: Bytes this process read from storage per step (``/proc/self/io``; page-cache hits excluded).
    read_bytes_per_step: int | None = None
    #: Streamed modes: store bytes filled into the ring per step, layers read again for backward per step.
    store_bytes_per_step: float | None = None
    backward_reads_per_step: float | None = None
    #: The measured steps' losses (``float.hex``) and an xxh3-64 of the adapters after them.
    losses: list[str] = field(default_factory=list)
    adapters_xxh3: str | None = None


def run_finetune_mode(spec: FinetuneSpec, *, memory_limit: int | None, timeout_s: float = 3600) -> list[StepResult]:
    """Run one mode in a child (under the cap if given) after dropping the weights' page cache."""

    evict(weight_files(Path(spec.checkpoint), Path(spec.store)))
    found, run = child_rows("gds_offload.bench.weights.finetune_child", spec, memory_limit=memory_limit, timeout_s=timeout_s)
    rows = [StepResult(**r) for r in found]
    done = {r.batch for r in rows}
    if run.returncode != 0 or any(r.status != "ok" for r in rows):
        why = rows[-1].error if rows and rows[-1].error else run.failure()
        rows += [StepResult(spec.mode, b, status="error", error=f"not run after batch {max(done)}: {why}" if done else why)
                 for b in spec.batch_sizes if b not in done]  # fmt: skip
    for r in rows:
        if run.cap is not None:
            r.cgroup_limit_bytes, r.cgroup_peak_bytes = run.cap.limit_bytes, run.cap.peak_bytes
    return rows


def run_finetune_bench(base: FinetuneSpec, modes: list[str], *, model: BenchModel, rounds: int = 1, memory_limit: int | None = None,
                       checkpoint: Path | None = None, progress: Any = None) -> dict[str, Any]:  # fmt: skip
    """Prepare, run every mode ``rounds`` times (interleaved, each round starting one mode later),
    compare with ``resident``. Returns a JSON-ready dict: ``model``, ``spec``, ``summary`` (per
    mode and batch: medians over rounds) and ``results`` (every row)."""
    say = progress or (lambda text: None)
    say("preparing the checkpoint and the store")
    ckpt, store = prepare(model, Path(base.workdir), checkpoint)
    rows = run_rounds(modes, rounds, memory_limit=memory_limit, workdir=Path(base.workdir), say=say,
                      run=lambda mode, limit: run_finetune_mode(replace(base, mode=mode, checkpoint=str(ckpt), store=str(store)), memory_limit=limit))  # fmt: skip
    ref = {(r.round, r.batch): r for r in rows if r.mode == "resident" and r.status == "ok"}
    for r in rows:
        want = ref.get((r.round, r.batch))
        if r.status == "ok" and want is not None:
            r.matches_resident = r.losses == want.losses and r.adapters_xxh3 == want.adapters_xxh3
    return {
        "model": asdict(model) | {"checkpoint": str(ckpt), "store": str(store), "weights_nbytes": read_manifest(store).total_nbytes()},
        "spec": {k: v for k, v in asdict(base).items() if k not in ("mode", "checkpoint", "store")}
        | {"memory_limit_bytes": memory_limit, "memory_limit_applies_to": [x for x in modes if x in CAPPED] if memory_limit else [], "rounds": rounds},
        "summary": {"finetune": _summarize(rows)},
        "results": [asdict(r) for r in rows],
    }


def _summarize(rows: list[StepResult]) -> list[dict[str, Any]]:
    out = summarize(rows, ("step_s", "tokens_per_s", "read_bytes_per_step", "store_bytes_per_step", "backward_reads_per_step", "stall_s",
                           "peak_rss_bytes", "cgroup_peak_bytes", "cgroup_limit_bytes"))  # fmt: skip
    for row in out:
        row["errors"] = sorted(set(row["errors"]))  # a peer fails the same way every round
    return out


def finetune_table(report: dict[str, Any]) -> dict[str, Any]:
    """The page's table: one row per mode and batch size."""

    rows = report["summary"]["finetune"]
    resident = {r["batch"]: r["tokens_per_s"] for r in rows if r["mode"] == "resident" and r["tokens_per_s"]}
    cols = ["mode", "batch", "train tok/s", "step", "x resident", "read / step", "layers re-read for backward / step",
            "peak memory / cap", "losses, adapters = resident"]  # fmt: skip
    out = []
    for r in rows:
        label = _LABELS.get(r["mode"], r["mode"])
        if not r["rounds_ok"]:
            out.append([label, str(r["batch"]), "failed", "-", "-", "-", "-", "-", "; ".join(r["errors"])[:160]])
            continue
        x = r["tokens_per_s"] / resident[r["batch"]] if resident.get(r["batch"]) else None
        peak = r["cgroup_peak_bytes"] or r["peak_rss_bytes"]
        cap = f" / {format_bytes(r['cgroup_limit_bytes'])}" if r["cgroup_limit_bytes"] else " (uncapped)"
        same = {True: "yes", False: "NO", None: "-"}[r["matches_resident"]]
        out.append([label, str(r["batch"]), f"{r['tokens_per_s']:.3g}", f"{r['step_s']:.2f} s", "-" if x is None else f"{x:.2f}",
                    format_bytes(r["read_bytes_per_step"] or 0), "-" if r["backward_reads_per_step"] is None else f"{r['backward_reads_per_step']:g}",
                    (format_bytes(peak) if peak else "-") + cap, same])  # fmt: skip
    return {"columns": cols, "rows": out}


def finetune_document(report: dict[str, Any], *, started: float, workdir: Path, commit: str | None, title: str | None,
                      command: str | None) -> dict[str, Any]:
    """``bench-finetune``'s result file from :func:`run_finetune_bench`'s report (``kind: "table"``)."""
    m, spec = report["model"], report["spec"]
    size = format_bytes(m["weights_nbytes"])
    cap = f"a {format_bytes(spec['memory_limit_bytes'])} memory cap (page cache included)" if spec["memory_limit_bytes"] else "no memory cap"
    about = (f"LoRA (rank {spec['rank']}, q/k/v/o projections, PEFT) on a {m['layers']}-layer Llama-shaped model ({size} of {m['dtype']} "
             f"weights, random, from a safetensors checkpoint), sequences of {spec['seq_len']} tokens, AdamW"
             f"{', Hugging Face gradient checkpointing (non-reentrant) in every mode' if spec.get('checkpointing') else ''}; per batch size one step not "
             f"measured, then the median of {spec['steps']}. streamed-drive and accelerate-disk under {cap}, resident and streamed-host "
             f"uncapped; every child with MALLOC_MMAP_THRESHOLD_=1048576; {spec['rounds']} round(s) interleaved, medians. Every mode starts "
             f"from the same adapters; its losses (exact) and trained adapters (xxh3) are compared with resident's.")  # fmt: skip
    return {
        "kind": "table",
        "title": title or f"LoRA fine-tuning with streamed weights{' and gradient checkpointing' if spec.get('checkpointing') else ''} (cpu)",
        "about": about,
        "command": command or "gds-offload bench-finetune",
        "commit": commit,
        "exercises": exercised_paths("bench-finetune"),
        "machine": describe_machine(workdir).as_dict(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": time.time() - started,
        "table": finetune_table(report),
        **report,
    }
