"""Mixture-of-experts models stream exactly: every MoE architecture whose checkpoint transformers 5
converts at load (experts saved one tensor each, fused into one per layer) is stored in the
model's form by transformers' own loader (``weights/store/fused.py``), and streams bit-identical
to the resident model ``from_pretrained`` makes: logits, greedy and sampled ``generate``,
layer-major ``generate_many``, LoRA on the attention projections.

Each model is tiny, random, built from a transformers config, and saved with ``save_pretrained``:
the Hub's layout, one tensor per expert, as released checkpoints are.
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("transformers.core_model_loading", reason="transformers < 5 loads experts as saved")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.llama import assert_same_generation  # noqa: E402

from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.weights import as_reference, convert, load_streamed, read_manifest  # noqa: E402
from gds_offload.weights.store import fused  # noqa: E402

VOCAB = 128
_COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
#: One tiny config per MoE architecture that transformers 5.25 converts at load (its
#: conversion_mapping lists a WeightConverter for it). Layer 0 of the DeepSeek, GLM and ERNIE
#: shapes is dense (first_k_dense_replace / moe_layer_start_index): both kinds of layer stream.
ARCHS: dict[str, Any] = {
    "mixtral": lambda: transformers.MixtralConfig(intermediate_size=64, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **_COMMON),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                                     num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, **_COMMON),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2, head_dim=8,
                                                     num_experts=4, num_experts_per_tok=2, **_COMMON),
    "olmoe": lambda: transformers.OlmoeConfig(intermediate_size=16, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, **_COMMON),
    "phimoe": lambda: transformers.PhimoeConfig(intermediate_size=64, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **_COMMON),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=4,
                                                         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                                         q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1,
                                                         topk_group=1, **_COMMON),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=4,
                                                         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                                         q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1,
                                                         topk_group=1, **_COMMON),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2, head_dim=8,
                                                   n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                                   n_group=1, topk_group=1, **_COMMON),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2, moe_num_experts=4,
                                                            moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1, **_COMMON),
    "minimax": lambda: transformers.MiniMaxConfig(intermediate_size=64, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                                  num_experts_per_tok=2, **_COMMON),
    "flex_olmo": lambda: transformers.FlexOlmoConfig(intermediate_size=64, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, **_COMMON),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**(_COMMON | {"num_hidden_layers": 4}), intermediate_size=64, moe_intermediate_size=16,
                                                       shared_expert_intermediate_size=16, num_key_value_heads=2, head_dim=8, num_experts=4,
                                                       num_experts_per_tok=2, linear_num_value_heads=2, linear_num_key_heads=2,
                                                       linear_key_head_dim=8, linear_value_head_dim=8),
}  # fmt: skip
#: An expert's own tensor, as the Hub's checkpoints name them (``...experts.3.w1.weight``).
PER_EXPERT = re.compile(r"\.experts\.\d+\.")


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    d = real_disk_base() / f"gds_offload-moe-{os.getpid()}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _checkpoint(base: Path, arch: str) -> Path:
    ckpt = base / f"ckpt-{arch}"
    if not ckpt.exists():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(ARCHS[arch]()).save_pretrained(ckpt)
    return ckpt


def _skeleton(store: Path) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(store))


def _reference(ckpt: Path) -> torch.nn.Module:
    return as_reference(transformers.AutoModelForCausalLM.from_pretrained(ckpt)).eval()


def _ids(batch: int = 2, n: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_moe_checkpoint_is_stored_as_the_model_holds_it_and_streams_exactly(base: Path, arch: str) -> None:
    ckpt = _checkpoint(base, arch)
    assert any(PER_EXPERT.search(n) for n in _safetensors_names(ckpt)), "the checkpoint is not in the Hub's per-expert layout"
    manifest = convert(ckpt, base / f"store-{arch}")
    assert manifest.source.get("form") == fused.MODEL_FORM
    assert not [t.name for t in manifest.tensors if PER_EXPERT.search(t.name)], "experts left one tensor each"
    ref = _reference(ckpt)
    assert {t.name for t in manifest.tensors} <= set(ref.state_dict()), "a stored name the model does not have"
    ids, mask = _ids(), torch.ones(2, 6, dtype=torch.long)
    with load_streamed(_skeleton(base / f"store-{arch}"), base / f"store-{arch}") as lm, torch.no_grad():
        assert lm.stats().streamed_layers, "nothing streamed"
        assert torch.equal(lm(ids).logits, ref(ids).logits)
        greedy = lm.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        assert torch.equal(greedy, ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False))
        torch.manual_seed(5)
        sampled = lm.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=20, **SCORES)
        torch.manual_seed(5)
        assert_same_generation(sampled, ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=20, **SCORES))


SCORES = dict(output_scores=True, return_dict_in_generate=True)


def _safetensors_names(ckpt: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            names += list(h.keys())
    return names


def test_generate_many_runs_a_moe_layer_major_exactly(base: Path) -> None:
    ckpt = _checkpoint(base, "qwen3_moe")
    convert(ckpt, base / "store-many", overwrite=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g) for _ in range(7)]
    with load_streamed(_skeleton(base / "store-many"), base / "store-many") as lm:
        out = lm.generate_many(prompts, micro_batch=2, per_load=2, seed=7, pad_token_id=0, max_new_tokens=4, do_sample=True, **SCORES)
        assert lm.stats().teams >= 1
    ref = _reference(ckpt)
    for j, mb in enumerate(out.micro_batches):
        torch.manual_seed(7 + j)
        want = ref.generate(mb.input_ids, attention_mask=mb.attention_mask, pad_token_id=0, max_new_tokens=4, do_sample=True, **SCORES)
        assert_same_generation(out.outputs[j], want, f"micro-batch {j}: ")


def test_lora_on_a_moe_trains_as_resident(base: Path) -> None:
    peft = pytest.importorskip("peft")
    ckpt = _checkpoint(base, "mixtral")
    convert(ckpt, base / "store-lora", overwrite=True)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ids = _ids(2, 8, seed=4)

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    torch.manual_seed(9)
    ref = peft.get_peft_model(_reference(ckpt), peft.LoraConfig(**lora))
    want_loss, want_grads = step(ref)
    streamed = peft.get_peft_model(_skeleton(base / "store-lora"), peft.LoraConfig(**lora))
    torch.manual_seed(9)  # the adapters are made real at load, as get_peft_model makes them (weights/streaming/adapters.py)
    with load_streamed(streamed, base / "store-lora") as lm:
        got_loss, got_grads = step(lm.model)
    assert torch.equal(got_loss, want_loss)
    assert sorted(got_grads) == sorted(want_grads) and got_grads, "LoRA gradients differ in which parameters have them"
    for n, w in want_grads.items():
        assert torch.equal(got_grads[n], w), n


def test_a_store_of_experts_in_the_checkpoints_form_is_refused_with_a_command_that_works(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store converted before stores took the model's form (forced here: no model form) holds
    each expert's tensor as saved; streaming it is refused, naming the tensor and the command that
    converts it again, and that command, run as written, makes a store that streams exactly."""
    import shlex
    import subprocess
    import sys

    ckpt = _checkpoint(base, "olmoe")
    store = base / "store-old"
    with monkeypatch.context() as m:
        m.setattr(fused.ModelForm, "of", classmethod(lambda cls, checkpoint: None))
        manifest = convert(ckpt, store, overwrite=True)
    assert "form" not in manifest.source and any(PER_EXPERT.search(t.name) for t in manifest.tensors)
    with pytest.raises(ConfigError, match=r"experts\.\d+\.\w+\.weight: transformers merges or splits .*Convert the checkpoint again: ") as err:
        load_streamed(_skeleton(store), store)
    command = str(err.value).rsplit("Convert the checkpoint again: ", 1)[1].strip().strip("`")
    words = shlex.split(command)
    assert words[0] == "gds-offload", command
    done = subprocess.run([sys.executable, "-m", "gds_offload.cli", *words[1:]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert read_manifest(store).source.get("form") == fused.MODEL_FORM
    ids = _ids()
    with load_streamed(_skeleton(store), store) as lm, torch.no_grad():
        assert torch.equal(lm(ids).logits, _reference(ckpt)(ids).logits)


def test_a_dense_checkpoint_keeps_the_checkpoints_form(base: Path) -> None:
    cfg = transformers.LlamaConfig(**_COMMON, intermediate_size=64, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(base / "ckpt-dense")
    manifest = convert(base / "ckpt-dense", base / "store-dense")
    assert "form" not in manifest.source
    assert sorted(t.name for t in manifest.tensors) == sorted(_safetensors_names(base / "ckpt-dense"))


def test_full_finetuning_of_a_moe_equals_resident_training(base: Path, tmp_path: Path) -> None:
    """StreamedTrainer on a MoE store in the model's form: every expert's fused tensor is read,
    stepped with AdamW and written back; losses, the exported weights and the optimizer state
    equal resident training's."""
    import functools

    from safetensors import torch as safetensors_torch

    from gds_offload.weights import StreamedTrainer, export

    ckpt = _checkpoint(base, "qwen2_moe")
    store = tmp_path / "store"
    convert(ckpt, store)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(6)
    steps = [[{"input_ids": (ids := torch.randint(3, VOCAB, (2, 8), generator=g)), "labels": ids} for _ in range(2)] for _ in range(2)]
    ref = _reference(ckpt)
    for p in ref.parameters():
        p.requires_grad_(True)
    opt = optimizer(list(ref.parameters()))
    want = []
    for s in steps:
        for b in s:
            loss = ref(**b).loss
            loss.backward()
            want.append(loss.detach())
        opt.step()
        opt.zero_grad()
    with load_streamed(_skeleton(store), store) as lm, StreamedTrainer(lm, optimizer) as trainer:
        got = [loss for s in steps for loss in trainer.step(s)]
        name = "model.layers.1.mlp.experts.gate_up_proj"
        state = opt.state[dict(ref.named_parameters())[name]]
        assert all(torch.equal(state[k], trainer.state_of(name)[k]) for k in state), name
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    export(store, tmp_path / "out")
    weights = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    expected = ref.state_dict()
    assert sorted(weights) == sorted(expected) and all(torch.equal(weights[k], expected[k]) for k in expected)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()  # transformers loads the fused form as it is
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_gpt_oss_whose_checkpoint_holds_fused_experts_streams_as_it_is(base: Path) -> None:
    """gpt-oss saves its experts fused, as the model holds them: transformers converts nothing, and
    the store keeps the checkpoint's form (and names), streaming exactly."""
    cfg = transformers.GptOssConfig(**_COMMON, intermediate_size=32, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(base / "ckpt-gpt-oss")
    manifest = convert(base / "ckpt-gpt-oss", base / "store-gpt-oss")
    assert "form" not in manifest.source
    assert sorted(t.name for t in manifest.tensors) == sorted(_safetensors_names(base / "ckpt-gpt-oss"))
    ids = _ids()
    with load_streamed(_skeleton(base / "store-gpt-oss"), base / "store-gpt-oss") as lm, torch.no_grad():
        assert torch.equal(lm(ids).logits, _reference(base / "ckpt-gpt-oss")(ids).logits)
