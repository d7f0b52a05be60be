"""The result document of ``gds-offload bench-weights --out``: what ``gds-offload report`` renders
(``kind: "table"``, formatted rows) with the raw figures kept beside it, the targets the issue
sets and whether this run met them, and a PNG of tokens/s against batch size per mode.

Targets (all within one run, ``drive`` against ``accelerate-disk``):

* decode at batch 1 draws at least 0.9x the drive's raw ``O_DIRECT`` read rate with as many
  reads in flight as the streamer keeps, measured around each decode in the same process
  (``decode_read_vs_raw``, :attr:`~gds_offload.bench.weights.bench.BenchSpec.paired_raw`; results
  without it: the best pass of :func:`~gds_offload.bench.weights.drive.raw_read_bandwidth`);
* decode at batch 1 is at least Accelerate's tokens/s;
* at every batch >= 8, prefill and decode are at least 2x Accelerate's tokens/s.

Each tokens/s target also gets two bounds, as ratios to Accelerate, that no streamer of every
layer could beat on this machine: ``ceiling``, the faster mode that holds every weight in
memory (resident, streamed-host: streaming that costs no time at all), and ``drive_ceiling``,
the phase's layers read, computing nothing, at the fastest rate the run measured: of a raw
``O_DIRECT`` pass, or drawn by the streamer itself in any round (a bound below what was
reached would be none), less the ``slots`` layers a phase may find already read. Where either
is below the need, the target is out of reach here.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gds_offload.bench.docs.stale import exercised_paths
from gds_offload.bench.machine import describe_machine
from gds_offload.units import format_bytes

__all__ = ["LABELS", "bench_document", "emit", "fastest_raw", "fastest_read", "targets", "table", "plot", "document", "render"]

#: How modes are named on the page.
LABELS = {"resident": "resident", "drive": "streamed-drive", "host": "streamed-host", "accelerate-disk": "accelerate-disk"}
_COLUMNS = ["mode", "batch", "prefill tok/s", "decode tok/s", "read / decoded token", "x Accelerate (prefill / decode)",
            "decode read rate", "peak memory / cap", "cached at start", "outputs = resident"]  # fmt: skip


def _by(summary: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["mode"], r["batch"]): r for r in summary if r["rounds_ok"]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fastest_raw(report: dict[str, Any]) -> float | None:
    """The fastest raw ``O_DIRECT`` read rate the run measured (the parent's passes and the ones around decodes), bytes/s."""
    rates = [r["bytes_per_s"] for r in report.get("raw_read", [])] + [r.get("raw_paired_bytes_per_s") or 0 for r in report["summary"]]
    return max((x for x in rates if x), default=None)


def fastest_read(report: dict[str, Any]) -> float | None:
    """The fastest read rate the run measured, bytes/s: :func:`fastest_raw`, or what the drive mode's
    prefill or decode drew in any round (``results``, else ``summary``)."""
    rows = [r for r in report.get("results") or report["summary"] if r["mode"] == "drive" and r.get("status", "ok") == "ok"]
    drawn = [r.get("decode_read_bytes_per_s") or 0 for r in rows]
    drawn += [r["prefill_read_bytes"] / r["prefill_s"] for r in rows if r.get("prefill_read_bytes") and r.get("prefill_s")]
    return max([x for x in [fastest_raw(report), *drawn] if x], default=None)


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: ``{"target", "value", "need", "met"}`` (``met`` is ``None`` when a mode did not run),
    tokens/s targets also ``ceiling`` and ``drive_ceiling``."""
    by = _by(report["summary"])
    raw = fastest_raw(report)
    drive1 = by.get(("drive", 1), {})
    if drive1.get("decode_read_vs_raw"):
        read = {"target": "decode batch 1: drive read rate / raw O_DIRECT rate around it", "need": 0.9, "value": drive1["decode_read_vs_raw"]}
    else:
        read = {"target": "decode batch 1: drive read rate / raw O_DIRECT rate", "need": 0.9, "value": _ratio(drive1.get("decode_read_bytes_per_s"), raw)}
    out: list[dict[str, Any]] = [read]
    wanted = [(1, "decode", 1.0)] + [(b, phase, 2.0) for b in sorted(b for m, b in by if m == "drive" and b >= 8) for phase in ("prefill", "decode")]
    model, spec = report.get("model", {}), report.get("spec", {})
    streamed, prompt, steps = model.get("layers_nbytes"), spec.get("prompt_len"), (spec.get("new_tokens") or 0) - 1
    # A timed phase may start with `slots` layers already in the ring (prefetched at the end of
    # the forward before it), so the bound counts them as read before it begins.
    head = (spec.get("slots") or 0) * (model.get("largest_layer_nbytes") or 0)
    rate = fastest_read(report)
    for batch, phase, need in wanted:
        key = f"{phase}_tokens_per_s"
        drive, acc, *held = (by.get((m, batch), {}).get(key) for m in ("drive", "accelerate-disk", "resident", "host"))
        t: dict[str, Any] = {"target": f"{phase} batch {batch}: tok/s / Accelerate's", "need": need, "value": _ratio(drive, acc),
             "ceiling": _ratio(max((h for h in held if h), default=None), acc)}  # fmt: skip
        forwards, tokens = (1, batch * (prompt or 0)) if phase == "prefill" else (steps, batch * steps)
        if rate and streamed and tokens and forwards * streamed > head:  # the phase's layers at the fastest rate, computing nothing
            t["drive_ceiling"] = _ratio(tokens * rate / (forwards * streamed - head), acc)
        out.append(t)
    for t in out:
        t["met"] = None if t["value"] is None else t["value"] >= t["need"]
    return out


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}" if v < 100 else f"{v:.0f}"


def table(report: dict[str, Any]) -> dict[str, Any]:
    """``{"columns", "rows"}`` of formatted strings, one row per mode and batch."""
    by = _by(report["summary"])
    rows = []
    for r in report["summary"]:
        label = LABELS.get(r["mode"], r["mode"])
        if not r["rounds_ok"]:
            rows.append([label, str(r["batch"]), f"failed: {(r['errors'] or ['?'])[0][:70]}"] + ["-"] * (len(_COLUMNS) - 3))
            continue
        acc = by.get(("accelerate-disk", r["batch"]), {})
        ratios = [_ratio(r[k], acc.get(k)) for k in ("prefill_tokens_per_s", "decode_tokens_per_s")]
        cap = r.get("cgroup_limit_bytes")
        peak = r.get("cgroup_peak_bytes") if cap else r.get("peak_rss_bytes")
        rows.append([
            label,
            str(r["batch"]),
            _num(r["prefill_tokens_per_s"]),
            _num(r["decode_tokens_per_s"]),
            "-" if r["drive_bytes_per_token"] is None else format_bytes(r["drive_bytes_per_token"]),
            "-" if r["mode"] == "accelerate-disk" or None in ratios else f"{ratios[0]:.2f} / {ratios[1]:.2f}",
            ("-" if not r["decode_read_bytes_per_s"] else f"{r['decode_read_bytes_per_s'] / 1e9:.2f} GB/s")
            + (f" ({r['decode_read_vs_raw']:.2f}x raw around it)" if r.get("decode_read_vs_raw") else ""),
            ("-" if peak is None else format_bytes(peak)) + (f" / {format_bytes(cap)}" if cap else " (uncapped)"),
            "-" if r["cached_fraction_before"] is None else f"{100 * r['cached_fraction_before']:.1f}%",
            {True: "yes", False: "NO", None: "-"}[r["matches_resident"]],
        ])  # fmt: skip
    return {"columns": list(_COLUMNS), "rows": rows}


def plot(report: dict[str, Any], out: Path, *, title: str) -> Path:
    """Prefill and decode tokens/s against batch size, one line per mode (matplotlib, Agg).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'gds_offload[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as exc:
        raise ImportError(f"plotting needs matplotlib ({exc}); pip install 'gds_offload[plot]'") from exc
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = list(dict.fromkeys(r["mode"] for r in report["summary"]))
    for ax, key, name in ((axes[0], "prefill_tokens_per_s", "prefill"), (axes[1], "decode_tokens_per_s", "decode")):
        for mode in modes:
            pts = sorted((r["batch"], r[key]) for r in report["summary"] if r["mode"] == mode and r["rounds_ok"] and r[key])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=LABELS.get(mode, mode))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        batches = sorted({r["batch"] for r in report["summary"]})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel(f"{name} tokens/s")
        ax.set_title(name)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def document(report: dict[str, Any], *, title: str, about: str, command: str, commit: str | None,
             machine: dict[str, Any], started: str, wall_s: float, plot_path: str | None) -> dict[str, Any]:  # fmt: skip
    """The result file: the report's own keys plus the page's (``kind``, ``title``, ``about``,
    ``command``, ``commit``, ``machine``, ``started``, ``wall_s``, ``plot``, ``table``) and ``targets``."""
    return {
        "kind": "table",
        "title": title,
        "about": about,
        "command": command,
        "commit": commit,
        "exercises": exercised_paths("bench-weights"),
        "machine": machine,
        "started": started,
        "wall_s": wall_s,
        "plot": plot_path,
        "table": table(report),
        "targets": targets(report),
    } | report


def bench_document(report: dict[str, Any], *, started: float, workdir: Path, commit: str | None, title: str | None, command: str | None,
                   out: str | None, plot_to: str | None) -> dict[str, Any]:
    """``bench-weights``' result file from :func:`~gds_offload.bench.weights.bench.run_bench`'s report: the
    text that says what ran, the plot (next to ``out``, or at ``plot_to``; ``""``: none) and :func:`document`."""
    m, spec = report["model"], report["spec"]
    size = format_bytes(m["layers_nbytes"] + m["resident_nbytes"])
    cap = f"a {format_bytes(spec['memory_limit_bytes'])} memory cap (page cache included)" if spec["memory_limit_bytes"] else "no memory cap"
    raw = (fastest_raw(report) or 0) / 1e9
    loads = [x for r in report["results"] if r.get("load_avg") for x in r["load_avg"]]
    load = f"; the machine's load average went from {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs" if loads else ""
    about = (f"A {m['layers']}-layer Llama-shaped model ({size} of {m['dtype']} weights, random, from a safetensors checkpoint) on {spec['device']}, "
             f"prompt {spec['prompt_len']} tokens, {spec['new_tokens'] - 1} decode steps; streamed-drive and accelerate-disk under {cap}, "
             f"resident and streamed-host uncapped (they hold every weight in memory); every child with MALLOC_MMAP_THRESHOLD_=1048576; "
             f"{spec['rounds']} round(s) interleaved, medians. "
             f"The drive's fastest raw O_DIRECT read pass in the same run: {raw:.2f} GB/s{_raw_where(spec)}{load}; the decodes of streamed-drive and "
             f"accelerate-disk at each batch size are also run {spec.get('paired_raw', 0)} more times after the measured runs, each "
             f"between raw passes of as many bytes of the file the mode reads, in its own process (x raw around it: the median; the "
             f"two modes' use of the drive compares free of its drift). On the resident and streamed-host rows, "
             f"x Accelerate is the ceiling a streamer that cost nothing would reach{_interference_line(report)}.")  # fmt: skip
    title = title or f"Weights streamed from NVMe for inference ({spec['device']})"
    plot_path = None
    if out and out != "-" and plot_to != "":
        target = Path(plot_to) if plot_to else Path(out).with_suffix(".png")
        try:
            plot(report, target, title=title)
            plot_path = target.as_posix()
        except ImportError as exc:
            print(f"gds-offload bench-weights: no plot: {exc}")
    started_s = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started))
    return document(report, title=title, about=about, command=command or "gds-offload bench-weights", commit=commit,
                    machine=describe_machine(workdir).as_dict(), started=started_s, wall_s=time.time() - started, plot_path=plot_path)  # fmt: skip


def _raw_where(spec: dict[str, Any]) -> str:
    # On a GPU the raw passes land in host memory while the streamer's reads land in device memory.
    return " (into host memory)" if str(spec.get("device", "cpu")).startswith("cuda") else ""


def _interference_line(report: dict[str, Any]) -> str:
    probe = report.get("interference")
    if not probe or "skipped" in probe:
        return ""
    return (f". Compute shaped like the model's MLP ran {probe['slowdown']:.2f}x slower beside O_DIRECT reads at "
            f"{probe['read_bytes_per_s'] / 1e9:.2f} GB/s than alone (same run): what reading costs the compute on this machine")


def emit(doc: dict[str, Any], out: str | None) -> None:
    """Write the result file to ``out`` and print the table, or print the file (``out="-"``)."""
    if out and out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if out == "-":
        print(json.dumps(doc, indent=2, default=str))
    else:
        render(doc)


def render(doc: dict[str, Any]) -> None:
    """Print the result's table and targets (rich)."""

    t = Table(title=doc["title"], caption=doc["about"])
    for col in doc["table"]["columns"]:
        t.add_column(col, justify="left" if col == "mode" else "right", no_wrap=col == "mode")
    for row in doc["table"]["rows"]:
        t.add_row(*row)
    console = Console(width=max(160, Console().width))
    console.print(t)
    for x in doc.get("targets") or []:
        verdict = {True: "[green]met[/]", False: "[red]not met[/]", None: "not measured"}[x["met"]]
        value = "-" if x["value"] is None else f"{x['value']:.2f}"
        ceiling = f" (resident: {x['ceiling']:.2f})" if x.get("ceiling") else ""
        console.print(f"target {x['target']} >= {x['need']}: {value} {verdict}{ceiling}")
