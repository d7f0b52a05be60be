"""A fork server for the trainer's kill loop (``test_weights_trainer_kill.py``): imports once,
then for each ``fork N`` line on stdin forks a child that trains the store (resuming from the
drive) step after step, and prints the child's PID; ``reap PID`` waits for it and prints its status.

The kills are aimed at events, not at times: once resumed, the child counts every event of its
steps (each streamed or resident layer's forward, and every file it opens, renames, removes or
truncates: the unlinking of the old generation, each weight and state file written,
``step.json.partial``, the rename, the first file opened after it) and SIGKILLs itself at the
``N``-th, whatever the machine's speed. ``fork 0`` runs one step and then kills itself.

The child appends ``ready STEP`` once it has resumed and ``done STEP EVENTS`` (events counted so
far) after each step to ``PROGRESS``. Usage: ``python train_kill_child.py STORE PROGRESS``.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import torch
import transformers

from gds_offload.weights import load_streamed
from gds_offload.weights.train.trainer import StreamedTrainer

VOCAB = 256
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, foreach=False)


def batches(step: int) -> list[dict[str, torch.Tensor]]:
    """Step ``step``'s two micro-batches (the same in the test's reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 10), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


#: The audit events counted as a step's file operations (``os.unlink`` raises ``os.remove``).
FILE_EVENTS = frozenset({"open", "os.rename", "os.replace", "os.remove", "os.truncate"})


class _Events:
    """Counts events once armed and SIGKILLs the process at the ``target``-th (0: never)."""

    def __init__(self, target: int) -> None:
        self.target, self.count, self.armed = target, 0, False

    def hit(self) -> None:
        if not self.armed:
            return
        self.count += 1
        if self.count == self.target:
            os.kill(os.getpid(), signal.SIGKILL)

    def audit(self, event: str, args: tuple[object, ...]) -> None:
        if event in FILE_EVENTS:
            self.hit()


def train(store: Path, progress: Path, target: int) -> None:
    torch.set_num_threads(1)
    events = _Events(target)
    sys.addaudithook(events.audit)  # engine threads' opens count too
    cfg = transformers.AutoConfig.from_pretrained(store)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: events.hit())
    with load_streamed(model, store, num_threads=2) as lm, StreamedTrainer(lm, OPTIMIZER) as trainer:
        with open(progress, "a") as log:
            print("ready", trainer.step_count, file=log, flush=True)
            events.armed = True
            while True:
                trainer.step(batches(trainer.step_count), max_norm=1.0)
                print("done", trainer.step_count, events.count, file=log, flush=True)
                if target == 0:
                    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    store, progress = Path(sys.argv[1]), Path(sys.argv[2])
    # transformers imports a model's modules at first use: once here, not in every child (seconds each).
    cfg = transformers.AutoConfig.from_pretrained(store)
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(cfg)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "fork":
            pid = os.fork()
            if pid == 0:
                try:
                    train(store, progress, int(cmd[1]))
                finally:
                    os._exit(1)
            print(pid, flush=True)
        elif cmd and cmd[0] == "reap":
            _, status = os.waitpid(int(cmd[1]), 0)
            print(status, flush=True)


if __name__ == "__main__":
    main()
