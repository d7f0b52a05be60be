"""PEFT adapters on streamed models (gds_offload.weights.streaming.adapters): every kind PEFT can put on a
supported layer gets exactly the values ``get_peft_model`` gives it on a real model, and trains
exactly as there; every other kind is refused by name before the store is read.

The reference is PEFT on the resident model, built from the same seed: ``torch.manual_seed(s);
get_peft_model(real)`` against ``get_peft_model(skeleton); torch.manual_seed(s); load_streamed``
(the contract in gds_offload.weights.streaming.adapters). Its parameters are cloned first, so that no CPU
kernel sees the 8-byte alignment of a memory-mapped safetensors tensor.
"""
from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.gates import cuda_test  # noqa: E402

from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.weights import convert, load_streamed  # noqa: E402
from gds_offload.weights.streaming.adapters import unwrap  # noqa: E402

LAYERS = 4
SEED = 7
#: Names of the tensors PEFT adds (adapters, modules_to_save copies, trainable tokens).
ADAPTER_MARKS = ("lora_", "modules_to_save.", "trainable_tokens_")


def _llama(**kw: Any) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                                        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
                                        "tie_word_embeddings": False} | kw))  # fmt: skip


ARCHS: dict[str, tuple[Any, torch.dtype]] = {
    "llama": (_llama(), torch.float32),
    "llama-tied": (_llama(tie_word_embeddings=True), torch.float32),
    "llama-bf16": (_llama(), torch.bfloat16),
    "gpt2": (transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64), torch.float32),  # tied, Conv1D
}


@pytest.fixture(scope="module")
def stores() -> Iterator[dict[str, tuple[Path, Path]]]:
    base = real_disk_base() / f"gds_offload-weights-adapters-{os.getpid()}"
    out = {}
    for name, (cfg, dtype) in ARCHS.items():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).save_pretrained(base / f"ckpt-{name}")
        convert(base / f"ckpt-{name}", base / f"store-{name}")
        # Only the manifest and config: loading that fails at the first read, so a refusal
        # from it shows the refusal came before anything was read.
        (base / f"bare-{name}").mkdir()
        for f in ("manifest.json", "config.json"):
            shutil.copy(base / f"store-{name}" / f, base / f"bare-{name}" / f)
        out[name] = (base / f"ckpt-{name}", base / f"store-{name}")
    yield out
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))


def _resident(ckpt: Path, dtype: torch.dtype) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    for p in model.parameters():  # fresh, 64-byte aligned tensors (not views of the mapped file)
        p.data = p.data.clone()
    return model


def _skeleton(store: Path, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(store), dtype=dtype)


def _lora(**kw: Any) -> peft.LoraConfig:
    return peft.LoraConfig(**({"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0} | kw))


def _one(**kw: Any) -> Callable[[torch.nn.Module], Any]:
    return lambda model: peft.get_peft_model(model, _lora(**kw))


def _two_adapters(model: torch.nn.Module) -> Any:
    pm = peft.get_peft_model(model, _lora(target_modules=["q_proj", "embed_tokens"]))
    pm.add_adapter("b", _lora(r=2, target_modules=["q_proj", "k_proj", "embed_tokens"], modules_to_save=["lm_head"]))
    pm.set_adapter("b")  # the second one trains
    return pm


#: (architecture, how PEFT is applied, load_streamed keywords)
KINDS: dict[str, tuple[str, Callable[[torch.nn.Module], Any], dict[str, Any]]] = {
    "linear-embedding-head": ("llama", _one(target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"]), {}),
    "init-false-dropout-qalora": ("llama", _one(init_lora_weights=False, lora_dropout=0.1, use_qalora=True,
                                                target_modules=["q_proj", "embed_tokens"]), {}),  # fmt: skip
    "gaussian-rslora-patterns": ("llama", _one(init_lora_weights="gaussian", use_rslora=True, rank_pattern={"v_proj": 2},
                                               alpha_pattern={"down_proj": 16}, layers_to_transform=[1, 3],
                                               target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"]), {}),  # fmt: skip
    "orthogonal": ("llama", _one(init_lora_weights="orthogonal", target_modules=["q_proj", "v_proj", "embed_tokens"]), {}),
    "lora-bias": ("llama", _one(lora_bias=True), {}),
    "lora-bias-init-false": ("llama", _one(lora_bias=True, init_lora_weights=False), {}),
    "modules-to-save": ("llama", _one(modules_to_save=["lm_head", "model.norm", "embed_tokens"]), {}),
    "modules-to-save-in-resident-layer": ("llama", _one(modules_to_save=["model.layers.0.post_attention_layernorm"]), {"resident_layers": 1}),
    "trainable-tokens": ("llama", _one(trainable_token_indices=[1, 5, 200]), {}),
    "two-adapters": ("llama", _two_adapters, {}),
    "bf16": ("llama-bf16", _one(target_modules=["q_proj", "embed_tokens", "lm_head"], modules_to_save=["model.norm"]), {}),
    "tied-lora-embedding-head": ("llama-tied", _one(target_modules=["q_proj", "embed_tokens", "lm_head"]), {}),
    "tied-modules-to-save": ("llama-tied", _one(target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"]), {}),
    "tied-trainable-tokens": ("llama-tied", _one(trainable_token_indices=[3, 4]), {}),
    "gpt2-conv1d": ("gpt2", _one(target_modules=["c_attn", "c_proj", "wte"], fan_in_fan_out=True), {}),
}


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    torch.manual_seed(SEED + 1)  # the same dropout masks
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return out.loss.detach(), out.logits.detach(), grads


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def _pair(stores: dict[str, tuple[Path, Path]], kind: str, device: str = "cpu") -> tuple[Any, Any, Any]:
    """``(PEFT on the resident model, PEFT on the skeleton, its StreamedModel)`` from the same seed."""
    arch, apply, kw = KINDS[kind]
    ckpt, store = stores[arch]
    dtype = ARCHS[arch][1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's advice on tied embeddings, lora_bias without a base bias, fan_in_fan_out
        torch.manual_seed(SEED)
        ref = apply(_resident(ckpt, dtype).to(device))
        pm = apply(_skeleton(store, dtype))
    torch.manual_seed(SEED)
    return ref, pm, load_streamed(pm, store, slots=1, device=device, **kw)


def _assert_same_tensors(ref: torch.nn.Module, pm: torch.nn.Module) -> None:
    """Every tensor PEFT added, and every resident one, equal to the reference (value, dtype, device, requires_grad)."""
    want, got = _tensors(ref), _tensors(pm)
    assert want.keys() == got.keys()
    added = [n for n in want if any(m in n for m in ADAPTER_MARKS)]
    assert added
    for n, w in want.items():
        g = got[n]
        if g.is_meta:  # a streamed layer's weight: frozen, real only in its forward
            assert n not in added and not w.requires_grad, n
            continue
        assert g.device == w.device and g.dtype == w.dtype and g.requires_grad == w.requires_grad, n
        assert torch.equal(g, w), n


@pytest.mark.parametrize("kind", list(KINDS))
def test_adapters_and_a_training_step_equal_peft_on_the_resident_model(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor,
                                                                       kind: str) -> None:  # fmt: skip
    ref, pm, streamed = _pair(stores, kind)
    with streamed as h:
        _assert_same_tensors(ref, pm)
        w_loss, w_logits, w_grads = _step(ref, ids)
        g_loss, g_logits, g_grads = _step(h.model, ids)
    assert torch.equal(g_loss, w_loss) and torch.equal(g_logits, w_logits)
    assert g_grads.keys() == w_grads.keys() and any(any(m in n for m in ADAPTER_MARKS) for n in w_grads)
    for n in w_grads:
        assert torch.equal(g_grads[n], w_grads[n]), n


@cuda_test
@pytest.mark.parametrize("kind", ["linear-embedding-head", "modules-to-save", "trainable-tokens", "two-adapters", "bf16"])
def test_adapters_on_a_gpu_equal_peft_on_the_resident_model_there(stores: dict[str, tuple[Path, Path]], kind: str) -> None:
    """PEFT draws on the CPU for a model on a GPU too (it builds adapters there and moves them)."""
    ref, pm, streamed = _pair(stores, kind, device="cuda")
    with streamed:
        _assert_same_tensors(ref, pm)


def test_trained_adapters_load_after_load_streamed(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor, tmp_path: Path) -> None:
    """Trained adapters (LoRA, a modules_to_save copy, trainable tokens) saved with
    PEFT load onto the streamed model with set_peft_model_state_dict: the resident model's logits."""
    ckpt, store = stores["llama"]
    cfg = _lora(modules_to_save=["lm_head"], trainable_token_indices=[2, 9])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "setting save_embedding_layers"
        ref = peft.get_peft_model(_resident(ckpt, torch.float32), cfg)
        with torch.no_grad():
            for p in ref.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p))  # "trained": nothing is at its initial value
        ref.save_pretrained(tmp_path / "adapters")
        trained = peft.utils.load_peft_weights(str(tmp_path / "adapters"))
    with load_streamed(peft.get_peft_model(_skeleton(store, torch.float32), cfg), store) as h, torch.no_grad():
        peft.set_peft_model_state_dict(h.model, trained)
        got = dict(h.model.named_parameters())
        for n, p in ref.named_parameters():
            if p.requires_grad:
                assert torch.equal(got[n], p), n
        assert torch.equal(h(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)
        # The copies are the model's own: loading into them left the stored (original) modules as they were.
        with h.model.disable_adapter(), ref.disable_adapter():
            assert torch.equal(h(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_lora_on_an_embedding_is_initialised(stores: dict[str, tuple[Path, Path]]) -> None:
    """lora_embedding_A/B live in ParameterDicts, not under lora_A: they were left uninitialised (NaN, 1e36)."""
    _, store = stores["llama"]
    for init in (True, False):
        with load_streamed(peft.get_peft_model(_skeleton(store, torch.float32), _lora(target_modules=["embed_tokens"], init_lora_weights=init)), store) as h:
            a, b = (dict(h.model.named_parameters())[f"base_model.model.model.embed_tokens.lora_embedding_{x}.default"] for x in "AB")
            assert torch.isfinite(a).all() and torch.isfinite(b).all()
            # PEFT: torch.randn, then (unless False) A zero and B standard normal.
            assert bool((a == 0).all()) == init and a.abs().max() < 10 and b.abs().max() < 10


def _bare(stores: dict[str, tuple[Path, Path]], arch: str) -> Path:
    return stores[arch][1].parent / f"bare-{arch}"


REFUSED: dict[str, tuple[str, Callable[[torch.nn.Module], Any], str]] = {
    "eva": ("llama", _one(init_lora_weights="eva", eva_config=peft.EvaConfig()), r"init_lora_weights='eva' derives the adapter from the base weights or from data"),
    "lora-ga": ("llama", _one(init_lora_weights="lora_ga", lora_ga_config=peft.tuners.lora.config.LoraGAConfig()),
                r"init_lora_weights='lora_ga' derives the adapter"),  # fmt: skip
    "dora": ("llama", _one(use_dora=True), r"adapter 'default' uses DoRA, whose magnitudes come from the base weights"),
    "alora": ("llama", _one(alora_invocation_tokens=[1, 2]), r"alora_invocation_tokens makes it a LoRA variant"),
    "velora": ("llama", _one(velora_config=peft.tuners.lora.config.VeloraConfig()), r"velora_config makes it a LoRA variant"),
    "target-parameters": ("llama", _one(target_modules=[], target_parameters=["mlp.down_proj.weight"]), r"target_parameters=\['mlp.down_proj.weight'\] puts LoRA on bare parameters"),
    "layer-replication": ("llama", _one(layer_replication=[[0, 4], [2, 4]]), r"layer_replication=.* repeats layers"),
    "bias-all": ("gpt2", _one(target_modules=["c_attn"], bias="all"), r"bias='all' makes base biases trainable \(transformer\.h\.0\."),
    "bias-lora-only": ("gpt2", _one(target_modules=["c_attn"], bias="lora_only"), r"bias='lora_only' makes base biases trainable"),
    "ensure-weight-tying-saved": ("llama-tied", _one(modules_to_save=["embed_tokens"], ensure_weight_tying=True), r"modules_to_tie=\['lm_head'\]"),
    "ensure-weight-tying-lora": ("llama-tied", _one(target_modules=["embed_tokens"], ensure_weight_tying=True), r"target_modules_to_tie="),
    "ia3": ("llama", lambda m: peft.get_peft_model(m, peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])),
            r"adapter 'default' is IA3 \(IA3Config\): only LoRA adapters"),  # fmt: skip
    "trainable-tokens-method": ("llama", lambda m: peft.get_peft_model(m, peft.TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[1])),
                                r"only LoRA adapters"),  # fmt: skip
    "custom-lora-layer": ("llama", lambda m: peft.get_peft_model(m, _custom()), r"q_proj is a .*\._Custom: load_streamed initialises PEFT adapters only as LoRA on"),
    "not-the-peft-model": ("llama", lambda m: peft.get_peft_model(m, _lora()).get_base_model(), r"not the PeftModel .* pass that to load_streamed"),
}


class _Custom(peft.tuners.lora.layer.Linear):
    """A LoRA layer class of the user's own (PEFT's custom module mapping)."""


def _custom() -> peft.LoraConfig:
    cfg = _lora(target_modules=["q_proj"])
    cfg._register_custom_module({torch.nn.Linear: _Custom})
    return cfg


@pytest.mark.parametrize("kind", list(REFUSED))
def test_what_cannot_be_initialised_as_peft_does_is_refused_by_name_before_any_read(stores: dict[str, tuple[Path, Path]], kind: str) -> None:
    arch, apply, match = REFUSED[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = apply(_skeleton(stores[arch][1], ARCHS[arch][1]))
    with pytest.raises(ConfigError, match=match):
        load_streamed(model, _bare(stores, arch))  # no data file: any read would fail otherwise


@pytest.mark.parametrize("option", ["modules_to_save", "trainable_token_indices"])
def test_saving_a_module_inside_a_streamed_layer_is_refused(stores: dict[str, tuple[Path, Path]], option: str) -> None:
    _, store = stores["llama"]
    if option == "modules_to_save":
        cfg, name = _lora(modules_to_save=["model.layers.2.mlp"]), "model.layers.2.mlp"
    else:
        cfg, name = _lora(trainable_token_indices={"model.layers.2.mlp.down_proj": [1]}, target_modules=["q_proj"]), "model.layers.2.mlp.down_proj"
    match = rf"{name} is in {option}, inside layer model.layers.2, which streams from the store.*resident_layers=3 or more"
    with pytest.raises(ConfigError, match=match):
        unwrap(peft.get_peft_model(_skeleton(store, torch.float32), cfg))[1].check_streamed(["model.layers.2", "model.layers.3"])
    # load_streamed refuses it (and works with that layer resident).
    with pytest.raises(ConfigError, match=rf"{name} is in {option}, inside .*which streams from the store"):
        load_streamed(peft.get_peft_model(_skeleton(store, torch.float32), cfg), store)
    with load_streamed(peft.get_peft_model(_skeleton(store, torch.float32), cfg), store, resident_layers=3) as h:
        assert not any(p.is_meta for n, p in h.model.named_parameters() if any(m in n for m in ADAPTER_MARKS))
