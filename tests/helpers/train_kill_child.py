"""A fork server for the trainer's kill loop (``test_weights_trainer_kill.py``): imports once,
then for each ``fork`` line on stdin forks a child that trains the store (resuming from the
drive) step after step until it is killed, and prints the child's PID; ``reap PID`` waits for it.

The child appends ``ready STEP`` once it has resumed and ``done STEP`` after each step to
``PROGRESS``. Usage: ``python train_kill_child.py STORE PROGRESS``.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
import transformers

from gds_offload.weights import load_streamed
from gds_offload.weights.trainer import StreamedTrainer

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


def train(store: Path, progress: Path) -> None:
    torch.set_num_threads(1)
    cfg = transformers.AutoConfig.from_pretrained(store)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with load_streamed(model, store, num_threads=2) as lm, StreamedTrainer(lm, OPTIMIZER) as trainer:
        with open(progress, "a") as log:
            print("ready", trainer.step_count, file=log, flush=True)
            while True:
                trainer.step(batches(trainer.step_count), max_norm=1.0)
                print("done", trainer.step_count, file=log, flush=True)


def main() -> None:
    store, progress = Path(sys.argv[1]), Path(sys.argv[2])
    # transformers imports a model's modules at first use: once here, not in every child (seconds each).
    cfg = transformers.AutoConfig.from_pretrained(store)
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(cfg)
    for line in sys.stdin:
        cmd = line.split()
        if cmd == ["fork"]:
            pid = os.fork()
            if pid == 0:
                try:
                    train(store, progress)
                finally:
                    os._exit(1)
            print(pid, flush=True)
        elif cmd and cmd[0] == "reap":
            _, status = os.waitpid(int(cmd[1]), 0)
            print(status, flush=True)


if __name__ == "__main__":
    main()
