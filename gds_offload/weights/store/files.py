"""Opening a store's data files and reading whole groups through the project's engines.

A group is read as one aligned range (``offset`` and length multiples of 4 KiB) into a
page-aligned host buffer, so :class:`~gds_offload.io.posix.PosixEngine` moves it with
``O_DIRECT`` straight into that buffer (:mod:`gds_offload.io.pages`: a buffer whose head
is 0 is read in place, in chunks spread over the engine's threads).
"""
from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gds_offload.errors import OffloadError
from gds_offload.io.base import Engine, IOFuture
from gds_offload.io.fds import close_fd
from gds_offload.io.integrity import checksum
from gds_offload.io.layout import ALIGN, File, Slot, align_up
from gds_offload.io.pages import map_anonymous
from gds_offload.weights.errors import StoreCorruptError, StoreFormatError
from gds_offload.weights.store.advice import reconvert_command
from gds_offload.weights.store.manifest import GroupEntry, Manifest, TensorEntry
from gds_offload.weights.store.trust import check_name, open_dir, open_file

__all__ = ["StoreFiles", "aligned_host_buffer", "corrupt_error", "read_group", "resolve_dirs", "view_of"]


def resolve_dirs(store: str | os.PathLike[str] | list[str | os.PathLike[str]], manifest: Manifest | None = None) -> list[Path]:
    """The store's directories as a list; checks the count against ``manifest`` when given."""
    dirs = [Path(p) for p in store] if isinstance(store, (list, tuple)) else [Path(store)]
    if manifest is not None:
        need = 1 + max((f.dir for f in manifest.files), default=0)
        if len(dirs) != need:
            raise StoreFormatError(
                f"the store is striped over {need} directories but {len(dirs)} were given ({', '.join(map(str, dirs))}); "
                f"pass all of them in the order used at conversion: {', '.join(manifest.dirs) or '(not recorded)'}"
            )
    return dirs


def aligned_host_buffer(nbytes: int) -> torch.Tensor:
    """A page-aligned CPU uint8 tensor of ``nbytes`` rounded up to 4 KiB, in its own mapping
    (huge pages where the kernel allows, :func:`~gds_offload.io.pages.map_anonymous`).

    The tensor keeps the mapping alive: views of it (parameters) may outlive every other reference.
    """
    length = max(ALIGN, align_up(nbytes))
    mm = map_anonymous(length)
    return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=length))



class StoreFiles:
    """The store's data files, opened read-only (``O_DIRECT`` where the filesystem allows).

    Each directory and file is opened as :mod:`~gds_offload.weights.store.trust` opens a store's:
    yours or root's, writable by nobody else, a regular file (no symlink followed, no FIFO
    waited on), its name a plain name inside its directory. Each file must be exactly the size
    the manifest says (so no group the manifest places can be larger than the drive's bytes),
    and no two entries may be one file.

    Raises:
        StoreFormatError: a data file is missing, of another size, or listed twice.
        StoreTrustError: a directory or file another user could have changed, a symlink, or not a regular file.
    """

    def __init__(self, dirs: list[Path], manifest: Manifest, *, direct: bool = True, converted: bool = True) -> None:
        self.files: list[File] = []
        #: What a corrupt group's error suggests: converting the checkpoint into these directories
        #: again (``converted``), or nothing (a trained generation, which no conversion makes).
        self.redo = reconvert_command(dirs, manifest.source.get("checkpoint")) if converted else ""
        dir_fds: dict[int, int] = {}
        seen: dict[tuple[int, int], Path] = {}
        try:
            for i, entry in enumerate(manifest.files):
                d = dirs[entry.dir]
                if entry.dir not in dir_fds:
                    dir_fds[entry.dir] = open_dir(d)
                path = d / check_name(entry.path, where=str(dirs[0] / "manifest.json"))
                opened = open_file(dir_fds[entry.dir], d, entry.path, direct=direct)
                if opened is None:
                    raise StoreFormatError(f"{path} is missing: the store is incomplete; convert the checkpoint again")
                fd, is_direct = opened
                note = "" if is_direct else (f"{d} refused O_DIRECT: buffered reads" if direct else "O_DIRECT not requested")
                self.files.append(File(id=i, path=path, fd=fd, direct=is_direct, note=note, size=entry.nbytes, unnamed=False, what="weight store file"))
                st = os.fstat(fd)
                # Format 1 reserved one byte for a file that holds no group.
                if st.st_size != entry.nbytes and not (entry.nbytes == 0 and st.st_size == 1):
                    what = "truncated" if st.st_size < entry.nbytes else "it is not the file the manifest describes"
                    raise StoreFormatError(f"{path} has {st.st_size} bytes, the manifest says {entry.nbytes}: {what}; convert the checkpoint again")
                if (st.st_dev, st.st_ino) in seen:
                    raise StoreFormatError(
                        f"{path} and {seen[st.st_dev, st.st_ino]} are one file: a directory was given twice? Pass the store's "
                        f"directories in the order used at conversion: {', '.join(manifest.dirs) or '(not recorded)'}"
                    )
                seen[st.st_dev, st.st_ino] = path
        except BaseException:
            self.close()
            raise
        finally:
            for dfd in dir_fds.values():
                os.close(dfd)

    @property
    def direct(self) -> bool:
        return all(f.direct for f in self.files)

    def slot(self, group: GroupEntry) -> Slot:
        """The group's byte range as an engine slot (aligned start and length)."""
        return Slot(self.files[group.file], group.offset, group.padded_nbytes)

    def close(self) -> None:
        for f in self.files:
            close_fd(f)


def read_group(
    engine: Engine, files: StoreFiles, group: GroupEntry, dst: torch.Tensor, *, verify: bool = False, ready: Any = None
) -> IOFuture:
    """Start reading ``group`` into ``dst`` (a page-aligned uint8 tensor, host or device, at
    least ``group.padded_nbytes`` long, its storage owned by it). Returns at once.

    The whole padded range is read (one aligned request: ``O_DIRECT`` and cuFile's direct
    path move it without bouncing); the data are ``dst[:group.nbytes]``. ``ready``: a CUDA
    event the engine waits for before it writes ``dst`` (a kernel may still read it).

    The future fails with :class:`~gds_offload.errors.OffloadError` on an I/O error or a
    short read, and, with ``verify``, with :class:`StoreCorruptError` naming the layer when
    the bytes' xxh3-64 differs from the manifest's (hashed on the engine thread that
    completed the read, before the future is done; device bytes are copied to host for it).

    .. note:: Buffer ownership: the caller keeps ``dst`` alive and untouched until the future is done.
    """
    assert dst.numel() >= group.padded_nbytes and dst.data_ptr() % ALIGN == 0, "read_group needs a page-aligned buffer of the padded size"
    if group.nbytes == 0:
        return IOFuture.completed(0)
    span = dst[: group.padded_nbytes]
    out: Future[int] = Future()

    def check(done: IOFuture) -> None:
        try:
            moved = done.wait(0)
            if moved != group.padded_nbytes:
                raise OffloadError(f"short read of {group.describe()}: {moved} of {group.padded_nbytes} bytes")
            if verify:
                actual = checksum(dst[: group.nbytes])
                if actual != group.xxh3_64:
                    raise corrupt_error(group, files, f"xxh3-64 {actual:016x}, expected {group.xxh3_64:016x}")
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            out.set_exception(exc)
            return
        out.set_result(group.nbytes)

    engine.read(span, files.slot(group), ready=ready).add_done_callback(check)
    return IOFuture(out, group.nbytes)


def corrupt_error(group: GroupEntry, files: StoreFiles, why: str) -> StoreCorruptError:
    """A :class:`StoreCorruptError` naming the group (layer), its file and offset, and what differs."""
    f = files.files[group.file]
    return StoreCorruptError(
        f"{group.describe()} is corrupt: {why}. File {f.path}, offset {group.offset}, {group.nbytes} bytes. "
        + (f"Check the drive, then convert the checkpoint again: {files.redo}" if files.redo else "Check the drive")
    )


def view_of(buf: torch.Tensor, entry: TensorEntry, base: int) -> torch.Tensor:
    """The tensor ``entry`` as a view of ``buf`` (a uint8 tensor holding its group from file offset ``base``)."""
    lo = entry.offset - base
    return buf[lo : lo + entry.nbytes].view(getattr(torch, entry.dtype)).view(entry.shape)
