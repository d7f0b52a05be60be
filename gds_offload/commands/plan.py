"""``gds-offload plan``: measure a weight store's model on this machine and choose the shape of a
workload (micro-batch size, micro-batches per weight load, resident layers, ring slots, KV cache
placement, prefill chunk) that runs fastest under a memory limit; print it with the alternatives.

Examples::

    gds-offload plan /mnt/nvme0/llama-store --memory 1.2GiB --workload generate --prompts 512 --prompt-len 64 --new-tokens 32
    gds-offload plan STORE --memory 20GiB --device cuda --out plan.json --plot plan.png

Exit status: 0 a plan was chosen; 2 bad input (one line, before anything is measured where the
store alone shows it: a memory limit below what any plan needs, a workload longer than the model).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gds_offload.commands.run_args import check_outputs
from gds_offload.errors import ConfigError, OffloadError
from gds_offload.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from gds_offload.weights.planning.planner import Plan, Profile
    from gds_offload.weights.planning.workload import Workload

HELP = "measure a weight store's model here and plan a workload's shape under a memory limit (micro-batches per weight load, KV placement, ...)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", type=Path, help="the weight store (gds-offload convert)")
    p.add_argument("--memory", required=True, help="the memory the run may use, e.g. 1.2GiB (on a GPU: its memory)")
    p.add_argument("--workload", choices=["generate", "finetune"], default="generate", help="what to plan (default generate)")
    p.add_argument("--prompts", type=int, default=512, help="generate: prompts to generate for (default 512)")
    p.add_argument("--prompt-len", type=int, default=64, help="generate: tokens per prompt (default 64)")
    p.add_argument("--new-tokens", type=int, default=32, help="generate: tokens to generate per prompt (default 32)")
    p.add_argument("--sequences", type=int, default=1024, help="finetune: sequences to train on (default 1024)")
    p.add_argument("--seq", type=int, default=256, help="finetune: tokens per sequence (default 256)")
    p.add_argument("--global-batch", type=int, default=64, help="finetune: sequences per optimizer step (default 64)")
    p.add_argument("--lora-r", type=int, default=8, help="finetune: LoRA rank, adapters on every linear layer (default 8)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--engine", default="auto", help="the reads' engine: auto (default), gds, compat, posix")
    p.add_argument("--out", type=Path, default=None, help="write the plan as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write the curve (tokens/s against sequences per load) as a PNG here")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from gds_offload.weights.planning.planner import Finetune, Generate, check_feasible, choose
    from gds_offload.weights.run.profile import trust

    try:
        memory = parse_bytes(args.memory, name="--memory")
        if memory <= 0:
            raise ConfigError("--memory=0: give the memory the run may use, e.g. 1.2GiB")
        workload = (Finetune(args.sequences, args.seq, args.global_batch, args.lora_r) if args.workload == "finetune"
                    else Generate(args.prompts, args.prompt_len, args.new_tokens))  # fmt: skip
        check_outputs(("--out", args.out, None), ("--plot", args.plot, None))
        check_feasible(args.store, workload, memory)
        profile = _measure(args, workload, memory)
        doubt = trust(profile.measured)
        if doubt is not None:
            print(f"gds-offload plan: warning: the profile was {doubt}", file=sys.stderr)
        plan = choose(profile, workload, memory)
    except (ConfigError, OffloadError, OSError) as exc:
        print(f"gds-offload plan: {exc}", file=sys.stderr)
        return 2
    doc = plan.as_dict() | {"command": getattr(args, "command_line", "gds-offload plan")}
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot is not None:
        from gds_offload.bench.plan.plot import plot_plan

        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _render(plan)
    return 0


def _measure(args: argparse.Namespace, workload: Workload, memory: int) -> Profile:
    from rich.console import Console

    from gds_offload.weights.run.measure import measure

    console = Console(stderr=True)
    if not console.is_terminal:
        return measure(args.store, workload, device=args.device, engine=args.engine, memory=memory,
                       progress=lambda what: print(f"gds-offload plan: {what}", file=sys.stderr, flush=True))  # fmt: skip
    with console.status("measuring") as status:
        return measure(args.store, workload, device=args.device, engine=args.engine, memory=memory,
                       progress=lambda what: status.update(f"measuring: {what}"))  # fmt: skip


def _render(plan: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    p = plan.profile
    console.print(f"[bold]plan[/bold]: {plan.describe()}")
    if p.train_forward.per_row:
        console.print(f"measured: read {p.read_Bps / 1e9:.2f} GB/s; a layer {format_bytes(p.layer_nbytes)}: forward "
                      f"{p.train_forward.per_row * 1e3:.3f} ms/token, backward {p.train_backward.per_row * 1e3:.3f} ms/token, "
                      f"{format_bytes(p.saved_nbytes)} saved per token; base memory {format_bytes(p.base_nbytes)}")  # fmt: skip
    else:
        chunked = f" ({p.prefill_chunked.per_row * 1e3:.3f} in a chunk on a cache)" if p.prefill_chunked is not None else ""
        console.print(f"measured: read {p.read_Bps / 1e9:.2f} GB/s; a layer {format_bytes(p.layer_nbytes)}: prefill "
                      f"{p.prefill.per_row * 1e3:.3f} ms/token{chunked}, decode {p.decode.fixed * 1e3:.1f} ms + {p.decode.per_row * 1e3:.3f} ms/sequence; "
                      f"base memory {format_bytes(p.base_nbytes)}")  # fmt: skip
    from gds_offload.weights.planning.planner import variant

    t = Table(title="the choice, and the best plan at each micro-batch size and variant")
    for col in ("shape", "resident+slots", "variant", "chunk", "tok/s", "peak", "bound", ""):
        t.add_column(col, justify="left" if col in ("shape", "variant", "bound", "") else "right")
    for e, why in [(plan.predicted, "chosen"), *plan.alternatives]:
        c = e.choice
        t.add_row(f"{c.per_load} x {c.micro_batch}", f"{c.resident_layers}+{c.slots}", variant(plan.workload, c), str(c.prefill_chunk or "-"),
                  f"{e.tokens_per_s:.1f}", format_bytes(e.peak_nbytes), e.bound, "chosen" if why == "chosen" else ("slower" if e.fits else "over memory"))  # fmt: skip
    console.print(t)
