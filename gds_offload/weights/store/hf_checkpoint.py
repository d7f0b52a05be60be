"""Reading a safetensors checkpoint's tensor list, grouping it by layer, and laying it out.

Only headers are read here (names, dtypes, shapes); :func:`open_tensors` hands out one
tensor at a time for the converter. Nothing reads a whole shard, let alone the model.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gds_offload.errors import ConfigError
from gds_offload.io.layout import ALIGN, align_up
from gds_offload.weights.store.config import CONFIG_NAME, GENERATION_CONFIG_NAME
from gds_offload.weights.store.manifest import DTYPE_SIZES, RESIDENT, TENSOR_ALIGN, GroupEntry, TensorEntry

__all__ = ["CheckpointTensor", "Checkpoint", "find_checkpoint", "group_tensors", "plan_layout", "SAFETENSORS_DTYPES"]

#: safetensors' dtype codes -> torch dtype names (the manifest's spelling).
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
assert set(SAFETENSORS_DTYPES.values()) <= set(DTYPE_SIZES), "every dtype read can be stored"
#: ``<container>.<index>.<rest>``: the first numbered component of a name.
_NUMBERED = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)\.")


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor as the checkpoint's header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory: its safetensors files, tensors (in name order) and configs.

    ``config`` is ``config.json`` parsed, ``config_bytes`` and ``generation_config_bytes`` the
    files as read (``None``: none there); the store gets these very bytes.
    """

    dir: Path
    files: list[Path]
    tensors: list[CheckpointTensor]
    config_path: Path | None
    config: dict[str, Any] | None = None
    config_bytes: bytes | None = None
    generation_config_bytes: bytes | None = None


def find_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> Checkpoint:
    """Read the headers of ``model.safetensors``, or of the shards ``model.safetensors.index.json``
    lists, and the checkpoint's ``config.json`` and ``generation_config.json``.

    Raises:
        ConfigError: no safetensors checkpoint there; an index that is not JSON or has no
            ``weight_map`` of file names; a shard missing or not a safetensors file; a tensor
            listed twice or of a dtype this version cannot store; a ``config.json`` that is
            not a JSON object. Each names the file.
    """
    d = Path(checkpoint_dir)
    single, index = d / "model.safetensors", d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({d / f for f in _weight_map(index).values()})
    elif single.is_file():
        files = [single]
    else:
        found = ", ".join(sorted(p.name for p in d.iterdir())[:10]) if d.is_dir() else "not a directory"
        raise ConfigError(
            f"{d} holds neither model.safetensors nor model.safetensors.index.json ({found}); "
            f"pass a Hugging Face checkpoint directory saved with safetensors (save_pretrained(..., safe_serialization=True))"
        )
    tensors: dict[str, CheckpointTensor] = {}
    for f in files:
        if not f.is_file():
            raise ConfigError(f"shard {f.name} listed in {index} is missing from {d}; download or copy it")
        for name, code, shape in _header(f):
            if code not in SAFETENSORS_DTYPES:
                raise ConfigError(f"tensor {name} in {f.name} has dtype {code}, which this version cannot store ({', '.join(SAFETENSORS_DTYPES)})")
            if name in tensors:
                raise ConfigError(f"tensor {name} is in both {tensors[name].file.name} and {f.name}; the checkpoint is inconsistent")
            tensors[name] = CheckpointTensor(name, SAFETENSORS_DTYPES[code], shape, f)
    config_bytes, gen_bytes = _read(d / CONFIG_NAME), _read(d / GENERATION_CONFIG_NAME)
    config = None if config_bytes is None else _json_object(d / CONFIG_NAME, config_bytes)
    if gen_bytes is not None:
        _json_object(d / GENERATION_CONFIG_NAME, gen_bytes)
    return Checkpoint(d, files, [tensors[n] for n in sorted(tensors)], d / CONFIG_NAME if config_bytes is not None else None,
                      config, config_bytes, gen_bytes)  # fmt: skip


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index: ``{tensor name: shard file name}``."""
    d = _json_object(index, index.read_bytes())
    weight_map = d.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        got = "none" if weight_map is None else type(weight_map).__name__
        raise ConfigError(f"{index} has no weight_map of tensor names to shard files ({got}); the index is damaged: save the checkpoint again")
    return weight_map


def _header(f: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, safetensors dtype code, shape)`` of every tensor in the safetensors file ``f``."""
    from safetensors import safe_open

    try:
        with safe_open(f, framework="pt") as fh:
            return [(n, (sl := fh.get_slice(n)).get_dtype(), tuple(sl.get_shape())) for n in fh.keys()]  # noqa: SIM118 - no __iter__
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError, and OSError
        raise ConfigError(f"{f} is not a readable safetensors file ({type(exc).__name__}: {exc}); save the checkpoint again "
                          f"(save_pretrained(..., safe_serialization=True)) or copy the file again") from None  # fmt: skip


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror or exc}); fix its permissions") from None


def _json_object(path: Path, data: bytes) -> dict[str, Any]:
    try:
        d = json.loads(data)
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); fix or replace it (save_pretrained writes it)") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path} holds a JSON {type(d).__name__}, not an object; fix or replace it (save_pretrained writes it)")
    return d


def group_tensors(names: list[str], layer_prefix: str | None = None) -> tuple[str | None, dict[str, int | None]]:
    """``(layer_prefix, {name: layer index or None})``: which tensors belong to which layer.

    The repeated blocks are the numbered children of one container: by default the
    container (``model.layers`` in ``model.layers.3.mlp.up_proj.weight``) with the most
    distinct indices; ``layer_prefix`` names it instead. Tensors outside it are resident.

    Raises:
        ConfigError: ``layer_prefix`` given but no tensor name starts with ``<layer_prefix>.<index>.``.
    """
    counts: dict[str, set[int]] = {}
    for n in names:
        m = _NUMBERED.match(n)
        if m:
            counts.setdefault(m["prefix"], set()).add(int(m["index"]))
    if layer_prefix is None and counts:
        layer_prefix = max(counts, key=lambda p: (len(counts[p]), -len(p)))
    if layer_prefix is not None and layer_prefix not in counts:
        raise ConfigError(
            f"layer_prefix={layer_prefix!r}: no tensor is named {layer_prefix}.<index>.<...>; "
            f"numbered containers in this checkpoint: {', '.join(sorted(counts)) or 'none'}"
        )
    pattern = re.compile(rf"^{re.escape(layer_prefix)}\.(\d+)\.") if layer_prefix else None
    where: dict[str, int | None] = {}
    for n in names:
        m = pattern.match(n) if pattern else None
        where[n] = int(m[1]) if m else None
    return layer_prefix, where


def plan_layout(
    tensors: list[CheckpointTensor],
    where: dict[str, int | None],
    layer_prefix: str | None,
    *,
    n_files: int = 1,
    tensor_align: int = TENSOR_ALIGN,
) -> tuple[list[GroupEntry], list[TensorEntry], list[int]]:
    """Offsets for every group and tensor: ``(groups, tensors, file sizes)``.

    The resident group comes first in file 0; layer ``i`` (the ``i``-th in index order) goes
    to file ``i % n_files``. Groups start at multiples of :data:`~gds_offload.io.layout.ALIGN` and take their
    size rounded up to it; tensors inside start at multiples of ``tensor_align``. Checksums
    are left 0 (the converter fills them in as it writes). A tensor also starts at a multiple of
    its element size, should ``tensor_align`` be smaller (its view in a group's buffer needs it).
    """
    if tensor_align < 1 or ALIGN % tensor_align:
        raise ConfigError(f"tensor_align={tensor_align}: must divide {ALIGN} (256, the default, or 4096 are usual)")
    members: dict[int | None, list[CheckpointTensor]] = {}
    for t in tensors:
        members.setdefault(where[t.name], []).append(t)
    order: list[int | None] = ([None] if None in members else []) + sorted(k for k in members if k is not None)
    sizes = [0] * n_files
    groups: list[GroupEntry] = []
    entries: list[TensorEntry] = []
    for rank, layer in enumerate(order):
        file = 0 if layer is None else (rank - (1 if None in members else 0)) % n_files
        name = RESIDENT if layer is None else f"{layer_prefix}.{layer}"
        start = sizes[file]
        cursor = 0
        for t in members[layer]:
            cursor = align_up(cursor, max(tensor_align, DTYPE_SIZES[t.dtype]))
            entries.append(TensorEntry(t.name, t.dtype, t.shape, name, start + cursor, t.nbytes))
            cursor += t.nbytes
        groups.append(GroupEntry(name, layer, file, start, cursor, 0))
        sizes[file] = start + align_up(cursor)
    return groups, entries, sizes


@contextlib.contextmanager
def open_tensors(checkpoint: Checkpoint) -> Iterator[dict[Path, object]]:
    """``{shard path: safe_open handle}`` for every shard, closed on exit (memory-mapped, not read).

    Raises:
        ConfigError: a shard can no longer be opened as safetensors (names it).
    """
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        handles = {}
        for f in checkpoint.files:
            try:
                handles[f] = stack.enter_context(safe_open(f, framework="pt"))
            except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError, OSError
                raise ConfigError(f"{f} is not a readable safetensors file ({type(exc).__name__}: {exc}); copy it again") from None
        yield handles
