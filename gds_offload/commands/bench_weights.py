"""``gds-offload bench-weights``: inference tokens/s with weights resident, streamed from the
drive or host memory by :mod:`gds_offload.weights`, and under Accelerate's disk offload,
each mode in its own process (:mod:`gds_offload.bench.weights.bench`). Examples::

    gds-offload bench-weights --tiny                                  # seconds: the end-to-end check
    gds-offload bench-weights --memory-limit 1.2GiB --out docs/results/weights-cpu.json
    gds-offload bench-weights --tiny --device cuda --modes resident,drive,host --out /tmp/w.json

``--out`` writes the result file ``gds-offload report`` renders (and a PNG next to it, or at
``--plot``). Exit status: 0 every mode ran and matched the resident outputs, 1 one did not,
2 a usage error: every flag is checked before the first child starts (the working directory,
memory cap, modes and batch sizes as ``bench-finetune`` checks them:
:mod:`gds_offload.commands.run_args`).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from gds_offload.bench.docs.report import current_commit
from gds_offload.commands.run_args import batch_sizes_arg, check_outputs, memory_limit_arg, modes_arg, positive_int, resolve_device, workdir_arg
from gds_offload.errors import ConfigError

HELP = "benchmark inference with weights resident, streamed from drive/host, and Accelerate disk offload"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 model, short prompt: runs in seconds")
    p.add_argument("--modes", default="resident,drive,host,accelerate-disk", help="comma-separated (default: all four)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--hidden", type=positive_int, default=None, help="hidden size (default 2048)")
    p.add_argument("--intermediate", type=positive_int, default=None, help="MLP size (default 5632)")
    p.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default 12)")
    p.add_argument("--vocab", type=positive_int, default=None, help="vocabulary (default 16000)")
    p.add_argument("--dtype", default=None, help="float32 (default) or bfloat16")
    p.add_argument("--batch-sizes", type=batch_sizes_arg, default=None, help="comma-separated (default 1,8,64)")
    p.add_argument("--prompt-len", type=positive_int, default=None, help="prompt tokens (default 16)")
    p.add_argument("--new-tokens", type=positive_int, default=None, help="tokens generated per sequence, the first by the prefill (default 3)")
    p.add_argument("--rounds", type=positive_int, default=1, help="run every mode this many times, interleaved; medians are shown (default 1)")
    p.add_argument("--repeats", type=positive_int, default=1, help="measurements per batch size inside each child (default 1)")
    p.add_argument("--slots", type=positive_int, default=2, help="ring buffers of the drive mode (default 2)")
    p.add_argument("--threads", type=positive_int, default=None, help="engine threads of the streamed modes (default: 4 on the CPU, the engine's on a GPU)")
    p.add_argument("--engine", default="auto", help="engine of the drive mode: auto, gds, compat, posix (default auto)")
    p.add_argument("--raw-depths", default="1,4,8", help="requests in flight of the raw O_DIRECT read passes (default 1,4,8)")
    p.add_argument("--checkpoint", type=Path, default=None, help="use this safetensors checkpoint (Llama-like) instead of random weights")
    p.add_argument("--workdir", default=None, help="where the checkpoint and store go (default: a private <tmp>/gds_offload-bench-weights-<uid>)")
    p.add_argument("--memory-limit", default=None, help="cap the drive and accelerate-disk children (page cache included), e.g. 1.2GiB; needs root and cgroup v1")
    p.add_argument("--out", "--json", dest="out", metavar="OUT", default=None, help="write the result file (JSON) to OUT ('-': print it instead of the table)")
    p.add_argument("--plot", default=None, help="PNG of tokens/s against batch size (default: OUT with .png; '' for none)")
    p.add_argument("--title", default=None, help="the result's title on the performance page")


#: ``--dtype`` values: the weights' dtype in every mode.
DTYPES = ("float32", "bfloat16")


def _depths(text: str) -> tuple[int, ...]:
    try:
        depths = tuple(int(d) for d in text.split(",") if d.strip())
    except ValueError:
        raise ConfigError(f"--raw-depths {text!r} is not a comma-separated list of integers, e.g. 1,4,8") from None
    if not depths or min(depths) < 1:
        raise ConfigError(f"--raw-depths {text!r}: requests in flight must be positive integers (0 is not 'the default': leave the flag out)")
    return depths


def run(args: argparse.Namespace) -> int:
    from gds_offload.bench.weights.bench import DEFAULT_MODEL, MODES, TINY, BenchSpec, run_bench
    from gds_offload.bench.weights.doc import bench_document, emit
    from gds_offload.io.factory import validate_mode

    try:  # every flag, before the checkpoint is made and the first child starts
        check_outputs(("--out", args.out, None), ("--plot", args.plot, None))
        modes = modes_arg(args.modes, MODES)
        if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
            raise ConfigError(f"--device {args.device!r}: expected cpu or cuda")
        device = resolve_device(args.device)  # a CUDA device this machine has
        if args.dtype is not None and args.dtype not in DTYPES:
            raise ConfigError(f"--dtype {args.dtype!r}: expected {' or '.join(DTYPES)}")
        try:
            validate_mode(args.engine)
        except ConfigError as exc:
            raise ConfigError(f"--engine {args.engine!r}: {exc}") from None
        model = TINY if args.tiny else DEFAULT_MODEL
        over = (("hidden", args.hidden), ("intermediate", args.intermediate), ("layers", args.layers), ("vocab", args.vocab), ("dtype", args.dtype))
        model = replace(model, **{k: v for k, v in over if v is not None})
        defaults = ((1, 2), 16, 4) if args.tiny else ((1, 8, 64), 16, 3)
        batches = args.batch_sizes or defaults[0]
        depths = _depths(args.raw_depths)
        new_tokens = args.new_tokens or defaults[2]
        if args.rounds < 1 or args.repeats < 1 or new_tokens < 2 or min(batches) < 1:
            raise ConfigError(f"--rounds {args.rounds} --repeats {args.repeats} --batch-sizes {batches}: at least 1 each; --new-tokens {new_tokens}: at least 2")
        limit = memory_limit_arg(args.memory_limit)
        workdir = workdir_arg(args.workdir, tiny=args.tiny)  # last: it creates the directory
        spec = BenchSpec("", "", "", str(workdir), batch_sizes=batches, prompt_len=args.prompt_len or defaults[1], new_tokens=new_tokens,
                         slots=args.slots, num_threads=args.threads, repeats=args.repeats, engine=args.engine, device=device)  # fmt: skip
    except ConfigError as exc:
        print(f"gds-offload bench-weights: {exc}")
        return 2
    from rich.console import Console


    console = Console(stderr=True)
    started = time.time()
    commit = current_commit()  # before the run writes its plot and results into the checkout
    try:
        report = run_bench(spec, modes, model=model, rounds=args.rounds, memory_limit=limit, checkpoint=args.checkpoint,
                           interference_s=0.2 if args.tiny else 2.0,
                           raw_depths=depths, progress=lambda text: console.log(text))  # fmt: skip
    except ConfigError as exc:
        print(f"gds-offload bench-weights: {exc}", file=sys.stderr)
        return 2
    emit(bench_document(report, started=started, workdir=workdir, commit=commit, title=args.title,
                        command=getattr(args, "command_line", None), out=args.out, plot_to=args.plot), args.out)
    failed = [r for r in report["summary"] if r["rounds_ok"] < r["rounds"] or r["matches_resident"] is False]
    return 1 if failed else 0


