"""Layer-major generation and accumulation on a GPU: ``generate_many`` (the KV cache on the device
and on the drive) and ``accumulate`` (LoRA, three AdamW steps) with the layers streamed into
device memory equal the resident model on the same GPU running the same micro-batches one after
another: tokens, scores, losses, gradients and adapters ``torch.equal``.

Marked ``gpu``: ``pytest -m gpu`` (``scripts/gpu_check.sh``) runs them; without CUDA each skips
naming the missing GPU.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.gates import requires_cuda  # noqa: E402
from helpers.llama import VOCAB, assert_same_generation, llama_config, meta_skeleton, save_checkpoint  # noqa: E402

from gds_offload.weights import as_reference, convert, load_streamed  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_cuda]


@pytest.fixture(scope="module")
def ckpt_store() -> Iterator[tuple[Path, Path]]:
    d = Path(os.environ.get("GDS_TEST_DIR") or real_disk_base()) / f"gds_offload-layer-major-gpu-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    try:
        ckpt = save_checkpoint(llama_config(max_position_embeddings=128), d / "ckpt")
        convert(ckpt, d / "store")
        yield ckpt, d / "store"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _prompts(n: int = 9) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g) for _ in range(n)]


@pytest.mark.parametrize("kv", ["device", "host", "drive"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generate_many_on_cuda_equals_the_resident_model_per_micro_batch(ckpt_store: tuple[Path, Path], tmp_path: Path, kv: str, sample: bool) -> None:
    ckpt, store = ckpt_store
    kw: dict[str, Any] = dict(max_new_tokens=5, do_sample=sample, top_k=20 if sample else None, output_scores=True, return_dict_in_generate=True)
    with load_streamed(meta_skeleton(store), store, device="cuda", slots=2) as lm:
        out = lm.generate_many(_prompts(), micro_batch=3, per_load=2, kv=kv, kv_path=tmp_path / "kv", seed=7, pad_token_id=0, **kw)
    ref = as_reference(transformers.AutoModelForCausalLM.from_pretrained(ckpt).cuda().eval())
    assert len(out.micro_batches) > 0 and len(out.outputs) == len(out.micro_batches)
    for j, (mb, got) in enumerate(zip(out.micro_batches, out.outputs, strict=True)):
        torch.manual_seed(7 + j)
        want = ref.generate(mb.input_ids.cuda(), attention_mask=mb.attention_mask.cuda(), pad_token_id=0, **kw)
        assert_same_generation(got, want, f"micro-batch {j}: ")


def test_accumulate_on_cuda_equals_ordinary_accumulation_on_the_resident_model(ckpt_store: tuple[Path, Path]) -> None:
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'gds_offload[hf]')")
    ckpt, store = ckpt_store
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    g = torch.Generator().manual_seed(5)
    batches = [{"input_ids": (ids := torch.randint(0, VOCAB, (2, 10), generator=g).cuda()), "labels": ids} for _ in range(4)]

    def train(model: Any, run: Any) -> list[Any]:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
        record = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            losses = run(batches)
            opt.step()
            record.append((losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}))
        return record

    torch.manual_seed(1)
    ref = peft.get_peft_model(as_reference(transformers.AutoModelForCausalLM.from_pretrained(ckpt).cuda()), lora)
    ref.train()
    want = train(ref, lambda bs: [(loss := ref(**b).loss).backward() or loss.detach() for b in bs])
    torch.manual_seed(1)
    model = peft.get_peft_model(meta_skeleton(store), lora)
    with load_streamed(model, store, device="cuda", slots=2) as lm:
        lm.model.train()
        got = train(lm.model, lambda bs: lm.accumulate(bs, per_load=2, seed=3))
    assert len(got) == len(want), f"{len(got)} steps, the reference ran {len(want)}"
    for step, ((gl, ga), (wl, wa)) in enumerate(zip(got, want, strict=True)):
        assert len(gl) == len(wl) and all(torch.equal(a, b) for a, b in zip(gl, wl, strict=True)), f"step {step}: losses"
        assert ga.keys() == wa.keys() and all(torch.equal(ga[k], wa[k]) for k in wa), f"step {step}: adapters"
