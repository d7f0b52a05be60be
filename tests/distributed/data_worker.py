"""Worker for ``test_data_hardening.py``: run under ``torchrun --nproc-per-node 3`` (gloo, CPU).

Usage: ``torchrun ... data_worker.py SHARD_DIR OUT_DIR EPOCHS``.

Each rank builds the README's loader, ``TokenLoader(dir, batch_size=8, shard_id=rank,
num_shards=world, seed=0)``, and trains a tiny model under DDP on its batches for
``EPOCHS`` epochs. Before each step the ranks agree, with one all-reduce, on whether every
rank has a batch: where one has run out while another has not (the uneven counts that
would hang DDP's gradient all-reduce), each rank records the step and stops instead of
hanging. ``OUT_DIR/rank{rank}.json``: per epoch, the batch sizes, the served windows, and
the step where the ranks disagreed (None when they never did).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gds_offload.data import TokenLoader


def main() -> None:
    shards, out, epochs = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = TokenLoader(shards, batch_size=8, shard_id=rank, num_shards=world, seed=0, device="cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Embedding(4096, 8), nn.Linear(8, 4096)))
    record = []
    for _ in range(epochs):
        sizes, windows, disagreed = [], [], None
        it = iter(loader)
        while True:
            batch = next(it, None)
            have = torch.tensor([batch is not None], dtype=torch.int64)
            low, high = have.clone(), have.clone()
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            if int(low) != int(high):
                disagreed = len(sizes)
                break
            if batch is None:
                break
            logits = model(batch["input_ids"])
            nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()
            sizes.append(int(batch["input_ids"].shape[0]))
            windows.extend(torch.cat([batch["input_ids"], batch["labels"][:, -1:]], 1).tolist())
        record.append({"sizes": sizes, "windows": windows, "disagreed": disagreed})
        if disagreed is not None:
            break
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
