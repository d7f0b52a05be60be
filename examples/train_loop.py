"""Offload a GPT's activations in a plain PyTorch training loop.

    python examples/train_loop.py [--steps 5] [--path /mnt/nvme/spill] [--mode auto]

``attach(model)`` finds the GPT's blocks, and from then on every forward writes the
activations autograd saves to the spill directory and backward reads them back. The
losses are exactly those of training without it.
"""
import argparse

import torch

import gds_offload
from gds_offload.models import GPTConfig, lm_loss, make_gpt, synthetic_batch
from gds_offload.units import format_bytes

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--path", default=None, help="spill directory (default: $GDS_OFFLOAD_DIR or <tmp>/gds_offload-<uid>)")
parser.add_argument("--mode", default="auto", help="engine: auto, gds, compat, posix or host")
args = parser.parse_args()

config = GPTConfig(layers=4, hidden=128, heads=4, seq=128, vocab=1024)
model = make_gpt(config, seed=0)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

with gds_offload.attach(model, path=args.path, mode=args.mode, min_bytes="256KiB") as off:
    print(f"engine: {off.engine.name} ({off.stats().engine_reason}); layers: {', '.join(off.layer_names)}")
    for step in range(args.steps):
        loss = lm_loss(model, synthetic_batch(config, batch=8, seed=step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    s = off.stats()

print(
    f"per step: saved {format_bytes(s.bytes_packed / s.steps)}, offloaded {format_bytes(s.bytes_offloaded / s.steps)}, "
    f"deduplicated {format_bytes(s.bytes_deduplicated / s.steps)}; peak resident {format_bytes(s.peak_resident_bytes)}; "
    f"I/O wait {s.io_wait_s:.3f} s in {s.steps} steps"
)
