"""Layer-major gradient accumulation (gds_offload.weights.run.accumulate): several micro-batches per
weight load in forward and backward, losses, gradients and LoRA adapters after three AdamW steps
``torch.equal`` to the resident PEFT model accumulating the same micro-batches, on every engine,
with and without the activation offloader attached, and each layer read once per round."""
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
peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.gates import ENGINES  # noqa: E402

import gds_offload  # noqa: E402
from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.weights import as_reference, convert, load_streamed  # noqa: E402

LAYERS = 4


@pytest.fixture(scope="module")
def ckpt_store() -> Iterator[tuple[Path, Path]]:
    base = real_disk_base() / f"gds_offload-accumulate-{os.getpid()}"
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(base / "ckpt")
    convert(base / "ckpt", base / "store")
    yield base / "ckpt", base / "store"
    shutil.rmtree(base, ignore_errors=True)


def _lora() -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.1)


def _batches(n: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 256, (2, 10), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _train(model: torch.nn.Module, run: Any, steps: int = 3) -> list[Any]:
    """``steps`` optimizer steps of ``run(batches) -> losses``; each step's losses, gradients and adapters after it."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    record = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = run(_batches())
        grads = _grads(model)
        opt.step()
        record.append((losses, grads, _adapters(model)))
    return record


def _reference(ckpt: Path, seed: int) -> list[Any]:
    torch.manual_seed(1)
    model = peft.get_peft_model(as_reference(transformers.AutoModelForCausalLM.from_pretrained(ckpt)), _lora())
    model.train()

    def run(batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        losses = []
        for j, b in enumerate(batches):
            torch.manual_seed(seed + j)  # the micro-batch's random numbers (LoRA dropout), as accumulate gives them
            loss = model(**b).loss
            loss.backward()
            losses.append(loss.detach())
        return losses

    return _train(model, run)


def _streamed(store: Path, **kw: Any) -> Any:
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(store))
    model = peft.get_peft_model(skeleton, _lora())
    torch.manual_seed(1)
    return load_streamed(model, store, **kw)


def _assert_same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want), f"{len(got)} steps, the reference ran {len(want)}"
    for step, ((gl, gg, ga), (wl, wg, wa)) in enumerate(zip(got, want, strict=True)):
        assert len(gl) == len(wl) and all(torch.equal(a, b) for a, b in zip(gl, wl, strict=True)), f"step {step}: losses"
        assert gg.keys() == wg.keys() and all(torch.equal(gg[k], wg[k]) for k in wg), f"step {step}: gradients"
        assert ga.keys() == wa.keys() and all(torch.equal(ga[k], wa[k]) for k in wa), f"step {step}: adapters"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("per_load", [1, 2, 4])
def test_layer_major_accumulation_equals_ordinary_accumulation(ckpt_store: tuple[Path, Path], engine: str, per_load: int) -> None:
    ckpt, store = ckpt_store
    want = _reference(ckpt, seed=3)
    with _streamed(store, slots=2, engine=engine) as lm:
        lm.model.train()
        got = _train(lm.model, lambda batches: lm.accumulate(batches, per_load=per_load, seed=3))
        s = lm.stats()
    _assert_same(got, want)
    rounds = 3 * (4 // per_load)  # optimizer steps x waves of per_load micro-batches
    assert s.loads == [rounds] * LAYERS, "each layer bound once per wave in forward"
    assert [sum(n) for n in zip(s.backward_reads, s.backward_held, s.backward_copies)] == [rounds] * LAYERS, "and fetched once per wave in backward"
    assert s.backward_copies == [0] * LAYERS and s.renewed_slots == 0, "from the ring's slots, none still viewed when written"


def test_with_the_activations_offloaded_too(ckpt_store: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, store = ckpt_store
    want = _reference(ckpt, seed=3)
    with _streamed(store, slots=2) as lm:
        lm.model.train()
        with gds_offload.attach(lm.model, path=tmp_path / "spill", min_bytes=0, keep_last=0) as off:
            got = _train(lm.model, lambda batches: _settled(off, lm.accumulate(batches, per_load=2, seed=3)))
            assert off.stats().bytes_offloaded > 0
    _assert_same(got, want)


def _settled(off: Any, losses: list[torch.Tensor]) -> list[torch.Tensor]:
    off.synchronize()
    return losses


def test_bad_input_is_refused(ckpt_store: tuple[Path, Path]) -> None:
    _, store = ckpt_store
    with _streamed(store) as lm:
        with pytest.raises(ConfigError, match="batches=\\[\\]"):
            lm.accumulate([])
        with pytest.raises(ConfigError, match="batches\\[0\\] is a Tensor"):
            lm.accumulate([torch.zeros(2)])
        with pytest.raises(ConfigError, match="per_load=0"):
            lm.accumulate(_batches(), per_load=0)
        with torch.no_grad(), pytest.raises(ConfigError, match="grad mode on"):
            lm.accumulate(_batches())
        with pytest.raises(ConfigError, match="scalar tensor"):
            lm.accumulate(_batches(1), loss=lambda out, b: out.logits)
