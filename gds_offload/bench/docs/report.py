"""``docs/performance.md`` from the JSON result files under ``docs/results/``.

Each result file is what one benchmark command wrote with ``--out``: the command line,
the commit it ran at, the machine (:mod:`gds_offload.bench.machine`) and the figures.
This module only renders: every number on the page is read from a file, and every
section names the command, commit and machine that produced it. Regenerate with
``gds-offload report`` after adding or replacing a result file.
"""
from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gds_offload.bench.docs.summary import render_summary
from gds_offload.bench.machine import CPU_SOURCE, CUDA_SOURCE
from gds_offload.units import format_bytes

__all__ = ["Section", "load_sections", "render_page", "current_commit"]

METHOD = """\
## Method

* **One run, several modes.** Each figure compares modes measured in the same run of one
  command, on one machine: a ratio across runs or machines would carry their noise.
* **Own processes, interleaved rounds.** Every mode of `gds-offload bench` runs in its own
  child process; with `--rounds N` the modes run N times, each round starting one mode
  later, the ratio to `keep` is taken within a round and the median over rounds is shown.
* **Paired steps.** With `--paired`, each offload process alternates offloaded steps with
  steps under `off.paused()` (ABBA order) and reports the median of the pair ratios: the
  cost of offloading with the machine's slow spells cancelled out.
* **Ranks.** `gds-offload bench --nproc N` runs every mode on one process and on N DDP
  ranks (torchrun) in the same rounds, each process with the same torch thread count and
  the same per-rank batch; ratios to `keep` are taken within a setting, and every rank's
  losses are compared with `keep`'s on that rank.
* **Memory.** Peak activation memory is the child's peak RSS (GPU: peak allocated bytes)
  over the whole run, first step included, above its level before the first step with the
  model and optimizer (AdamW state included) built and nothing of the mode set up; it
  includes gradients, backward temporaries and the first step's one-time allocations, which
  every mode has, and everything a mode allocates. Results measured otherwise say so in
  their `memory` line. The offloader's own peaks (kept, held by writes in flight, read
  ahead) come from `Offloader.stats()`, over the same steps.
* **Exactness.** Every mode's losses and final weights are compared bit for bit with
  `keep`'s; a mode that differs across processes is re-checked in one process.
* **Load.** Each run records the machine's load average at its start and end. On a
  machine shared with other work, step-time ratios move with that load; memory ratios and
  exactness do not.
"""


@dataclass(frozen=True)
class Section:
    """One result file, ready to render."""

    path: Path
    doc: dict[str, Any]

    @property
    def title(self) -> str:
        return str(self.doc.get("title") or self.path.stem)


def current_commit(cwd: Path | None = None) -> str | None:
    """``git rev-parse --short HEAD`` (with ``+dirty`` for uncommitted changes to anything but
    result files: a run that rewrites ``docs/results/`` has not changed the code that measures),
    or None outside a checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/", ":(exclude,top)docs/results"],
                               cwd=cwd, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


#: The suffix of times in result files written before every time was named ``*_s``.
OLD_SECONDS_SUFFIX = "_seconds"


def current_keys(value: Any) -> Any:
    """``value`` (a result file's JSON) with every key of an older file renamed as it is named
    now: ``*_seconds`` keys (``step_seconds``, ``io_wait_seconds``...) become ``*_s``. Keys of the
    current format, and every value, are left as they are."""
    if isinstance(value, dict):
        return {(k[: -len(OLD_SECONDS_SUFFIX)] + "_s" if isinstance(k, str) and k.endswith(OLD_SECONDS_SUFFIX) else k): current_keys(v)
                for k, v in value.items()}  # fmt: skip
    if isinstance(value, list):
        return [current_keys(v) for v in value]
    return value


def load_sections(results_dir: Path) -> list[Section]:
    """Every ``*.json`` under ``results_dir``, in name order, read in the current key names
    (:func:`current_keys`: files written by older versions render as new ones do).

    Raises:
        ValueError: a file is not a JSON object with a ``command``; names the file.
    """
    sections = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc}); rerun the command that wrote it") from exc
        if not isinstance(doc, dict) or "command" not in doc:
            raise ValueError(f"{path}: a result file must be a JSON object with a 'command' (written by a --out option)")
        sections.append(Section(path, current_keys(doc)))
    return sections


def _machine_line(m: dict[str, Any] | None) -> str:
    if not m:
        return "machine not recorded"
    parts = [
        f"{m.get('cpu_usable') or m.get('cpu_cores')} CPUs ({m.get('cpu_model') or 'unknown CPU'})",
        f"{format_bytes(m['ram_bytes'])} RAM" if m.get("ram_bytes") else None,
        ", ".join(m["gpus"]) if m.get("gpus") else "no GPU",
        f"spill drive {m.get('drive') or m.get('mount_source') or '?'} ({m.get('filesystem') or '?'}"
        + (", O_DIRECT" if m.get("o_direct") else "")
        + ")",
        f"torch {m.get('torch')}",
        f"KvikIO {m['kvikio']}" if m.get("kvikio") else None,
        m.get("os"),
    ]
    return "; ".join(p for p in parts if p)


def _load_line(load: Any) -> str:
    """The 1-minute load average at the start and end of the run: other work on the machine
    moves step times (not memory, not exactness)."""
    if not load:
        return ""
    if isinstance(load, dict):
        first = [v[0] if isinstance(v, (list, tuple)) else v for v in (load.get("start"), load.get("end"))]
        return f"; load average {first[0]:.1f} at the start, {first[1]:.1f} at the end"
    if isinstance(load, (list, tuple)):
        load = load[0]
    return f"; load average {float(load):.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"



def _pooled(runs: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(median step time, median peak activation memory) of one mode's runs, rounds pooled."""
    steps = sorted(x for run in runs for x in run["step_s"])
    peaks = sorted(run["peak_activation_bytes"] for run in runs if run.get("peak_activation_bytes") is not None)
    return (steps[len(steps) // 2] if steps else None), (peaks[len(peaks) // 2] if peaks else None)


def _verdict(row: dict[str, Any]) -> str:
    """A summary row's ``losses = keep`` cell."""
    agree = row.get("losses_agree")
    return "-" if agree is None else "yes" if agree else ("yes, in one process" if row.get("exact_in_process") is True else "NO")


def _bench_table(doc: dict[str, Any]) -> list[str]:
    """The table of a ``gds-offload bench`` result: one row per mode (rounds pooled)."""
    summary = doc["summary"]["modes"]
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in doc["results"]:
        rows.setdefault(r["mode"], []).append(r)
    paired = any("paired_ratio" in s for s in summary.values())
    head = ["mode", "step (median)", "x keep", *(["x keep, paired"] if paired else []), "peak activation memory", "x keep",
            "written / step", "deduplicated / step", "offloader peak: kept / writing / read ahead", "I/O wait / step", "losses = keep"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for mode, runs in rows.items():
        s, r = summary[mode], runs[0]
        if r["status"] != "ok":
            out.append(f"| {mode} | {r['status']}: {r['error'][:80]} |" + " - |" * (len(head) - 2))
            continue
        median, peak = _pooled(runs)
        off = r.get("offload") or {}
        n = max(1, off.get("steps") or len(r["step_s"]))
        parts = "-" if not off else " / ".join(format_bytes(off.get(k)) for k in ("peak_kept_bytes", "peak_writing_bytes", "peak_loaded_bytes"))
        out.append("| " + " | ".join([
            mode,
            f"{median:.3f} s" if median else "-",
            _ratio(s.get("step_ratio")),
            *([_ratio(s.get("paired_ratio"))] if paired else []),
            format_bytes(peak),
            _ratio(s.get("memory_ratio")),
            format_bytes(off["bytes_offloaded"] / n) if off else "-",
            format_bytes(off["bytes_deduplicated"] / n) if off else "-",
            parts,
            f"{off['io_wait_s'] / n:.3f} s" if off else "-",
            _verdict(s),
        ]) + " |")
    return out


def ranks_table(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a ``gds-offload bench --nproc N`` result: per mode, its row on one
    process and on N ranks (rounds pooled), each ``x keep`` against ``keep`` in the same
    setting, and on the N-rank row that ratio over the one-process ratio."""
    n = doc["nproc"]
    settings, scaling = doc["summary"]["settings"], doc["summary"]["scaling"]
    paired = any("paired_ratio" in row for s in settings.values() for row in s["modes"].values())
    head = ["mode", "processes", "step (median)", "x keep", f"x keep, {n} ranks / 1 process",
            *(["x keep, paired", f"paired, {n} ranks / 1 process"] if paired else []),
            "peak activation memory (largest rank)", "written / step (per rank)", "I/O wait / step (per rank)", "losses = keep"]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in doc["results"]:
        runs.setdefault((r["mode"], r["nproc"]), []).append(r)
    rows = []
    for mode in doc["modes"]:
        for nproc in (1, n):
            group = runs.get((mode, nproc), [])
            bad = next((r for r in group if r["status"] != "ok"), None)
            if not group or bad is not None:
                why = f"{bad['status']}: {bad['error'][:120]}".replace("|", "/") if bad else "not run"
                rows.append([mode, str(nproc), why, *["-"] * (len(head) - 3)])
                continue
            s = settings[str(nproc)]["modes"][mode]
            median, peak = _pooled(group)
            off = group[0].get("offload") or {}
            steps = max(1, off.get("steps") or len(group[0]["step_s"]))
            rows.append([
                mode,
                str(nproc),
                f"{median:.3f} s" if median else "-",
                _ratio(s.get("step_ratio")),
                _ratio(scaling.get(mode, {}).get("n_over_1")) if nproc == n else "",
                *([_ratio(s.get("paired_ratio")), _ratio(scaling.get(mode, {}).get("paired_n_over_1")) if nproc == n else ""]
                  if paired else []),
                format_bytes(peak),
                format_bytes(off["bytes_offloaded"] / steps) if off else "-",
                f"{off['io_wait_s'] / steps:.3f} s" if off else "-",
                _verdict(s),
            ])
    return head, rows


def ranks_spread(doc: dict[str, Any]) -> list[str]:
    """One line per mode with its ``x keep`` in every round of both settings: the noise the
    medians in :func:`ranks_table` carry."""
    n, settings = doc["nproc"], doc["summary"]["settings"]
    out = []
    for mode in doc["modes"]:
        rows = [settings[str(k)]["modes"].get(mode, {}) for k in (1, n)]
        per = [row.get("step_ratios") or [] for row in rows]
        if mode != "keep" and any(per):
            one, many = (", ".join(f"{x:.2f}" for x in ratios) or "-" for ratios in per)
            line = f"{mode}: x keep per round, 1 process: {one}; {n} ranks: {many}"
            pairs = [sorted(row.get("paired_ratios") or []) for row in rows]
            if all(pairs):
                one, many = (f"{p[0]:.2f} to {p[-1]:.2f}" for p in pairs)
                line += f"; paired, each pair: {one} on 1 process, {many} on {n} ranks"
            out.append(line)
    return out


def _ranks_markdown(doc: dict[str, Any]) -> list[str]:
    head, rows = ranks_table(doc)
    table = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]
    spread = ranks_spread(doc)
    return table + (["", *(f"* {line}" for line in spread)] if spread else [])


def _generic(doc: dict[str, Any]) -> list[str]:
    table = doc.get("table")
    if not isinstance(table, dict) or "columns" not in table:
        return ["(no table in this result file; see the JSON)"]
    cols = table["columns"]
    out = ["| " + " | ".join(_md(c) for c in cols) + " |", "|" + " --- |" * len(cols)]
    out += ["| " + " | ".join(_md(v) for v in row) + " |" for row in table["rows"]]
    return out


def _targets(doc: dict[str, Any]) -> list[str]:
    """The targets a result file checked (``{"target", "need", "value", "met"}``, optionally the
    bounds in :data:`CEILINGS`, measured in the same run: ``ceiling``, the same work with no data
    to move; ``drive_ceiling``, the data moved at the fastest rate measured, with no work): met, missed,
    or out of reach on this machine, where a bound falls short of the need."""
    targets = doc.get("targets")
    if not isinstance(targets, list) or not targets:
        return []
    ceilings = [(k, name) for k, name in CEILINGS if any(k in t for t in targets)]
    head = ["target", "need", "measured", *(name for _, name in ceilings), "verdict"]
    out = ["", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for t in targets:
        value = t.get("value")
        if t.get("refused"):
            verdict = (f"met: refused before loading, naming the least memory to give ({t['refused']})" if t["met"] else
                       f"out of reach here: the cap is below the least memory any plan needs ({t['refused']}), said in the same run")  # fmt: skip
        elif t.get("met") is None:
            verdict = "not run"
        elif t["met"]:
            verdict = "met"
        elif out_of_reach(t):
            verdict = "out of reach here: a ceiling, measured in the same run, is below the need"
        else:
            verdict = "missed"
        cells = [str(t["target"]), f">= {t['need']:g}", "-" if value is None else f"{value:.2f}"]
        cells += ["-" if t.get(k) is None else f"{t[k]:.2f}" for k, _ in ceilings]
        out.append("| " + " | ".join(_md(c) for c in [*cells, verdict]) + " |")
    return out


def _md(cell: object) -> str:
    """A table cell: a ``|`` in it (``1 - |p/m - 1|``) would end the cell."""
    return str(cell).replace("|", "\\|")


def out_of_reach(target: dict[str, Any]) -> bool:
    """A missed target one of whose bounds (:data:`CEILINGS`) is below its need, or that could not
    run because the memory given was below the least any plan needs (``refused``)."""
    if target.get("refused") and not target.get("met"):
        return True
    bounds = [target[k] for k, _ in CEILINGS if target.get(k) is not None]
    return not target.get("met") and bool(bounds) and min(bounds) < target["need"]


#: The bounds a target may carry, and their column names.
CEILINGS = (("ceiling", "ceiling: every weight in memory"), ("drive_ceiling", "ceiling: layers read at the fastest rate measured"))


#: How each kind of result file renders, by its ``kind`` (``bench`` when absent and it has results).
RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {"bench": _bench_table, "bench-ranks": _ranks_markdown, "table": _generic}


def _kind(doc: dict[str, Any]) -> str:
    return str(doc.get("kind") or ("bench" if "results" in doc and "summary" in doc else "table"))


def render_section(section: Section, page_dir: Path) -> list[str]:
    doc = section.doc
    lines = [f"## {section.title}", ""]
    if doc.get("about"):
        lines += [str(doc["about"]), ""]
    lines += [
        f"* command: `{doc['command']}`",
        f"* commit: `{doc.get('commit') or 'not recorded'}`; started {doc.get('started', '?')}; wall {doc.get('wall_s', 0):.0f} s",
        f"* machine: {_machine_line(doc.get('machine'))}" + _load_line(doc.get("load_average")),
        f"* results: [`{section.path.name}`]({os.path.relpath(section.path, page_dir)})",
        "",
    ]
    sources = sorted({str(r["memory_source"]) for r in doc.get("results") or [] if isinstance(r, dict) and r.get("memory_source")})
    if sources and sources != [CPU_SOURCE] and sources != [CUDA_SOURCE]:
        lines[-1:-1] = [f"* memory: {'; '.join(sources)}"]
    lines += RENDERERS.get(_kind(doc), _generic)(doc)
    lines += _targets(doc)
    plot = _plot(doc, section.path, page_dir)
    if plot is not None:
        lines += ["", f"![{section.title}]({os.path.relpath(plot, page_dir)})"]
    return lines + [""]


def _plot(doc: dict[str, Any], result: Path, page_dir: Path) -> Path | None:
    """The result's plot, if kept beside the page: its recorded path (from the repository root, as
    the command was run), else the PNG copied beside ``result`` (a run written elsewhere)."""
    if not doc.get("plot"):
        return None
    for plot in (Path(doc["plot"]), result.with_suffix(".png")):
        if plot.exists() and plot.resolve().is_relative_to(page_dir.resolve()):
            return plot
    return None


def render_page(sections: list[Section], page_dir: Path, *, command: str) -> str:
    """The whole page: a header naming the command that regenerates it, the summary table (how
    fast, against what), the method, then one section per result file."""

    lines = [
        "# Performance",
        "",
        f"Generated by `{command}` from the result files in `docs/results/`; do not edit by hand.",
        "Each section names the command, commit and machine that produced its figures. To add",
        "figures from another machine, run the command with `--out docs/results/NAME.json`, then",
        "regenerate this page.",
        "",
        *render_summary(sections),
        METHOD,
    ]
    for s in sections:
        lines += render_section(s, page_dir)
    lines += gpu_section(sections)
    return "\n".join(lines).rstrip() + "\n"


def gpu_section(sections: list[Section]) -> list[str]:
    """The page's "GPU" section: the GPU results (machines that recorded a GPU), or, until one
    exists, a plain statement that none does and the command that makes them."""
    gpus = sorted({g for s in sections for g in ((s.doc.get("machine") or {}).get("gpus") or [])})
    lines = ["", "## GPU", ""]
    if gpus:
        lines.append(f"Sections above measured on {', '.join(gpus)} name it in their machine line.")
    else:
        lines += ["No GPU figure exists yet: every section above ran on a CPU-only machine, and nothing on this page",
                  "was measured through GPUDirect Storage. On a GPU machine, `scripts/gpu_check.sh OUTDIR` runs the",
                  "GPU tests (exactness first), a plan-and-run of a small model, one activation benchmark, one",
                  "streamed-weights benchmark and `gds-check --json`, and writes their results and the hardware to",
                  "`OUTDIR/gpu_check.json`."]
    return lines
