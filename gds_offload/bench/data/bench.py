"""Loader throughput, side by side in one run: the DALI :class:`~gds_offload.data.TokenLoader`,
a plain ``torch.utils.data.DataLoader`` over ``np.memmap`` shards, and what the demo's
training step consumes.

* **TokenLoader**: one epoch (or ``max_windows``) of shuffled batches.
* **DataLoader over np.memmap** (the nanoGPT way): the same shard files opened with
  ``np.load(mmap_mode="r")``, a map-style dataset of windows, ``shuffle=True`` with a
  seeded generator, ``0`` and ``2`` worker processes; each window becomes an ``int64``
  tensor and the batch the same ``{"input_ids", "labels"}`` pair the loader yields.
* **demo step**: the demo model (:data:`gds_offload.models.gpt.DEMO_PRESETS`, at the shards'
  sequence length) trained from these shards without offloading, in its own process
  (:func:`gds_offload.bench.train.runner.run_mode`): ``batch * seq`` tokens per median step.

Tokens are counted as ``windows * seq`` (the input tokens; a step consumes ``batch * seq``).
Each loader is measured ``rounds`` times, interleaved, and the median is reported.
:func:`run_loader_bench` returns a ``kind: "table"`` result document for
:mod:`gds_offload.bench.docs.report`.
"""
from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gds_offload.bench.docs.report import current_commit
from gds_offload.bench.docs.stale import exercised_paths
from gds_offload.bench.machine import describe_machine
from gds_offload.bench.train.runner import run_mode
from gds_offload.bench.train.spec import RunSpec
from gds_offload.data.format import ShardSet, scan_shards
from gds_offload.data.loader import TokenLoader
from gds_offload.models.gpt import demo_preset

__all__ = ["Measurement", "MemmapWindows", "memmap_loader", "time_batches", "run_loader_bench"]


@dataclass
class Measurement:
    """Tokens/s of one source at one batch size, over rounds."""

    source: str
    batch: int
    tokens: int = 0
    seconds: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / statistics.median(self.seconds) if self.seconds else 0.0

    def spread(self) -> str:
        if len(self.seconds) < 2:
            return "-"
        return f"{self.tokens / max(self.seconds) / 1e6:,.1f}-{self.tokens / min(self.seconds) / 1e6:,.1f}"


class MemmapWindows(torch.utils.data.Dataset):
    """Window ``i`` of a shard directory as an ``int64`` tensor ``[seq + 1]``, read from ``np.memmap``s.

    The memmaps are opened on first use in each process (so DataLoader workers open their own).
    """

    def __init__(self, shards: ShardSet) -> None:
        self.paths = [str(f.path) for f in shards.files]
        self.ends = np.cumsum([f.windows for f in shards.files])
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._maps is None:
            self._maps = [np.load(p, mmap_mode="r") for p in self.paths]
        k = int(np.searchsorted(self.ends, index, side="right"))
        row = index - (int(self.ends[k - 1]) if k else 0)
        return torch.from_numpy(self._maps[k][row].astype(np.int64))


def _collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    tokens = torch.stack(rows)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def memmap_loader(shards: ShardSet, *, batch: int, seed: int, num_workers: int, pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """A shuffled ``DataLoader`` over :class:`MemmapWindows` (every window once per epoch)."""
    return torch.utils.data.DataLoader(MemmapWindows(shards), batch_size=batch, shuffle=True, num_workers=num_workers,
                                       generator=torch.Generator().manual_seed(seed), collate_fn=_collate,
                                       pin_memory=pin_memory)


def time_batches(batches: Iterable[dict[str, torch.Tensor]], *, device: torch.device, max_windows: int | None) -> tuple[int, float]:
    """``(input tokens, seconds)`` to take batches from ``batches`` (moved to ``device``) until exhausted or ``max_windows``."""
    t0 = time.perf_counter()
    tokens = windows = 0
    for batch in batches:
        ids = batch["input_ids"].to(device, non_blocking=True)
        tokens += ids.numel()
        windows += ids.shape[0]
        if max_windows is not None and windows >= max_windows:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return tokens, time.perf_counter() - t0


def demo_step(shards: ShardSet, device: str, steps: int, timeout_s: float) -> tuple[Any, Any]:
    cfg, batch = demo_preset(device)
    vocab = max(cfg.vocab, shards.vocab or 0)
    spec = RunSpec(mode="keep", model="gpt", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, seq=shards.seq,
                   vocab=vocab, batch=batch, dropout=cfg.dropout, steps=steps, warmup=1, device=device,
                   measure_memory=False, data=str(shards.directory.resolve()))
    return spec, run_mode(spec, timeout_s=timeout_s)


def run_loader_bench(directory: str | os.PathLike[str], *, batches: Sequence[int] = (4, 64), rounds: int = 3,
                     workers: Sequence[int] = (0, 2), device: str = "cpu", max_windows: int | None = None,
                     demo_steps: int = 2, seed: int = 0, command: str = "", timeout_s: float = 900.0,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every source and return the result document (``kind: "table"``).

    Raises:
        ShardError: a bad shard directory.
        ConfigError: DALI missing, or a bad argument.
    """

    say = progress or (lambda _msg: None)
    started = time.time()
    commit = current_commit()  # before the run writes anything into the checkout
    load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    shards = scan_shards(directory)
    dev = torch.device(device)
    sources: list[tuple[Measurement, Callable[[int], Iterable[dict[str, torch.Tensor]]]]] = []
    reader = "DALI GPU reader" if dev.type == "cuda" else "DALI CPU reader"

    def token_loader(batch: int, k: int) -> Iterable[dict[str, torch.Tensor]]:
        return TokenLoader(directory, batch_size=batch, seed=seed + k, device=dev)

    def data_loader(batch: int, num_workers: int, k: int) -> Iterable[dict[str, torch.Tensor]]:
        return memmap_loader(shards, batch=batch, seed=seed + k, num_workers=num_workers, pin_memory=dev.type == "cuda")

    for b in batches:
        sources.append((Measurement(f"TokenLoader ({reader})", b), functools.partial(token_loader, b)))
        for w in workers:
            mw = Measurement(f"DataLoader, np.memmap, {w} worker{'s' if w != 1 else ''}", b)
            sources.append((mw, functools.partial(data_loader, b, w)))
    rows = [m for m, _ in sources]
    for k in range(rounds):
        for m, make in sources[k % len(sources):] + sources[: k % len(sources)]:
            say(f"round {k + 1}/{rounds}: {m.source}, batch {m.batch}")
            tokens, seconds = time_batches(make(k), device=dev, max_windows=max_windows)
            if m.tokens and tokens != m.tokens:
                raise RuntimeError(f"{m.source} served {tokens} tokens in round {k + 1}, {m.tokens} before")
            m.tokens = tokens
            m.seconds.append(seconds)
    say(f"demo step: {demo_steps} steps of the demo model on {device}")
    spec, demo = demo_step(shards, device, demo_steps, timeout_s)
    demo_tps = demo.tokens_per_s if demo.status == "ok" else None
    return _document(shards, rows, spec, demo, demo_tps, rounds=rounds, max_windows=max_windows, device=device,
                     command=command, commit=commit, machine=describe_machine(shards.directory).as_dict(),
                     started=started, load_average=load_average)


def _document(shards: ShardSet, rows: list[Measurement], spec: Any, demo: Any, demo_tps: float | None, *, rounds: int,
              max_windows: int | None, device: str, command: str, commit: str | None, machine: dict[str, Any],
              started: float, load_average: float | None = None) -> dict[str, Any]:
    columns = ["source", "batch", "tokens/s (median)", "range, M tokens/s", "x demo step", "x best DataLoader, same batch"]
    table: list[list[str]] = []
    verdicts: list[str] = []
    for m in rows:
        best = max((r.tokens_per_s for r in rows if r.batch == m.batch and r.source.startswith("DataLoader")), default=0.0)
        vs_demo = f"{m.tokens_per_s / demo_tps:,.0f}x" if demo_tps else "-"
        vs_dl = f"{m.tokens_per_s / best:.2f}x" if m.source.startswith("TokenLoader") and best else "-"
        table.append([m.source, str(m.batch), f"{m.tokens_per_s:,.0f}", m.spread(), vs_demo, vs_dl])
        if m.source.startswith("TokenLoader"):
            ok_demo = demo_tps is not None and m.tokens_per_s >= 2 * demo_tps
            verdicts.append(f"batch {m.batch}: {'>=' if ok_demo else 'NOT >='} 2x the demo step, "
                            f"{'>=' if m.tokens_per_s >= best else 'NOT >='} the best DataLoader")
    demo_row = f"demo training step ({spec.model} {spec.layers}x{spec.hidden}, seq {spec.seq}, keep)"
    if demo_tps:
        table.append([demo_row, str(spec.batch), f"{demo_tps:,.0f}", "-", "1x", "-"])
    else:
        table.append([demo_row, str(spec.batch), f"{demo.status}: {demo.error[:80]}", "-", "-", "-"])
    span = f"the first {max_windows} windows of an epoch" if max_windows else "one epoch"
    if shards.tokenizer == "synthetic" and shards.sources:
        origin = f"written by `gds-offload shards DIR {shards.sources[0]}`"
    else:
        origin = f"tokenizer {shards.tokenizer or 'unknown'}, {len(shards.sources)} source file(s)"
    load = f"; load average {load_average:.1f} at the start (a shared machine)" if load_average is not None else ""
    about = (f"{len(shards.files)} shard files ({shards.nbytes / 1e6:,.0f} MB, {shards.windows:,} windows of {shards.seq + 1} "
             f"{shards.dtype} tokens, {origin}) on {device}{load}; each loader serves {span} of "
             f"shuffled batches, {rounds} rounds interleaved, files in the page cache after the first round. "
             f"Tokens counted are input tokens (windows x seq). The demo step trains the demo model from the same shards "
             f"in its own process (median of {spec.steps} steps after 1 warm-up). Targets: " + "; ".join(verdicts) + ".")
    return {
        "kind": "table",
        "title": f"Token loader throughput on {device}: DALI against a DataLoader over np.memmap",
        "about": about,
        "command": command,
        "commit": commit,
        "exercises": exercised_paths("shards"),
        "machine": machine,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": time.time() - started,
        "table": {"columns": columns, "rows": table},
        "measurements": [{"source": m.source, "batch": m.batch, "tokens": m.tokens, "seconds": m.seconds,
                          "tokens_per_s": m.tokens_per_s} for m in rows],
        "demo": {"spec": spec.to_json(), "status": demo.status, "error": demo.error, "tokens_per_s": demo_tps,
                 "step_s": demo.step_s},
        "directory": str(Path(shards.directory).resolve()),
        "load_average": load_average,
    }
