"""Lightning Fabric (DDP) with the offloader: ``pip install lightning``.

    python examples/fabric_ddp.py --devices 8 --path '/mnt/nvme{local_rank}/spill'    # one node, 8 GPUs
    python examples/fabric_ddp.py --devices 2 --steps 3 --check                        # CPU, gloo

``fabric.launch()`` starts the other processes itself (or run the script under
``torchrun``/``srun``; Fabric reads their variables, and so does ``attach``). Attach to
the module before ``fabric.setup`` wraps it: the wrapper's forward calls the module's, so
the offloader's hooks run. Each rank spills to its own directory (the template, or
``<default>/rank<rank>``). ``--check`` first trains without the offloader and compares every
loss and the final parameters bit for bit; rank 0 prints every rank's counters combined.
"""
import argparse
import sys

import torch
from lightning.fabric import Fabric

import gds_offload
from gds_offload.models import GPTConfig, lm_loss, make_gpt, synthetic_batch
from gds_offload.units import format_bytes

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--path", default=None, help="spill directory: a {local_rank}/{rank} template, 'auto', or a directory")
parser.add_argument("--mode", default="auto")
parser.add_argument("--check", action="store_true", help="train without the offloader first and compare bit for bit")
args = parser.parse_args()

fabric = Fabric(accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=args.devices, strategy="ddp")
fabric.launch()
config = GPTConfig(layers=4, hidden=128, heads=4, seq=128, vocab=1024)


def train(offload: bool):
    module = make_gpt(config, seed=0)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-4)
    model, optimizer = fabric.setup(module, optimizer)  # moves the module to this rank's device
    off = gds_offload.attach(module, path=args.path, mode=args.mode, min_bytes="64KiB") if offload else None
    losses = []
    for step in range(args.steps):
        batch = synthetic_batch(config, batch=4, seed=step * fabric.world_size + fabric.global_rank, device=fabric.device)
        loss = lm_loss(model, batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    stats = None
    if off is not None:
        stats = off.stats(all_ranks=True)  # a collective: every rank calls it
        off.detach()
    return losses, [p.detach().clone() for p in module.parameters()], stats


reference = train(offload=False) if args.check else None
losses, params, s = train(offload=True)
exact = reference is None or (
    all(torch.equal(a, b) for a, b in zip(reference[0], losses)) and all(torch.equal(a, b) for a, b in zip(reference[1], params))
)
exact = bool(fabric.all_reduce(torch.tensor(float(exact)), reduce_op="min"))  # every rank's verdict
fabric.print(f"all {s.ranks} ranks, {s.steps} steps: offloaded {format_bytes(s.bytes_offloaded)}, read {format_bytes(s.bytes_read)}, "
             f"largest peak resident {format_bytes(s.peak_resident_bytes)}; engine {s.engine}")
if reference is not None:
    fabric.print("losses and parameters bit-identical to the run without the offloader on every rank:", "yes" if exact else "NO")
fabric.barrier()
sys.exit(0 if exact else 1)
