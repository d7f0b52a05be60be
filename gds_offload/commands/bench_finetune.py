"""``gds-offload bench-finetune``: LoRA fine-tuning steps with the weights resident, streamed from the
drive or host memory, and under Accelerate's disk offload, each mode in its own process
(:mod:`gds_offload.bench.weights.finetune`); with ``--full``, every weight trained, resident,
streamed with its optimizer state by ``StreamedTrainer``, and under DeepSpeed ZeRO-Infinity
(:mod:`gds_offload.bench.weights.full`). Examples::

    gds-offload bench-finetune --tiny                                  # seconds: the end-to-end check
    gds-offload bench-finetune --memory-limit 1.6GiB --out docs/results/finetune-cpu.json
    gds-offload bench-finetune --full --memory-limit 2GiB --out docs/results/finetune-full-cpu.json

Exit status: 0 when resident and the streamed modes ran and matched the resident losses and
adapters (a peer that fails is a finding, shown in the table), 1 otherwise, 2 a usage error.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from gds_offload.bench.docs.report import current_commit
from gds_offload.commands.run_args import batch_sizes_arg, check_outputs, memory_limit_arg, modes_arg, positive_int, workdir_arg
from gds_offload.errors import ConfigError

HELP = "benchmark LoRA (or, with --full, full) fine-tuning with weights resident, streamed, and under Accelerate or DeepSpeed offload"
#: The modes whose failure fails the command (the others are peers).
OURS = ("resident", "drive", "host")
_LORA_MODES = "resident,drive,host,accelerate-disk"
_FULL_MODES = "resident,drive,deepspeed-infinity"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 model: runs in seconds")
    p.add_argument("--full", action="store_true", help="train every weight (AdamW; optimizer state on the drive when streamed), not LoRA adapters")
    p.add_argument("--modes", default=None, help=f"comma-separated (default: {_LORA_MODES}; with --full: {_FULL_MODES})")
    p.add_argument("--batch-sizes", type=batch_sizes_arg, default=None, help="comma-separated (default 1,4,8; with --full, micro-batch sizes: 1)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default 16; with --full 256)")
    p.add_argument("--micro-batches", type=positive_int, default=2, help="--full: micro-batches per optimizer step (default 2)")
    p.add_argument("--per-load", type=positive_int, default=None, help="--full: micro-batches per weight load when streamed (default: all of a step's)")
    p.add_argument("--child-timeout", type=positive_int, default=7200, help="--full: seconds a mode's child may run before it is killed (default 7200)")
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
    from gds_offload.bench.weights.finetune import MODES

    try:  # every flag, before the checkpoint is made and the first child starts
        check_outputs(("--out", args.out, None))
        if args.full:
            from gds_offload.bench.weights.full import FULL_MODES

            if args.checkpointing:
                raise ConfigError("--full with --checkpointing: StreamedTrainer does not train a gradient-checkpointed model yet; drop --checkpointing")
            if args.per_load is not None and args.per_load > args.micro_batches:
                raise ConfigError(f"--per-load {args.per_load} is more than --micro-batches {args.micro_batches}; give at most {args.micro_batches}")
            modes = modes_arg(args.modes or _FULL_MODES, FULL_MODES)
        else:
            modes = modes_arg(args.modes or _LORA_MODES, MODES)
        limit = memory_limit_arg(args.memory_limit)
        workdir = workdir_arg(args.workdir, tiny=args.tiny)  # last: it creates the directory
    except ConfigError as exc:
        print(f"gds-offload bench-finetune: {exc}")
        return 2
    from rich.console import Console

    from gds_offload.bench.weights.doc import emit

    model = TINY if args.tiny else DEFAULT_MODEL
    console = Console(stderr=True)
    started, commit = time.time(), current_commit()
    command = getattr(args, "command_line", None)
    try:
        if args.full:
            return _run_full(args, modes, model, limit, workdir, console, started, commit, command)
        from gds_offload.bench.weights.finetune import FinetuneSpec, finetune_document, run_finetune_bench

        spec = FinetuneSpec("", "", "", str(workdir), batch_sizes=args.batch_sizes or (1, 4, 8), seq_len=args.seq_len or 16, steps=args.steps,
                            rank=args.rank, slots=args.slots, checkpointing=args.checkpointing)  # fmt: skip
        report = run_finetune_bench(spec, modes, model=model, rounds=args.rounds, memory_limit=limit, progress=lambda text: console.log(text))
    except ConfigError as exc:
        print(f"gds-offload bench-finetune: {exc}", file=sys.stderr)
        return 2
    emit(finetune_document(report, started=started, workdir=workdir, commit=commit, title=args.title, command=command), args.out)
    ours = [r for r in report["summary"]["finetune"] if r["mode"] in OURS]
    return 1 if any(r["rounds_ok"] < r["rounds"] or r["matches_resident"] is False for r in ours) else 0


def _run_full(args: argparse.Namespace, modes: list[str], model: Any, limit: int | None, workdir: Any, console: Any, started: float,
              commit: str | None, command: str | None) -> int:  # fmt: skip
    """``--full``: exit 1 when resident or streamed-drive failed, or drive's losses or weights differ from resident's."""
    from gds_offload.bench.weights.doc import emit
    from gds_offload.bench.weights.full import FullSpec, full_document, run_full_bench

    spec = FullSpec("", "", "", str(workdir), batch_sizes=args.batch_sizes or (1,), seq_len=args.seq_len or 256, micro_batches=args.micro_batches,
                    per_load=args.per_load or args.micro_batches, steps=args.steps, slots=args.slots)  # fmt: skip
    report = run_full_bench(spec, modes, model=model, rounds=args.rounds, memory_limit=limit, progress=lambda text: console.log(text),
                            timeout_s=args.child_timeout)  # fmt: skip
    emit(full_document(report, started=started, workdir=workdir, commit=commit, title=args.title, command=command), args.out)
    ours = [r for r in report["summary"]["full"] if r["mode"] in ("resident", "drive")]
    return 1 if any(r["rounds_ok"] < r["rounds"] or r["matches_resident"] is False for r in ours) else 0
