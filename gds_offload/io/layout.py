"""Where bytes lie on a drive: the one alignment, files and the byte ranges engines move.

Every aligned thing in the package is aligned to :data:`ALIGN` (4 KiB: the page size,
``O_DIRECT``'s and cuFile's unit): spill slots, weight-store groups, token-shard headers,
staging buffers, ``O_DIRECT`` chunks. :func:`align_up` is the one round-up.

A :class:`File` is an open file an engine reads and writes through its descriptor: an
unnamed spill file (its ``path`` the directory it lives in), a named file such as a weight
store's data file, or, for engines that keep bytes in memory, a virtual one (``fd == -1``,
no path). A :class:`Slot` is a byte range of one. Nothing here imports torch (:func:`aligned_view`
only slices a tensor it is given).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGN", "File", "Slot", "align_up", "aligned_view"]

#: The one alignment (bytes): the page size, and the unit of O_DIRECT and of cuFile.
ALIGN = 4096


def align_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align`` (``align_up(1) == 4096``, ``align_up(0) == 0``)."""
    return -(-n // align) * align


def aligned_view(raw: torch.Tensor, nbytes: int, head: int = 0) -> torch.Tensor:
    """The ``nbytes`` of the 1-D uint8 ``raw`` that start ``head`` bytes after its first
    :data:`ALIGN` boundary. ``raw`` must hold ``nbytes + head + ALIGN`` bytes: allocators
    promise less alignment than ``O_DIRECT`` and cuFile need (torch's caching allocator 512
    bytes, its pinned one none). The view keeps ``raw``'s storage alive."""
    skip = -raw.data_ptr() % ALIGN
    return raw[skip + head : skip + head + nbytes]


@dataclass(frozen=True, slots=True)
class Slot:
    """A byte range of a file. ``nbytes`` is a multiple of :data:`ALIGN`."""

    file: File
    offset: int
    nbytes: int


@dataclass(eq=False)
class File:
    """One open file an engine moves bytes through (or a virtual one: ``fd == -1``).

    Attributes:
        id: its number among its owner's files (a spill store's, a weight store's).
        path: an unnamed file's directory, a named file's own path; ``None`` for a virtual file.
        fd: the descriptor (``-1``: virtual, or closed).
        direct: opened with ``O_DIRECT``.
        note: why not ``O_DIRECT``, or how the file was made unnamed.
        unnamed: no name on disk (``O_TMPFILE``, or unlinked at open): ``path`` is its directory.
        what: what it is, in messages (``"spill file"``, ``"weight store file"``).
        size, allocated, full: the spill store's bookkeeping (its allocator below).
    """

    id: int
    path: Path | None
    fd: int = -1
    direct: bool = False
    note: str = ""
    size: int = 0
    allocated: int = 0
    full: bool = False
    unnamed: bool = True
    what: str = "spill file"
    _free: list[tuple[int, int]] = field(default_factory=list)  # sorted (offset, length)

    @property
    def proc_path(self) -> str:
        """A path that reopens this file by its descriptor (for libraries that take paths, such as KvikIO)."""
        return f"/proc/self/fd/{self.fd}"

    @property
    def directory(self) -> Path | None:
        """The directory holding the file (for ``gds-check --path``)."""
        if self.path is None or self.unnamed:
            return self.path
        return self.path.parent

    def describe(self) -> str:
        if self.path is None:
            return f"host buffer pool #{self.id}"
        return f"{self.what} #{self.id} in {self.path}" if self.unnamed else f"{self.what} {self.path}"

    # A first-fit allocator of the file's ranges. The caller holds its owner's lock.
    def take(self, nbytes: int) -> int | None:
        for i, (off, length) in enumerate(self._free):
            if length >= nbytes:
                if length == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (off + nbytes, length - nbytes)
                self.allocated += nbytes
                return off
        return None

    def give_back(self, off: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._free, (off, 0))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # merge with left
            i -= 1
            off, nbytes = self._free[i][0], self._free[i][1] + nbytes
            del self._free[i]
        if i < len(self._free) and off + nbytes == self._free[i][0]:  # merge with right
            nbytes += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (off, nbytes))

    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)
