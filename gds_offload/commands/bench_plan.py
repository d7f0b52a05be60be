"""``gds-offload bench-plan``: the planner's choice against the resident model, today's API without a
plan, the peers users would pick and a measured sweep, on the weights benchmark's model under a
memory cap (:mod:`gds_offload.bench.plan.bench`). Examples::

    gds-offload bench-plan --tiny --memory-limit 512MiB          # about a minute: the end-to-end check
    gds-offload bench-plan --memory-limit 1.2GiB --out docs/results/plan-cpu.json
    gds-offload bench-plan --workload finetune --memory-limit 1.2GiB --out docs/results/plan-finetune-cpu.json
    gds-offload bench-plan --matrix --out docs/results/plan-matrix-cpu.json  # four shapes x two caps, under an hour on 2 cores

``--out`` writes the result file ``gds-offload report`` renders, and a PNG beside it (the plan's
predicted curve with the measured points over it). Exit status: 0 every mode ran and the planned
tokens equal the resident model's, 1 otherwise, 2 a usage error (every flag is checked before
anything is measured). ``--workload finetune``: LoRA fine-tuning
(:mod:`gds_offload.bench.plan.finetune`), the plan against ordinary accumulation and the
resident model on the same micro-batches; 0 when the planned losses and adapters equal the
resident model's. ``--matrix``: the planner on four model shapes it was not tuned on, each at two caps
(fractions of its weights), through ``from_pretrained`` inside the capped process
(:mod:`gds_offload.bench.plan.matrix`); 0 when every cell's targets are met.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from gds_offload.bench.docs.report import current_commit
from gds_offload.bench.docs.stale import exercised_paths
from gds_offload.bench.machine import describe_machine
from gds_offload.commands.run_args import check_outputs, memory_limit_arg, modes_arg, positive_int, workdir_arg
from gds_offload.errors import ConfigError
from gds_offload.units import format_bytes

HELP = "benchmark the weight planner's choice against resident, unplanned streaming, the peers and a sweep"

MODES = ("planned", "naive", "resident", "sweep")
PEERS = ("accelerate-disk", "airllm", "deepspeed-zero-inference")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=("generate", "finetune"), default="generate", help="generation over many prompts (default), or LoRA fine-tuning")
    p.add_argument("--sequences", type=positive_int, default=None, help="finetune: sequences in the workload (default 1024; --tiny 32)")
    p.add_argument("--seq", type=positive_int, default=None, help="finetune: tokens per sequence (default 256; --tiny 16)")
    p.add_argument("--global-batch", type=positive_int, default=None, help="finetune: sequences per optimizer step (default 64; --tiny 8)")
    p.add_argument("--lora-r", type=positive_int, default=8, help="finetune: the adapters' rank (default 8)")
    p.add_argument("--steps", type=positive_int, default=None, help="finetune: optimizer steps each mode runs (default 1; --tiny 3)")
    p.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 model and a small workload: about a minute")
    p.add_argument("--memory-limit", default=None, help="the cap of the streamed children (page cache included), e.g. 1.2GiB; needs root and cgroup v1")
    p.add_argument("--prompts", type=positive_int, default=None, help="prompts in the workload (default 512; --tiny 16)")
    p.add_argument("--prompt-len", type=positive_int, default=None, help="tokens per prompt (default 64; --tiny 16)")
    p.add_argument("--new-tokens", type=positive_int, default=None, help="tokens generated per prompt (default 32; --tiny 4)")
    p.add_argument("--subset", type=positive_int, default=None, help="prompts the slow modes (naive, the peers) run (default 16; --tiny 8)")
    p.add_argument("--sweep-prompts", type=positive_int, default=None, help="prompts of the sweep's smaller workload (default 32; --tiny 8)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated (default: {','.join(MODES)})")
    p.add_argument("--peers", default="", help=f"comma-separated peers to run at their best batch under the cap: {', '.join(PEERS)} (default none)")
    p.add_argument("--checkpoint", type=Path, default=None, help="use this safetensors checkpoint (Llama-like) instead of random weights")
    p.add_argument("--workdir", default=None, help="where the checkpoint, store and KV files go (default: a private <tmp> directory)")
    p.add_argument("--timeout", type=positive_int, default=7200, help="seconds each child may run (default 7200)")
    p.add_argument("--out", default=None, help="write the result file (JSON) here ('-': print it)")
    p.add_argument("--plot", default=None, help="PNG (default: OUT with .png; '' for none)")
    p.add_argument("--title", default=None, help="the result's title on the performance page")
    p.add_argument("--matrix", action="store_true", help="four model shapes x two caps through from_pretrained (defaults: 128 prompts of 32 + 8 tokens)")
    p.add_argument("--shapes", default=None, help="--matrix: comma-separated shapes (default: all of llama, qwen2-gqa, phi-wide, granite-deep)")
    p.add_argument("--caps", default="0.6,0.85", help="--matrix: caps as fractions of each shape's weight bytes (--tiny: of 1 GiB)")
    p.add_argument("--keep", action="store_true", help="--matrix: keep each shape's checkpoint and store in the workdir")


def run(args: argparse.Namespace) -> int:
    if args.matrix:
        return _run_matrix(args)
    try:
        check_outputs(("--out", args.out, None), ("--plot", args.plot, None))
        modes = tuple(modes_arg(args.modes, MODES))
        peers = tuple(modes_arg(args.peers, PEERS)) if args.peers else ()
        d = (16, 16, 4, 8, 8) if args.tiny else (512, 64, 32, 16, 32)
        prompts, prompt_len, new_tokens, subset, sweep = (v or dflt for v, dflt in zip(
            (args.prompts, args.prompt_len, args.new_tokens, args.subset, args.sweep_prompts), d))  # fmt: skip
        if new_tokens < 2:
            raise ConfigError(f"--new-tokens {new_tokens}: at least 2 (the first comes from the prefill)")
        limit = memory_limit_arg(args.memory_limit or ("512MiB" if args.tiny else "1.2GiB"))
        assert limit is not None, "a default is given"
        if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
            raise ConfigError(f"--checkpoint {args.checkpoint}: no config.json there; give a Hugging Face checkpoint directory")
        workdir = workdir_arg(args.workdir, tiny=args.tiny)
        if args.workload == "finetune":
            from gds_offload.weights.planning.workload import Finetune

            f = (32, 16, 8, 3) if args.tiny else (1024, 256, 64, 1)
            sequences, seq, global_batch, steps = (v or dflt for v, dflt in zip((args.sequences, args.seq, args.global_batch, args.steps), f))
            workload = Finetune(sequences, seq, global_batch, args.lora_r)
            if steps > workload.steps:
                raise ConfigError(f"--steps {steps}: the workload has {workload.steps} optimizer steps ({sequences} / {global_batch})")
            if args.modes == ",".join(MODES):
                modes = ("planned", "naive", "resident")
            bad = [m for m in modes if m == "sweep"] + list(peers)
            if bad:
                raise ConfigError(f"--workload finetune runs planned, naive and resident; {', '.join(bad)} run with --workload generate")
    except ConfigError as exc:
        print(f"gds-offload bench-plan: {exc}", file=sys.stderr)
        return 2
    if args.workload == "finetune":
        return _run_finetune(args, workload=workload, steps=steps, modes=modes, limit=limit, workdir=workdir)
    from rich.console import Console

    from gds_offload.bench.plan.bench import run_bench_plan

    console = Console(stderr=True)
    started, commit = time.time(), current_commit()
    try:
        doc = run_bench_plan(workdir=workdir, memory_limit=limit, prompts=prompts, prompt_len=prompt_len, new_tokens=new_tokens,
                             subset=min(subset, prompts), sweep_prompts=min(sweep, prompts), modes=modes, peers=peers, tiny=args.tiny,
                             checkpoint=args.checkpoint, say=console.log, timeout_s=args.timeout)  # fmt: skip
    except ConfigError as exc:
        print(f"gds-offload bench-plan: {exc}", file=sys.stderr)
        return 2
    doc = document(doc, title=args.title, command=getattr(args, "command_line", None) or "gds-offload bench-plan", commit=commit,
                   machine=describe_machine(workdir).as_dict(), started=started)  # fmt: skip
    if args.out and args.out != "-" and args.plot != "":
        doc["plot"] = _plot(doc, Path(args.plot) if args.plot else Path(args.out).with_suffix(".png"))
    _write(doc, args.out, console)
    planned = doc["results"].get("planned", {})
    return 0 if planned.get("tokens_per_s") and planned.get("exact") is not False else 1


def _run_finetune(args: argparse.Namespace, *, workload: Any, steps: int, modes: tuple[str, ...], limit: int, workdir: Path) -> int:
    from rich.console import Console

    from gds_offload.bench.plan.finetune import finetune_document, run_bench_finetune

    console = Console(stderr=True)
    started, commit = time.time(), current_commit()
    try:
        doc = run_bench_finetune(workdir=workdir, memory_limit=limit, workload=workload, steps=steps, modes=modes, tiny=args.tiny,
                                 checkpoint=args.checkpoint, say=console.log, timeout_s=args.timeout)  # fmt: skip
    except ConfigError as exc:
        print(f"gds-offload bench-plan: {exc}", file=sys.stderr)
        return 2
    doc = finetune_document(doc, title=args.title, command=getattr(args, "command_line", None) or "gds-offload bench-plan --workload finetune",
                            commit=commit, machine=describe_machine(workdir).as_dict(), started=started)  # fmt: skip
    _write(doc, args.out, console)
    planned = doc["results"].get("planned", {})
    return 0 if planned.get("tokens_per_s") and planned.get("exact") is not False else 1


def _run_matrix(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gds_offload.bench.plan import matrix as pm

    try:
        check_outputs(("--out", args.out, None), ("--plot", args.plot, None))
        if args.workload != "generate" or args.peers or args.checkpoint is not None or args.memory_limit is not None:
            raise ConfigError("--matrix runs generation on its own shapes and caps; drop --workload, --peers, --checkpoint and --memory-limit")
        by_name = {s.name: s for s in (pm.TINY_SHAPES if args.tiny else pm.SHAPES)}
        names = modes_arg(args.shapes, tuple(by_name)) if args.shapes else list(by_name)
        caps = tuple(_fraction(c) for c in args.caps.split(","))
        d = (8, 16, 4, 4) if args.tiny else (128, 32, 8, 16)
        prompts, prompt_len, new_tokens, subset = (v or dflt for v, dflt in zip((args.prompts, args.prompt_len, args.new_tokens, args.subset), d))
        if new_tokens < 2:
            raise ConfigError(f"--new-tokens {new_tokens}: at least 2 (the first comes from the prefill)")
        workdir = workdir_arg(args.workdir, tiny=args.tiny)
    except ConfigError as exc:
        print(f"gds-offload bench-plan: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    started, commit = time.time(), current_commit()
    try:
        doc = pm.run_matrix(workdir=workdir, shapes=tuple(by_name[n] for n in names), caps=caps, prompts=prompts, prompt_len=prompt_len,
                            new_tokens=new_tokens, subset=min(subset, prompts), say=console.log, timeout_s=args.timeout, keep=args.keep,
                            cap_base=(1 << 30) if args.tiny else None)  # fmt: skip
    except ConfigError as exc:
        print(f"gds-offload bench-plan: {exc}", file=sys.stderr)
        return 2
    doc = pm.document(doc, title=args.title, command=getattr(args, "command_line", None) or "gds-offload bench-plan --matrix", commit=commit,
                      machine=describe_machine(workdir).as_dict(), started=started)  # fmt: skip
    if args.out and args.out != "-" and args.plot != "":
        try:
            doc["plot"] = pm.plot_matrix(doc, Path(args.plot) if args.plot else Path(args.out).with_suffix(".png")).as_posix()
        except ImportError as exc:
            print(f"gds-offload bench-plan: no plot: {exc}", file=sys.stderr)
    _write(doc, args.out, console)
    return 0 if all(t["met"] is not False for t in doc["targets"]) else 1


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        f = -1.0
    if not 0 < f <= 4:
        raise ConfigError(f"--caps {text!r}: give fractions of the weights, e.g. --caps 0.6,0.85")
    return f


def _write(doc: dict[str, Any], out: str | None, console: Any) -> None:
    if out == "-":
        print(json.dumps(doc, indent=2, default=str))
        return
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    _print(doc, console)


#: The issue's targets: (name, measured key in the summary, need, the bound that can prove it out of reach).
TARGETS = (
    ("planned / resident's best", "planned_over_resident", 0.7, None),
    ("planned / streamed-naive", "planned_over_naive", 3.0, "naive"),
    ("planned / Accelerate disk offload", "planned_over_accelerate-disk", 3.0, "accelerate-disk"),
    ("planned / AirLLM", "planned_over_airllm", 5.0, "airllm"),
    ("planned / DeepSpeed ZeRO-Inference", "planned_over_deepspeed-zero-inference", 2.0, "deepspeed-zero-inference"),
    ("plan / best point of the sweep", "sweep_plan_over_best", 0.9, None),
)


def document(doc: dict[str, Any], *, title: str | None, command: str, commit: str | None, machine: dict[str, Any], started: float) -> dict[str, Any]:
    """The result file: what ran, a table of the modes, and the targets with their bounds."""
    from gds_offload.bench.plan.finetune import planner_targets

    r, s, w = doc["results"], doc["summary"], doc["workload"]
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
    m = doc["model"]
    about = (f"A {m['layers']}-layer Llama-shaped model (hidden {m['hidden']}, {m['dtype']}, random weights), {w['prompts']} prompts of "
             f"{w['prompt_len']} tokens, {w['new_tokens']} new tokens each (greedy); streamed modes and peers under a "
             f"{format_bytes(doc['memory_limit'])} memory cap (cgroup v1, page cache included, the weights' cache dropped before each child); "
             f"resident uncapped at the best of the batches probed ({', '.join(map(str, doc.get('resident_probes') or {})) or 'none'}). Slow modes ran a subset of the prompts (the 'prompts' column): every batch of "
             f"such a mode has the same shape, so its rate is the workload's. The plan: {doc['plan']['describe']}.")  # fmt: skip
    return {"kind": "table", "title": title or "Balance Beam's planner: layer-major generation under a memory cap (cpu)", "about": about,
            "command": command, "commit": commit, "exercises": exercised_paths("bench-plan"), "machine": machine, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "wall_s": time.time() - started, "table": _table(doc), "targets": targets, **doc}  # fmt: skip


def _cell(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table(doc: dict[str, Any]) -> dict[str, Any]:
    cols = ["mode", "shape", "prompts", "tok/s", "prefill tok/s", "decode tok/s", "peak (cap group)", "predicted tok/s", "predicted peak",
            "read/token", "exact", "planned x"]  # fmt: skip
    planned = (doc["results"].get("planned") or {}).get("tokens_per_s")
    rows = []
    for mode, res in doc["results"].items():
        if "error" in res and not res.get("tokens_per_s"):
            rows.append([mode, "-", "-", res["error"][:60], *["-"] * (len(cols) - 4)])
            continue
        c = res.get("choice")
        shape = _shape(c) if c else f"batch {res.get('batch', '-')}"
        pr = res.get("predicted") or {}
        gen = res.get("generated") or 0
        rows.append([mode, shape, str(res.get("prompts_measured", "-")), _cell(res.get("tokens_per_s")), _cell(res.get("prefill_tokens_per_s"), "{:.1f}"),
                     _cell(res.get("decode_tokens_per_s")), format_bytes(res.get("cap_peak_bytes") or res.get("peak_rss_bytes")),
                     _cell(pr.get("tokens_per_s")), format_bytes(pr.get("peak_bytes")),
                     format_bytes(res["bytes_read"] / gen) if gen and res.get("bytes_read") is not None else "-",
                     {True: "yes", False: "NO", None: "-"}[res.get("exact")],
                     _cell(planned / res["tokens_per_s"]) if planned and res.get("tokens_per_s") else "-"])  # fmt: skip
    for i, sw in enumerate(doc.get("sweep") or []):
        c = sw.get("choice") or {}
        rows.append([f"sweep {i + 1}{' (plan)' if sw.get('is_plan') else ''}",
                     _shape(c),
                     str(sw.get("prompts_measured", "-")), _cell(sw.get("tokens_per_s")) if sw.get("tokens_per_s") else _failed(sw),
                     _cell(sw.get("prefill_tokens_per_s"), "{:.1f}"), _cell(sw.get("decode_tokens_per_s")),
                     format_bytes(sw.get("cap_peak_bytes")), _cell(sw.get("predicted_tokens_per_s")), format_bytes(sw.get("predicted_peak_bytes")),
                     "-", "-", "-"])  # fmt: skip
    return {"columns": cols, "rows": rows}


def _shape(c: dict[str, Any]) -> str:
    """A choice as the table shows it: micro-batches x size per load, residency, slots, KV, prefill chunk."""
    chunk = c.get("prefill_chunk")
    return (f"{c.get('per_load')} x {c.get('micro_batch')}, {c.get('resident_layers')} res, {c.get('slots')} slots, KV {c.get('kv')}, "
            f"{f'chunk {chunk}' if chunk else 'whole prompts'}")  # fmt: skip


def _failed(sw: dict[str, Any]) -> str:
    """A sweep point that did not finish: its error, and whether the cost model had said it would not fit."""
    why = (sw.get("error") or "-")[:40]
    return f"predicted over the cap; {why}" if sw.get("predicted_fits") is False else why


def _plot(doc: dict[str, Any], path: Path) -> str | None:
    from gds_offload.bench.plan.plot import plot_plan
    from gds_offload.weights.planning.planner import Plan

    measured: list[tuple[str, int, float]] = []
    for mode, res in doc["results"].items():
        if res.get("tokens_per_s"):
            c = res.get("choice")
            measured.append((mode, c["per_load"] * c["micro_batch"] if c else int(res.get("batch") or 1), res["tokens_per_s"]))
    try:
        plot_plan(Plan.from_dict(doc["plan"]), path, measured=tuple(measured))
    except ImportError as exc:
        print(f"gds-offload bench-plan: no plot: {exc}", file=sys.stderr)
        return None
    return path.as_posix()


def _print(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title=doc["title"], caption=doc["about"])
    for col in doc["table"]["columns"]:
        t.add_column(col, justify="left" if col in ("mode", "shape") else "right")
    for row in doc["table"]["rows"]:
        t.add_row(*row)
    console.print(t)
    for x in doc["targets"]:
        verdict = {True: "met", False: "not met", None: "not measured"}[x["met"]]
        console.print(f"target {x['target']} >= {x['need']}: {_cell(x['value'])} {verdict}")
