"""``gds-offload``: one subcommand per module in :mod:`gds_offload.commands`.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit code), and imports heavy packages inside ``run``.

Stopping: Ctrl-C (``SIGINT``), ``SIGTERM`` and ``SIGHUP`` stop the command and the child
processes it runs (:mod:`gds_offload.bench.procs`); it prints one line and exits with
128 + the signal number (130 for Ctrl-C).
"""
from __future__ import annotations

import argparse
import importlib
import shlex
import signal
import sys
from collections.abc import Sequence

from gds_offload._version import __version__
from gds_offload.bench.procs import Terminated, stop_signals

__all__ = ["main"]

#: What ``gds-offload --help`` says the package does: both halves.
DESCRIPTION = (
    "Offloading for PyTorch models larger than GPU memory: activations saved for backward go to NVMe "
    "(GPUDirect Storage through KvikIO, or O_DIRECT) and come back before backward; weights stream layer "
    "by layer from an NVMe store for inference and fine-tuning. Start with `gds-offload demo`."
)

COMMANDS: dict[str, str] = {
    "info": "gds_offload.commands.info",
    "bench-io": "gds_offload.commands.bench_io",
    "demo": "gds_offload.commands.demo",
    "bench": "gds_offload.commands.bench",
    "rok": "gds_offload.commands.rok",
    "convert": "gds_offload.commands.convert",
    "export": "gds_offload.commands.export",
    "bench-weights": "gds_offload.commands.bench_weights",
    "bench-finetune": "gds_offload.commands.bench_finetune",
    "plan": "gds_offload.commands.plan",
    "bench-plan": "gds_offload.commands.bench_plan",
    "report": "gds_offload.commands.report",
    "shards": "gds_offload.commands.shards",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gds-offload", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"gds_offload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    #: The command line as given, recorded in result files so a figure names its command.
    args.command_line = "gds-offload " + shlex.join(argv)
    if not getattr(args, "_run", None):
        print("gds-offload: no command given; try `gds-offload demo` (the main job), or `gds-offload --help` for every command",
              file=sys.stderr)
        return 2

    try:
        with stop_signals():
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return stopped(f"gds-offload {args.command}", signal.SIGINT)
    except Terminated as exc:
        return stopped(f"gds-offload {args.command}", exc.signum)


def stopped(prog: str, signum: int) -> int:
    """Say in one line (on stderr) that ``prog`` was stopped by ``signum``; the exit code to return."""
    name = signal.Signals(signum).name
    what = "interrupted (SIGINT)" if signum == signal.SIGINT else f"stopped by {name}"
    print(f"{prog}: {what}", file=sys.stderr)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
