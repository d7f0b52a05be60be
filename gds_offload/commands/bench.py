"""``gds-offload bench``: train one model in several modes, each in its own process, and compare.

Modes (``--modes``, comma-separated): ``keep`` (no offloader), ``offload`` (engine
``auto``), ``offload:<engine>`` (``posix``, ``compat``, ``host``, ``gds``),
``offload:*`` (every engine that runs here), ``adaptive`` (``policy="adaptive"``),
``recompute`` (per-layer activation checkpointing) and ``save_on_cpu`` (CUDA only).
``auto`` (the default) is ``keep,offload:*,adaptive,recompute`` plus ``save_on_cpu`` on
a GPU. See :mod:`gds_offload.bench.child` for how each mode is run and measured.

Models (``--model``): ``gpt`` (the built-in GPT), ``llama`` / ``gpt2`` (Hugging Face
``LlamaForCausalLM`` / ``GPT2LMHeadModel`` built from a config of the requested size,
random weights), or ``pkg.module:factory``: a function called with a
:class:`~gds_offload.bench.workload.ModelSpec` (the sizes below, ``seed`` and ``device``)
that returns ``(model, batch_fn)`` or ``(model, batch_fn, loss_fn)``, where
``batch_fn(step: int)`` returns that step's batch (a function of the step only) and the
loss is ``loss_fn(model, batch)``, else the model's output for the batch (``**dict``,
``*tuple`` or the object), itself a scalar tensor or with ``.loss``. The module must be
importable by the child processes (from the current directory or ``PYTHONPATH``). Example::

    gds-offload bench --modes keep,offload:posix,offload:compat,recompute --steps 5
    gds-offload bench --model llama --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4
    gds-offload bench --model mypkg.models:make --modes keep,offload

Exit code: 0 when every mode that could run here ran and all losses agree bit for bit
with ``keep``; 1 when losses disagree or a mode failed (``unavailable`` modes do not count).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

HELP = "benchmark keep / offload / recompute / ... on one model: step time, activation memory, exactness"

DEFAULT_MODES = "auto"


def _number(kind: type, low: float, what: str) -> Any:
    """An argparse ``type`` parsing ``kind`` and refusing values below ``low`` (argparse names the flag)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if math.isnan(value) or math.isinf(value) or value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse's message for a failed conversion
    return parse


#: argparse types: sizes and counts. Zero never means "the default": leave the flag out for that.
positive_int = _number(int, 1, "a positive integer")
non_negative_int = _number(int, 0, "an integer >= 0")
positive_float = _number(float, 1e-300, "a positive number")


def add_model_arguments(p: argparse.ArgumentParser, *, steps: int, warmup: int) -> None:
    """The model, size and offloader options ``bench`` and ``demo`` share."""
    p.add_argument("--model", default="gpt", help="gpt (built-in), llama, gpt2 (HF configs, random weights) or pkg.module:factory (default: gpt)")
    p.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default: the device's demo preset)")
    p.add_argument("--hidden", type=positive_int, default=None, help="model width (default: preset)")
    p.add_argument("--heads", type=positive_int, default=None, help="attention heads (default: preset, or hidden/64)")
    p.add_argument("--seq", type=positive_int, default=None, help="tokens per sequence (default: preset)")
    p.add_argument("--vocab", type=positive_int, default=None, help="vocabulary size (default: preset)")
    p.add_argument("--batch", type=positive_int, default=None, help="sequences per step (default: preset)")
    p.add_argument("--dropout", type=float, default=None, help="dropout probability (default: preset)")
    p.add_argument("--steps", type=positive_int, default=steps, help=f"measured steps (default: {steps})")
    p.add_argument("--warmup", type=positive_int, default=warmup, help=f"warm-up steps before measuring, >= 1 (default: {warmup})")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, batches and dropout (default: 0)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (a GPU if there is one) (default: auto)")
    p.add_argument("--path", default=None, help="spill directory (default: $GDS_OFFLOAD_DIR or <tmp>/gds_offload-<uid>)")
    p.add_argument("--max-bandwidth", default=None, help="cap the engine, e.g. 500MB/s (imitate a slower drive)")
    p.add_argument("--keep-last", type=non_negative_int, default=None, help="layer calls kept in memory at the end (attach default: 1)")
    p.add_argument("--min-bytes", default=None, help="storages under this stay in memory, e.g. 1MiB (attach default)")
    p.add_argument("--prefetch-bytes", default=None, help="read-ahead window in backward, e.g. 512MiB (attach default)")
    p.add_argument("--num-threads", type=positive_int, default=None, help="engine I/O threads (engine default)")
    p.add_argument("--timeout", type=positive_float, default=1800.0, help="seconds before a mode's process is killed (default: 1800)")
    p.add_argument("--data", default=None, help="train on token shards from this directory (gds-offload shards) instead of synthetic tokens; sets --seq (and --vocab) from them")
    p.add_argument("--no-memory", action="store_true", help="CPU: do not measure peak memory; run with glibc's default allocator settings (measuring makes every step ~30%% slower; see gds_offload.bench.runner)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=5, warmup=2)
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated modes: keep, offload, offload:<engine>, offload:*, adaptive, recompute, save_on_cpu; auto: all that run here (default: auto)")
    p.add_argument("--rounds", type=positive_int, default=1, help="run every mode this many times, interleaved (each round starts one mode later); ratios are taken within a round and the median is reported: slow spells of a shared machine then hit every mode alike (default: 1)")
    p.add_argument("--paired", action="store_true", help="offload modes also time steps with the offloader paused, alternating with offloaded ones in the same process (ABBA); the 'x keep, paired' column is the median ratio of each pair (an odd --steps leaves the last offloaded step unpaired)")
    p.add_argument("--policy", default="all", choices=("all", "adaptive"), help="attach policy of the offload modes (default: all)")
    p.add_argument("--out", default="results/bench.json", help="JSON results file; '' for none (default: results/bench.json)")
    p.add_argument("--plot", default="results/bench.png", help="PNG of step time and memory per mode; '' for none (default: results/bench.png)")
    p.add_argument("--title", default="", help="a title for the result file (shown on the performance page)")
    p.add_argument("--about", default="", help="a sentence on what the run shows (shown on the performance page)")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cpu``, ``cuda`` and ``cuda:N`` checked.

    Raises:
        ConfigError: an unknown device, or a CUDA device this machine does not have.
    """
    import re

    import torch

    from gds_offload.errors import ConfigError

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if device != "cpu" and m is None:
        raise ConfigError(f"--device {device!r} is unknown; pass cpu, cuda, cuda:N or auto")
    if m is not None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {device}: torch sees no CUDA GPU here; pass --device cpu (or auto)")
        if m.group(1) is not None and int(m.group(1)) >= count:
            raise ConfigError(f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return device


def check_model_name(model: str) -> None:
    """``--model`` names a built-in model or an importable ``pkg.module:factory``.

    Raises:
        ConfigError: an unknown name, a module that cannot be found, or transformers missing for llama/gpt2.
    """
    import importlib.util

    from gds_offload.bench.workload import BUILTIN_MODELS
    from gds_offload.errors import ConfigError

    if model == "gpt":
        return
    if model in ("llama", "gpt2"):
        if importlib.util.find_spec("transformers") is None:
            raise ConfigError(f"--model {model} needs transformers; pip install transformers, or use --model gpt")
        return
    module, sep, attr = model.partition(":")
    if not sep or not module or not attr.isidentifier():
        raise ConfigError(f"--model {model!r} is unknown; expected {', '.join(BUILTIN_MODELS)} or pkg.module:factory")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ConfigError(f"--model {model}: no module {module!r} on sys.path (the current directory or PYTHONPATH)")


def available_memory(device: str) -> tuple[int, str] | None:
    """(bytes, where the figure comes from) a process can still allocate on ``device``; None if unknown."""
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        free, _total = torch.cuda.mem_get_info(index)
        return int(free), f"free memory of {device} (torch.cuda.mem_get_info)"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        return None
    return None


def mode_needs(est: Any, mode: str, device: str) -> dict[str, int]:
    """Bytes ``mode`` needs per memory (``"cpu"``, or the CUDA device and ``"cpu"`` for host copies)."""
    from gds_offload.bench.spec import parse_mode

    kind, engine = parse_mode(mode)
    cuda = device.startswith("cuda")
    if kind == "keep":
        return {device: est.keep_bytes()}
    if kind == "recompute":
        return {device: est.recompute_bytes()}
    if kind == "save_on_cpu" or engine == "host":
        if not cuda:
            return {device: est.keep_bytes()}  # host memory is where the activations were anyway
        return {device: est.offload_bytes(), "cpu": est.activation_bytes}
    return {device: est.offload_bytes()}


def check_fits(base: Any, modes: list[str]) -> None:
    """Refuse, with the estimate, a built-in GPT run that cannot fit in this machine's memory.

    Raises:
        ConfigError: a mode needs more than is available (:func:`available_memory`).
    """
    from gds_offload.bench.gpt import GPTConfig, estimate_memory
    from gds_offload.errors import ConfigError
    from gds_offload.units import format_bytes

    if base.model != "gpt":
        return  # the estimate is the built-in GPT's
    est = estimate_memory(GPTConfig(base.layers, base.hidden, base.heads, base.seq, base.vocab, base.dropout), base.batch)
    free: dict[str, tuple[int, str] | None] = {}
    for mode in modes:
        for where, need in mode_needs(est, mode, base.device).items():
            if where not in free:
                free[where] = available_memory(where)
            got = free[where]
            if got is None or need <= got[0]:
                continue
            have, source = got
            raise ConfigError(
                f"{mode} needs about {format_bytes(need)} on {where} (model, gradients and AdamW state "
                f"{format_bytes(est.state_bytes)}; activations {format_bytes(est.activation_bytes)} in all, "
                f"{format_bytes(est.layer_bytes)} per layer) but {format_bytes(have)} is available ({source}). "
                f"Lower the sizes (--batch or --batches, --seq, --layers, --hidden)" + (", or leave out keep" if mode == "keep" else "")
            )


def check_runs(base: Any, modes: list[str]) -> None:
    """Everything the runs' children would refuse, refused now, before the first one starts: the
    model name, every offload mode's attach() arguments and spill directory, and the memory.

    Raises:
        ConfigError: the first problem, naming the flag.
    """
    from gds_offload.bench.spec import parse_mode
    from gds_offload.config import OffloadConfig

    check_model_name(base.model)
    for mode in modes:
        kind, engine = parse_mode(mode)
        if kind not in ("offload", "adaptive"):
            continue
        OffloadConfig.from_kwargs(
            path=base.path, mode=engine or "auto", policy="adaptive" if kind == "adaptive" else base.policy,
            keep_last=1 if base.keep_last is None else base.keep_last,
            **({} if base.min_bytes is None else {"min_bytes": base.min_bytes}),
            prefetch_bytes=base.prefetch_bytes, max_bandwidth=base.max_bandwidth, num_threads=base.num_threads,
            origin="--path",
        )
    check_fits(base, modes)


def base_spec(args: argparse.Namespace, device: str) -> Any:
    """The :class:`~gds_offload.bench.spec.RunSpec` the options describe (mode left as ``keep``).

    Raises:
        ConfigError: a bad size string or shape.
    """
    from gds_offload.bench.gpt import GPTConfig, demo_preset
    from gds_offload.bench.spec import RunSpec
    from gds_offload.data.train import data_defaults
    from gds_offload.units import parse_bandwidth, parse_bytes

    preset, preset_batch = demo_preset(device)

    def given(value: int | None, default: int) -> int:
        return default if value is None else value  # 0 is refused by argparse, never "the default"

    data = os.path.abspath(args.data) if getattr(args, "data", None) else None
    data_seq, data_vocab = data_defaults(data, seq=args.seq) if data else (None, None)
    hidden = given(args.hidden, preset.hidden)
    heads = given(args.heads, preset.heads if args.hidden is None else max(1, hidden // 64))
    cfg = GPTConfig(
        layers=given(args.layers, preset.layers),
        hidden=hidden,
        heads=heads,
        seq=given(args.seq, data_seq or preset.seq),
        vocab=given(args.vocab, max(preset.vocab, data_vocab or 0)),
        dropout=preset.dropout if args.dropout is None else args.dropout,
    )  # validates the shape for every model kind
    if args.max_bandwidth is not None:
        parse_bandwidth(args.max_bandwidth, name="--max-bandwidth")
    return RunSpec(
        mode="keep",
        model=args.model,
        layers=cfg.layers,
        hidden=cfg.hidden,
        heads=cfg.heads,
        seq=cfg.seq,
        vocab=cfg.vocab,
        batch=given(args.batch, preset_batch),
        dropout=cfg.dropout,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        device=device,
        path=str(args.path) if args.path else None,
        max_bandwidth=args.max_bandwidth,
        policy=getattr(args, "policy", "all"),
        keep_last=args.keep_last,
        min_bytes=None if args.min_bytes is None else parse_bytes(args.min_bytes, name="--min-bytes"),
        prefetch_bytes=None if args.prefetch_bytes is None else parse_bytes(args.prefetch_bytes, name="--prefetch-bytes"),
        num_threads=args.num_threads,
        measure_memory=not args.no_memory,
        paired=getattr(args, "paired", False),
        data=data,
    )


def select_modes(text: str, device: str, path: str | None) -> list[str]:
    """``--modes`` expanded (``auto``, ``offload:*``) and validated."""
    from gds_offload.bench.spec import expand_modes

    if text.strip() == "auto":
        text = "keep,offload:*,adaptive,recompute" + (",save_on_cpu" if device.startswith("cuda") else "")
    return expand_modes(text.split(","), device, path)


def summarize(results: list[Any]) -> dict[str, Any]:
    """Per mode: its ratios to ``keep`` and whether its losses agree with ``keep``'s.

    Each ratio is taken within one round (against that round's ``keep``), and the
    summary's ``step_ratio`` / ``memory_ratio`` is the median over rounds; the
    per-round ratios are in ``step_ratios`` / ``memory_ratios``. Paired runs add
    ``paired_ratio``: the median, over every pair of every round, of an offloaded
    step's time over its paused partner's (``paired_ratios``). Losses agree when they
    agree in every round.
    """
    from gds_offload.bench.spec import compare_losses, paired_ratios

    rounds = sorted({r.round for r in results})
    per_round = {k: [r for r in results if r.round == k] for k in rounds}
    rows: dict[str, dict[str, Any]] = {}
    for k in rounds:
        agree = compare_losses(per_round[k])
        keep = next((r for r in per_round[k] if r.mode == "keep" and r.status == "ok"), None)
        for r in per_round[k]:
            row = rows.setdefault(r.mode, {"status": r.status, "losses_agree": None, "step_ratios": [], "memory_ratios": []})
            if row["status"] == "ok":  # a mode that failed in any round shows that failure
                row["status"] = r.status
            if agree.get(r.mode) is not None:
                row["losses_agree"] = agree[r.mode] and row["losses_agree"] is not False
            if keep is not None and r.status == "ok" and keep.median_step_s:
                row["step_ratios"].append(r.median_step_s / keep.median_step_s)
                if r.peak_activation_bytes is not None and keep.peak_activation_bytes:
                    row["memory_ratios"].append(r.peak_activation_bytes / keep.peak_activation_bytes)
    for mode, row in rows.items():
        pairs = [x for r in results if r.mode == mode and r.status == "ok" for x in paired_ratios(r)]
        if pairs:
            row["paired_ratios"] = pairs
            row["paired_ratio"] = statistics.median(pairs)
        row["step_ratio"] = statistics.median(row["step_ratios"]) if row["step_ratios"] else None
        row["memory_ratio"] = statistics.median(row["memory_ratios"]) if row["memory_ratios"] else None
    checked = [v["losses_agree"] for v in rows.values() if v["losses_agree"] is not None]
    return {
        "rounds": len(rounds),
        "modes": rows,
        "all_losses_agree": all(checked) if checked else None,
        "failed": sorted({r.mode for r in results if r.status == "error"}),
        "unavailable": sorted({r.mode for r in results if r.status == "unavailable"}),
    }


def check_in_process(summary: dict[str, Any], base: Any, console: Any = None) -> None:
    """For each offload mode whose losses differed from keep's across processes, decide in one
    process (:func:`~gds_offload.bench.child.exact_in_process`) and record the verdict as the
    mode's ``exact_in_process`` in ``summary``. Other modes (recompute, ...) are not checked."""
    from gds_offload.bench.child import exact_in_process
    from gds_offload.bench.spec import parse_mode

    for mode, row in summary["modes"].items():
        if row["losses_agree"] is False and parse_mode(mode)[0] in ("offload", "adaptive"):
            if console is not None:
                console.print(f"{mode}: losses differ from keep's process; checking in one process (2 steps without, then with) ...")
            row["exact_in_process"] = exact_in_process(replace(base, mode=mode, progress=False))


def unexplained_differences(summary: dict[str, Any]) -> list[str]:
    """Modes whose losses differed from keep's and were not shown bit-identical in one process."""
    return [m for m, row in summary["modes"].items() if row["losses_agree"] is False and row.get("exact_in_process") is not True]


def combine_rounds(results: list[Any]) -> list[Any]:
    """One row per mode (in first-seen order) pooling its rounds.

    ``step_seconds`` holds every round's steps and ``median_step_s`` is their median;
    ``peak_activation_bytes`` is the median of the rounds' peaks; ``offload`` and the
    rest come from the mode's first round. A mode that failed in any round is that
    failed row.
    """
    out: list[Any] = []
    for mode in dict.fromkeys(r.mode for r in results):
        runs = [r for r in results if r.mode == mode]
        bad = next((r for r in runs if r.status != "ok"), None)
        if bad is not None or len(runs) == 1:
            out.append(bad or runs[0])
            continue
        steps = [s for r in runs for s in r.step_seconds]
        paused = [s for r in runs for s in r.paired_keep_seconds]
        peaks = [r.peak_activation_bytes for r in runs if r.peak_activation_bytes is not None]
        median = statistics.median(steps)
        out.append(replace(
            runs[0],
            step_seconds=steps,
            paired_keep_seconds=paused,
            median_step_s=median,
            tokens_per_s=runs[0].tokens_per_step / median if median else None,
            peak_activation_bytes=int(statistics.median(peaks)) if peaks else None,
            wall_s=sum(r.wall_s for r in runs),
        ))
    return out


def _fmt_bytes(n: float | None) -> str:
    from gds_offload.units import format_bytes

    return "-" if n is None else format_bytes(n)


def render_table(results: list[Any], summary: dict[str, Any], *, title: str) -> None:
    """The results as a rich table, then one line per mode that did not run."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=150)  # a file or a pipe: no 80-column wrapping
    table = Table(title=title)
    paired = any("paired_ratio" in s for s in summary["modes"].values())
    cols = ["mode", "step (median)", "x keep", *(["x keep, paired"] if paired else []), "peak act. mem", "x keep",
            "tokens/s", "offloaded/step", "dedup/step", "I/O wait/step", "losses = keep"]
    for col in cols:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in results:
        s = summary["modes"][r.mode]
        if r.status != "ok":
            table.add_row(r.mode, f"[red]{r.status}[/]" if r.status == "error" else f"[yellow]{r.status}[/]", *["-"] * (len(cols) - 2))
            continue
        off = r.offload or {}
        steps = max(1, off.get("steps", 0) or len(r.step_seconds))
        agree = s["losses_agree"]
        table.add_row(
            r.mode,
            f"{r.median_step_s:.3f} s",
            f"{s['step_ratio']:.2f}" if s.get("step_ratio") is not None else "-",
            *([f"{s['paired_ratio']:.2f}" if "paired_ratio" in s else "-"] if paired else []),
            _fmt_bytes(r.peak_activation_bytes),
            f"{s['memory_ratio']:.2f}" if s.get("memory_ratio") is not None else "-",
            f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-",
            _fmt_bytes(off["bytes_offloaded"] / steps) if off else "-",
            _fmt_bytes(off["bytes_deduplicated"] / steps) if off else "-",
            f"{off['io_wait_seconds'] / steps:.3f} s" if off else "-",
            "-" if agree is None else "[green]yes[/]" if agree else "[red]NO[/]",
        )
    console.print(table)
    for r in results:
        if r.status != "ok":
            console.print(f"[bold]{r.mode}[/]: {r.error}")
    if summary["all_losses_agree"] is False:
        from gds_offload.bench.child import LOSSES_DIFFER_NOTE, in_process_verdict

        console.print("[red]losses differ between modes (bit-identical expected)[/]")
        console.print(f"[yellow]{LOSSES_DIFFER_NOTE}[/]")
        for mode, row in summary["modes"].items():
            if "exact_in_process" in row:
                console.print(f"{mode}: {in_process_verdict(row['exact_in_process'])}")


def round_order(modes: list[str], k: int) -> list[str]:
    """The order of round ``k``: ``modes`` rotated left by ``k``, so that no mode always runs first or last."""
    k %= max(1, len(modes))
    return modes[k:] + modes[:k]


def run_modes(base: Any, modes: list[str], *, timeout_s: float, status: Any = None, rounds: int = 1) -> list[Any]:
    """Run each mode in its own child process, one after the other, ``rounds`` times.

    Round ``k`` runs the modes in :func:`round_order` ``(modes, k)``; every result
    carries its ``round``.
    """
    from gds_offload.bench.runner import run_mode

    results = []
    total = len(modes) * rounds
    for k in range(rounds):
        for i, mode in enumerate(round_order(modes, k), 1):
            label = f"[{k * len(modes) + i}/{total}] {mode}" + (f" (round {k + 1}/{rounds})" if rounds > 1 else "")

            def on_event(ev: dict[str, Any], label: str = label) -> None:
                if status is not None and ev.get("event") == "step":
                    status.update(f"{label}: {ev['phase']} step {ev['step'] + 1}/{base.warmup + base.steps} ({ev['step_s']:.2f} s)")

            if status is not None:
                status.update(f"{label}: starting")
            r = run_mode(replace(base, mode=mode, progress=status is not None), on_event=on_event, timeout_s=timeout_s)
            r.round = k
            results.append(r)
    return results


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gds_offload.bench.machine import describe_machine
    from gds_offload.errors import ConfigError

    try:
        device = resolve_device(args.device)
        base = base_spec(args, device)
        modes = select_modes(args.modes, device, base.path)
        check_runs(base, modes)
    except (ConfigError, ValueError) as exc:
        print(f"gds-offload bench: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    started = time.time()
    load_before = os.getloadavg()
    if args.json:
        results = run_modes(base, modes, timeout_s=args.timeout, rounds=args.rounds)
    else:
        with console.status("starting") as status:
            results = run_modes(base, modes, timeout_s=args.timeout, status=status, rounds=args.rounds)
    summary = summarize(results)
    if summary["all_losses_agree"] is False:
        check_in_process(summary, base, console)
    rows = combine_rounds(results)
    from gds_offload.bench.report import current_commit

    doc: dict[str, Any] = {
        "kind": "bench",
        "title": args.title or None,
        "about": args.about or None,
        "command": getattr(args, "command_line", shlex.join(sys.argv)),
        "commit": current_commit(),
        "plot": args.plot or None,
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": time.time() - started,
        # Other work on the machine moves step times (not memory or exactness): recorded with them.
        "load_average": {"start": list(load_before), "end": list(os.getloadavg())},
        "spec": asdict(base) | {"mode": None, "progress": None},
        "modes": modes,
        "machine": describe_machine(base.path).as_dict(),
        "summary": summary,
        "results": [r.as_dict() for r in results],
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    # On a CPU the thread count decides how much of the cores the I/O has to take from the model.
    counts = sorted({r.torch_threads for r in rows if r.torch_threads})
    threads = f"torch threads: {'/'.join(map(str, counts))}" if counts and device == "cpu" else ""
    if args.plot:
        try:
            from gds_offload.bench.plot import plot_results

            m = doc["machine"]
            title = (f"{base.model} L{base.layers} h{base.hidden} seq{base.seq} batch{base.batch} on {device} "
                     f"({m['cpu_usable']} CPUs{', ' + threads if threads else ''}{', ' + m['gpus'][0] if m['gpus'] else ''}; {m['filesystem']})")
            ratios = {m: {k: v for k, v in row.items() if k in ("step_ratio", "memory_ratio", "paired_ratio")} for m, row in summary["modes"].items()}
            plot_results([r.as_dict() | ratios[r.mode] for r in rows], args.plot, title=title)
        except ImportError as exc:
            console.print(f"[yellow]no plot: {exc}[/]")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        title = f"gds-offload bench: {base.model} layers={base.layers} hidden={base.hidden} seq={base.seq} batch={base.batch} on {device}"
        if threads:
            title += f" ({threads})"
        if args.rounds > 1:
            title += f"; {args.rounds} interleaved rounds, x keep = median of per-round ratios"
        if args.paired:
            title += "; x keep, paired = offloaded step / paused step in one process"
        render_table(rows, summary, title=title)
        if args.out:
            Console().print(f"results: {args.out}" + (f", plot: {args.plot}" if args.plot else ""))
    bad = summary["failed"] or unexplained_differences(summary)
    return 1 if bad else 0
