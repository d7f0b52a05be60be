"""Gradient accumulation under the offloader: several forwards and backwards per optimizer step.

    python examples/grad_accumulation.py [--steps 3] [--micro-batches 4] [--path DIR] [--mode auto]

Each micro-batch's forward offloads its activations and its backward reads them back;
the offloader keeps the forwards apart, so gradients accumulate exactly as without it.
"""
import argparse

import torch

import gds_offload
from gds_offload.models import GPTConfig, lm_loss, make_gpt, synthetic_batch
from gds_offload.units import format_bytes

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--micro-batches", type=int, default=4)
parser.add_argument("--path", default=None)
parser.add_argument("--mode", default="auto")
args = parser.parse_args()

config = GPTConfig(layers=4, hidden=128, heads=4, seq=128, vocab=1024, dropout=0.1)
model = make_gpt(config, seed=0)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

with gds_offload.attach(model, path=args.path, mode=args.mode, min_bytes="256KiB") as off:
    for step in range(args.steps):
        total = 0.0
        for micro in range(args.micro_batches):
            batch = synthetic_batch(config, batch=4, seed=step * args.micro_batches + micro)
            loss = lm_loss(model, batch) / args.micro_batches
            loss.backward()  # gradients add up in .grad
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {total:.4f} over {args.micro_batches} micro-batches")
    s = off.stats()

print(f"{s.steps} forwards; offloaded {format_bytes(s.bytes_offloaded)}, read back {format_bytes(s.bytes_read)}, "
      f"served from memory {format_bytes(s.bytes_forwarded)}; peak resident {format_bytes(s.peak_resident_bytes)}")
