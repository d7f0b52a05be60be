"""Mixed precision: bf16 autocast with the offloader (works on CPU and GPU).

    python examples/amp_bf16.py [--steps 3] [--path DIR] [--mode auto] [--device cpu|cuda]

Under autocast, autograd saves bf16 activations (half the bytes of fp32) next to the
fp32 weights' bf16 copies; the offloader moves whatever dtype autograd saves, bit for bit.
"""
import argparse

import torch

import gds_offload
from gds_offload.models import GPTConfig, lm_loss, make_gpt, synthetic_batch
from gds_offload.units import format_bytes

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--path", default=None)
parser.add_argument("--mode", default="auto")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()

config = GPTConfig(layers=4, hidden=128, heads=4, seq=128, vocab=1024)
model = make_gpt(config, seed=0, device=args.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

with gds_offload.attach(model, path=args.path, mode=args.mode, min_bytes="128KiB") as off:
    for step in range(args.steps):
        batch = synthetic_batch(config, batch=8, seed=step, device=args.device)
        with torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16):
            loss = lm_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    s = off.stats()

print(f"per step: saved {format_bytes(s.bytes_packed / s.steps)}, offloaded {format_bytes(s.bytes_offloaded / s.steps)}; "
      f"engine {s.engine}, GDS {'yes' if s.gds else 'no'}")
