"""Fine-tune LoRA adapters on a model whose layers stream from a weight store.

    python examples/lora_streamed.py [--steps 5] [--path /mnt/nvme0/lora-demo] [--check]

Builds a small Llama from a config (random weights, saved as a safetensors checkpoint),
converts it to a store under ``--path``, puts LoRA adapters on the meta skeleton with PEFT,
and trains them with every decoder layer read from the store for each forward (one ring
slot: nothing else fits) and again for backward. ``--check`` trains the same adapters on the
resident model too and compares the losses bit for bit.
"""
import argparse
import tempfile
from pathlib import Path

import peft
import torch
import transformers

from gds_offload.units import format_bytes
from gds_offload.weights import convert, load_streamed

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--path", default=None, help="where the checkpoint and the store go (default: a temporary directory)")
parser.add_argument("--check", action="store_true", help="also train on the resident model and compare the losses")
args = parser.parse_args()

work = Path(args.path or tempfile.mkdtemp(prefix="gds_offload-lora-"))
config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256)  # fmt: skip
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(config).save_pretrained(work / "checkpoint")
if not (work / "store" / "manifest.json").exists():
    convert(work / "checkpoint", work / "store")


def lora() -> peft.LoraConfig:
    return peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def train(model: torch.nn.Module) -> list[torch.Tensor]:
    """``args.steps`` AdamW steps on fixed synthetic batches; the losses."""
    torch.manual_seed(1)  # the same adapter initialisation for every model
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        print(f"step {step}: loss {loss.item():.4f}")
    return losses


with torch.device("meta"):
    skeleton = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(work / "store"))
with load_streamed(peft.get_peft_model(skeleton, lora()), work / "store", slots=1) as lm:
    lm.model.print_trainable_parameters()
    streamed = train(lm.model)
    s = lm.stats()
print(f"read {format_bytes(s.bytes_read)} of layers for forwards; each layer read again for backward {s.backward_reads} times")

if args.check:
    resident = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(work / "checkpoint"), lora())
    same = all(torch.equal(a, b) for a, b in zip(streamed, train(resident)))
    print("losses equal to the resident model's:", same)
    raise SystemExit(0 if same else 1)
