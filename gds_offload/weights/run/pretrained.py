"""One call from a checkpoint to a planned, streamed model: :func:`from_pretrained`.

What Accelerate and AirLLM users expect (``AutoModel.from_pretrained(path)`` and done): the store
is made (or remade) when it is missing or stale, the skeleton built from the checkpoint's config
(:func:`~gds_offload.weights.run.skeleton.empty_model`: weights on the meta device, buffers computed,
so every architecture ``load_streamed`` streams), the workload planned on this machine under the
memory given, and the streamed model returned with the plan applied (``generate_many`` takes its
shape from it). As ``transformers``' own ``from_pretrained``, the model is in eval mode and
``generate`` takes its defaults from the checkpoint's ``generation_config.json``; a store trained
by :class:`~gds_offload.weights.train.trainer.StreamedTrainer` gives its last complete step
(``converted=True``: the converted weights), as :func:`~gds_offload.weights.store.export.export` does.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import transformers

from gds_offload.errors import ConfigError
from gds_offload.weights.errors import StoreFormatError
from gds_offload.weights.planning.planner import Generate, Plan, as_plan
from gds_offload.weights.run.model import load_streamed
from gds_offload.weights.run.plan import plan as measure_and_plan
from gds_offload.weights.run.progress import ProgressArg, reporter
from gds_offload.weights.run.skeleton import check_empty_model, empty_model
from gds_offload.weights.store.convert import convert
from gds_offload.weights.store.manifest import read_manifest

__all__ = ["from_pretrained", "stale_reason"]


def stale_reason(checkpoint: Path, store: Path) -> str | None:
    """Why ``store`` does not hold ``checkpoint`` as it is now, or ``None``: no store there, one
    converted from another directory, a config that differs, or a checkpoint file newer than it."""
    if not (store / "manifest.json").exists():
        return "no store yet"
    try:
        m = read_manifest(store)
    except StoreFormatError as exc:
        return f"the store is damaged ({exc})"
    source = m.source
    if source.get("checkpoint") and Path(source["checkpoint"]).resolve() != checkpoint.resolve():
        return f"converted from {source['checkpoint']}"
    config = checkpoint / "config.json"
    if config.exists() and m.config_file_sha256 and hashlib.sha256(config.read_bytes()).hexdigest() != m.config_file_sha256:
        return "the checkpoint's config.json changed"
    written = (store / "manifest.json").stat().st_mtime
    for f in sorted(checkpoint.glob("*.safetensors*")):
        if f.stat().st_mtime > written:
            return f"{f.name} is newer than the store"
    return None


def from_pretrained(
    checkpoint: str | os.PathLike[str],
    *,
    store: str | os.PathLike[str],
    memory: int | str | None = None,
    workload: Generate | None = None,
    device: str = "cpu",
    engine: str = "auto",
    progress: ProgressArg = True,
    plan: Plan | str | os.PathLike[str] | None = None,
    **load_kwargs: Any,
) -> Any:
    """Convert ``checkpoint`` into ``store`` if needed, plan ``workload`` under ``memory`` and return
    the streamed model (:class:`~gds_offload.weights.run.model.StreamedModel`, ``.plan`` set).

    Args:
        checkpoint: a safetensors checkpoint directory with its ``config.json``.
        store: where the weight store is (made when missing or stale: :func:`stale_reason`).
        memory: what the run may use (``"1.2GiB"``); without ``workload``, the weights' share of it
            (``load_streamed(max_memory=)``). Needed unless ``plan`` is given.
        workload: what will run (:class:`~gds_offload.weights.planning.planner.Generate`); ``None``: no plan.
        progress: ``True`` (default): a bar per phase (convert, measure, load) on a terminal, else a
            line per phase on stderr; ``False``: nothing; a ``logging.Logger`` or a callable taking a
            line: every phase and measuring step to it (:mod:`~gds_offload.weights.run.progress`).
        plan: a plan made before (a :class:`~gds_offload.weights.planning.planner.Plan`, or the JSON file
            ``gds-offload plan --out`` wrote), applied without measuring again; not with ``workload``.
        load_kwargs: more ``load_streamed`` arguments (``verify``, ``num_threads``, ``tier``;
            ``converted=True`` or ``train_dir`` for a trained store).

    Raises:
        ConfigError: no ``config.json`` in ``checkpoint``; Accelerate not installed; a plan that
            cannot fit ``memory``; neither ``memory`` nor ``plan``, or ``plan`` with ``workload``;
            what ``convert``, ``plan`` and ``load_streamed`` raise.
    """
    say = reporter(progress, name="from_pretrained")
    ckpt, out = Path(checkpoint), Path(store)
    if not (ckpt / "config.json").is_file():
        raise ConfigError(f"{ckpt} has no config.json: from_pretrained builds the model from it; pass a Hugging Face checkpoint directory")
    check_empty_model()
    chosen = as_plan(plan)
    if chosen is not None and workload is not None:
        raise ConfigError("from_pretrained got plan= and workload=: a plan was made for its own workload; pass one or the other")
    if chosen is None and memory is None:
        raise ConfigError("from_pretrained needs memory= (what the run may use, e.g. '8GiB'), or plan= (a plan gds-offload plan --out wrote)")
    why = stale_reason(ckpt, out)
    if why is not None:
        with say.phase(f"converting {ckpt} into {out} ({why})") as phase:
            convert(ckpt, out, overwrite=why != "no store yet", progress=phase.bytes)
    if workload is not None:
        assert memory is not None, "a workload without a plan was checked to come with memory="
        with say.phase(f"measuring the model in {out} on {device} to plan {workload}") as phase:
            chosen = measure_and_plan(out, workload, memory=memory, device=device, engine=engine, progress=phase.step)
    skeleton = empty_model(transformers.AutoConfig.from_pretrained(out))
    with say.phase(f"loading {out} on {device}"):
        if chosen is not None:
            return load_streamed(skeleton, out, device=device, engine=engine, plan=chosen, **load_kwargs)
        return load_streamed(skeleton, out, device=device, engine=engine, max_memory=memory, **load_kwargs)
