"""The weight store's manifest: where every tensor lies, and what the bytes must hash to.

A store is a directory (or several, striped) holding ``weights.bin`` and ``manifest.json``.
The file is a sequence of *groups*, each one contiguous range starting at a multiple of
:data:`~gds_offload.io.layout.ALIGN` (4 KiB) and padded with zeros to the next one, so each group is one
aligned ``O_DIRECT`` (or cuFile) read:

* ``resident``: everything outside the repeated blocks (embeddings, final norm, ``lm_head``);
* one group per repeated block (decoder layer), named by its module path (``model.layers.3``),
  in layer order.

Inside a group, tensors start at multiples of ``tensor_align`` (256 bytes since
:data:`TENSOR_ALIGN`; 64 in older stores, which still load: every dtype's elements stay aligned
in a view of the group's buffer), one after the other, the group's
``nbytes`` ending with its last. Each tensor's ``offset`` is its absolute offset in its
group's file. A group's ``xxh3_64`` covers its ``nbytes`` data bytes (not the padding); a
tensor's (format 2) covers its own bytes.

The manifest is plain JSON; nothing in it is executed. :func:`read_manifest` trusts it no
further than it checks it, all of it, before anything is allocated or read: every field's
type; each tensor's size against its shape and dtype; tensors and groups inside their
group and file, aligned, and never overlapping; data file names plain names in the store's
directory. :class:`~gds_offload.weights.store.files.StoreFiles` then checks each file's size
against the manifest when it opens it. The config hashes: :mod:`gds_offload.weights.store.config`.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gds_offload.io.layout import ALIGN, align_up
from gds_offload.weights.errors import StoreFormatError
from gds_offload.weights.store.advice import no_store_advice, reconvert_command
from gds_offload.weights.store.config import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    VOLATILE_CONFIG_KEYS,
    canonical_config,
    check_copied,
    config_fingerprint,
)
from gds_offload.weights.store.trust import check_name, open_dir, read_file

__all__ = [
    "TENSOR_ALIGN",
    "DTYPE_SIZES",
    "FORMAT",
    "FORMAT_VERSION",
    "RESIDENT",
    "MANIFEST_NAME",
    "VOLATILE_CONFIG_KEYS",
    "TensorEntry",
    "GroupEntry",
    "FileEntry",
    "Manifest",
    "canonical_config",
    "config_fingerprint",
    "read_manifest",
]

FORMAT = "gds_offload.weights"
#: Format 2 adds each tensor's checksum and ``generation_config_sha256``; format 1 stores still load.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
#: Name of the group of non-repeated tensors.
RESIDENT = "resident"
#: Where tensors start inside a group, in stores written now: cuBLASLt picks its kernels by the
#: operands' pointer alignment (up to 256 bytes), so a streamed weight at a 64-byte offset could
#: get another kernel than the resident model's (allocator-aligned) weight, and other last bits.
TENSOR_ALIGN = 256
#: Stores written before :data:`TENSOR_ALIGN` placed tensors at 64 bytes; they still load.
LEGACY_TENSOR_ALIGN = 64
MANIFEST_NAME = "manifest.json"
#: The most bytes a manifest may have (a model of a million tensors needs a fraction of it).
MANIFEST_LIMIT = 256 << 20
#: The dtypes a store holds (torch's names) and their element sizes.
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}  # fmt: skip
_MAX_DIMS = 64  # torch's limit
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_XXH = re.compile(r"^[0-9a-f]{1,16}$")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: ``nbytes`` bytes at absolute ``offset`` of its group's file."""

    name: str
    dtype: str  # a torch dtype name: "float32", "bfloat16", ...
    shape: tuple[int, ...]
    group: str
    offset: int
    nbytes: int
    #: xxh3-64 of the tensor's bytes (format 2; ``None`` in format 1 stores): tells apart two tensors
    #: a model ties (:mod:`gds_offload.weights.streaming.bind`).
    xxh3_64: int | None = None


@dataclass(frozen=True)
class GroupEntry:
    """One contiguous, 4 KiB-aligned range of a file: the resident group or one layer."""

    name: str
    #: The layer's index (``3`` for ``model.layers.3``); ``None`` for the resident group.
    layer: int | None
    file: int
    offset: int
    nbytes: int
    xxh3_64: int

    @property
    def padded_nbytes(self) -> int:
        """Bytes of the file the group occupies (``nbytes`` rounded up to :data:`~gds_offload.io.layout.ALIGN`)."""
        return align_up(self.nbytes)

    def describe(self) -> str:
        return "the resident group" if self.layer is None else f"layer {self.layer} ({self.name})"


@dataclass(frozen=True)
class FileEntry:
    """One data file: ``path``, a plain file name in directory ``dir`` (an index into the store's directories)."""

    path: str
    dir: int
    nbytes: int


@dataclass
class Manifest:
    """Everything a loader needs to find, check and place a store's tensors.

    Build it with :func:`gds_offload.weights.convert`; read it with :func:`read_manifest`
    or :meth:`from_json` (which validate it).
    """

    groups: list[GroupEntry]
    tensors: list[TensorEntry]
    files: list[FileEntry]
    #: SHA-256 of the model config (:func:`config_fingerprint`), ``None`` if the checkpoint had none.
    config_sha256: str | None = None
    #: SHA-256 of the store's ``config.json``, a byte copy of the checkpoint's (``None``: it had none); checked at load.
    config_file_sha256: str | None = None
    #: The same for ``generation_config.json`` (format 2).
    generation_config_sha256: str | None = None
    #: The module path of the repeated blocks (``model.layers``); ``None``: no layers found.
    layer_prefix: str | None = None
    tensor_align: int = LEGACY_TENSOR_ALIGN
    #: The output directories as given to convert (hints for error messages only).
    dirs: list[str] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    # -- queries --------------------------------------------------------------------------
    @property
    def layers(self) -> list[GroupEntry]:
        """The layer groups, in layer order."""
        return [g for g in self.groups if g.layer is not None]

    @property
    def resident(self) -> GroupEntry | None:
        return next((g for g in self.groups if g.layer is None), None)

    def group(self, name: str) -> GroupEntry:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r} in the manifest (groups: {', '.join(g.name for g in self.groups)})")

    def tensors_of(self, group: str) -> list[TensorEntry]:
        return [t for t in self.tensors if t.group == group]

    def total_nbytes(self) -> int:
        """Data bytes of all groups (without padding)."""
        return sum(g.nbytes for g in self.groups)

    # -- JSON -----------------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        for g in d["groups"] + d["tensors"]:
            if g["xxh3_64"] is not None:
                g["xxh3_64"] = f"{g['xxh3_64']:016x}"
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str, *, where: str = "manifest") -> Manifest:
        """Parse and validate. Raises :class:`StoreFormatError` naming ``where`` and the problem."""
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise StoreFormatError(f"{where} is not valid JSON ({exc}); convert the checkpoint again") from exc
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise StoreFormatError(f"{where} is not a gds_offload weight store manifest (format {d.get('format') if isinstance(d, dict) else None!r})")
        if d.get("format_version") not in READABLE_VERSIONS:
            source = d.get("source")
            store = Path(where).parent if Path(where).name == MANIFEST_NAME else "STORE"
            again = reconvert_command([store], source.get("checkpoint") if isinstance(source, dict) else None)
            raise StoreFormatError(
                f"{where} has format version {d.get('format_version')!r}; this gds_offload reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}. Convert the checkpoint again with this version: {again}"
            )
        m = _Parser(where).manifest(d)
        m.validate(where=where)
        return m

    def validate(self, *, where: str = "manifest") -> None:
        """Check the layout's invariants (the fields' types are :meth:`from_json`'s). Raises
        :class:`StoreFormatError` on the first broken one."""
        _validate(self, where)


class _Parser:
    """Typed fields out of the manifest's JSON: each one checked, none coerced."""

    def __init__(self, where: str) -> None:
        self.where = where

    def bad(self, msg: str) -> StoreFormatError:
        return StoreFormatError(f"{self.where}: {msg}; the manifest is damaged or was edited, convert the checkpoint again")

    def fields(self, d: object, what: str, required: set[str], optional: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
        if not isinstance(d, dict):
            raise self.bad(f"{what} is {type(d).__name__}, not an object")
        missing, unknown = required - set(d), set(d) - required - optional
        if missing or unknown:
            raise self.bad(f"{what} " + "; ".join(
                ([f"lacks {', '.join(sorted(missing))}"] if missing else []) + ([f"has unknown fields {', '.join(sorted(unknown))}"] if unknown else [])))  # fmt: skip
        return d

    def integer(self, v: object, what: str, *, optional: bool = False) -> Any:
        if v is None and optional:
            return None
        if type(v) is not int or v < 0:
            raise self.bad(f"{what} is {v!r}, not a non-negative integer")
        return v

    def string(self, v: object, what: str, *, optional: bool = False, pattern: re.Pattern[str] | None = None) -> Any:
        if v is None and optional:
            return None
        if not isinstance(v, str) or not v or (pattern is not None and not pattern.match(v)):
            raise self.bad(f"{what} is {v!r}, not " + ("a non-empty string" if pattern is None else f"a string matching {pattern.pattern}"))
        return v

    def array(self, v: object, what: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.bad(f"{what} is {type(v).__name__}, not a list")
        return v

    def xxh(self, v: object, what: str, *, optional: bool = False) -> Any:
        s = self.string(v, what, optional=optional, pattern=_XXH)
        return None if s is None else int(s, 16)

    def manifest(self, d: dict[str, Any]) -> Manifest:
        v1 = d.get("format_version") == 1
        top = {"groups", "tensors", "files", "format", "format_version"}
        self.fields(d, "the manifest", top, {"config_sha256", "config_file_sha256", "layer_prefix", "tensor_align", "dirs", "source"}
                    | (set() if v1 else {"generation_config_sha256"}))  # fmt: skip
        groups = [self.group(g, i) for i, g in enumerate(self.array(d["groups"], "groups"))]
        tensors = [self.tensor(t, i) for i, t in enumerate(self.array(d["tensors"], "tensors"))]
        files = [self.file(f, i) for i, f in enumerate(self.array(d["files"], "files"))]
        dirs = self.array(d.get("dirs", []), "dirs")
        for i, s in enumerate(dirs):
            self.string(s, f"dirs[{i}]")
        if not isinstance(d.get("source", {}), dict):
            raise self.bad(f"source is {type(d['source']).__name__}, not an object")
        return Manifest(
            groups=groups, tensors=tensors, files=files,
            config_sha256=self.string(d.get("config_sha256"), "config_sha256", optional=True, pattern=_SHA256),
            config_file_sha256=self.string(d.get("config_file_sha256"), "config_file_sha256", optional=True, pattern=_SHA256),
            generation_config_sha256=self.string(d.get("generation_config_sha256"), "generation_config_sha256", optional=True, pattern=_SHA256),
            layer_prefix=self.string(d.get("layer_prefix"), "layer_prefix", optional=True),
            tensor_align=self.integer(d.get("tensor_align", LEGACY_TENSOR_ALIGN), "tensor_align"),
            dirs=dirs, source=d.get("source", {}), format=d["format"], format_version=d["format_version"],
        )  # fmt: skip

    def group(self, g: object, i: int) -> GroupEntry:
        g = self.fields(g, f"groups[{i}]", {"name", "layer", "file", "offset", "nbytes", "xxh3_64"})
        what = f"group {g['name']!r}" if isinstance(g["name"], str) else f"groups[{i}]"
        return GroupEntry(self.string(g["name"], f"groups[{i}].name"), self.integer(g["layer"], f"{what} layer", optional=True),
                          self.integer(g["file"], f"{what} file"), self.integer(g["offset"], f"{what} offset"),
                          self.integer(g["nbytes"], f"{what} nbytes"), self.xxh(g["xxh3_64"], f"{what} xxh3_64"))  # fmt: skip

    def tensor(self, t: object, i: int) -> TensorEntry:
        t = self.fields(t, f"tensors[{i}]", {"name", "dtype", "shape", "group", "offset", "nbytes"}, {"xxh3_64"})
        what = f"tensor {t['name']!r}" if isinstance(t["name"], str) else f"tensors[{i}]"
        shape = self.array(t["shape"], f"{what} shape")
        if len(shape) > _MAX_DIMS:
            raise self.bad(f"{what} has {len(shape)} dimensions, more than torch's {_MAX_DIMS}")
        dtype = self.string(t["dtype"], f"{what} dtype")
        if dtype not in DTYPE_SIZES:
            raise self.bad(f"{what} has dtype {dtype!r}, not one a store holds ({', '.join(DTYPE_SIZES)})")
        return TensorEntry(self.string(t["name"], f"tensors[{i}].name"), dtype, tuple(self.integer(s, f"{what} shape[{k}]") for k, s in enumerate(shape)),
                           self.string(t["group"], f"{what} group"), self.integer(t["offset"], f"{what} offset"),
                           self.integer(t["nbytes"], f"{what} nbytes"), self.xxh(t.get("xxh3_64"), f"{what} xxh3_64", optional=True))  # fmt: skip

    def file(self, f: object, i: int) -> FileEntry:
        f = self.fields(f, f"files[{i}]", {"path", "dir", "nbytes"})
        return FileEntry(check_name(f["path"], where=self.where), self.integer(f["dir"], f"files[{i}].dir"), self.integer(f["nbytes"], f"files[{i}].nbytes"))


def _validate(m: Manifest, where: str) -> None:
    def bad(msg: str) -> StoreFormatError:
        return StoreFormatError(f"{where}: {msg}; the store is damaged or was edited, convert the checkpoint again")

    if m.tensor_align < 1 or ALIGN % m.tensor_align:
        raise bad(f"tensor_align {m.tensor_align} does not divide {ALIGN}")
    if len({(f.dir, f.path) for f in m.files}) != len(m.files):
        raise bad("two data files are one file (same directory and name)")
    if {f.dir for f in m.files} != set(range(len({f.dir for f in m.files}))):
        raise bad(f"the data files' directory numbers ({sorted({f.dir for f in m.files})}) are not 0, 1, ...")
    groups = {g.name: g for g in m.groups}
    if len(groups) != len(m.groups):
        raise bad("two groups share a name")
    members: dict[str, list[TensorEntry]] = {g: [] for g in groups}
    names = set()
    for t in m.tensors:
        if t.name in names:
            raise bad(f"tensor {t.name} is listed twice")
        names.add(t.name)
        if t.group not in members:
            raise bad(f"tensor {t.name} names group {t.group!r}, which does not exist")
        members[t.group].append(t)
    numbered = re.compile(rf"^{re.escape(m.layer_prefix)}\.\d+\.") if m.layer_prefix else None
    last_layer = -1
    by_file: dict[int, list[GroupEntry]] = {}
    for g in m.groups:
        if g.layer is None:
            if g.name != RESIDENT:
                raise bad(f"group {g.name} has no layer index and is not the {RESIDENT!r} group")
        elif m.layer_prefix is None or g.name != f"{m.layer_prefix}.{g.layer}":
            raise bad(f"group {g.name} (layer {g.layer}) is not named {m.layer_prefix}.{g.layer} (layer_prefix {m.layer_prefix!r})")
        elif g.layer <= last_layer:
            raise bad(f"layer {g.layer} comes after layer {last_layer}: the layers are not in order")
        else:
            last_layer = g.layer
        if not 0 <= g.file < len(m.files):
            raise bad(f"group {g.name} names file #{g.file}, which does not exist")
        if g.offset % ALIGN:
            raise bad(f"group {g.name} starts at {g.offset}, not a multiple of {ALIGN}")
        if g.offset + g.padded_nbytes > m.files[g.file].nbytes:
            raise bad(f"group {g.name} ({g.nbytes} bytes at {g.offset}) ends past the end of {m.files[g.file].path} ({m.files[g.file].nbytes} bytes)")
        _check_members(g, members[g.name], m.tensor_align, numbered, bad)
        by_file.setdefault(g.file, []).append(g)
    if sum(g.layer is None for g in m.groups) > 1:
        raise bad(f"two groups are {RESIDENT!r}")
    for gs in by_file.values():
        gs.sort(key=lambda g: g.offset)
        for a, b in zip(gs, gs[1:]):
            if a.offset + a.padded_nbytes > b.offset:
                raise bad(f"groups {a.name} and {b.name} overlap")


def _check_members(g: GroupEntry, ts: list[TensorEntry], align: int, numbered: re.Pattern[str] | None, bad: Any) -> None:
    """A group's tensors: sizes match shapes, inside the group and aligned, no overlaps, the group ending with the last."""
    if not ts:
        raise bad(f"group {g.name} holds no tensor")
    for t in ts:
        inside = t.name.startswith(g.name + ".")
        if (g.layer is not None and not inside) or (g.layer is None and numbered is not None and numbered.match(t.name)):
            raise bad(f"tensor {t.name} is listed in group {g.name}, which is not its layer")
        n = DTYPE_SIZES[t.dtype]
        for s in t.shape:
            n *= s
        if t.nbytes != n:
            raise bad(f"tensor {t.name} is {t.dtype} {t.shape}, {n} bytes, but the manifest gives it {t.nbytes}")
        if t.offset % align or t.offset % DTYPE_SIZES[t.dtype]:
            raise bad(f"tensor {t.name} at offset {t.offset} is not aligned to {align} bytes nor to its dtype")
        if not g.offset <= t.offset <= t.offset + t.nbytes <= g.offset + g.nbytes:
            raise bad(f"tensor {t.name} ({t.nbytes} bytes at {t.offset}) is outside group {g.name} ({g.nbytes} bytes at {g.offset})")
    ordered = sorted(ts, key=lambda t: (t.offset, t.nbytes))
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset:
            raise bad(f"tensors {a.name} and {b.name} overlap ({a.nbytes} bytes at {a.offset}, {b.nbytes} at {b.offset})")
    end = max(t.offset + t.nbytes for t in ts)
    if g.offset + g.nbytes != end:
        raise bad(f"group {g.name} gives {g.nbytes} bytes, but its tensors end {end - g.offset} bytes after its start")


def read_manifest(store_dir: str | os.PathLike[str]) -> Manifest:
    """The validated manifest of the store in ``store_dir`` (its first directory if striped).

    The directory and the manifest are opened as :mod:`~gds_offload.weights.store.trust` opens a
    store's files (yours or root's, writable by nobody else, regular files), and the store's
    copies of the checkpoint's configs are checked against the hashes recorded
    (:func:`~gds_offload.weights.store.config.check_copied`).

    Raises:
        StoreFormatError: no manifest there (not a store, or a conversion that did not finish),
            a bad one, or config copies that are not the store's.
        StoreTrustError: the directory or a file another user could have changed.
    """
    d = Path(store_dir)
    dfd = open_dir(d)
    try:
        raw = read_file(dfd, d, MANIFEST_NAME, limit=MANIFEST_LIMIT)
        if raw is None:
            raise StoreFormatError(
                f"{store_dir} holds no {MANIFEST_NAME}: not a weight store, or its conversion did not finish; {no_store_advice(d)}"
            )
        try:
            text = raw.decode()
        except UnicodeDecodeError as exc:
            raise StoreFormatError(f"{d / MANIFEST_NAME} is not UTF-8 text ({exc}); convert the checkpoint again") from None
        m = Manifest.from_json(text, where=str(d / MANIFEST_NAME))
        recorded = {CONFIG_NAME: m.config_file_sha256}
        if m.format_version >= 2:
            recorded[GENERATION_CONFIG_NAME] = m.generation_config_sha256
        check_copied(dfd, d, recorded)
    finally:
        os.close(dfd)
    return m
