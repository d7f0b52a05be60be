"""Hugging Face Trainer with the offloader: OffloadCallback.

    python examples/hf_trainer.py [--steps 3] [--path DIR] [--mode auto]

A small GPT-2 built from a config (random weights: nothing is downloaded) trains on
random tokens. The callback attaches when training begins, adds ``gds_offload/*``
figures to the logs, and detaches when it ends.
"""
import argparse
import os
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
args = parser.parse_args()


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 1024, (128,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_embd=128, n_layer=4, n_head=4, n_positions=128,
                                   bos_token_id=0, eos_token_id=0))
callback = OffloadCallback(path=args.path, mode=args.mode, min_bytes="256KiB")
with tempfile.TemporaryDirectory() as out:
    training = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=8, logging_steps=1,
                                 save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(), callbacks=[callback])
    trainer.train()

s = callback.final_stats
print(f"offloader: engine {s.engine}; {s.steps} steps; offloaded {format_bytes(s.bytes_offloaded)}, "
      f"deduplicated {format_bytes(s.bytes_deduplicated)}; peak resident {format_bytes(s.peak_resident_bytes)}")
last = [e for e in trainer.state.log_history if "loss" in e][-1]
print("last log entry:", {k: v for k, v in last.items() if k.startswith("gds_offload/")})
