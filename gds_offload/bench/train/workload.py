"""The model a benchmark run trains, with its batches and its loss.

``gpt``: :mod:`gds_offload.models.gpt`. ``llama`` / ``gpt2``: Hugging Face models built from a
config of the requested size. ``pkg.module:factory``: a user's model (see :func:`_user_workload`
for the factory contract). Every batch depends only on the step and the seed, so every
mode trains on the same data.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gds_offload.bench.train.data import with_data
from gds_offload.bench.train.spec import RunSpec
from gds_offload.models.gpt import GPTConfig, lm_loss, make_gpt, synthetic_batch

__all__ = ["BUILTIN_MODELS", "ModelSpec", "Workload", "build_workload", "hf_model"]

#: Built-in model names (``gpt``: :mod:`gds_offload.models.gpt`; the others: Hugging Face configs).
BUILTIN_MODELS = ("gpt", "llama", "gpt2")


@dataclass(frozen=True)
class ModelSpec:
    """What a user's model factory (``--model pkg.module:factory``) is called with."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int
    dropout: float
    seed: int
    device: str


@dataclass
class Workload:
    """A model and how to train it: ``loss_fn(model, batch_fn(step))`` is one step's loss."""

    model: Any
    batch_fn: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], Any]


def build_workload(spec: RunSpec) -> Workload:
    """The model of ``spec.model`` on ``spec.device`` with its batches and loss.

    ``gpt``: :mod:`gds_offload.models.gpt`. ``llama`` / ``gpt2``: ``LlamaForCausalLM`` /
    ``GPT2LMHeadModel`` from a config of the requested size, random weights (nothing is
    downloaded), SDPA attention. ``pkg.module:factory``: see :func:`_user_workload`.

    Raises:
        ValueError: an unknown model name.
    """
    import torch

    if spec.data:

        return with_data(build_workload(replace(spec, data=None)), spec)
    torch.manual_seed(spec.seed)
    if spec.model == "gpt":

        cfg = GPTConfig(spec.layers, spec.hidden, spec.heads, spec.seq, spec.vocab, spec.dropout)
        model = make_gpt(cfg, seed=spec.seed, device=spec.device)
        return Workload(model, lambda i: synthetic_batch(cfg, spec.batch, spec.seed + 1 + i, device=spec.device), lm_loss)
    if spec.model in ("llama", "gpt2"):
        model = hf_model(spec.model, spec).to(spec.device)
        return Workload(model, lambda i: _hf_batch(spec, i), _output_loss)
    if ":" in spec.model:
        return _user_workload(spec)
    raise ValueError(
        f"model={spec.model!r} is unknown; expected {', '.join(BUILTIN_MODELS)} or 'pkg.module:factory' "
        f"(a function taking a ModelSpec and returning (model, batch_fn))"
    )


def hf_model(name: str, spec: RunSpec | ModelSpec) -> Any:
    """A Hugging Face ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` of the size in ``spec``, random weights."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        if name == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM

            # attn_implementation: every PretrainedConfig takes it, but transformers' declared
            # signatures of the model configs leave it out.
            llama = LlamaConfig(  # type: ignore[call-arg]
                vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=4 * spec.hidden,
                num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
                max_position_embeddings=spec.seq, attention_dropout=0.0, attn_implementation="sdpa",
            )
            return LlamaForCausalLM(llama)
        from transformers import GPT2Config, GPT2LMHeadModel

        gpt2 = GPT2Config(  # type: ignore[call-arg]  # attn_implementation: as above
            vocab_size=spec.vocab, n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
            n_positions=spec.seq, resid_pdrop=spec.dropout, embd_pdrop=spec.dropout, attn_pdrop=0.0,
            bos_token_id=spec.vocab - 1, eos_token_id=spec.vocab - 1, attn_implementation="sdpa",
        )
        return GPT2LMHeadModel(gpt2)


def _hf_batch(spec: RunSpec, step: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(spec.seed + 1 + step)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=gen).to(spec.device)
    return {"input_ids": ids, "labels": ids}


def _output_loss(model: Any, batch: Any) -> Any:
    """The loss convention for HF models and user factories: call the model with the batch
    (``**dict``, ``*tuple`` or the object) and take the output itself when it is a tensor,
    else ``output.loss`` / ``output["loss"]``."""
    import torch

    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"the model returned {type(out).__name__} with no loss; return a scalar tensor or an object "
            f"with .loss, or return (model, batch_fn, loss_fn) from the factory"
        )
    return loss


def _user_workload(spec: RunSpec) -> Workload:
    """``--model pkg.module:factory``: the factory contract.

    ``factory(spec: ModelSpec)`` returns ``(model, batch_fn)`` or ``(model, batch_fn, loss_fn)``:

    * ``model``: an ``nn.Module`` already on ``spec.device``;
    * ``batch_fn(step: int)``: the batch of that step; must depend only on ``step`` (and
      ``spec.seed``), so every mode trains on the same data;
    * ``loss_fn(model, batch) -> scalar tensor``; without it the model is called with the
      batch (``**dict``, ``*tuple``, or the object) and its output is the loss, or has
      ``.loss`` / ``["loss"]`` (Hugging Face models with ``labels``).
    """
    module_name, _, attr = spec.model.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model={spec.model!r}: cannot import {attr!r} from {module_name!r} ({exc})") from exc
    made = factory(ModelSpec(spec.layers, spec.hidden, spec.heads, spec.seq, spec.vocab, spec.batch,
                             spec.dropout, spec.seed, spec.device))
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise TypeError(f"{spec.model} returned {type(made).__name__}; expected (model, batch_fn) or (model, batch_fn, loss_fn)")
    return Workload(made[0], made[1], made[2] if len(made) == 3 else _output_loss)
