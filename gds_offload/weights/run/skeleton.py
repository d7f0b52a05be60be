"""The model skeleton :func:`~gds_offload.weights.run.pretrained.from_pretrained` and the planner
build for a store: :func:`empty_model`.

A skeleton built under ``torch.device("meta")`` has its computed buffers (rotary ``inv_freq``,
Gemma's ``embed_scale``) on the meta device too, and :func:`~gds_offload.weights.streaming.bind.rebuild_meta_buffers`
cannot rebuild every one of them (a buffer of a module that also owns weights). Under
``accelerate.init_empty_weights()`` only the parameters go to the meta device: every buffer is
computed by the model's own ``__init__``, as ``transformers``' ``from_pretrained`` computes it,
so every architecture :func:`~gds_offload.weights.load_streamed` streams gets one this way.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from gds_offload.errors import ConfigError

__all__ = ["check_empty_model", "empty_model"]


def check_empty_model() -> None:
    """Raise before anything is done when :func:`empty_model` cannot run here.

    Raises:
        ConfigError: Accelerate is not installed.
    """
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise ConfigError("the model skeleton is built under accelerate.init_empty_weights() (weights on the meta device, computed "
                          "buffers real), and accelerate is not installed: pip install 'gds_offload[hf]'") from None  # fmt: skip


def empty_model(config: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` with its parameters on the meta device and its
    buffers computed on the CPU (see the module doc).

    Raises:
        ConfigError: Accelerate is not installed.
    """
    check_empty_model()
    import accelerate
    import transformers

    with accelerate.init_empty_weights():
        return transformers.AutoModelForCausalLM.from_config(config)
