"""Hugging Face models built from tiny configs (random weights, nothing downloaded): loss from
``labels``, every gradient bit-identical with the offloader, layers found automatically.

Ported from the shape of transformers' ``tests/models/*/test_modeling_*.py``
(``ModelTester.prepare_config_and_inputs``: tiny hidden sizes, two layers, random ids) and
torchtune's ``test_offloading_is_same_as_without``. Dropout is left at the configs' defaults
where it exists: the harness resets the RNG before each step, so masks are identical.
"""
from __future__ import annotations

import os

import pytest
import torch
from helpers.exact import loss_step
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')"
)

VOCAB, SEQ, BATCH, HID = 64, 12, 2, 32
COMMON = {"attn_implementation": "eager"}


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HID, n_layer=2, n_head=4, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0, **COMMON)
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HID, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=True, **COMMON,
    )
    return transformers.LlamaForCausalLM(cfg)


def _mistral() -> nn.Module:
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=HID, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, sliding_window=4, **COMMON,
    )
    return transformers.MistralForCausalLM(cfg)


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HID, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=SEQ, **COMMON,
    )
    return transformers.BertForMaskedLM(cfg)


def _t5() -> nn.Module:
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=HID, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, **COMMON,
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _vit() -> nn.Module:
    cfg = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=HID, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5, **COMMON,
    )
    return transformers.ViTForImageClassification(cfg)


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ))


def _causal(model: nn.Module, i: int) -> torch.Tensor:
    ids = _ids()
    return model(input_ids=ids, labels=ids).loss


def _masked(model: nn.Module, i: int) -> torch.Tensor:
    ids = _ids()
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]  # at least one position per row
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # a padded row
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _seq2seq(model: nn.Module, i: int) -> torch.Tensor:
    return model(input_ids=_ids(), labels=torch.randint(1, VOCAB, (BATCH, SEQ // 2))).loss


def _image(model: nn.Module, i: int) -> torch.Tensor:
    return model(pixel_values=torch.randn(BATCH, 3, 16, 16), labels=torch.randint(0, 5, (BATCH,))).loss


#: name -> (builder, loss of one step, expected layer-name prefix found by auto-detection)
MODELS = {
    "gpt2": (_gpt2, _causal, "transformer.h."),
    "llama": (_llama, _causal, "model.layers."),
    "mistral": (_mistral, _causal, "model.layers."),
    "bert": (_bert, _masked, "bert.encoder.layer."),
    "t5": (_t5, _seq2seq, None),  # encoder and decoder stacks: either one is fine
    "vit": (_vit, _image, "vit."),  # vit.encoder.layer. (4.x) or vit.layers. (5.x)
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_model(name: str, exact) -> None:
    """GPT2LMHeadModel, LlamaForCausalLM (tied embeddings), MistralForCausalLM (sliding
    window), BertForMaskedLM (padding mask, -100 labels), T5ForConditionalGeneration
    (encoder-decoder, relative position bias), ViTForImageClassification; eager attention,
    float32, dropout on with the RNG reset: two steps exact."""
    make, forward, prefix = MODELS[name]

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = make().float()
        model.train()
        return model

    st = exact(build, loss_step(forward))
    names = [layer.name for layer in st.layers]
    if prefix is not None:
        assert any(n.startswith(prefix) for n in names), f"layers found: {names}"
