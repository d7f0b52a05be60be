"""``gds-offload bench --nproc N``'s runs: every mode on one process and on N DDP ranks, interleaved, in one run.

Per mode there are two runs per round: the one-process run of ``bench``
(:func:`~gds_offload.bench.train.runner.run_mode`) and the same mode on ``N`` ranks under torchrun
(:func:`~gds_offload.bench.train.ranks_runner.run_ranked`), with the same model, the same per-rank
batch and the same number of torch threads per process (``torch.set_num_threads``: the usable
CPUs divided by ``N``, at least 1), so one process computes as one rank does. The runs of a
round go in the order of :func:`~gds_offload.bench.train.suite.round_order` over the
(mode, processes) pairs, each round starting one pair later.

Each setting is summarised on its own (:func:`~gds_offload.bench.train.suite.summarize`): the
``x keep`` of a mode is its step time over ``keep``'s in the same setting and round, and its
losses (and final weights) are compared bit for bit with ``keep``'s in the same setting, on
every rank. The offloader's per-rank overhead on N ranks against its overhead on one
process is then the mode's N-rank ``x keep`` over its one-process ``x keep``
(``scaling``): 1.00 when each rank pays what one process pays. With ``--paired`` each offload
run also times paused steps between its offloaded ones (on every rank at once), and
``scaling`` has the same ratio of the paired ratios, which a shared machine's slow spells,
hitting one run and not another, do not move.

The one-process run spills where rank 0 does: ``--path`` as a template is filled in for local
rank 0, and the default directory is the base of the ranks' ``<default>/rank<r>``.

Exit code: as ``bench``: 0 when every run that could run here ran and every loss agrees
with ``keep``'s; 1 when not; 2 for bad options.
"""
from __future__ import annotations

import os
from dataclasses import asdict, replace
from typing import Any

from gds_offload.activations.spill.ranks import AUTO, node_placements
from gds_offload.bench.docs.report import ranks_spread, ranks_table
from gds_offload.bench.train.checks import check_fits, check_runs
from gds_offload.bench.train.ranks_runner import RankedResult, run_ranked
from gds_offload.bench.train.runner import run_mode
from gds_offload.bench.train.suite import round_order, summarize
from gds_offload.errors import ConfigError

__all__ = ["check_ranked", "per_process_threads", "one_process_path", "ranks_agree", "render", "run_all", "summarize_settings"]


def per_process_threads(nproc: int) -> int:
    """torch threads for each process: the CPUs this process may use, shared by ``nproc`` ranks."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return max(1, usable // nproc)


def one_process_path(path: str | None, nproc: int) -> str | None:
    """Where the one-process runs spill: rank 0's directory of ``path`` (a template filled in;
    the default and ``auto`` as they are, which put the ranks under or beside it)."""

    if path is None or path == AUTO:
        return path
    first = node_placements(path, nproc, env={})[0]
    return str(first.paths[0]) if first.changed else path


def check_ranked(base: Any, modes: list[str], nproc: int) -> None:
    """What :func:`~gds_offload.bench.train.checks.check_runs` refuses, for every rank's spill
    directory, and the memory of ``nproc`` processes at once.

    Raises:
        ConfigError: the first problem.
    """
    import torch

    if base.device.startswith("cuda"):
        if base.device != "cuda":
            raise ConfigError(f"--device {base.device} --nproc {nproc}: each rank takes the GPU of its local rank; pass --device cuda")
        if torch.cuda.device_count() < nproc:
            raise ConfigError(f"--nproc {nproc}: this machine has {torch.cuda.device_count()} CUDA GPU(s), one per rank needed")
    if base.path is None or base.path == AUTO:
        check_runs(base, modes)
    else:
        for where in dict.fromkeys(str(p.paths[0]) for p in node_placements(base.path, nproc, env={})):
            check_runs(replace(base, path=where), modes)
    check_fits(base, modes, copies=nproc)


def ranks_agree(results: list[RankedResult]) -> dict[str, bool | None]:
    """Per mode of N-rank runs: every rank's losses, in every round, equal ``keep``'s on that
    rank in that round (None: nothing to compare)."""
    out: dict[str, bool | None] = {}
    for k in sorted({r.round for r in results}):
        runs = [r for r in results if r.round == k]
        keep = next((r for r in runs if r.mode == "keep" and r.status == "ok" and r.ranks), None)
        for r in runs:
            if keep is None or r.status != "ok" or not r.ranks:
                out.setdefault(r.mode, None)
                continue
            same = [a.get("losses_hex") for a in r.ranks] == [b.get("losses_hex") for b in keep.ranks]
            out[r.mode] = same and out.get(r.mode) is not False
    return out


def summarize_settings(results: list[RankedResult], nproc: int) -> dict[str, Any]:
    """Both settings summarised (:func:`~gds_offload.bench.train.suite.summarize`, plus every
    rank's losses on N ranks), and per mode its ``scaling``: the N-rank ``x keep`` over the
    one-process one (the medians' ratio, and round by round where both settings ran)."""

    settings = {}
    for n in (1, nproc):
        mine = [r for r in results if r.nproc == n]
        summary = summarize(mine)
        if n > 1:
            for mode, same in ranks_agree(mine).items():
                if same is False:
                    summary["modes"][mode]["losses_agree"] = False
            checked = [v["losses_agree"] for v in summary["modes"].values() if v["losses_agree"] is not None]
            summary["all_losses_agree"] = all(checked) if checked else None
        settings[str(n)] = summary
    one, many = settings["1"]["modes"], settings[str(nproc)]["modes"]
    scaling: dict[str, dict[str, Any]] = {}
    for mode in one:
        if mode == "keep" or mode not in many:
            continue
        a, b = one[mode].get("step_ratio"), many[mode].get("step_ratio")
        xs, ys = one[mode]["step_ratios"], many[mode]["step_ratios"]
        per_round = [y / x for x, y in zip(xs, ys)] if len(xs) == len(ys) else []  # a failed round leaves them unpaired
        scaling[mode] = {"x_keep_1": a, f"x_keep_{nproc}": b, "n_over_1": b / a if a and b else None, "n_over_1_per_round": per_round}
        pa, pb = one[mode].get("paired_ratio"), many[mode].get("paired_ratio")
        if pa and pb:  # --paired: offloaded over paused steps of the same processes, the same ratio of ratios
            scaling[mode] |= {"paired_1": pa, f"paired_{nproc}": pb, "paired_n_over_1": pb / pa}
    agreed = [s["all_losses_agree"] for s in settings.values() if s["all_losses_agree"] is not None]
    return {
        "settings": settings,
        "scaling": scaling,
        "all_losses_agree": all(agreed) if agreed else None,
        "failed": sorted({f"{r.mode} ({r.nproc} proc)" for r in results if r.status == "error"}),
    }


def run_all(single: Any, ranked: Any, modes: list[str], nproc: int, *, timeout_s: float, rounds: int, status: Any) -> list[RankedResult]:
    """Every (mode, processes) pair, ``rounds`` times, in :func:`round_order`."""

    pairs = [(mode, n) for mode in modes for n in (1, nproc)]
    results: list[RankedResult] = []
    for k in range(rounds):
        for i, (mode, n) in enumerate(round_order(pairs, k), 1):
            label = f"[{k * len(pairs) + i}/{len(pairs) * rounds}] {mode} on {n} process{'es' if n > 1 else ''}"
            if rounds > 1:
                label += f" (round {k + 1}/{rounds})"

            def on_event(ev: dict[str, Any], label: str = label) -> None:
                if status is not None and ev.get("event") == "step":
                    status.update(f"{label}: {ev['phase']} step {ev['step'] + 1}/{single.warmup + single.steps} ({ev['step_s']:.2f} s)")

            if status is not None:
                status.update(f"{label}: starting")
            progress = status is not None
            if n == 1:
                r = RankedResult(**asdict(run_mode(replace(single, mode=mode, progress=progress), on_event=on_event, timeout_s=timeout_s)))
            else:
                r = run_ranked(replace(ranked, mode=mode, progress=progress), n, on_event=on_event, timeout_s=timeout_s)
            r.round = k
            results.append(r)
    return results


def render(doc: dict[str, Any], title: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=170)  # a file or a pipe: no 80-column wrapping
    head, rows = ranks_table(doc)
    table = Table(title=title)
    for col in head:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for row in rows:
        if row[2].startswith(("error:", "unavailable:")):
            row[2] = row[2].split(":", 1)[0]  # the whole message is printed below the table
        table.add_row(*(f"[red]{escape(c)}[/]" if c in ("NO", "error") else escape(c) for c in row))
    console.print(table)
    for line in ranks_spread(doc):
        console.print(line)
    for r in doc["results"]:
        if r["status"] != "ok":  # error texts are the ranks' own: printed as they are, not as markup
            console.print(f"[bold]{r['mode']} on {r['nproc']} process(es)[/], round {r['round'] + 1}: {escape(r['error'])}")
