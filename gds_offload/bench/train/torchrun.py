"""Launching ranks through torchrun: the command line, and a torchrun that stops with its parent.

:func:`torchrun_command` is the one place that spells ``python -m torch.distributed.run
--nproc-per-node N --standalone -m MODULE ...`` (``demo --nproc`` and ``bench --nproc``).

``bench --nproc`` runs torchrun as a child of its own (:func:`~gds_offload.bench.procs.spawn`),
so it passes ``owned=True``: the command then starts this module, which asks the kernel to stop
it with its parent (:func:`~gds_offload.bench.procs.die_with_parent`) and runs torchrun in
this same process. Its ranks, children of torchrun, call ``die_with_parent`` too, against
torchrun's pid (set here in :data:`~gds_offload.bench.procs.PARENT_ENV`): so killing the
command, or torchrun being killed on a timeout, leaves no rank running. On ``SIGTERM`` torchrun
itself stops its ranks before it exits.
"""
from __future__ import annotations

import os
import sys

from gds_offload.bench.procs import PARENT_ENV, die_with_parent

__all__ = ["torchrun_command", "main"]


def torchrun_command(nproc: int, module: str, args: list[str], *, owned: bool = False, python: str | None = None) -> list[str]:
    """The command that starts ``nproc`` ranks of ``python -m module *args`` on this node.

    Args:
        nproc: ranks (``--nproc-per-node``); ``--standalone`` picks a free rendezvous port.
        module: what each rank runs with ``-m``.
        args: its arguments.
        owned: start torchrun through this module, tied to its parent (see the module doc).
        python: the interpreter (default: this one).
    """
    launcher = "gds_offload.bench.train.torchrun" if owned else "torch.distributed.run"
    return [python or sys.executable, "-m", launcher, "--nproc-per-node", str(nproc), "--standalone", "-m", module, *args]


def main(argv: list[str] | None = None) -> None:
    """torchrun (``torch.distributed.run``'s arguments), stopped with the process that started it."""

    die_with_parent()
    os.environ[PARENT_ENV] = str(os.getpid())  # the ranks' parent is this process
    from torch.distributed.run import main as torchrun

    torchrun(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
