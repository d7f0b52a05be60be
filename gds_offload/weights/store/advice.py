"""The commands the weight store's errors suggest, each one that runs as written from where the
user is (``tests/test_advice.py`` runs them): a store's directory is named as the user gave it,
the checkpoint it was converted from as the manifest recorded it, and ``--force`` is there where
the directory holds a store already. An upper-case word (``CHECKPOINT``) is the one thing the
user fills in: what the error cannot know.
"""
from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

from gds_offload.io.directory import missing_parent

__all__ = ["is_checkpoint", "no_store_advice", "reconvert_command"]


def is_checkpoint(d: Path) -> bool:
    """``d`` holds a Hugging Face checkpoint (its ``config.json`` and safetensors weights)."""
    return (d / "config.json").is_file() and any(d.glob("*.safetensors")) if d.is_dir() else False


def _free_sibling(d: Path) -> Path:
    """``<d>-store``, or ``<d>-store-2``, ... : a name beside ``d`` that nothing holds yet."""
    base = d.parent / f"{d.name}-store"
    candidate, n = base, 2
    while os.path.lexists(candidate):
        candidate, n = base.with_name(f"{base.name}-{n}"), n + 1
    return candidate


def no_store_advice(d: Path) -> str:
    """What to do when there is no weight store at ``d``: convert the checkpoint there (or, when
    ``d`` is itself a checkpoint, convert it into a new directory beside it and pass that)."""
    if is_checkpoint(d) or (d.is_file() and is_checkpoint(d.parent)):
        ckpt = d if d.is_dir() else d.parent
        out = _free_sibling(ckpt)
        return (f"{ckpt} is a Hugging Face checkpoint, not a weight store: convert it into a store of its own first, "
                f"`gds-offload convert {shlex.quote(str(ckpt))} {shlex.quote(str(out))}`, then pass {out}")
    no_parent = missing_parent(d)
    if no_parent is not None:
        return no_parent
    if d.is_dir() and any(d.iterdir()):
        return f"{d} holds other files: convert the checkpoint into a new directory, `gds-offload convert CHECKPOINT {shlex.quote(str(_free_sibling(d)))}`, and pass that"
    return f"convert a checkpoint into it: `gds-offload convert CHECKPOINT {shlex.quote(str(d))}`"


def reconvert_command(dirs: Sequence[str | os.PathLike[str]], source: object) -> str:
    """``gds-offload convert --force CHECKPOINT DIR...``: convert again into the store's own
    directories, from the checkpoint the manifest names (``source``) when it is still there."""
    ckpt = source if isinstance(source, str) and source and is_checkpoint(Path(source)) else "CHECKPOINT"
    return f"`gds-offload convert --force {shlex.join([ckpt, *(os.fspath(d) for d in dirs)])}`"
