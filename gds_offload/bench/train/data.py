"""Training from shards in ``gds-offload demo --data DIR`` and ``bench --data DIR``.

The benchmark runner wants ``batch_fn(step)``: the batch of a step, a function of the step
only (every mode, in its own process, trains on the same data). :class:`StepBatches` is
that function over a :class:`~gds_offload.data.TokenLoader` (``drop_last=True``, so every
batch is whole): it reads on while the steps come in order and seeks when they do not.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from gds_offload.data.format import scan_shards
from gds_offload.data.loader import TokenLoader
from gds_offload.errors import ConfigError

__all__ = ["StepBatches", "data_defaults", "with_data", "DATA_MODELS"]

#: Models whose batches :class:`StepBatches` knows how to shape.
DATA_MODELS = ("gpt", "llama", "gpt2")


def data_defaults(directory: str | os.PathLike[str], *, seq: int | None = None) -> tuple[int, int | None]:
    """``(seq, vocab)`` of a shard directory (vocab None without a manifest).

    Raises:
        ShardError: a bad directory or file, or windows of another length than ``seq + 1``.
    """
    shards = scan_shards(directory, seq=seq)
    return shards.seq, shards.vocab


class StepBatches:
    """``batch_fn(step)`` over a shard directory: ``[batch, seq + 1]`` windows (``gpt``) or
    ``{"input_ids", "labels"}`` with ``labels = input_ids`` (Hugging Face models shift them).

    Args:
        directory: the shard directory.
        model: ``gpt``, ``llama`` or ``gpt2``.
        batch: windows per step.
        seq: the model's sequence length (must be the shards').
        vocab: the model's vocabulary (must hold the shards' tokens).
        seed: the loader's seed.
        device: where batches go.
    """

    def __init__(self, directory: str | os.PathLike[str], *, model: str, batch: int, seq: int, vocab: int,
                 seed: int, device: str) -> None:
        if model not in DATA_MODELS:
            raise ConfigError(f"--data trains {', '.join(DATA_MODELS)}; model={model!r} brings its own batches")
        self.loader = TokenLoader(directory, batch_size=batch, seq=seq, seed=seed, device=device, drop_last=True)
        data_vocab = self.loader.shards.vocab
        if data_vocab is not None and data_vocab > vocab:
            raise ConfigError(f"--data {directory}: tokens up to {data_vocab - 1} (vocab {data_vocab}) do not fit "
                              f"the model's vocab {vocab}; pass --vocab {data_vocab}")
        self.model = model
        self._stream: Iterator[dict[str, torch.Tensor]] | None = None
        self._next = 0

    def __call__(self, step: int) -> Any:
        if self._stream is None or step != self._next:
            self.loader.seek(step)
            self._stream = self.loader.batches()
        batch = next(self._stream)
        self._next = step + 1
        if self.model == "gpt":
            return torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
        return {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}


def with_data(workload: Any, spec: Any) -> Any:
    """``workload`` (a :class:`~gds_offload.bench.train.workload.Workload`) with its batches read from ``spec.data``."""
    workload.batch_fn = StepBatches(spec.data, model=spec.model, batch=spec.batch, seq=spec.seq, vocab=spec.vocab,
                                    seed=spec.seed, device=spec.device)
    return workload
