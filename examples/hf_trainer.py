"""Hugging Face Trainer with the offloader: OffloadCallback, on one process or several.

    python examples/hf_trainer.py [--steps 3] [--path DIR] [--mode auto] [--check]

With ``accelerate launch`` (or torchrun) each process trains one data-parallel replica;
give each its own drive with a template, or let it spill to ``<default>/rank<rank>``:

    accelerate launch --multi_gpu --num_processes 8 examples/hf_trainer.py --path '/mnt/nvme{local_rank}/spill'
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py --steps 3 --check

(``--multi_gpu`` selects accelerate's torchrun launcher; on a machine without GPUs the
Trainer then trains on the CPU over gloo, while ``--cpu`` would start a single process.)

A small GPT-2 built from a config (random weights: nothing is downloaded) trains on
random tokens. The callback attaches when training begins, adds ``gds_offload/*``
figures to the logs, and detaches when it ends; under a launch of several processes the
main process also prints every rank's counters combined (``callback.final_stats_all_ranks``).
``--check`` first trains without the callback and compares every logged loss and the final
parameters bit for bit.
"""
import argparse
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gds_offload.integrations.transformers import OffloadCallback
from gds_offload.units import format_bytes

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--path", default=None)
parser.add_argument("--mode", default="auto")
parser.add_argument("--check", action="store_true", help="train without the offloader first and compare bit for bit")
args = parser.parse_args()


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 1024, (128,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def train(callbacks):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_embd=128, n_layer=4, n_head=4, n_positions=128,
                                       bos_token_id=0, eos_token_id=0))
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=8, logging_steps=1,
                                     save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
        trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(), callbacks=callbacks)
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, losses, [p.detach().clone() for p in model.parameters()]


reference = train([]) if args.check else None
callback = OffloadCallback(path=args.path, mode=args.mode, min_bytes="256KiB")
trainer, losses, params = train([callback])
main = trainer.is_world_process_zero()

s = callback.final_stats
print(f"offloader (process {trainer.args.process_index}): engine {s.engine}; {s.steps} steps; offloaded "
      f"{format_bytes(s.bytes_offloaded)}, deduplicated {format_bytes(s.bytes_deduplicated)}; peak resident "
      f"{format_bytes(s.peak_resident_bytes)}")
if main:
    last = [e for e in trainer.state.log_history if "loss" in e][-1]
    print("last log entry:", {k: v for k, v in last.items() if k.startswith("gds_offload/")})
    a = callback.final_stats_all_ranks
    if a is not None:
        print(f"all {a.ranks} ranks: offloaded {format_bytes(a.bytes_offloaded)}, read {format_bytes(a.bytes_read)}, "
              f"fell back {format_bytes(a.bytes_fallback)}; largest peak resident {format_bytes(a.peak_resident_bytes)}")
exact = True
if reference is not None:
    exact = reference[1] == losses and all(torch.equal(a, b) for a, b in zip(reference[2], params))
    print(f"process {trainer.args.process_index}: logged losses and parameters bit-identical to the run without "
          f"the offloader: {'yes' if exact else 'NO'}")
sys.exit(0 if exact else 1)
