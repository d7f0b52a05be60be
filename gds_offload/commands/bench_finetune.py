"""``gds-offload bench-finetune``: LoRA fine-tuning steps with the weights resident, streamed from the
drive or host memory, and under Accelerate's disk offload, each mode in its own process
(:mod:`gds_offload.bench.weights.finetune`). Examples::

    gds-offload bench-finetune --tiny                                  # seconds: the end-to-end check
    gds-offload bench-finetune --memory-limit 1.6GiB --out docs/results/finetune-cpu.json

Exit status: 0 when resident and the streamed modes ran and matched the resident losses and
adapters (a peer that fails is a finding, shown in the table), 1 otherwise, 2 a usage error.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HELP = "benchmark LoRA fine-tuning with weights resident, streamed from drive/host, and Accelerate disk offload"
#: The modes whose failure fails the command (the others are peers).
OURS = ("resident", "drive", "host")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gds_offload.commands.bench_weights import batch_sizes_arg
    from gds_offload.commands.run_args import positive_int

    p.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 model: runs in seconds")
    p.add_argument("--modes", default="resident,drive,host,accelerate-disk", help="comma-separated (default: all four)")
    p.add_argument("--batch-sizes", type=batch_sizes_arg, default=None, help="comma-separated (default 1,4,8)")
    p.add_argument("--seq-len", type=positive_int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--steps", type=positive_int, default=2, help="measured steps per batch size, after one warm-up (default 2)")
    p.add_argument("--rank", type=positive_int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--slots", type=positive_int, default=2, help="ring buffers of the drive mode (default 2)")
    p.add_argument("--checkpointing", action="store_true", help="Hugging Face gradient checkpointing in every mode (layers recomputed in backward)")
    p.add_argument("--rounds", type=positive_int, default=1, help="run every mode this many times, interleaved; medians are shown")
    p.add_argument("--workdir", default=None, help="where the checkpoint and store go (default: bench-weights' private workdir)")
    p.add_argument("--memory-limit", default=None, help="cap the drive and accelerate-disk children (page cache included); needs root and cgroup v1")
    p.add_argument("--out", "--json", dest="out", metavar="OUT", default=None, help="write the result file (JSON) to OUT ('-': print it)")
    p.add_argument("--title", default=None, help="the result's title on the performance page")


def run(args: argparse.Namespace) -> int:
    from gds_offload.bench.weights.bench import DEFAULT_MODEL, TINY
    from gds_offload.bench.weights.finetune import MODES, FinetuneSpec, run_finetune_bench
    from gds_offload.commands.bench_weights import emit, memory_limit_arg, modes_arg, workdir_arg
    from gds_offload.errors import ConfigError

    try:  # every flag, before the checkpoint is made and the first child starts
        modes = modes_arg(args.modes, MODES)
        limit = memory_limit_arg(args.memory_limit)
        workdir = workdir_arg(args.workdir, tiny=args.tiny)  # last: it creates the directory
    except ConfigError as exc:
        print(f"gds-offload bench-finetune: {exc}")
        return 2
    from rich.console import Console

    from gds_offload.bench.docs.report import current_commit

    model = TINY if args.tiny else DEFAULT_MODEL
    spec = FinetuneSpec("", "", "", str(workdir), batch_sizes=args.batch_sizes or (1, 4, 8), seq_len=args.seq_len, steps=args.steps,
                        rank=args.rank, slots=args.slots, checkpointing=args.checkpointing)  # fmt: skip
    console = Console(stderr=True)
    started, commit = time.time(), current_commit()
    try:
        report = run_finetune_bench(spec, modes, model=model, rounds=args.rounds, memory_limit=limit, progress=lambda text: console.log(text))
    except ConfigError as exc:
        print(f"gds-offload bench-finetune: {exc}", file=sys.stderr)
        return 2
    emit(_document(args, report, started, workdir, commit), args.out)
    ours = [r for r in report["summary"]["finetune"] if r["mode"] in OURS]
    return 1 if any(r["rounds_ok"] < r["rounds"] or r["matches_resident"] is False for r in ours) else 0


def _document(args: argparse.Namespace, report: dict[str, Any], started: float, workdir: Path, commit: str | None) -> dict[str, Any]:
    from gds_offload.bench.machine import describe_machine
    from gds_offload.bench.weights.finetune import finetune_table
    from gds_offload.units import format_bytes

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
        "title": args.title or f"LoRA fine-tuning with streamed weights{' and gradient checkpointing' if spec.get('checkpointing') else ''} (cpu)",
        "about": about,
        "command": getattr(args, "command_line", "gds-offload bench-finetune"),
        "commit": commit,
        "machine": describe_machine(workdir).as_dict(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": time.time() - started,
        "table": finetune_table(report),
        **report,
    }
