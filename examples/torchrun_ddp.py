"""Data-parallel training (DDP) with the offloader: each rank spills to its own directory.

One node, 8 GPUs, drive i for local rank i (the directories must exist):

    torchrun --nproc-per-node 8 examples/torchrun_ddp.py --path '/mnt/nvme{local_rank}/spill'

One node, the NVMe drive closest to each GPU (what it picks: ``gds-check --ranks --path auto``):

    torchrun --nproc-per-node 8 examples/torchrun_ddp.py --path auto

Two nodes: run this on each, HEAD being the first node's address:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\
        --rdzv-id demo1 examples/torchrun_ddp.py --path '/mnt/nvme{local_rank}/spill'

CPU only (gloo), two processes, with the exactness check:

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --steps 3 --check

Under SLURM, ``srun`` starts one task per GPU and its variables give the ranks: see
``examples/slurm.sbatch``. Without ``--path`` each rank spills to
``<default>/rank<rank>`` (``$GDS_OFFLOAD_DIR``, else ``<tmp>/gds_offload-<uid>``).

``--check`` first trains the same steps without the offloader, then compares every loss
and the final parameters bit for bit (``torch.equal``). Rank 0 prints the counters of all
ranks together (``off.stats(all_ranks=True)``).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - imported before init_process_group: see there
from torch.nn.parallel import DistributedDataParallel

import gds_offload
from gds_offload.models import GPTConfig, lm_loss, make_gpt, synthetic_batch
from gds_offload.units import format_bytes

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--path", default=None, help="spill directory: a {local_rank}/{rank} template, 'auto', or a directory")
parser.add_argument("--mode", default="auto", help="engine: auto, gds, compat, posix or host")
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--hidden", type=int, default=128)
parser.add_argument("--check", action="store_true", help="train without the offloader first and compare bit for bit")
args = parser.parse_args()

# torchrun sets RANK/WORLD_SIZE/MASTER_ADDR; under srun the SLURM variables give the rank and
# the batch script exports MASTER_ADDR/MASTER_PORT.
launch = gds_offload.rank_env()
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(launch.local_rank or 0)
# torch.distributed.nn.functional (which DDP imports on first use) binds ``group.WORLD`` as the
# default argument of its functions when it is imported: imported after this line, it would hold
# the process group for good. destroy_process_group() could then not free the group, gloo's
# worker threads would run on into interpreter exit, and one still releasing a finished
# collective's tensor there aborts the rank ("terminate called without an active exception").
# Hence its import above.
dist.init_process_group("nccl" if cuda else "gloo", rank=launch.rank or 0, world_size=launch.world_size)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
if not cuda:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
config = GPTConfig(layers=args.layers, hidden=args.hidden, heads=4, seq=128, vocab=1024)


def train(offload: bool):
    model = make_gpt(config, seed=0, device=device)  # the same weights on every rank
    off = gds_offload.attach(model, path=args.path, mode=args.mode, min_bytes="64KiB") if offload else None
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    losses = []
    for step in range(args.steps):
        loss = lm_loss(ddp, synthetic_batch(config, batch=4, seed=step * world + rank, device=device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
        if rank == 0:
            print(f"{'offload' if offload else 'keep'} step {step}: loss {loss.item():.4f}", flush=True)
    stats = None
    if off is not None:
        print(f"rank {rank}: spilled to {', '.join(map(str, off.config.paths))} ({off.engine.name})", flush=True)
        stats = off.stats(all_ranks=True)  # a collective: every rank calls it
        off.detach()
    return losses, [p.detach().clone() for p in model.parameters()], stats


reference = train(offload=False) if args.check else None
losses, params, s = train(offload=True)
exact = True
if reference is not None:
    same = all(torch.equal(a, b) for a, b in zip(reference[0], losses)) and all(torch.equal(a, b) for a, b in zip(reference[1], params))
    flags = torch.tensor([int(same)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    exact = bool(flags.item())
if rank == 0:
    print(
        f"all {s.ranks} ranks, {s.steps} steps: offloaded {format_bytes(s.bytes_offloaded)}, read {format_bytes(s.bytes_read)}, "
        f"kept {format_bytes(s.bytes_kept)}, fell back {format_bytes(s.bytes_fallback)}; largest peak resident "
        f"{format_bytes(s.peak_resident_bytes)}; I/O wait {s.io_wait_s:.3f} s; engine {s.engine}"
    )
    if reference is not None:
        print("losses and parameters bit-identical to the run without the offloader on every rank:", "yes" if exact else "NO")
dist.barrier()  # no rank tears its connections down while another is still using them
dist.destroy_process_group()
sys.exit(0 if exact else 1)
