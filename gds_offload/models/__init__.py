"""Models the examples and benchmarks train: the demo GPT (:mod:`gds_offload.models.gpt`).

* :class:`GPTConfig`, :func:`make_gpt`: a small decoder-only GPT (pre-norm blocks of attention
  and MLP), seeded; :func:`synthetic_batch` random tokens of a step, :func:`lm_loss` its loss.
* :func:`demo_preset`: the sizes ``gds-offload demo`` trains on a CPU or a GPU;
  :func:`estimate_memory`: what a run of the model needs.
"""
from __future__ import annotations

from gds_offload.models.gpt import GPT, GPTConfig, MemoryEstimate, demo_preset, estimate_memory, lm_loss, make_gpt, synthetic_batch

__all__ = ["GPT", "GPTConfig", "MemoryEstimate", "demo_preset", "estimate_memory", "lm_loss", "make_gpt", "synthetic_batch"]
