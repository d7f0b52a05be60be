"""``export``: a weight store -> a sharded safetensors checkpoint that ``transformers`` loads as is.

The inverse of :func:`~gds_offload.weights.store.convert.convert`: every tensor of the store, under the
name the checkpoint gave it, in shards of at most ``shard_bytes`` (a layer is never split), with
``model.safetensors.index.json`` when there is more than one, and the store's ``config.json`` and
``generation_config.json`` (the bytes its manifest hashes). So
``AutoModelForCausalLM.from_pretrained(OUT)`` builds the model whose weights are the store's, bit
for bit.

Every group is read with its checksum checked (``O_DIRECT``, two groups in flight), so a damaged
store is refused by layer name, not exported. Peak memory: the shard being assembled, its copy
while safetensors writes it, and one group being read.

Order of work, so a failure leaves nothing that looks complete: ``OUT`` must be missing or empty
(it is created 0755 less the umask); each shard is written as ``NAME.partial`` and renamed;
the configs, then the index, come last. A failure removes every file this call wrote.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from gds_offload.errors import ConfigError
from gds_offload.io.base import Engine, IOFuture
from gds_offload.io.directory import missing_parent
from gds_offload.io.factory import make_engine
from gds_offload.io.integrity import checksum
from gds_offload.units import parse_bytes
from gds_offload.weights.store.config import CONFIG_NAME, GENERATION_CONFIG_NAME
from gds_offload.weights.store.files import StoreFiles, aligned_host_buffer, corrupt_error, read_group, resolve_dirs, view_of
from gds_offload.weights.store.manifest import GroupEntry, Manifest, read_manifest
from gds_offload.weights.store.steps import STEP_NAME, Generations, Step
from gds_offload.weights.store.trust import open_dir, read_file

__all__ = ["export", "Exported", "INDEX_NAME", "DEFAULT_SHARD_BYTES"]

#: The index ``transformers`` reads for a sharded safetensors checkpoint.
INDEX_NAME = "model.safetensors.index.json"
#: Default largest shard: 2 GiB.
DEFAULT_SHARD_BYTES = 2 << 30
_CONFIG_LIMIT = 16 << 20

#: ``progress(group, done_bytes, total_bytes)`` after each group is read and checked.
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote: the shard files (in order), the tensors, their bytes, the seconds."""

    out: Path
    shards: tuple[str, ...]
    tensors: int
    nbytes: int
    seconds: float
    #: The training step exported (0: the converted store's weights).
    step: int = 0


def export(
    store: str | os.PathLike[str] | list[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    train_dir: str | os.PathLike[str] | None = None,
    converted: bool = False,
    progress: Progress | None = None,
) -> Exported:
    """Write the store's tensors as a safetensors checkpoint in ``out`` (see the module doc).

    Args:
        store: the store's directory (a list, in conversion order, if it was striped).
        out: a new or empty directory.
        shard_bytes: largest shard (bytes or ``"2GiB"``); a layer larger than it gets a shard of its own.
        train_dir: a :class:`~gds_offload.weights.train.trainer.StreamedTrainer`'s directory (default
            ``STORE/train``): its last complete step is exported, when it has one.
        converted: export the converted store's own weights, not a training step's.

    Raises:
        ConfigError: ``out`` holds files, is a file, or is the store's directory; a bad ``shard_bytes``;
            a ``train_dir`` given that holds no step.
        StoreCorruptError: a group's bytes differ from the manifest's checksum (named by layer).
        StoreFormatError: no store there, or a damaged one.
    """
    from safetensors.torch import save_file

    limit = parse_bytes(shard_bytes, name="shard_bytes")
    if limit < 1:
        raise ConfigError(f"shard_bytes={shard_bytes!r}: give at least 1 byte (e.g. '2GiB')")
    first = Path(store[0] if isinstance(store, (list, tuple)) else store)
    manifest = read_manifest(first)
    dirs = resolve_dirs(store, manifest)
    target = Path(out)
    _check_out(target, dirs)
    gens = Generations(Path(train_dir) if train_dir is not None else first / "train", manifest, dirs)
    if converted:
        gens.current = Step()
    elif train_dir is not None and gens.current.generation is None:
        raise ConfigError(f"{train_dir} holds no training step (no {STEP_NAME}); pass the directory StreamedTrainer(state_dir=...) wrote")
    shards = _plan_shards(manifest, limit)
    names = [_shard_name(i, len(shards)) for i in range(len(shards))]
    start = time.perf_counter()
    written: list[Path] = []
    files = gens.files()
    engine = make_engine("posix", read_only=True, num_threads=4, read_pool_bytes=0)
    try:
        target.mkdir(mode=0o755, parents=True, exist_ok=True)
        weight_map: dict[str, str] = {}
        total, done = manifest.total_nbytes(), 0
        for groups, name in zip(shards, names):
            tensors: dict[str, torch.Tensor] = {}
            for g, buf in _read_checked(engine, files, groups, gens.group_xxh3):
                for t in manifest.tensors_of(g.name):
                    tensors[t.name] = view_of(buf, t, g.offset).clone()  # safetensors refuses tensors sharing a buffer
                    weight_map[t.name] = name
                done += g.nbytes
                if progress is not None:
                    progress(g.name, done, total)
            written.append(_write_shard(save_file, tensors, target, name))
        for config in (CONFIG_NAME, GENERATION_CONFIG_NAME):
            data = _store_file(first, config)
            if data is not None:
                written.append(_write_whole(target, config, data))
        if len(names) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in manifest.tensors)}, "weight_map": dict(sorted(weight_map.items()))}
            written.append(_write_whole(target, INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode()))
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        for p in target.glob("*.partial") if target.is_dir() else ():
            p.unlink(missing_ok=True)
        raise
    finally:
        engine.close()
        files.close()
    return Exported(target, tuple(names), len(manifest.tensors), sum(t.nbytes for t in manifest.tensors), time.perf_counter() - start,
                    gens.current.step)  # fmt: skip


def _check_out(target: Path, dirs: list[Path]) -> None:
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target} is a file; give a new or empty directory to export into")
    no_parent = missing_parent(target)
    if no_parent is not None:
        raise ConfigError(f"out={target}: {no_parent}")
    resolved = target.resolve()
    if any(resolved == d.resolve() for d in dirs):
        raise ConfigError(f"{target} is the store's own directory; export into a new or empty directory")
    present = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    if present:
        shown = ", ".join(present[:5]) + (f" and {len(present) - 5} more" if len(present) > 5 else "")
        raise ConfigError(f"{target} holds files ({shown}); export into a new or empty directory (remove them first)")


def _plan_shards(manifest: Manifest, limit: int) -> list[list[GroupEntry]]:
    """Groups in store order, packed into shards of at most ``limit`` tensor bytes (one group per shard at least)."""
    shards: list[list[GroupEntry]] = []
    size = 0
    for g in manifest.groups:
        if not shards or (size + g.nbytes > limit and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += g.nbytes
    return shards or [[]]


def _shard_name(i: int, n: int) -> str:
    # transformers' own names: model.safetensors, or model-00001-of-00003.safetensors.
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _read_checked(engine: Engine, files: StoreFiles, groups: list[GroupEntry], expected: Callable[[GroupEntry], int]) -> Iterator[tuple[GroupEntry, torch.Tensor]]:
    """Yield ``(group, buffer)`` in order, each checked against its xxh3-64, the next read in flight
    meanwhile (into the other buffer: a buffer is read into again only after its group was consumed)."""
    largest = max((g.padded_nbytes for g in groups), default=0)
    buffers = [aligned_host_buffer(largest), aligned_host_buffer(largest)]
    pending: list[tuple[GroupEntry, torch.Tensor, IOFuture]] = []
    for i, g in enumerate(groups):
        pending.append((g, buffers[i % 2], read_group(engine, files, g, buffers[i % 2])))
        if len(pending) == 2:
            yield _checked(*pending.pop(0), files, expected)
    for item in pending:
        yield _checked(*item, files, expected)


def _checked(g: GroupEntry, buf: torch.Tensor, future: IOFuture, files: StoreFiles, expected: Callable[[GroupEntry], int]) -> tuple[GroupEntry, torch.Tensor]:
    future.wait()
    got, want = checksum(buf[: g.nbytes]), expected(g)
    if got != want:
        raise corrupt_error(g, files, f"xxh3-64 {got:016x}, expected {want:016x}")
    return g, buf


def _store_file(store: Path, name: str) -> bytes | None:
    dfd = open_dir(store)
    try:
        return read_file(dfd, store, name, limit=_CONFIG_LIMIT)  # read_manifest checked its hash
    finally:
        os.close(dfd)


def _write_shard(save_file: Callable[..., None], tensors: dict[str, torch.Tensor], target: Path, name: str) -> Path:
    partial = target / (name + ".partial")
    save_file(tensors, str(partial), metadata={"format": "pt"})  # transformers checks the format key
    _fsync(partial)
    final = target / name
    os.replace(partial, final)
    return final


def _write_whole(target: Path, name: str, data: bytes) -> Path:
    partial = target / (name + ".partial")
    partial.write_bytes(data)
    _fsync(partial)
    final = target / name
    os.replace(partial, final)
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
