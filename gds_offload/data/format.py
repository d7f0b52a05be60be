"""Token shards on disk: aligned ``.npy`` files of token windows, and the checks that read them.

A shard directory holds ``shard-NNNNNN.npy`` files and a ``shards.json`` manifest (the set's
index), written last and atomically: a directory without it is an unfinished set, which
:func:`scan_shards` refuses. Each
file is one C-order array ``[windows, seq + 1]`` of ``uint16`` (or ``uint32``/``int32``)
tokens: window ``i`` is ``input_ids = w[:-1]``, ``labels = w[1:]``. Consecutive windows of
the token stream overlap by one token, so every window stands alone and can be shuffled.

The ``.npy`` header (format 1.0, which DALI reads) is padded with spaces to
:data:`~gds_offload.io.layout.ALIGN`, so the tokens start on a 4 KiB boundary: a GPUDirect Storage read of
the data is aligned at its start in the file, and DALI's reader places it at the start of
a ``cudaMalloc`` buffer. See :mod:`gds_offload.data` for why the unit of a read is a file.

The index records each file's window count, size, modification time and xxh3-64 hash of
its bytes. :func:`scan_shards` checks every file against it at the cost of a ``stat``: a
file of another size is refused, one whose modification time differs is hashed again (a
copy that did not keep the times: accepted, with a warning, when the bytes match; a file
rewritten after the set was written: refused). A file rewritten keeping both its size and
its modification time is not detected. The hashes identify the data set
(:meth:`ShardSet.fingerprint`), which is how a resumed loader tells its shards from others.

Every check raises :class:`ShardError` naming the file and what to do.
"""
from __future__ import annotations

import ast
import json
import os
import shlex
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gds_offload.errors import ConfigError
from gds_offload.io.directory import missing_parent
from gds_offload.io.layout import ALIGN

__all__ = [
    "TOKEN_DTYPES",
    "MANIFEST_NAME",
    "FORMAT",
    "ShardError",
    "ShardFile",
    "ShardEntry",
    "ShardSet",
    "shard_name",
    "write_shard",
    "read_shard_header",
    "scan_shards",
    "file_xxh3",
    "write_index",
]

#: Where the token data of a shard starts (bytes): the header is padded to this.
#: Token dtypes a shard may hold (little-endian).
TOKEN_DTYPES = ("uint16", "uint32", "int32")
#: The manifest the shard writer leaves beside the shards.
MANIFEST_NAME = "shards.json"
#: ``format`` field of the manifest (``/1`` had no sizes, times or hashes).
FORMAT = "gds_offload.shards/2"
_MAGIC = b"\x93NUMPY"
_FIX = "write the directory again: `gds-offload shards DIR --text FILE... --overwrite` (DIR: the file's directory)"
_HASH_CHUNK_BYTES = 8 << 20


class ShardError(ConfigError):
    """A shard directory or file the loader cannot use. The message names the file."""


@dataclass(frozen=True)
class ShardFile:
    """One shard as its header describes it.

    Attributes:
        path: the file.
        windows: rows of the array (token windows).
        window_tokens: columns (``seq + 1``).
        dtype: numpy dtype name of the tokens.
        data_offset: byte offset of the first token (the header's length).
    """

    path: Path
    windows: int
    window_tokens: int
    dtype: str
    data_offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of token data."""
        return self.windows * self.window_tokens * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class ShardEntry:
    """One file as the set's index (``shards.json``) records it.

    Attributes:
        name: the file's name in the directory.
        windows: rows of its array.
        size: its size in bytes.
        mtime_ns: its modification time when the set was written.
        xxh3: xxh3-64 of its bytes (hex; :func:`file_xxh3`).
    """

    name: str
    windows: int
    size: int
    mtime_ns: int
    xxh3: str

    @classmethod
    def of(cls, info: ShardFile) -> ShardEntry:
        """The entry of a file just written (its size and time from ``stat``, its hash read back)."""
        st = os.stat(info.path)
        return cls(info.path.name, info.windows, st.st_size, st.st_mtime_ns, file_xxh3(info.path))

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "windows": self.windows, "bytes": self.size, "mtime_ns": self.mtime_ns, "xxh3": self.xxh3}


@dataclass(frozen=True)
class ShardSet:
    """A checked shard directory: its files in name order, all of one window length and dtype.

    Attributes:
        directory: the directory.
        files: the shards, in name order.
        seq: tokens per training sequence (each window holds ``seq + 1``).
        dtype: the token dtype shared by every file.
        vocab: vocabulary size from the manifest, None without one.
        tokenizer: the manifest's tokenizer name (``bytes``, ``synthetic``), ``""`` without one.
        sources: the manifest's sources (text files, or the synthetic stream's arguments).
        hashes: the index's xxh3-64 of each file, in the order of ``files``.
    """

    directory: Path
    files: tuple[ShardFile, ...]
    seq: int
    dtype: str
    vocab: int | None = None
    tokenizer: str = ""
    sources: tuple[str, ...] = ()
    hashes: tuple[str, ...] = ()

    @property
    def windows(self) -> int:
        return sum(f.windows for f in self.files)

    @property
    def tokens(self) -> int:
        """Tokens in all windows (``windows * (seq + 1)``; the overlap counted twice)."""
        return self.windows * (self.seq + 1)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def fingerprint(self) -> str:
        """A digest of the window length, dtype, and each file's name, window count and hash.

        What an order depends on (names and counts), and what the tokens are (hashes): two
        sets with one fingerprint serve the same batches for the same loader arguments.
        """
        import xxhash

        h = xxhash.xxh3_64()
        h.update(f"{self.seq}:{self.dtype}".encode())
        for f, digest in zip(self.files, self.hashes or ("",) * len(self.files)):
            h.update(f"|{f.path.name}:{f.windows}:{digest}".encode())
        return h.hexdigest()

    def file_hashes(self) -> dict[str, str]:
        """``name -> xxh3`` of each file, as the index records them."""
        return {f.path.name: d for f, d in zip(self.files, self.hashes)}

    def difference(self, theirs: object) -> str:
        """The first file in which another set's :meth:`file_hashes` (``theirs``) differs from this one, in words."""
        mine = self.file_hashes()
        if not isinstance(theirs, dict):
            return f"its data-set fingerprint is not that of {self.directory}"
        for name in sorted(set(mine) | set(theirs)):
            if name not in theirs:
                return f"{self.directory / name} was not in that set"
            if name not in mine:
                return f"{self.directory / name} is missing here"
            if theirs[name] != mine[name]:
                return f"{self.directory / name} holds other tokens: xxh3 {mine[name]} here, {theirs[name]} there"
        return f"the window length or dtype of {self.directory} differs"


def shard_name(index: int) -> str:
    """``shard-000042.npy``."""
    return f"shard-{index:06d}.npy"


def _header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """A format 1.0 ``.npy`` header padded with spaces to :data:`~gds_offload.io.layout.ALIGN`."""
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
    pad = ALIGN - len(_MAGIC) - 4 - len(text) - 1
    if pad < 0:
        raise ShardError(f"a header for shape {shape} does not fit in {ALIGN} bytes")
    body = text.encode("latin1") + b" " * pad + b"\n"
    return _MAGIC + b"\x01\x00" + struct.pack("<H", len(body)) + body


def file_xxh3(path: Path) -> str:
    """xxh3-64 (hex) of the bytes of ``path``, read in chunks."""
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _fsync_directory(directory: Path) -> None:
    """Make the renames in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_index(directory: Path, doc: dict[str, Any]) -> Path:
    """Write ``doc`` as ``directory/shards.json``: to a temporary file, fsynced, renamed over it.

    The writer calls it after every shard is on disk (fsynced, renamed), so a directory
    with an index holds every file it lists, and a writer killed at any point before
    leaves none (or the previous set's, which ``--overwrite`` removes first).
    """
    path = directory / MANIFEST_NAME
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_directory(directory)
    return path


def write_shard(path: Path, windows: np.ndarray) -> ShardFile:
    """Write ``windows`` (``[n, seq + 1]``, a token dtype) as an aligned ``.npy``; atomically.

    The bytes go to ``<path>.tmp`` first, fsynced, which is renamed over ``path`` when
    complete, so a reader never sees half a shard.

    Raises:
        ShardError: a shape or dtype the loader would refuse.
    """
    arr = np.ascontiguousarray(windows)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2:
        raise ShardError(f"{path}: windows must be [n >= 1, seq + 1 >= 2], got shape {arr.shape}")
    if arr.dtype.name not in TOKEN_DTYPES:
        raise ShardError(f"{path}: token dtype {arr.dtype} is not one of {TOKEN_DTYPES}")
    arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_header(tuple(int(n) for n in arr.shape), arr.dtype))
        arr.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return ShardFile(path, int(arr.shape[0]), int(arr.shape[1]), arr.dtype.name, ALIGN)


def _parse_header(path: Path, head: bytes) -> tuple[dict[str, Any], int]:
    """The header dict and the data offset of ``head`` (the file's first bytes)."""
    if head[:6] != _MAGIC:
        raise ShardError(f"{path}: not a .npy file (no \\x93NUMPY magic at its start); {_FIX}")
    if len(head) < 10:
        raise ShardError(f"{path}: the .npy header is cut short ({len(head)} bytes); {_FIX}")
    major, minor = head[6], head[7]
    if (major, minor) != (1, 0):
        raise ShardError(f"{path}: .npy format version {major}.{minor}; DALI reads only version 1.0 headers; {_FIX}")
    (length,) = struct.unpack("<H", head[8:10])
    offset = 10 + length
    if len(head) < offset:
        raise ShardError(f"{path}: the .npy header claims {length} bytes but the file has {len(head) - 10}; {_FIX}")
    try:
        meta = ast.literal_eval(head[10:offset].decode("latin1"))
    except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ShardError(f"{path}: corrupted .npy header ({type(exc).__name__}: {exc}); {_FIX}") from None
    if not isinstance(meta, dict) or not {"descr", "fortran_order", "shape"} <= set(meta):
        raise ShardError(f"{path}: corrupted .npy header (expected a dict with descr, fortran_order, shape); {_FIX}")
    return meta, offset


def read_shard_header(path: Path) -> ShardFile:
    """Read and check one shard's header (and that the file holds all the data it announces).

    Raises:
        ShardError: not a ``.npy``, a corrupted header, a wrong dtype or shape, or a truncated file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(10 + 0xFFFF)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise ShardError(f"{path}: cannot read ({exc.strerror or exc})") from None
    meta, offset = _parse_header(path, head)
    try:
        dtype = np.dtype(meta["descr"])
    except (TypeError, ValueError):
        raise ShardError(f"{path}: corrupted .npy header (descr={meta['descr']!r} is no dtype); {_FIX}") from None
    shape = meta["shape"]
    if dtype.name not in TOKEN_DTYPES or dtype.byteorder == ">":
        raise ShardError(f"{path}: tokens of dtype {dtype.str} ({dtype.name}); expected one of {TOKEN_DTYPES}, "
                         f"little-endian; {_FIX}")
    if meta["fortran_order"]:
        raise ShardError(f"{path}: Fortran-order array; shards are C order ({_FIX})")
    if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ShardError(f"{path}: corrupted .npy header (shape={shape!r}); {_FIX}")
    if len(shape) != 2:
        raise ShardError(f"{path}: a {len(shape)}-D array of shape {shape}; shards are [windows, seq + 1] token windows ({_FIX})")
    if shape[0] < 1 or shape[1] < 2:
        raise ShardError(f"{path}: shape {shape} is shorter than one window (need >= 1 window of >= 2 tokens); "
                         f"remove the file or {_FIX}")
    info = ShardFile(path, shape[0], shape[1], dtype.name, offset)
    if size < offset + info.nbytes:
        raise ShardError(f"{path}: truncated: the header announces {info.nbytes} bytes of tokens after byte {offset}, "
                         f"the file has {size - offset}; {_FIX}")
    return info


def _read_index(directory: Path) -> tuple[dict[str, Any], list[ShardEntry]]:
    """The index's document and its entries; refused when absent, unreadable or of another format."""
    path = directory / MANIFEST_NAME
    if not path.exists():
        raise ShardError(f"{directory}: no {MANIFEST_NAME}: the set is incomplete (was gds-offload shards interrupted?); "
                         f"write it again: `gds-offload shards {shlex.quote(str(directory))} --text FILE... --overwrite`")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardError(f"{path}: unreadable manifest ({exc}); {_FIX}") from None
    if isinstance(doc, dict) and doc.get("format") == "gds_offload.shards/1":
        raise ShardError(f"{path}: a gds_offload.shards/1 index records no file sizes or hashes, so a resumed loader "
                         f"cannot tell these shards from others; {_FIX}")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ShardError(f"{path}: not a {FORMAT} manifest; {_FIX}")
    listed: Any = doc.get("files")
    entries: list[ShardEntry] = []
    for e in listed if isinstance(listed, list) else [listed]:
        try:
            entry: ShardEntry | None = ShardEntry(e["name"], e["windows"], e["bytes"], e["mtime_ns"], e["xxh3"])
        except (TypeError, KeyError, IndexError):
            entry = None
        if entry is None or not (isinstance(entry.name, str) and isinstance(entry.xxh3, str)
                                 and all(isinstance(v, int) for v in (entry.windows, entry.size, entry.mtime_ns))):
            raise ShardError(f"{path}: corrupted manifest (file entry {e!r}); {_FIX}")
        entries.append(entry)
    return doc, entries


def _check_index(directory: Path, entries: list[ShardEntry], files: list[ShardFile]) -> tuple[str, ...]:
    """The files on disk are those the index lists, as it records them; their hashes, in ``files`` order.

    A file whose modification time differs from the record is hashed again: the same
    bytes (a copy that did not keep the times) pass with a warning, other bytes are refused.
    """
    listed = {e.name: e for e in entries}
    found = {f.path.name: f for f in files}
    missing = sorted(set(listed) - set(found))
    if missing:
        raise ShardError(f"{directory / missing[0]}: listed in {MANIFEST_NAME} but missing "
                         f"({len(missing)} file(s) missing); restore it or {_FIX}")
    extra = sorted(set(found) - set(listed))
    if extra:
        raise ShardError(f"{directory / extra[0]}: not listed in {MANIFEST_NAME}; move it out or {_FIX}")
    rehashed = 0
    for name, f in found.items():
        entry = listed[name]
        if entry.windows != f.windows:
            raise ShardError(f"{f.path}: {f.windows} windows, {MANIFEST_NAME} says {entry.windows}; {_FIX}")
        st = os.stat(f.path)
        if st.st_size != entry.size:
            raise ShardError(f"{f.path}: {st.st_size} bytes, {MANIFEST_NAME} says {entry.size}: the file changed after "
                             f"the set was written; {_FIX}")
        if st.st_mtime_ns != entry.mtime_ns:
            digest = file_xxh3(f.path)
            if digest != entry.xxh3:
                raise ShardError(f"{f.path}: its bytes are not those {MANIFEST_NAME} records (xxh3 {digest}, recorded "
                                 f"{entry.xxh3}): it was rewritten after the set was written; {_FIX}")
            rehashed += 1
    if rehashed:
        warnings.warn(f"{directory}: {rehashed} of {len(files)} shard(s) have other modification times than "
                      f"{MANIFEST_NAME} records, so they were hashed again: their bytes match. A copy that keeps "
                      f"the times (cp -p, rsync -t) is checked without reading it", stacklevel=3)
    return tuple(listed[f.path.name].xxh3 for f in files)


def scan_shards(directory: str | os.PathLike[str], *, seq: int | None = None) -> ShardSet:
    """Check a shard directory: every ``*.npy`` header, one window length and dtype, the manifest.

    Args:
        directory: the directory ``gds-offload shards`` wrote.
        seq: the sequence length the caller trains with; None accepts the files' own.

    Raises:
        ShardError: a missing or empty directory, a bad file (named), mixed window lengths or
            dtypes, a window length other than ``seq + 1``, no ``shards.json`` (an unfinished
            set), or files that differ from it: unlisted, missing, resized or rewritten.
    """
    root = Path(directory)
    if not root.exists():
        no_parent = missing_parent(root)
        if no_parent is not None:
            raise ShardError(f"data directory {root} does not exist, and {no_parent}")
        raise ShardError(f"data directory {root} does not exist; write shards there with "
                         f"`gds-offload shards {shlex.quote(str(root))} --text FILE...` (or --synthetic N)")
    if not root.is_dir():
        raise ShardError(f"data directory {root} is not a directory")
    paths = sorted(p for p in root.glob("*.npy") if p.is_file())
    if not paths:
        raise ShardError(f"data directory {root} holds no .npy shards; write some with "
                         f"`gds-offload shards {shlex.quote(str(root))} --text FILE...` (or --synthetic N)")
    files = [read_shard_header(p) for p in paths]
    first = files[0]
    for f in files[1:]:
        if f.window_tokens != first.window_tokens:
            raise ShardError(f"{f.path}: windows of {f.window_tokens} tokens, but {first.path.name} has "
                             f"{first.window_tokens}: one directory holds one sequence length; {_FIX}")
        if f.dtype != first.dtype:
            raise ShardError(f"{f.path}: tokens of dtype {f.dtype}, but {first.path.name} has {first.dtype}; {_FIX}")
    if seq is not None and first.window_tokens != seq + 1:
        raise ShardError(f"{root}: windows of {first.window_tokens} tokens (seq {first.window_tokens - 1}), "
                         f"not seq {seq}; pass --seq {first.window_tokens - 1}, or write shards with --seq {seq}")
    doc, entries = _read_index(root)
    hashes = _check_index(root, entries, files)
    vocab, tokenizer, sources = doc.get("vocab"), str(doc.get("tokenizer", "")), tuple(map(str, doc.get("sources", [])))
    return ShardSet(root, tuple(files), first.window_tokens - 1, first.dtype, vocab, tokenizer, sources, hashes)
