"""A tiny Llama checkpoint (4 layers, hidden 64, random weights), its meta skeleton and its resident model.

Import after ``pytest.importorskip("transformers")``: this module imports transformers.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers

__all__ = ["LAYERS", "VOCAB", "assert_same_generation", "converted", "llama_config", "meta_skeleton", "resident_model", "save_checkpoint"]

LAYERS, VOCAB = 4, 256


def llama_config(**kw: object) -> transformers.LlamaConfig:
    """The tiny Llama's config; ``kw`` overrides fields."""
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    return transformers.LlamaConfig(**(base | kw))


def save_checkpoint(cfg: transformers.PretrainedConfig, path: Path, **save_kw: object) -> Path:
    """A model of ``cfg`` with seed-0 weights, saved (safetensors) at ``path``."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path, **save_kw)
    return path


def meta_skeleton(path: Path, *, empty_weights: bool = False) -> torch.nn.Module:
    """The model of the config at ``path`` on the meta device (or Accelerate's ``init_empty_weights``), in eval mode."""
    cfg = transformers.AutoConfig.from_pretrained(path)
    if empty_weights:
        import accelerate  # only the test that asks for it needs Accelerate

        with accelerate.init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    else:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.eval()


def resident_model(path: Path) -> torch.nn.Module:
    """The checkpoint at ``path`` loaded as transformers loads it, in eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@contextlib.contextmanager
def converted(name: str) -> Iterator[tuple[Path, Path]]:
    """The tiny Llama's checkpoint and its converted store, in a directory of their own on a real
    disk (``name`` tells tests apart), removed after the block."""
    from gds_offload.weights import convert
    from helpers.disks import real_disk_base

    base = real_disk_base() / f"gds_offload-{name}-{os.getpid()}"
    ckpt = save_checkpoint(llama_config(), base / "ckpt")
    convert(ckpt, base / "store")
    try:
        yield ckpt, base / "store"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def assert_same_generation(got: Any, want: Any, where: str = "") -> None:
    """Two ``generate`` outputs (``output_scores=True, return_dict_in_generate=True``) bit for bit:
    the tokens, and the scores of every step, as many steps on each side (at least one: a side
    that returned no scores fails)."""
    __tracebackhide__ = True
    assert torch.equal(got.sequences, want.sequences), f"{where}tokens differ"
    assert len(want.scores) > 0, f"{where}the reference has no scores: ask for output_scores=True, return_dict_in_generate=True"
    assert len(got.scores) == len(want.scores), f"{where}scores of {len(got.scores)} steps, the reference has {len(want.scores)}"
    for i, (g, w) in enumerate(zip(got.scores, want.scores, strict=True)):
        assert torch.equal(g, w), f"{where}scores of step {i} differ"
