"""LoRA adapters (PEFT) on a streamed model: fine-tuning a model whose layers stream from a store.

Apply ``peft.get_peft_model`` to the meta skeleton, then hand the returned ``PeftModel`` to
:func:`~gds_offload.weights.load_streamed`. PEFT wraps each targeted module (``q_proj``) in a
tuner layer that keeps the original as ``base_layer`` and adds adapter modules (``lora_A``,
``lora_B``); on a meta skeleton it leaves those on the meta device as well, since it moves
adapters to the base weight's device. :class:`Adapters` gives the loader:

* the store name of every base tensor: ``...q_proj.base_layer.weight`` is the store's
  ``...q_proj.weight`` (:meth:`Adapters.store_name`; adapter tensors have none);
* :meth:`Adapters.materialize`: the adapters made real on the model's device and initialised
  the way PEFT would have (its ``reset_lora_parameters``, with the adapter config's
  ``init_lora_weights``; ``False``: the modules' own ``reset_parameters``).

The adapters are ordinary resident parameters: they train, and backward through the frozen
streamed weights reaches them exactly (:mod:`gds_offload.weights.backward`). Initialisations
derived from the base weights or from data (PiSSA, OLoRA, LoftQ: PEFT itself fails on a meta
skeleton; EVA, CorDA: refused here) and DoRA's magnitudes are refused, since a streamed layer
has no weights outside its forward; so are PEFT methods other than LoRA.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gds_offload.errors import ConfigError

__all__ = ["Adapters", "unwrap"]

@dataclass
class Adapters:
    """The PEFT tuner layers of a model (empty for a model without adapters)."""

    #: module name -> its tuner layer.
    layers: dict[str, nn.Module] = field(default_factory=dict)
    #: adapter name -> its PEFT config.
    configs: dict[str, Any] = field(default_factory=dict)
    #: Full names of the adapters' own parameters and buffers.
    names: set[str] = field(default_factory=set)

    def store_name(self, name: str) -> str | None:
        """The store's name for model tensor ``name``, or ``None`` for an adapter tensor."""
        if name in self.names:
            return None
        for mod in self.layers:
            head = f"{mod}.base_layer."
            if name.startswith(head):
                return f"{mod}.{name[len(head):]}"
        return name

    def materialize(self, device: torch.device) -> None:
        """Make every adapter tensor on the meta device real on ``device`` and initialise it (see the module doc)."""
        for layer in self.layers.values():
            subs = _adapter_modules(layer)
            if not any(t.is_meta for s in subs for t in [*s.parameters(), *s.buffers()]):
                continue
            for s in subs:
                s.to_empty(device=device)
            lora_a, lora_b = getattr(layer, "lora_A"), getattr(layer, "lora_B")  # noqa: B009 - typed Any, not Tensor | Module
            for adapter in lora_a:
                init = self.configs[adapter].init_lora_weights
                if init is False:  # PEFT keeps the modules' own initialisation then
                    lora_a[adapter].reset_parameters()
                    lora_b[adapter].reset_parameters()
                else:
                    getattr(layer, "reset_lora_parameters")(adapter, init)  # noqa: B009


def unwrap(model: nn.Module) -> tuple[nn.Module, Adapters]:
    """``(the model PEFT wraps, its adapters)`` for a ``PeftModel``; ``(model, no adapters)`` otherwise.

    Raises:
        ConfigError: a model with tuner layers that is not the ``PeftModel`` (its adapters'
            configs are needed), a PEFT method other than LoRA, or an initialisation or DoRA
            that needs the base weights.
    """
    tuner_cls = _tuner_layer_class()
    if tuner_cls is None:
        return model, Adapters()
    is_peft = callable(getattr(model, "get_base_model", None)) and isinstance(getattr(model, "peft_config", None), dict)
    base: nn.Module = model.get_base_model() if is_peft else model  # type: ignore[operator]
    found = {n: m for n, m in base.named_modules() if _is_tuner(m, tuner_cls)}
    if not found:
        return base, Adapters()
    if not is_peft:
        raise ConfigError(
            f"the model has PEFT adapters ({next(iter(found))}, ...) but is not the PeftModel that peft.get_peft_model "
            f"returned; pass that to load_streamed (its adapter configs say how to initialise the adapters)"
        )
    configs: dict[str, Any] = model.peft_config  # type: ignore[assignment]
    out = Adapters(layers=found, configs=configs)
    for name, layer in found.items():
        if not (hasattr(layer, "lora_A") and hasattr(layer, "reset_lora_parameters")):
            raise ConfigError(f"{name} is a {type(layer).__name__}: only LoRA adapters can be put on streamed layers")
        for adapter in getattr(layer, "lora_A"):  # noqa: B009
            init = configs[adapter].init_lora_weights
            if not (isinstance(init, bool) or (isinstance(init, str) and init.lower() == "gaussian")):  # shape-only inits
                raise ConfigError(
                    f"adapter {adapter!r}: init_lora_weights={init!r} derives the adapter from the base weights or from data, "
                    f"which load_streamed cannot give it; use init_lora_weights=True or 'gaussian', or load trained "
                    f"adapters after load_streamed (peft.set_peft_model_state_dict)"
                )
            if getattr(layer, "use_dora", {}).get(adapter, False):
                raise ConfigError(f"adapter {adapter!r} uses DoRA, whose magnitudes come from the base weights; use plain LoRA")
        for s_name, s in zip(_adapter_attrs(layer), _adapter_modules(layer)):
            for leaf, _ in [*s.named_parameters(), *s.named_buffers()]:
                out.names.add(f"{name}.{s_name}.{leaf}")
    return base, out


def _tuner_layer_class() -> type | None:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft: no adapters
        return None
    return BaseTunerLayer


def _is_tuner(module: nn.Module, tuner_cls: type) -> bool:
    return isinstance(module, tuner_cls)


def _adapter_attrs(layer: nn.Module) -> list[str]:
    names = list(getattr(layer, "adapter_layer_names", ())) + list(getattr(layer, "other_param_names", ()))
    return [n for n in names if isinstance(getattr(layer, n, None), (nn.ModuleDict, nn.ParameterDict))]


def _adapter_modules(layer: nn.Module) -> list[nn.Module]:
    return [getattr(layer, n) for n in _adapter_attrs(layer)]
