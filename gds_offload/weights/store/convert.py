"""``convert``: a safetensors checkpoint -> an aligned weight store; ``verify_store``: check one.

The converter reads the checkpoint tensor by tensor (each shard is memory-mapped by
safetensors, and only the tensor being copied is materialised), packs each group (the
resident tensors, then each layer) into a page-aligned buffer, hashes it (xxh3-64) and
writes it with ``O_DIRECT`` through :class:`~gds_offload.io.posix.PosixEngine`, double
buffered (group ``g+1`` is packed while ``g`` is written). Peak memory: two buffers of
the largest group, plus one tensor.

Order of work, so a failure leaves nothing half-done that looks complete:

1. read the headers and configs, plan the layout (:func:`~gds_offload.weights.store.hf_checkpoint.plan_layout`);
2. judge the output directories (:func:`~gds_offload.weights.store.outdir.prepare_dirs`: new, empty
   or holding a store of ours; nothing changes unless all pass), create or empty them;
3. check free space on every output filesystem (:func:`free_bytes`), then reserve the files
   whole with ``posix_fallocate``: a drive too small fails here, before any byte is written;
4. write the groups into ``weights.bin.partial``, fsync, rename to ``weights.bin``;
5. copy the checkpoint's ``config.json`` / ``generation_config.json`` (the bytes read in 1,
   whose hashes the manifest records), and write ``manifest.json`` last (its presence marks a
   complete store).

A failure after 2 (a drive another writer filled after the reservation: a
:class:`StoreSpaceError`) removes every store file written, so nothing half-done is left.
Files are created 0644 and directories 0755 less the umask, never writable by group or others
(:mod:`~gds_offload.weights.store.trust`).
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gds_offload.errors import ConfigError
from gds_offload.io.base import IOFuture
from gds_offload.io.factory import make_engine
from gds_offload.io.integrity import checksum
from gds_offload.io.layout import File, Slot
from gds_offload.io.spill import free_bytes
from gds_offload.units import format_bytes
from gds_offload.weights.errors import StoreCorruptError, StoreSpaceError
from gds_offload.weights.store.config import CONFIG_NAME, GENERATION_CONFIG_NAME
from gds_offload.weights.store.files import StoreFiles, aligned_host_buffer, read_group, resolve_dirs
from gds_offload.weights.store.fused import MODEL_FORM, ModelForm
from gds_offload.weights.store.hf_checkpoint import Checkpoint, find_checkpoint, group_tensors, open_tensors, plan_layout
from gds_offload.weights.store.manifest import (
    MANIFEST_NAME,
    TENSOR_ALIGN,
    FileEntry,
    GroupEntry,
    Manifest,
    TensorEntry,
    config_fingerprint,
    read_manifest,
)
from gds_offload.weights.store.outdir import DATA_NAME, prepare_dirs, remove_store, write_small_file
from gds_offload.weights.store.steps import Generations
from gds_offload.weights.store.trust import create_file

__all__ = ["convert", "verify_store", "StoreCheck", "free_bytes", "DATA_NAME"]

#: ``progress(group, done_bytes, total_bytes)``: how far a conversion or a check has come.
Progress = Callable[[str, int, int], None]

#: Room kept free beyond the data files (manifest, configs).
_SLACK_BYTES = 1 << 20
#: errno values that mean "the drive (or the quota, or the file-size limit) is full".
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass(frozen=True)
class StoreCheck:
    """What :func:`verify_store` read: every group's checksum matched."""

    groups: int
    nbytes: int
    seconds: float
    #: The training step checked too (``STORE/train``, :class:`~gds_offload.weights.train.trainer.StreamedTrainer`'s), 0 if none.
    train_step: int = 0
    train_states: int = 0


def convert(
    checkpoint_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | list[str | os.PathLike[str]],
    *,
    config: object = None,
    layer_prefix: str | None = None,
    tensor_align: int = TENSOR_ALIGN,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Manifest:
    """Convert a safetensors checkpoint into a weight store laid out for GPUDirect Storage.

    Args:
        checkpoint_dir: holds ``model.safetensors``, or ``model.safetensors.index.json`` and its shards.
        out: the store's directory (created if missing), or a list of directories: layer ``i``
            goes to directory ``i % n``, the resident group and the manifest to the first.
        config: the model config to fingerprint (a ``PretrainedConfig``, dict or path);
            default: the checkpoint's ``config.json`` (none: the store records no config hash).
        layer_prefix: the module path of the repeated blocks (default: found from the names).
        tensor_align: alignment of tensors inside a group (divides 4096).
        overwrite: replace a store already in ``out`` (never other files: a directory holding
            anything but a store is refused).
        progress: ``progress(group, done_bytes, total_bytes)``, on the calling thread once each
            group is packed and its write issued (``gds-offload convert`` draws a bar with it).

    Returns:
        The manifest written to ``<out>/manifest.json``.

    Raises:
        ConfigError: no checkpoint or a damaged one (names the file), a bad argument, ``out`` is the
            checkpoint, a file, holds other files, is another user's or writable by others, or
            holds a store and not ``overwrite``.
        StoreSpaceError: a filesystem lacks room (names bytes needed and free); nothing was written.
            Or it filled up during the writes (another writer); nothing of the store is left.
    """
    ckpt = find_checkpoint(checkpoint_dir)
    dirs = resolve_dirs(out)
    if len({d.resolve() for d in dirs}) != len(dirs):
        raise ConfigError(f"out lists a directory twice ({', '.join(map(str, dirs))}); give each drive's directory once")
    form = ModelForm.of(ckpt)  # experts transformers fuses at load: stored as the model holds them
    tensors = form.tensors if form is not None else ckpt.tensors
    prefix, where = group_tensors([t.name for t in tensors], layer_prefix)
    groups, entries, sizes = plan_layout(tensors, where, prefix, n_files=len(dirs), tensor_align=tensor_align)
    try:
        fingerprint = config_fingerprint(config if config is not None else ckpt.config)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config={config!r} cannot be read as a model config ({exc}); pass a PretrainedConfig, a dict or a config.json path") from None
    copies = [(n, b) for n, b in ((CONFIG_NAME, ckpt.config_bytes), (GENERATION_CONFIG_NAME, ckpt.generation_config_bytes)) if b is not None]
    manifest = Manifest(
        groups=groups,
        tensors=entries,
        files=[FileEntry(DATA_NAME, i, n) for i, n in enumerate(sizes)],
        config_sha256=fingerprint,
        config_file_sha256=_sha256(ckpt.config_bytes),
        generation_config_sha256=_sha256(ckpt.generation_config_bytes),
        layer_prefix=prefix,
        tensor_align=tensor_align,
        dirs=[str(d.resolve()) for d in dirs],
        source={"checkpoint": str(Path(checkpoint_dir).resolve()), "files": [f.name for f in ckpt.files],
                **({"form": MODEL_FORM} if form is not None else {})},
    )
    manifest.validate(where="the planned layout")
    dfds = prepare_dirs(dirs, checkpoint=ckpt.dir, overwrite=overwrite)
    try:
        _check_space(dirs, sizes)
        fds = _reserve(dirs, dfds, sizes)
        try:
            manifest.groups, manifest.tensors = _write_groups(ckpt, manifest, fds, progress, form)
            for fd, _ in fds:
                os.fsync(fd)
            for fd, _ in fds:
                os.close(fd)
            fds = []
            for dfd in dfds:
                os.rename(DATA_NAME + ".partial", DATA_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
            for name, data in copies:
                write_small_file(dfds[0], dirs[0], name, data)
            write_small_file(dfds[0], dirs[0], MANIFEST_NAME, manifest.to_json().encode())
            for dfd in dfds:
                os.fsync(dfd)
        except BaseException as exc:
            for fd, _ in fds:
                os.close(fd)
            remove_store(dfds)
            full = _full_drive(exc, dirs)
            if full is not None:
                raise full from exc
            raise
    finally:
        for dfd in dfds:
            os.close(dfd)
    return manifest


def _sha256(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _full_drive(exc: BaseException, dirs: list[Path]) -> StoreSpaceError | None:
    """The :class:`StoreSpaceError` for a write that found the drive full after the reservation
    (an ``OSError``, or the engine's error caused by one); ``None`` for any other failure."""
    seen: BaseException | None = exc
    while seen is not None and not (isinstance(seen, OSError) and seen.errno in _FULL):
        seen = seen.__cause__ or seen.__context__
    if not isinstance(seen, OSError):
        return None
    what = seen.filename or str(exc)
    free = ", ".join(f"{d}: {_free_or_unknown(d)}" for d in dirs)
    return StoreSpaceError(
        f"{what}: the drive filled up while the weight store was written ({seen.strerror or os.strerror(seen.errno or 0)}), after its room "
        f"had been reserved: another writer took it? Free now: {free}. Nothing of the store was left; free space or "
        f"pass another drive, then convert again"
    )


def _free_or_unknown(d: Path) -> str:
    try:
        return format_bytes(free_bytes(d))
    except OSError:
        return "unknown"


def verify_store(store: str | os.PathLike[str] | list[str | os.PathLike[str]], *, progress: Progress | None = None) -> StoreCheck:
    """Re-read every group of a store and check its xxh3-64 checksum; ``progress(group, done_bytes,
    total_bytes)`` after each group is checked (on the calling thread). A store trained by
    :class:`~gds_offload.weights.train.trainer.StreamedTrainer` has its last complete step checked too
    (its weights and optimizer state against ``STORE/train/step.json``).

    Raises:
        StoreCorruptError: the first group (in file order) whose bytes differ, by layer name.
        StoreFormatError: no store there, or a damaged manifest or data file.
    """
    first = store[0] if isinstance(store, (list, tuple)) else store
    manifest = read_manifest(first)
    dirs = resolve_dirs(store, manifest)
    files = StoreFiles(dirs, manifest)
    engine = make_engine("posix", read_only=True, num_threads=4, read_pool_bytes=0)
    start = time.perf_counter()
    try:
        largest = max((g.padded_nbytes for g in manifest.groups), default=0)
        buffers = [aligned_host_buffer(largest), aligned_host_buffer(largest)]
        order = sorted(manifest.groups, key=lambda g: (g.file, g.offset))
        pending: list[tuple[GroupEntry, IOFuture]] = []
        total, done = manifest.total_nbytes(), 0

        def check(g: GroupEntry, f: IOFuture) -> None:
            nonlocal done
            _wait_checked(g, f)
            done += g.nbytes
            if progress is not None:
                progress(g.name, done, total)

        for i, g in enumerate(order):
            pending.append((g, read_group(engine, files, g, buffers[i % 2], verify=True)))
            if len(pending) == 2:
                check(*pending.pop(0))
        for item in pending:
            check(*item)
        gens = Generations(Path(first) / "train", manifest, dirs)
        trained = gens.verify(engine) if gens.current.generation is not None else (0, 0)
    finally:
        engine.close()
        files.close()
    return StoreCheck(len(manifest.groups), manifest.total_nbytes(), time.perf_counter() - start, gens.current.step, trained[1])


def _wait_checked(group: GroupEntry, future: IOFuture) -> None:
    try:
        future.wait()
    except StoreCorruptError:
        raise
    except Exception as exc:
        raise StoreCorruptError(f"{group.describe()} could not be read back: {exc}") from exc


# -- helpers ------------------------------------------------------------------------------
def _check_space(dirs: list[Path], sizes: list[int]) -> None:
    """Raise :class:`StoreSpaceError` unless each filesystem has room for its files (directories on one
    filesystem are summed)."""
    need: dict[int, tuple[list[Path], int]] = {}
    for d, n in zip(dirs, sizes):
        dev = os.stat(d).st_dev
        paths, total = need.get(dev, ([], _SLACK_BYTES))
        need[dev] = (paths + [d], total + n)
    for paths, total in need.values():
        free = free_bytes(paths[0])
        if free < total:
            raise StoreSpaceError(
                f"{', '.join(map(str, paths))}: the weight store needs {total} bytes ({format_bytes(total)}) but the "
                f"filesystem has {free} bytes ({format_bytes(free)}) free; free space, pass a larger drive, or stripe "
                f"over several drives (out=[dir1, dir2, ...]). Nothing was written"
            )


def _reserve(dirs: list[Path], dfds: list[int], sizes: list[int]) -> list[tuple[int, bool]]:
    """Create ``weights.bin.partial`` in each directory, reserved whole: ``[(fd, O_DIRECT)]``."""
    fds: list[tuple[int, bool]] = []
    try:
        for d, dfd, n in zip(dirs, dfds, sizes):
            fds.append(create_file(dfd, DATA_NAME + ".partial", direct=True))
            if not n:
                continue  # a directory that holds no group: an empty file
            try:
                os.posix_fallocate(fds[-1][0], 0, n)
            except OSError as exc:
                if exc.errno in _FULL:
                    raise StoreSpaceError(
                        f"{d}: reserving {n} bytes ({format_bytes(n)}) for {DATA_NAME} failed ({os.strerror(exc.errno)}; "
                        f"{free_bytes(d)} bytes free); free space or pass another drive. Nothing was written"
                    ) from exc
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                os.ftruncate(fds[-1][0], n)  # no fallocate on this filesystem: ENOSPC would show while writing
    except BaseException:
        for fd, _ in fds:
            os.close(fd)
        for dfd in dfds:
            try:
                os.unlink(DATA_NAME + ".partial", dir_fd=dfd)
            except FileNotFoundError:
                pass
        raise
    return fds


def _write_groups(
    ckpt: Checkpoint, manifest: Manifest, fds: list[tuple[int, bool]], progress: Progress | None, form: ModelForm | None
) -> tuple[list[GroupEntry], list[TensorEntry]]:
    """Pack, hash and write every group (its tensors made by ``form``, when the store is in the
    model's form); returns the groups and the tensors with their checksums."""
    total, issued = manifest.total_nbytes(), 0
    files = [File(id=i, path=Path(manifest.dirs[e.dir]) / e.path, fd=fd, direct=direct, unnamed=False, what="weight store file")
             for i, (e, (fd, direct)) in enumerate(zip(manifest.files, fds))]
    largest = max((g.padded_nbytes for g in manifest.groups), default=0)
    buffers = [aligned_host_buffer(largest), aligned_host_buffer(largest)]
    in_flight: list[IOFuture | None] = [None, None]
    members: dict[str, list[TensorEntry]] = {}
    for t in manifest.tensors:
        members.setdefault(t.group, []).append(t)
    engine = make_engine("posix", num_threads=4, read_pool_bytes=0)
    done: list[GroupEntry] = []
    hashes: dict[str, int] = {}
    try:
        with open_tensors(ckpt) as handles:
            source = {t.name: handles[t.file] for t in ckpt.tensors}  # the checkpoint's form
            for i, g in enumerate(manifest.groups):
                buf = buffers[i % 2]
                previous = in_flight[i % 2]
                if previous is not None:
                    previous.wait()  # the buffer's previous group is on the drive
                buf[: g.padded_nbytes].zero_()
                inside = members.get(g.name, [])
                made = form.layer([t.name for t in inside], handles) if form is not None else {}
                for t in inside:
                    tensor = made[t.name] if form is not None else source[t.name].get_tensor(t.name)  # type: ignore[attr-defined]
                    hashes[t.name] = _pack(tensor, t, buf, g.offset)
                data = buf[: g.nbytes]
                done.append(GroupEntry(g.name, g.layer, g.file, g.offset, g.nbytes, checksum(data)))
                if g.nbytes:
                    in_flight[i % 2] = engine.write(data, Slot(files[g.file], g.offset, g.padded_nbytes))
                issued += g.nbytes
                if progress is not None:
                    progress(g.name, issued, total)
        for f in in_flight:
            if f is not None:
                f.wait()
    finally:
        engine.close()
    return done, [dataclasses.replace(t, xxh3_64=hashes[t.name]) for t in manifest.tensors]


def _pack(tensor: torch.Tensor, entry: TensorEntry, buf: torch.Tensor, group_offset: int) -> int:
    """Copy ``tensor`` into its place in ``buf`` (holding its group from file offset ``group_offset``); its xxh3-64."""
    if tensor.dtype != getattr(torch, entry.dtype) or tuple(tensor.shape) != entry.shape:
        raise ConfigError(f"tensor {entry.name}: header says {entry.dtype} {entry.shape}, data is {tensor.dtype} {tuple(tensor.shape)}")
    lo = entry.offset - group_offset
    if entry.nbytes:
        buf[lo : lo + entry.nbytes].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
    return checksum(buf[lo : lo + entry.nbytes])
