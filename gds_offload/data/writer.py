"""The shard writer: a token stream (bytes of text files, or synthetic tokens) -> aligned shards.

The stream is cut into windows of ``seq + 1`` tokens with a stride of ``seq`` (window
``i`` is ``stream[i*seq : i*seq + seq + 1]``, so every token but the first is a label
once), and the windows into files of ``windows_per_file`` rows. Only the last file may
hold fewer. Tokens after the last whole window (fewer than ``seq + 1``) cannot form a
window; the manifest and the command report how many were left out.

The index (``shards.json``) is written last, atomically, once every shard is on disk: a
writer stopped at any point (an exception, ``kill -9``, a power cut) leaves a directory
without it, which the loader refuses. ``overwrite=True`` removes the old index before
the old shards, so a stopped overwrite leaves no index either, not a mix of two sets.

Text is tokenized byte by byte (:data:`BYTE_VOCAB` = 257: the 256 byte values and
:data:`EOT` after each file), which needs no vocabulary file and no download.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gds_offload.data.format import (
    FORMAT,
    MANIFEST_NAME,
    ShardEntry,
    ShardError,
    ShardFile,
    shard_name,
    write_index,
    write_shard,
)
from gds_offload.io.directory import missing_parent
from gds_offload.io.layout import ALIGN

__all__ = [
    "BYTE_VOCAB",
    "EOT",
    "DEFAULT_FILE_BYTES",
    "ShardWriter",
    "WriteSummary",
    "windows_per_file_for",
    "byte_tokens",
    "text_documents",
    "synthetic_tokens",
    "write_shards",
]

#: Vocabulary of the byte-level tokenizer: bytes 0..255 and the end-of-text token.
BYTE_VOCAB = 257
#: End-of-text token, written after each text file.
EOT = 256
#: Target size of one shard file (one read of the loader).
DEFAULT_FILE_BYTES = 4 << 20
_READ_CHUNK_BYTES = 16 << 20


def windows_per_file_for(seq: int, dtype: str | np.dtype, file_bytes: int = DEFAULT_FILE_BYTES) -> int:
    """Rows per file near ``file_bytes``, a multiple of the rows that make a whole number of 4 KiB pages.

    With ``seq=512`` and ``uint16`` a row is 1026 bytes, 2048 rows are 513 pages, so files
    hold a multiple of 2048 windows (about 2.1 MB each at the default 4 MiB target).
    """
    row_bytes = (seq + 1) * np.dtype(dtype).itemsize
    unit = ALIGN // math.gcd(row_bytes, ALIGN)
    return max(unit, (file_bytes // row_bytes) // unit * unit)


def byte_tokens(data: bytes) -> np.ndarray:
    """The byte-level tokens of ``data`` (``uint16``, values 0..255)."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def text_documents(paths: Iterable[str | os.PathLike[str]]) -> Iterator[np.ndarray]:
    """Byte tokens of each file in turn, in chunks, :data:`EOT` after each file.

    Raises:
        ShardError: a path that is not a readable file (named).
    """
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ShardError(f"text file {path} does not exist or is not a file")
        try:
            with open(path, "rb") as f:
                while chunk := f.read(_READ_CHUNK_BYTES):
                    yield byte_tokens(chunk)
        except OSError as exc:
            raise ShardError(f"text file {path}: cannot read ({exc.strerror or exc})") from None
        yield np.array([EOT], dtype=np.uint16)


def synthetic_tokens(count: int, *, vocab: int, seed: int = 0, dtype: str = "uint16") -> Iterator[np.ndarray]:
    """``count`` tokens drawn uniformly from ``[0, vocab)`` by ``numpy.random.default_rng(seed)``, in chunks."""
    rng = np.random.default_rng(seed)
    left = count
    while left > 0:
        n = min(left, 1 << 22)
        yield rng.integers(0, vocab, size=n, dtype=np.int64).astype(dtype)
        left -= n


@dataclass
class WriteSummary:
    """What :class:`ShardWriter` wrote (also the manifest, ``shards.json``)."""

    directory: Path
    seq: int
    dtype: str
    vocab: int
    tokenizer: str
    windows_per_file: int
    files: list[ShardFile] = field(default_factory=list)
    #: The index's record of each file (size, modification time, hash), in the order of ``files``.
    entries: list[ShardEntry] = field(default_factory=list)
    #: Tokens of the stream read.
    stream_tokens: int = 0
    #: Tokens after the last whole window: too few to form one, not in any shard.
    tail_tokens: int = 0
    #: Where the tokens came from (the text files, or the synthetic stream's arguments).
    sources: list[str] = field(default_factory=list)

    @property
    def windows(self) -> int:
        return sum(f.windows for f in self.files)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def manifest(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "seq": self.seq,
            "window_tokens": self.seq + 1,
            "dtype": self.dtype,
            "vocab": self.vocab,
            "tokenizer": self.tokenizer,
            "windows_per_file": self.windows_per_file,
            "windows": self.windows,
            "stream_tokens": self.stream_tokens,
            "tail_tokens_left_out": self.tail_tokens,
            "sources": self.sources,
            "files": [e.as_dict() for e in self.entries],
        }


class ShardWriter:
    """Cut a token stream into windows and write them as shards; :meth:`close` writes the manifest.

    Example::

        with ShardWriter("data/shards", seq=512, vocab=BYTE_VOCAB, tokenizer="bytes") as w:
            for chunk in text_documents(["a.txt", "b.txt"]):
                w.add(chunk)
        print(w.summary.windows)
    """

    def __init__(self, directory: str | os.PathLike[str], *, seq: int, vocab: int, tokenizer: str,
                 windows_per_file: int | None = None, file_bytes: int = DEFAULT_FILE_BYTES,
                 overwrite: bool = False, sources: list[str] | None = None) -> None:
        if seq < 1:
            raise ShardError(f"seq={seq} must be >= 1")
        if vocab < 1 or vocab > 2**31:
            raise ShardError(f"vocab={vocab} must be in [1, 2**31]")
        dtype = "uint16" if vocab <= 1 << 16 else "int32"
        per_file = windows_per_file or windows_per_file_for(seq, dtype, file_bytes)
        if per_file < 1:
            raise ShardError(f"windows_per_file={per_file} must be >= 1")
        root = Path(directory)
        _prepare_directory(root, overwrite)
        self.summary = WriteSummary(root, seq, dtype, vocab, tokenizer, per_file, sources=list(sources or []))
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._rows: list[np.ndarray] = []
        self._row_count = 0
        self._closed = False

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()

    def add(self, tokens: np.ndarray) -> None:
        """Append tokens to the stream; whole windows are written as files fill.

        Raises:
            ShardError: a token outside ``[0, vocab)``.
        """
        if tokens.size == 0:
            return
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.summary.vocab:
            raise ShardError(f"token {hi if hi >= self.summary.vocab else lo} is outside [0, vocab={self.summary.vocab})")
        self.summary.stream_tokens += int(tokens.size)
        self._pending.append(tokens.astype(self.summary.dtype, copy=False))
        self._pending_tokens += int(tokens.size)
        self._cut_windows()

    def _cut_windows(self) -> None:
        seq = self.summary.seq
        if self._pending_tokens < seq + 1:
            return
        stream = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        n = (stream.size - 1) // seq
        windows = np.lib.stride_tricks.sliding_window_view(stream, seq + 1)[: n * seq : seq]
        self._rows.append(np.array(windows))  # a copy: the view pins the stream
        self._row_count += n
        rest = stream[n * seq :]  # the last window's final token starts the next one
        self._pending, self._pending_tokens = [rest], int(rest.size)
        self._flush(final=False)

    def _flush(self, *, final: bool) -> None:
        per_file = self.summary.windows_per_file
        if self._row_count < per_file and not (final and self._row_count):
            return
        rows = np.concatenate(self._rows) if len(self._rows) > 1 else self._rows[0]
        start = 0
        while rows.shape[0] - start >= per_file or (final and start < rows.shape[0]):
            block = rows[start : start + per_file]
            path = self.summary.directory / shard_name(len(self.summary.files))
            info = write_shard(path, block)
            self.summary.files.append(info)
            self.summary.entries.append(ShardEntry.of(info))
            start += block.shape[0]
        rest = rows[start:]
        self._rows, self._row_count = ([rest], int(rest.shape[0])) if rest.shape[0] else ([], 0)

    def close(self) -> WriteSummary:
        """Write the last (shorter) file, then the index (:func:`~gds_offload.data.format.write_index`).

        Raises:
            ShardError: the stream was shorter than one window (``seq + 1`` tokens).
        """
        if self._closed:
            return self.summary
        self._closed = True
        self._flush(final=True)
        self.summary.tail_tokens = max(0, self._pending_tokens - 1) if self.summary.files else self._pending_tokens
        if not self.summary.files:
            raise ShardError(f"the input holds {self.summary.stream_tokens} tokens, shorter than one window of "
                             f"seq + 1 = {self.summary.seq + 1}; add text, or pass a smaller --seq")
        write_index(self.summary.directory, self.summary.manifest())
        return self.summary


def _prepare_directory(root: Path, overwrite: bool) -> None:
    if root.exists() and not root.is_dir():
        raise ShardError(f"output {root} exists and is not a directory")
    no_parent = missing_parent(root)
    if no_parent is not None:
        raise ShardError(f"output {root}: {no_parent}")
    root.mkdir(exist_ok=True)
    foreign = sorted(p for p in root.glob("*.npy") if not p.name.startswith("shard-"))
    if foreign:
        raise ShardError(f"output {root} holds {foreign[0].name}, which is not a shard (the loader reads every .npy "
                         f"there); choose an empty directory")
    index = root / MANIFEST_NAME
    old = sorted(root.glob("shard-*.npy*")) + sorted(root.glob(MANIFEST_NAME + "*"))
    if old and not overwrite:
        unfinished = "" if index.exists() else f" (an unfinished set: no {MANIFEST_NAME})"
        raise ShardError(f"output {root} already holds shards ({old[0].name}, ...){unfinished}; pass --overwrite to replace "
                         f"them, or choose another directory")
    if index.exists():  # first: from here on the old set no longer looks complete
        index.unlink()
    for p in old:
        p.unlink(missing_ok=True)


def write_shards(directory: str | os.PathLike[str], chunks: Iterable[np.ndarray], **kwargs: Any) -> WriteSummary:
    """Write every chunk of ``chunks`` through a :class:`ShardWriter` (``kwargs``) and close it."""
    writer = ShardWriter(directory, **kwargs)
    for chunk in chunks:
        writer.add(chunk)
    return writer.close()
