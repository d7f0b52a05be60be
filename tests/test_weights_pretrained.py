"""A streamed model is the model transformers' own from_pretrained returns for its checkpoint,
compared with torch.equal (as_reference): from_pretrained builds every architecture's skeleton so
that its computed buffers are real (Gemma's embed_scale); load_streamed and from_pretrained leave
the model in eval mode (the README's snippet, with OPT's and GPT-2's dropout) and give generate the
checkpoint's generation settings (generation_config.json, or config.json without one). Tiny models
built from transformers configs; nothing is downloaded."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402

from gds_offload.weights import as_reference, convert, from_pretrained, load_streamed, read_manifest  # noqa: E402

_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)
ARCHS: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **_SMALL),
    "gemma": lambda: transformers.GemmaConfig(num_key_value_heads=2, head_dim=16, **_SMALL),  # embed_scale: a computed buffer
    "gemma3": lambda: transformers.Gemma3TextConfig(num_key_value_heads=2, head_dim=16, sliding_window=8, **_SMALL),
    "opt": lambda: transformers.OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
                                          max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.1),  # fmt: skip
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=3, n_head=4, n_positions=64),  # dropout 0.1
}
DROPOUT = ("opt", "gpt2")
SCORES = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gds_offload-pretrained-", dir=real_disk_base()))  # on a drive: O_DIRECT
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(1))


def _checkpoint(cfg: Any, path: Path, generation: dict[str, Any] | None = None) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if generation is not None:
        model.generation_config = transformers.GenerationConfig(**generation)
    model.save_pretrained(path)
    return path


def _reference(ckpt: Path) -> Any:
    """transformers' own model of ``ckpt`` (eval mode, its generation config), aligned as a store holds it."""
    return as_reference(transformers.AutoModelForCausalLM.from_pretrained(ckpt))


def _readme_skeleton(store: Path) -> torch.nn.Module:
    """The README's skeleton: built on the meta device, left in training mode as from_config makes it."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(store))


def _streaming_memory(store: Path) -> int:
    """A ``memory`` for from_pretrained that keeps no layer resident: the resident group and two slots."""
    m = read_manifest(store)
    return (m.resident.padded_nbytes if m.resident else 0) + 2 * max(g.padded_nbytes for g in m.layers)


def _assert_same(got: Any, want: Any) -> None:
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) and all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_from_pretrained_streams_every_architecture_as_transformers_loads_it(base: Path, ids: torch.Tensor, arch: str) -> None:
    """from_pretrained builds the skeleton itself; one that load_streamed streams (Gemma's
    embed_scale, a buffer of the embedding module) must come out of it too, every layer streamed."""
    ckpt = _checkpoint(ARCHS[arch](), base / f"ckpt-{arch}")
    convert(ckpt, base / f"store-{arch}")
    ref = _reference(ckpt)
    with torch.no_grad():
        want_logits = ref(ids).logits
    want = ref.generate(ids, **SCORES)
    with from_pretrained(ckpt, store=base / f"store-{arch}", memory=_streaming_memory(base / f"store-{arch}")) as lm:
        assert len(lm.stats().streamed_layers) == 3 and not lm.model.training
        with torch.no_grad():
            assert torch.equal(lm(ids).logits, want_logits)
        _assert_same(lm.generate(ids, **SCORES), want)


@pytest.mark.parametrize("arch", DROPOUT)
def test_the_readme_snippet_is_bit_identical_with_dropout_in_the_config(base: Path, ids: torch.Tensor, arch: str) -> None:
    """A skeleton from from_config is in training mode; load_streamed returns the model in eval mode,
    as transformers' from_pretrained does, so the README's snippet equals the resident model with
    dropout in the config; model.train() still turns dropout on for training."""
    ckpt = _checkpoint(ARCHS[arch](), base / f"ckpt-dropout-{arch}")
    store = base / f"store-dropout-{arch}"
    convert(ckpt, store)
    ref = _reference(ckpt)
    want = ref.generate(ids, **SCORES)
    with torch.no_grad():
        want_logits = ref(ids).logits
    skeleton = _readme_skeleton(store)
    assert skeleton.training
    with load_streamed(skeleton, store, slots=2) as lm:
        assert not any(m.training for m in lm.model.modules())
        _assert_same(lm.generate(ids, **SCORES), want)
        lm.model.train()
        torch.manual_seed(0)
        with torch.no_grad():
            assert not torch.equal(lm(ids).logits, want_logits), "dropout is on in train mode"
        lm.model.eval()
        with torch.no_grad():
            assert torch.equal(lm(ids).logits, want_logits)


GENERATION = {"repetition_penalty": 3.0, "no_repeat_ngram_size": 2, "max_new_tokens": 12, "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("where", ["generation_config.json", "config.json"])
def test_generate_takes_the_checkpoints_generation_settings(base: Path, ids: torch.Tensor, where: str) -> None:
    """generate() without arguments: the store keeps the checkpoint's generation_config.json (or,
    without one, the generation settings an older config.json holds), and load_streamed and
    from_pretrained give generate the defaults transformers' from_pretrained gives it."""
    ckpt = base / f"ckpt-generation-{where}"
    if where == "generation_config.json":
        _checkpoint(ARCHS["llama"](), ckpt, GENERATION)
    else:
        _checkpoint(ARCHS["llama"](), ckpt)
        (ckpt / "generation_config.json").unlink()
        config = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps(config | {"repetition_penalty": 3.0, "no_repeat_ngram_size": 2, "max_length": 21}))
    store = base / f"store-generation-{where}"
    convert(ckpt, store)
    want = _reference(ckpt).generate(ids)
    assert want.shape[1] == ids.shape[1] + 12, "the checkpoint's own settings"
    with load_streamed(_readme_skeleton(store), store) as lm:
        model: Any = lm.model
        assert model.generation_config.repetition_penalty == 3.0
        assert torch.equal(lm.generate(ids), want)
    with from_pretrained(ckpt, store=store, memory=_streaming_memory(store)) as lm:
        assert torch.equal(lm.generate(ids), want)
