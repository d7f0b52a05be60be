"""PEFT adapters on a streamed model: fine-tuning a model whose layers stream from a store.

Apply ``peft.get_peft_model`` to the meta skeleton, then hand the returned ``PeftModel`` to
:func:`~gds_offload.weights.load_streamed`. PEFT wraps each targeted module (``q_proj``) in a
tuner layer that keeps the original as ``base_layer`` and adds adapter modules (``lora_A``,
``lora_B``; ``lora_embedding_A``/``B`` on an embedding); on a meta skeleton it leaves those on the
meta device as well, since it moves adapters to the base weight's device. :class:`Adapters`
gives the loader:

* the store name of every base tensor: ``...q_proj.base_layer.weight`` is the store's
  ``...q_proj.weight``, ``lm_head.original_module.weight`` (``modules_to_save``) and
  ``model.embed_tokens.token_adapter.base_layer.weight`` (``trainable_token_indices``) are
  ``lm_head.weight`` and ``model.embed_tokens.weight`` (:meth:`Adapters.store_name`; adapter
  tensors have none);
* :meth:`Adapters.check_streamed`: what cannot be had in a streamed layer, refused before
  anything is read;
* :meth:`Adapters.materialize`: the adapters made real on the model's device, with the values
  ``get_peft_model`` gives them on a real model (below).

**Initialisation contract.** On a real model ``get_peft_model`` draws the adapters' random
values from the CPU generator as it builds them (on the CPU also for a model on a GPU, moving
them after): for each adapter in the order the adapters
were added, each tuner layer in module order, ``lora_A`` then ``lora_B`` as ``nn.Linear`` builds
them, then ``init_lora_weights`` (``True``: ``lora_A`` again, Kaiming-uniform, ``lora_B`` zero;
``"gaussian"``: ``lora_A`` normal; ``"orthogonal"``: PEFT's orthogonal draws; ``False``:
nothing more); an embedding's ``lora_embedding_A``/``B`` are ``torch.randn`` (then, unless
``False``, zero and normal). The values are then moved to the base weight's dtype (a float32
draw rounded to bfloat16) and, by ``get_peft_model``'s ``autocast_adapter_dtype``, from half
precision back to float32. On a meta skeleton PEFT makes
the same draws and throws the values away. :meth:`Adapters.materialize` makes exactly those
draws again, with PEFT's own initialisers, from the CPU generator's state at
``load_streamed``, in the default dtype, and rounds them the same way. So::

    torch.manual_seed(s); peft.get_peft_model(real_model, cfg)          # and
    pm = peft.get_peft_model(skeleton, cfg); torch.manual_seed(s); load_streamed(pm, store)

give ``torch.equal`` adapters (nothing ``load_streamed`` does before draws from the generator).
An adapter none of whose tensors is on the meta device is kept as it is, on the device. A
``modules_to_save`` copy is a trainable copy of the stored module (PEFT's deepcopy: under tied
embeddings, of the tied weight, as on a real model); trainable tokens start as the stored
embedding's rows. Trained adapters load after ``load_streamed``
(``peft.set_peft_model_state_dict``): ``PeftModel.from_pretrained`` on a meta skeleton leaves
them on the meta device, without their values (torch warns "copying ... to a meta parameter").

Supported: LoRA on ``nn.Linear`` (``lm_head`` too), transformers' ``Conv1D``
(``fan_in_fan_out``) and ``nn.Embedding``, with ``init_lora_weights`` ``True``, ``False``,
``"gaussian"`` or ``"orthogonal"``, ``lora_bias``, ``use_rslora``, ``rank_pattern``,
``alpha_pattern``, ``layers_to_transform``, ``lora_dropout``, several adapters (``add_adapter``),
``modules_to_save`` and ``trainable_token_indices`` on resident modules (``use_qalora``, which
PEFT applies to GPTQ layers only, changes nothing). Everything else is refused by name with a
``ConfigError`` before the store is read, mostly because it needs a streamed layer's weights
outside its forward, or data: the initialisations PiSSA, OLoRA, LoftQ, CorDA, MiCA, EVA,
LoRA-GA; DoRA and the other LoRA variants (aLoRA, VeLoRA, BD-LoRA, Arrow, MonteCLoRA, KaSA);
``target_parameters``; ``layer_replication``; a ``bias`` that makes base biases trainable;
``ensure_weight_tying`` on tied embeddings; other tuner layers (convolutions, attention,
quantized or custom LoRA layers); PEFT methods other than LoRA; and ``modules_to_save`` or
trainable tokens inside a streamed layer (:meth:`Adapters.check_streamed`).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gds_offload.errors import ConfigError

__all__ = ["Adapters", "unwrap"]


@dataclass
class Adapters:
    """The PEFT adapters of a model (empty for a model without adapters)."""

    #: module name -> its LoRA layer (``peft.tuners.lora.Linear`` or ``Embedding``), in module order.
    layers: dict[str, nn.Module] = field(default_factory=dict)
    #: module name -> a ``TrainableTokensLayer`` that owns its deltas (a tied one shares them).
    tokens: dict[str, nn.Module] = field(default_factory=dict)
    #: module name -> its ``ModulesToSaveWrapper``.
    saved: dict[str, nn.Module] = field(default_factory=dict)
    #: adapter name -> its PEFT config, in the order the adapters were added.
    configs: dict[str, Any] = field(default_factory=dict)
    #: Full names of the adapters' own parameters and buffers (no store holds them).
    names: set[str] = field(default_factory=set)
    #: ``(model prefix, store prefix)`` of every wrapped module's base, longest first.
    prefixes: list[tuple[str, str]] = field(default_factory=list)

    def store_name(self, name: str) -> str | None:
        """The store's name for model tensor ``name``, or ``None`` for an adapter tensor."""
        if name in self.names:
            return None
        for head, store in self.prefixes:
            if name.startswith(head):
                return store + name[len(head) :]
        return name

    def check_streamed(self, groups: Iterable[str]) -> None:
        """Refuse what needs the weights of a layer in ``groups`` (the streamed ones) outside its forward.

        Raises:
            ConfigError: a ``modules_to_save`` module or trainable tokens inside a streamed layer.
        """
        for g in groups:
            for name, option in [*((n, "modules_to_save") for n in self.saved), *((n, "trainable_token_indices") for n in self.tokens)]:
                if name.startswith(g + "."):
                    raise _streamed_error(name.removesuffix(".token_adapter"), option, g)

    def materialize(self, device: torch.device) -> None:
        """Make every adapter tensor real on ``device`` with PEFT's values (the module doc's contract).

        Raises:
            ConfigError: a ``modules_to_save`` module or trainable tokens whose stored weights are
                not resident (inside a streamed layer).
        """
        for adapter, cfg in self.configs.items():
            # An adapter is drawn again whole if any of it is on the meta device: PEFT leaves one added
            # with add_adapter real on the CPU in layers that already hold a meta adapter, unrounded.
            fresh = any(t.is_meta for layer in self.layers.values() for t in _lora_tensors(layer, adapter))
            for layer in self.layers.values():
                _init_lora(layer, adapter, cfg.init_lora_weights, device, fresh=fresh)
        for name, layer in self.tokens.items():
            _init_tokens(name, layer, device)
        for name, wrapper in self.saved.items():
            _copy_saved(name, wrapper, device)


def unwrap(model: nn.Module) -> tuple[nn.Module, Adapters]:
    """``(the model PEFT wraps, its adapters)`` for a ``PeftModel``; ``(model, no adapters)`` otherwise.

    Allocates nothing but host placeholders for the trainable tokens' non-persistent buffers.

    Raises:
        ConfigError: a model with PEFT adapters that is not the ``PeftModel`` (its adapters'
            configs are needed), or anything the module doc lists as refused.
    """
    peft = _peft()
    if peft is None:
        return model, Adapters()
    is_peft = callable(getattr(model, "get_base_model", None)) and isinstance(getattr(model, "peft_config", None), dict)
    base: nn.Module = model.get_base_model() if is_peft else model  # type: ignore[operator]
    modules = dict(base.named_modules())
    found: dict[str, Any] = {n: m for n, m in modules.items() if isinstance(m, (peft.tuner, peft.saved, peft.tokens_wrapper))}
    if not found:
        return base, Adapters()
    if not is_peft:
        raise ConfigError(
            f"the model has PEFT adapters ({next(iter(found))}, ...) but is not the PeftModel that peft.get_peft_model "
            f"returned; pass that to load_streamed (its adapter configs say how to initialise the adapters)"
        )
    configs: dict[str, Any] = model.peft_config  # type: ignore[assignment]
    for adapter, cfg in configs.items():
        _check_config(adapter, cfg)
    out = Adapters(configs=configs)
    for name, m in found.items():
        if isinstance(m, peft.saved):
            out.saved[name] = m
            out.prefixes.append((f"{name}.original_module.", f"{name}."))
            out.names.update(_tensor_names(m.modules_to_save, f"{name}.modules_to_save."))
        elif isinstance(m, peft.tokens_wrapper):
            out.prefixes.append((f"{name}.token_adapter.base_layer.", f"{name}."))
        elif isinstance(m, peft.tokens):
            if not isinstance(modules.get(name.rpartition(".")[0]), peft.tokens_wrapper):
                raise ConfigError(f"{name} is a TrainableTokensLayer of peft.TrainableTokensConfig: only LoRA adapters can be put on "
                                  f"streamed models; use LoraConfig(trainable_token_indices=...) for trainable tokens")  # fmt: skip
            if m.tied_adapter is None:
                out.tokens[name] = m
            out.names.update(n for n in _tensor_names(m, f"{name}.") if not n.startswith(f"{name}.base_layer."))
        else:
            _check_layer(name, m, peft)
            out.layers[name] = m
            out.prefixes.append((f"{name}.base_layer.", f"{name}."))
            out.names.update(n for n in _tensor_names(m, f"{name}.") if not n.startswith(f"{name}.base_layer."))
    _check_trainable_bias(base, out, configs)
    out.prefixes.sort(key=lambda p: -len(p[0]))
    for layer in out.tokens.values():
        # Not in any store, and non-persistent: without a placeholder the loader would try to rebuild
        # them as a model's own buffers (rotary inv_freq); materialize fills them.
        bufs = getattr(layer, "trainable_tokens_original")._buffers  # noqa: B009
        for key, b in bufs.items():
            if b is not None and b.is_meta:
                bufs[key] = torch.full(b.shape, torch.nan, dtype=b.dtype)
    return base, out


# -- refusals ------------------------------------------------------------------------------

#: init_lora_weights values that derive the adapters from the base weights, gradients or data.
_DERIVED = ("pissa", "olora", "loftq", "corda", "mica", "eva", "lora_ga")


def _check_config(adapter: str, cfg: Any) -> None:
    kind = str(getattr(cfg, "peft_type", type(cfg).__name__))
    if kind.rpartition(".")[2] != "LORA":
        raise ConfigError(f"adapter {adapter!r} is {kind.rpartition('.')[2]} ({type(cfg).__name__}): only LoRA adapters can be "
                          f"put on streamed models (peft.LoraConfig)")  # fmt: skip
    init = cfg.init_lora_weights
    if not (isinstance(init, bool) or (isinstance(init, str) and (init.lower() == "gaussian" or init == "orthogonal"))):
        what = "derives the adapter from the base weights or from data" if str(init).lower().startswith(_DERIVED) else "is not one PEFT draws at random"
        raise ConfigError(
            f"adapter {adapter!r}: init_lora_weights={init!r} {what}, which load_streamed cannot give it; use "
            f"init_lora_weights=True, False, 'gaussian' or 'orthogonal', or load trained adapters after load_streamed "
            f"(peft.set_peft_model_state_dict)"
        )
    if cfg.use_dora:
        raise ConfigError(f"adapter {adapter!r} uses DoRA, whose magnitudes come from the base weights; use plain LoRA (use_dora=False)")
    for f in dataclasses.fields(cfg):
        if f.metadata.get("is_lora_variant") and getattr(cfg, f.name):
            raise ConfigError(f"adapter {adapter!r}: {f.name} makes it a LoRA variant, which load_streamed does not initialise "
                              f"as PEFT does on a real model; use plain LoRA (leave {f.name} unset)")  # fmt: skip
    refused = {
        "target_parameters": "puts LoRA on bare parameters (PEFT's ParamWrapper), which load_streamed does not support; target their modules with target_modules",
        "layer_replication": "repeats layers as copies sharing one layer's weights, which load_streamed does not support (it streams each stored layer into one module); convert a checkpoint of the deeper model instead",
        "modules_to_tie": "(ensure_weight_tying=True on tied embeddings) ties a modules_to_save copy to the embedding's; set ensure_weight_tying=False",
        "target_modules_to_tie": "(ensure_weight_tying=True on tied embeddings) ties LoRA adapters to the embedding's; set ensure_weight_tying=False",
    }
    for attr, why in refused.items():
        value = getattr(cfg, attr, None)
        if value:
            raise ConfigError(f"adapter {adapter!r}: {attr}={sorted(value) if isinstance(value, set) else value!r} {why}")


def _check_layer(name: str, layer: nn.Module, peft: _Peft) -> None:
    if type(layer) not in (peft.linear, peft.embedding):
        hint = " (target_parameters)" if type(layer).__name__ == "ParamWrapper" else ""
        raise ConfigError(
            f"{name} is a {type(layer).__module__}.{type(layer).__name__}{hint}: load_streamed initialises PEFT adapters "
            f"only as LoRA on nn.Linear, transformers' Conv1D and nn.Embedding layers; leave {name.rpartition('.')[2]} out of target_modules"
        )
    variants = getattr(layer, "lora_variant", {})
    if variants:
        adapter, variant = next(iter(variants.items()))
        raise ConfigError(f"adapter {adapter!r} on {name} is a LoRA variant ({type(variant).__name__}), which load_streamed "
                          f"does not initialise as PEFT does on a real model; use plain LoRA")  # fmt: skip


def _check_trainable_bias(base: nn.Module, out: Adapters, configs: dict[str, Any]) -> None:
    biases = {c.bias for c in configs.values()} - {"none"}
    trained = [n for n, p in base.named_parameters() if p.requires_grad and n.endswith("bias") and out.store_name(n) is not None]
    if biases and trained:
        raise ConfigError(
            f"bias={sorted(biases)[0]!r} makes base biases trainable ({', '.join(trained[:3])}{', ...' if len(trained) > 3 else ''}), "
            f"but load_streamed binds base weights frozen; use bias='none' (lora_bias=True gives each adapter its own bias)"
        )


def _streamed_error(name: str, option: str, group: str | None = None) -> ConfigError:
    index = re.search(r"(\d+)$", group or "")
    keep = f"resident_layers={int(index[1]) + 1} or more" if index else "resident_layers="
    return ConfigError(
        f"{name} is in {option}, inside {f'layer {group}' if group else 'a layer'}, which streams from the store: a streamed "
        f"layer has no weights outside its forward to copy and train. Keep that layer resident ({keep}), or leave {name} out of {option}"
    )


# -- making the adapters real --------------------------------------------------------------

def _lora_tensors(layer: nn.Module, adapter: str) -> Iterator[torch.Tensor]:
    for attr in ("lora_A", "lora_B"):
        d = getattr(layer, attr)
        if adapter in d:
            yield from d[adapter].parameters()
    for attr in ("lora_embedding_A", "lora_embedding_B"):
        d = getattr(layer, attr)
        if adapter in d:
            yield d[adapter]


def _init_lora(layer: nn.Module, adapter: str, init: Any, device: torch.device, *, fresh: bool) -> None:
    """Draw adapter ``adapter`` of ``layer`` as PEFT's ``update_layer`` does if ``fresh``; else move it to ``device``."""
    lora_a, lora_b = getattr(layer, "lora_A"), getattr(layer, "lora_B")  # noqa: B009 - typed Any, not Tensor | Module
    emb_a, emb_b = getattr(layer, "lora_embedding_A"), getattr(layer, "lora_embedding_B")  # noqa: B009
    base_w = getattr(layer.get_base_layer(), "weight", None)  # type: ignore[operator]
    base_dtype = base_w.dtype if base_w is not None and base_w.dtype.is_floating_point else None
    if adapter in lora_a:
        mods = [lora_a[adapter], lora_b[adapter]]
        if not fresh:
            for m in mods:
                m.to(device)
            return
        final = [{k: (p.dtype, p.requires_grad) for k, p in m._parameters.items() if p is not None} for m in mods]
        for m in mods:  # built on the CPU, in the default dtype, as nn.Linear(...) in update_layer
            m.to_empty(device="cpu").to(torch.get_default_dtype())
            m.reset_parameters()
        if init == "orthogonal":  # update_layer's dispatch: before the other truthy values
            layer.orthogonal_init(adapter)  # type: ignore[operator]
        elif init:
            layer.reset_lora_parameters(adapter, init)  # type: ignore[operator]
        for m, flags in zip(mods, final):
            for k, (dtype, grad) in flags.items():
                m._parameters[k] = nn.Parameter(_rounded(m._parameters[k], base_dtype, dtype, device), requires_grad=grad)
    elif adapter in emb_a:
        metas = [emb_a[adapter], emb_b[adapter]]
        if not fresh:
            for d in (emb_a, emb_b):
                d[adapter] = nn.Parameter(d[adapter].to(device), requires_grad=d[adapter].requires_grad)
            return
        emb_a[adapter] = nn.Parameter(torch.randn(tuple(metas[0].shape)))
        emb_b[adapter] = nn.Parameter(torch.randn(tuple(metas[1].shape)))
        if init:
            layer.reset_lora_parameters(adapter, init)  # type: ignore[operator]
        for d, meta in zip((emb_a, emb_b), metas):
            d[adapter] = nn.Parameter(_rounded(d[adapter], base_dtype, meta.dtype, device), requires_grad=meta.requires_grad)


def _rounded(t: torch.Tensor, base_dtype: torch.dtype | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``t`` as PEFT leaves it: moved to its base layer's dtype, then to what ``get_peft_model`` casts it to."""
    with torch.no_grad():
        t = t.detach()
        if base_dtype is not None:
            t = t.to(base_dtype)
        return t.to(device=device, dtype=dtype)


def _init_tokens(name: str, layer: nn.Module, device: torch.device) -> None:
    """Trainable tokens start as the rows of the stored embedding they replace (PEFT's ``update_layer``)."""
    deltas, originals = getattr(layer, "trainable_tokens_delta"), getattr(layer, "trainable_tokens_original")  # noqa: B009
    for adapter, delta in list(deltas.items()):
        if not delta.is_meta:
            deltas[adapter] = nn.Parameter(delta.to(device), requires_grad=delta.requires_grad)
            originals[adapter] = originals[adapter].to(device)
            continue
        weight = layer.get_base_layer().weight  # type: ignore[operator]
        if weight.is_meta:
            raise _streamed_error(name.removesuffix(".token_adapter"), "trainable_token_indices")
        with torch.no_grad():
            rows = weight[getattr(layer, "token_indices")[adapter]]  # noqa: B009
            deltas[adapter] = nn.Parameter(rows.clone().to(device=device, dtype=delta.dtype), requires_grad=delta.requires_grad)
            originals[adapter] = rows.clone().to(device=device, dtype=originals[adapter].dtype)


def _copy_saved(name: str, wrapper: nn.Module, device: torch.device) -> None:
    """Each ``modules_to_save`` copy: a copy of the stored module's tensors, as PEFT's deepcopy of it."""
    original: nn.Module = getattr(wrapper, "original_module")  # noqa: B009
    copies: dict[int, torch.Tensor] = {}  # tensors shared within the copies stay shared
    for path, mod in getattr(wrapper, "modules_to_save").named_modules(remove_duplicate=False):  # noqa: B009
        src = original.get_submodule(path.partition(".")[2])  # "default.x" -> "x"
        for slots, src_slots in ((mod._parameters, src._parameters), (mod._buffers, src._buffers)):
            for leaf, t in list(slots.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in copies:
                    s = src_slots[leaf]
                    if s is None or s.is_meta:
                        raise _streamed_error(name, "modules_to_save")
                    with torch.no_grad():
                        c = s.detach().clone().to(device=device, dtype=t.dtype)
                    copies[id(t)] = nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else c
                slots[leaf] = copies[id(t)]


def _tensor_names(module: nn.Module, prefix: str) -> Iterator[str]:
    """Every parameter and buffer name under ``module`` as :func:`~gds_offload.weights.streaming.bind.bind` sees them (ties included)."""
    for path, mod in module.named_modules(remove_duplicate=False):
        head = f"{prefix}{path}." if path else prefix
        yield from (head + leaf for leaf, t in [*mod._parameters.items(), *mod._buffers.items()] if t is not None)


@dataclass(frozen=True)
class _Peft:
    """PEFT's classes (typed ``Any``: peft ships no type information)."""

    tuner: Any
    linear: Any
    embedding: Any
    saved: Any
    tokens: Any
    tokens_wrapper: Any


def _peft() -> _Peft | None:
    try:
        from peft.tuners.lora.layer import Embedding, Linear
        from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper
    except ImportError:  # no peft: no adapters
        return None
    return _Peft(BaseTunerLayer, Linear, Embedding, ModulesToSaveWrapper, TrainableTokensLayer, TrainableTokensWrapper)
