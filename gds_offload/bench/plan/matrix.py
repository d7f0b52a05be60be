"""``gds-offload bench-plan --matrix``: the planner on model shapes it was not tuned on, each at two
memory caps, as a user runs it.

Per shape (a transformers config, random weights, built here; nothing downloaded):

* ``resident`` (uncapped: the ceiling): probes at several batch sizes, then the workload at the best
  (:func:`gds_offload.bench.plan.bench.resident_best`);

and per cap (a fraction of the shape's weight bytes; cgroup v1, page cache included, the weights'
cache dropped before each child):

* ``naive``: ``load_streamed(slots=2)`` and ``generate`` in batches of 8, the first ``subset`` prompts;
* ``pretrained``: ``from_pretrained(memory=cap, workload=...)`` inside the capped process (it measures,
  plans and loads there), then ``generate_many`` over the whole workload; its prediction (tokens/s,
  peak) beside the measurement, and its first micro-batches checked token for token against the
  resident model on the same micro-batches.

Each cell is judged against the planner's targets (:data:`TARGETS`): never killed, a measured peak
under the cap and under the predicted peak x 1.05, predicted tokens/s within 20%, at least 0.7x
the resident model's best batch at the larger cap, at least 2x naive streaming, exact.
"""
from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gds_offload.bench.cgroup import check_limit, remove_stale_groups
from gds_offload.bench.docs.stale import exercised_paths
from gds_offload.bench.plan.bench import child_result, exact_tokens, resident_best
from gds_offload.bench.weights.bench import prepare
from gds_offload.units import format_bytes

__all__ = ["CAPS", "SHAPES", "TINY_SHAPES", "MatrixShape", "document", "cell_targets", "matrix_table", "plot_matrix", "run_matrix"]

MiB = 1 << 20


@dataclass(frozen=True)
class MatrixShape:
    """One model of the matrix: a transformers architecture (``<arch>Config``) and its arguments."""

    name: str
    what: str
    arch: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"

    def config(self) -> Any:
        import transformers

        return getattr(transformers, f"{self.arch}Config")(**self.kwargs, dtype=self.dtype)


#: Four shapes, none the planner's tests or the other benchmarks use: a Llama like the weights
#: benchmark's (scaled to a 2-core machine), Qwen2 with 4:1 grouped-query attention and q/k/v
#: biases, a wide and shallow Phi (parallel attention and MLP, biases, partial rotary), and a deep,
#: narrow Granite with a 100k vocabulary (tied, as small models with large vocabularies are).
SHAPES = (
    MatrixShape("llama", "Llama, 10 layers, hidden 1536, GQA 12:4, vocab 16000", "Llama",
                {"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 10, "num_attention_heads": 12, "num_key_value_heads": 4,
                 "vocab_size": 16000, "max_position_embeddings": 512, "tie_word_embeddings": False}),
    MatrixShape("qwen2-gqa", "Qwen2, 16 layers, hidden 1024, GQA 16:4 with q/k/v biases, vocab 32000", "Qwen2",
                {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
                 "vocab_size": 32000, "max_position_embeddings": 512, "tie_word_embeddings": False}),
    MatrixShape("phi-wide", "Phi, 5 layers, hidden 2048, MLP 8192, vocab 16000 (wide and shallow)", "Phi",
                {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 5, "num_attention_heads": 32, "vocab_size": 16000,
                 "max_position_embeddings": 512, "tie_word_embeddings": False}),
    MatrixShape("granite-deep", "Granite, 40 layers, hidden 640, GQA 10:2, vocab 100352 tied (deep and narrow)", "Granite",
                {"hidden_size": 640, "intermediate_size": 1728, "num_hidden_layers": 40, "num_attention_heads": 10, "num_key_value_heads": 2,
                 "vocab_size": 100352, "max_position_embeddings": 512, "tie_word_embeddings": True}),
)  # fmt: skip
#: The same architectures, tiny (the command's end-to-end check: ``--tiny``).
TINY_SHAPES = tuple(
    MatrixShape(s.name, f"{s.arch}, tiny", s.arch, s.kwargs | {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                                                                "vocab_size": 256} | ({"num_key_value_heads": 2} if "num_key_value_heads" in s.kwargs else {}))
    for s in SHAPES
)  # fmt: skip
#: The caps, as fractions of each shape's weight bytes.
CAPS = (0.6, 0.85)
#: ``(name, key of a cell, need)``; a cell's values are ratios where more is better.
TARGETS = (
    ("cap / measured peak (never killed)", "cap_over_peak", 1.0),
    ("predicted peak x 1.05 / measured peak", "predicted_peak_over_peak", 1.0 / 1.05),
    ("1 - |predicted / measured tok/s - 1|", "prediction_accuracy", 0.8),
    ("planned / naive", "planned_over_naive", 2.0),
    ("planned / resident (at 0.85x)", "planned_over_resident", 0.7),
)


def _prefixed(say: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    return lambda line: say(f"{prefix}: {line}")


def _weight_bytes(checkpoint: Path) -> int:
    return sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))


def run_matrix(
    *, workdir: Path, shapes: tuple[MatrixShape, ...], caps: tuple[float, ...], prompts: int, prompt_len: int, new_tokens: int, subset: int,
    say: Callable[[str], None], timeout_s: float = 3600, keep: bool = False, cap_base: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run every cell (see the module doc); the result document's measurements. Each shape's
    checkpoint and store are removed after its cells unless ``keep``. ``cap_base``: the caps are
    fractions of it instead of each shape's weight bytes (tiny shapes: their weights are far below
    what any process needs).

    Raises:
        ConfigError: this machine cannot apply a memory cap (before any child).
    """
    check_limit(1 << 30, name="--matrix")
    for line in remove_stale_groups():
        say(line)
    workload = {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens}
    cells: list[dict[str, Any]] = []
    residents: dict[str, dict[str, Any]] = {}
    for shape in shapes:
        where = workdir / shape.name
        say(f"{shape.name}: building the checkpoint and the store ({shape.what})")
        ckpt, store = prepare(shape, where)
        weights = _weight_bytes(ckpt)
        base = {"store": str(store), "checkpoint": str(ckpt), "workdir": str(where)} | workload
        resident, probes = resident_best(base, prompts, new_tokens, timeout_s=timeout_s, say=_prefixed(say, shape.name))
        residents[shape.name] = {"weight_bytes": weights, "result": resident, "probes": probes}
        for frac in caps:
            cap = int(frac * (cap_base or weights)) // MiB * MiB
            label = f"{shape.name} @ {frac:g}x ({format_bytes(cap)})"
            say(f"{label}: naive, batches of 8, the first {subset} prompts")
            naive = child_result(base | {"mode": "naive", "measure_prompts": subset, "batch": 8}, memory_limit=cap, timeout_s=timeout_s,
                                 say=_prefixed(say, label))  # fmt: skip
            say(f"{label}: from_pretrained under the cap, then the whole workload")
            planned = child_result(base | {"mode": "pretrained", "measure_prompts": prompts, "memory_limit": cap}, memory_limit=cap,
                                   timeout_s=timeout_s, say=_prefixed(say, label))  # fmt: skip
            planned["exact"] = exact_tokens(planned, base, timeout_s=timeout_s, say=_prefixed(say, label))
            cell = {"shape": shape.name, "fraction": frac, "cap": cap, "weight_bytes": weights, "naive": naive, "planned": planned}
            cell["values"] = cell_values(cell, resident)
            cells.append(cell)
            if planned.get("tokens_per_s"):
                say(f"{label}: {planned['tokens_per_s']:.1f} tok/s (predicted {(planned.get('predicted') or {}).get('tokens_per_s', 0):.1f}), "
                    f"peak {format_bytes(planned.get('cap_peak_bytes'))}; {planned['plan']['describe']}")  # fmt: skip
        if not keep:
            shutil.rmtree(where, ignore_errors=True)
    return {"workload": workload, "subset": subset, "caps": list(caps), "shapes": [{"name": s.name, "what": s.what, "arch": s.arch} for s in shapes],
            "resident": residents, "cells": cells}  # fmt: skip


def refused(planned: dict[str, Any]) -> int | None:
    """The least memory ``from_pretrained`` said to give, in bytes, where it refused the cap (exit
    code 1 with its ``ConfigError``), before loading anything; ``None`` where it did not refuse."""
    found = re.search(r"give at least (\d+) MiB", planned.get("error") or "")
    return int(found.group(1)) * MiB if found and planned.get("returncode") == 1 else None


def cell_values(cell: dict[str, Any], resident: dict[str, Any]) -> dict[str, float | None]:
    """The ratios :data:`TARGETS` judges, for one cell (``None`` where the run that gives it failed).
    The cap is judged on the memory group's peak (page cache included: what the kernel enforces),
    the predicted peak on the sampled anonymous peak (what the prediction counts,
    :class:`~gds_offload.bench.plan.child.AnonPeak`)."""
    p, naive = cell["planned"], cell["naive"]
    tps, peak, anon = p.get("tokens_per_s"), p.get("cap_peak_bytes"), p.get("peak_anon_bytes")
    pred = p.get("predicted") or {}
    out: dict[str, float | None] = {k: None for _, k, _ in TARGETS}
    if p.get("returncode") is not None and p["returncode"] < 0:
        out["cap_over_peak"] = 0.0  # killed: the target fails, whatever the peak was
    elif peak and tps:
        out["cap_over_peak"] = cell["cap"] / peak
    if anon and pred.get("peak_bytes"):
        out["predicted_peak_over_peak"] = pred["peak_bytes"] / anon
    if tps and pred.get("tokens_per_s"):
        out["prediction_accuracy"] = 1 - abs(pred["tokens_per_s"] / tps - 1)
    if tps and naive.get("tokens_per_s"):
        out["planned_over_naive"] = tps / naive["tokens_per_s"]
    if tps and resident.get("tokens_per_s") and cell["fraction"] >= 0.8:
        out["planned_over_resident"] = tps / resident["tokens_per_s"]
    return out


def cell_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One target row per cell and target (``met``: ``None`` where it does not apply or did not run;
    a planned run that failed fails every target that needs it)."""
    rows = []
    for cell in doc["cells"]:
        failed = not cell["planned"].get("tokens_per_s")
        least = refused(cell["planned"])
        for name, key, need in TARGETS:
            if key == "planned_over_resident" and cell["fraction"] < 0.8:
                continue
            value = cell["values"].get(key)
            met = None if value is None and not failed else (value is not None and value >= need)
            row = {"target": f"{cell['shape']} @ {cell['fraction']:g}x: {name}", "need": need, "value": value, "met": met}
            if least is not None:  # below any plan's floor: refused up front, which is not a kill; nothing else can run
                row |= {"met": key == "cap_over_peak", "refused": format_bytes(least)}
            rows.append(row)
    return rows


def _fmt(x: float | None, f: str = "{:.1f}") -> str:
    return "-" if x is None else f.format(x)


def matrix_table(doc: dict[str, Any]) -> dict[str, Any]:
    """One row per cell: the cap, resident's best, naive, the plan's choice, measured and predicted tokens/s and peaks, exactness."""
    cols = ["shape", "cap (x weights)", "resident best tok/s", "naive tok/s", "from_pretrained: plan", "tok/s", "predicted tok/s",
            "peak (cap group)", "anonymous peak (sampled)", "predicted peak", "planned / resident", "planned / naive", "exact"]  # fmt: skip
    rows = []
    for cell in doc["cells"]:
        res = doc["resident"][cell["shape"]]["result"]
        p, naive = cell["planned"], cell["naive"]
        pred = p.get("predicted") or {}
        least = refused(p)
        describe = (p.get("plan") or {}).get("describe") or (f"refused before loading: give at least {format_bytes(least)}" if least
                                                              else (p.get("error") or "-")[:90])  # fmt: skip
        rows.append([cell["shape"], f"{format_bytes(cell['cap'])} ({cell['fraction']:g}x)",
                     f"{_fmt(res.get('tokens_per_s'))} (batch {res.get('batch', '-')})", _fmt(naive.get("tokens_per_s")), describe,
                     _fmt(p.get("tokens_per_s")), _fmt(pred.get("tokens_per_s")), format_bytes(p.get("cap_peak_bytes")),
                     format_bytes(p.get("peak_anon_bytes")), format_bytes(pred.get("peak_bytes")),
                     _fmt(p["tokens_per_s"] / res["tokens_per_s"], "{:.2f}") if p.get("tokens_per_s") and res.get("tokens_per_s") else "-",
                     _fmt(cell["values"].get("planned_over_naive"), "{:.2f}"), {True: "yes", False: "NO", None: "-"}[p.get("exact")]])  # fmt: skip
    return {"columns": cols, "rows": rows}


def plot_matrix(doc: dict[str, Any], out: Path) -> Path:
    """Predicted against measured tokens/s, one mark per cell, the +-20% band shaded; and each
    cell's planned / resident and planned / naive ratios. Returns ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120)
    ran = [c for c in doc["cells"] if c["planned"].get("tokens_per_s") and (c["planned"].get("predicted") or {}).get("tokens_per_s")]
    top = max([c["planned"]["tokens_per_s"] for c in ran] + [c["planned"]["predicted"]["tokens_per_s"] for c in ran] + [1.0]) * 1.15
    a.fill_between([0, top], [0, 0.8 * top], [0, 1.2 * top], color="green", alpha=0.12, label="within 20%")
    a.plot([0, top], [0, top], "k:", linewidth=0.8)
    for c in ran:
        a.plot(c["planned"]["tokens_per_s"], c["planned"]["predicted"]["tokens_per_s"], "o" if c["fraction"] >= 0.8 else "s", markersize=6,
               label=f"{c['shape']} {c['fraction']:g}x")  # fmt: skip
    a.set_xlim(0, top), a.set_ylim(0, top)
    a.set_xlabel("measured tokens/s (from_pretrained's plan, under the cap)")
    a.set_ylabel("predicted tokens/s")
    a.legend(fontsize=7)
    a.grid(True, alpha=0.3)
    labels = [f"{c['shape']}\n{c['fraction']:g}x" for c in doc["cells"]]
    xs = range(len(labels))
    res = [c["values"].get("planned_over_resident") or 0 for c in doc["cells"]]
    nai = [c["values"].get("planned_over_naive") or 0 for c in doc["cells"]]
    b.bar([x - 0.2 for x in xs], res, width=0.4, label="planned / resident best")
    b.bar([x + 0.2 for x in xs], nai, width=0.4, label="planned / naive")
    b.axhline(0.7, color="C0", linestyle="--", linewidth=0.8)
    b.axhline(2.0, color="C1", linestyle="--", linewidth=0.8)
    b.set_xticks(list(xs), labels, fontsize=7)
    b.set_ylabel("ratio (dashed: the targets)")
    b.legend(fontsize=7)
    b.grid(True, axis="y", alpha=0.3)
    w = doc["workload"]
    fig.suptitle(f"The planner on four shapes at two caps: {w['prompts']} prompts x {w['prompt_len']} + {w['new_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def document(doc: dict[str, Any], *, command: str, commit: str | None, machine: dict[str, Any], started: float, title: str | None) -> dict[str, Any]:
    """The result file: the cells, a table, and a target row per cell."""
    w = doc["workload"]
    about = (f"The planner on {len(doc['shapes'])} model shapes (transformers configs, random fp32 weights: "
             f"{'; '.join(s['what'] for s in doc['shapes'])}) at {' and '.join(f'{c:g}x' for c in doc['caps'])} of each one's weight bytes. "
             f"{w['prompts']} prompts of {w['prompt_len']} tokens, {w['new_tokens']} new tokens each, greedy. Capped children in a cgroup v1 memory "
             f"group (page cache included, the weights' cache dropped first). from_pretrained measures, plans and loads inside the capped process; "
             f"naive is load_streamed(slots=2) in batches of 8 on the first {doc['subset']} prompts; resident is uncapped at the best batch probed.")  # fmt: skip
    return {"kind": "table", "title": title or "The planner on a matrix of models it was not tuned on (cpu)", "about": about, "command": command,
            "commit": commit, "exercises": exercised_paths("bench-plan"), "machine": machine,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)), "wall_s": time.time() - started,
            "table": matrix_table(doc), "targets": cell_targets(doc), **doc}  # fmt: skip
