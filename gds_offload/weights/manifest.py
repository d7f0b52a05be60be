"""The weight store's manifest: where every tensor lies, and what the bytes must hash to.

A store is a directory (or several, striped) holding ``weights.bin`` and ``manifest.json``.
The file is a sequence of *groups*, each one contiguous range starting at a multiple of
:data:`GROUP_ALIGN` (4 KiB) and padded with zeros to the next one, so each group is one
aligned ``O_DIRECT`` (or cuFile) read:

* ``resident``: everything outside the repeated blocks (embeddings, final norm, ``lm_head``);
* one group per repeated block (decoder layer), named by its module path (``model.layers.3``),
  in layer order.

Inside a group, tensors start at multiples of ``tensor_align`` (64 bytes: every dtype's
elements stay aligned in a view of the group's buffer). Each tensor's ``offset`` is its
absolute offset in its group's file. A group's ``xxh3_64`` covers its ``nbytes`` data
bytes (not the padding).

The manifest is plain JSON, parsed into dataclasses and validated (offsets, alignment,
bounds, overlaps) before anything reads the file; nothing in it is executed.

``config_sha256`` identifies the model config the weights belong to:
:func:`config_fingerprint` (the config with keys that do not change what the weights mean,
such as ``transformers_version`` or ``dtype``, removed; canonical JSON; SHA-256).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gds_offload.weights.errors import ConfigMismatchError, StoreFormatError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "GROUP_ALIGN",
    "RESIDENT",
    "MANIFEST_NAME",
    "TensorEntry",
    "GroupEntry",
    "FileEntry",
    "Manifest",
    "canonical_config",
    "check_config",
    "config_fingerprint",
    "read_manifest",
]

FORMAT = "gds_offload.weights"
FORMAT_VERSION = 1
#: Groups start at multiples of this (the ``O_DIRECT`` and cuFile alignment).
GROUP_ALIGN = 4096
#: Name of the group of non-repeated tensors.
RESIDENT = "resident"
MANIFEST_NAME = "manifest.json"
#: Config keys ignored by :func:`config_fingerprint`: they change neither the tensors'
#: names, shapes nor meaning (the dtype is checked tensor by tensor instead).
VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "use_cache", "attn_implementation"}
)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: ``nbytes`` bytes at absolute ``offset`` of its group's file."""

    name: str
    dtype: str  # a torch dtype name: "float32", "bfloat16", ...
    shape: tuple[int, ...]
    group: str
    offset: int
    nbytes: int


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
        """Bytes of the file the group occupies (``nbytes`` rounded up to :data:`GROUP_ALIGN`)."""
        return -(-self.nbytes // GROUP_ALIGN) * GROUP_ALIGN

    def describe(self) -> str:
        return "the resident group" if self.layer is None else f"layer {self.layer} ({self.name})"


@dataclass(frozen=True)
class FileEntry:
    """One data file: ``path`` relative to directory ``dir`` (an index into the store's directories)."""

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
    #: SHA-256 of the checkpoint's ``config.json`` bytes, as found (for humans; not compared).
    config_file_sha256: str | None = None
    #: The module path of the repeated blocks (``model.layers``); ``None``: no layers found.
    layer_prefix: str | None = None
    tensor_align: int = 64
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
        for g in d["groups"]:
            g["xxh3_64"] = f"{g['xxh3_64']:016x}"
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str, *, where: str = "manifest") -> Manifest:
        """Parse and validate. Raises :class:`StoreFormatError` naming ``where`` and the problem."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StoreFormatError(f"{where} is not valid JSON ({exc}); convert the checkpoint again") from exc
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise StoreFormatError(f"{where} is not a gds_offload weight store manifest (format {d.get('format') if isinstance(d, dict) else None!r})")
        if d.get("format_version") != FORMAT_VERSION:
            raise StoreFormatError(
                f"{where} has format version {d.get('format_version')!r}; this gds_offload reads version {FORMAT_VERSION}. "
                f"Convert the checkpoint again with this version (gds-offload convert CHECKPOINT OUT)"
            )
        try:
            m = cls(
                groups=[GroupEntry(**(g | {"xxh3_64": int(g["xxh3_64"], 16)})) for g in d.pop("groups")],
                tensors=[TensorEntry(**(t | {"shape": tuple(t["shape"])})) for t in d.pop("tensors")],
                files=[FileEntry(**f) for f in d.pop("files")],
                **d,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreFormatError(f"{where} has a malformed entry ({type(exc).__name__}: {exc}); convert the checkpoint again") from exc
        m.validate(where=where)
        return m

    def validate(self, *, where: str = "manifest") -> None:
        """Check the layout's invariants. Raises :class:`StoreFormatError` on the first broken one."""

        def bad(msg: str) -> StoreFormatError:
            return StoreFormatError(f"{where}: {msg}; the store is damaged, convert the checkpoint again")

        groups = {g.name: g for g in self.groups}
        if len(groups) != len(self.groups):
            raise bad("two groups share a name")
        by_file: dict[int, list[GroupEntry]] = {}
        for g in self.groups:
            if not 0 <= g.file < len(self.files):
                raise bad(f"group {g.name} names file #{g.file}, which does not exist")
            if g.offset % GROUP_ALIGN or g.nbytes < 0:
                raise bad(f"group {g.name} starts at {g.offset}, not a multiple of {GROUP_ALIGN}")
            if g.offset + g.padded_nbytes > self.files[g.file].nbytes:
                raise bad(f"group {g.name} ends past the end of {self.files[g.file].path}")
            by_file.setdefault(g.file, []).append(g)
        for gs in by_file.values():
            gs.sort(key=lambda g: g.offset)
            for a, b in zip(gs, gs[1:]):
                if a.offset + a.padded_nbytes > b.offset:
                    raise bad(f"groups {a.name} and {b.name} overlap")
        names = set()
        for t in self.tensors:
            if t.name in names:
                raise bad(f"tensor {t.name} is listed twice")
            names.add(t.name)
            group = groups.get(t.group)
            if group is None:
                raise bad(f"tensor {t.name} names group {t.group!r}, which does not exist")
            if t.offset % self.tensor_align or not group.offset <= t.offset <= t.offset + t.nbytes <= group.offset + group.nbytes:
                raise bad(f"tensor {t.name} ({t.nbytes} bytes at {t.offset}) is misaligned or outside group {group.name}")


def read_manifest(store_dir: str | os.PathLike[str]) -> Manifest:
    """The validated manifest of the store in ``store_dir`` (its first directory if striped).

    Raises:
        StoreFormatError: no manifest there (not a store, or a conversion that did not finish), or a bad one.
    """
    path = Path(store_dir) / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise StoreFormatError(
            f"{store_dir} holds no {MANIFEST_NAME}: not a weight store, or its conversion did not finish. "
            f"Run `gds-offload convert CHECKPOINT {store_dir}`"
        ) from None
    return Manifest.from_json(text, where=str(path))


def canonical_config(config: Any) -> dict[str, Any] | None:
    """A model config as the dict :func:`config_fingerprint` hashes; ``None`` for ``None``.

    ``config``: a ``config.json`` path, a dict or a ``transformers.PretrainedConfig``. With
    transformers installed and a ``model_type`` given, the config is rebuilt by its config
    class and reduced to its differences from that class's defaults (``to_diff_dict``), so
    a config.json that spells out defaults and a config built in code come out alike. Keys
    in :data:`VOLATILE_CONFIG_KEYS` and private keys (``_...``) are dropped.
    """
    if config is None:
        return None
    if isinstance(config, (str, os.PathLike)):
        config = json.loads(Path(config).read_text())
    elif not isinstance(config, dict):
        config = config.to_dict()
    d = _diff_dict(dict(config))
    return {k: v for k, v in d.items() if k not in VOLATILE_CONFIG_KEYS and not k.startswith("_")}


def config_fingerprint(config: Any) -> str | None:
    """SHA-256 of :func:`canonical_config` as canonical JSON (sorted keys); ``None`` for ``None``."""
    d = canonical_config(config)
    if d is None:
        return None
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def _diff_dict(d: dict[str, Any]) -> dict[str, Any]:
    model_type = d.get("model_type")
    if not model_type:
        return d
    try:
        from transformers import AutoConfig
    except ImportError:
        return d
    try:
        rest = {k: v for k, v in d.items() if k != "model_type"}
        return AutoConfig.for_model(model_type, **rest).to_diff_dict()
    except (ValueError, TypeError, KeyError):  # a model type transformers does not know
        return d


def check_config(model: Any, manifest: Manifest, store: Path) -> None:
    """Refuse a model whose ``config`` is not the one the store at ``store`` was converted from
    (no check when either has none).

    Raises:
        ConfigMismatchError: names the differing keys and how to build the right model.
    """
    cfg = getattr(model, "config", None)
    if manifest.config_sha256 is None or cfg is None or not hasattr(cfg, "to_dict"):
        return
    ours_sha = config_fingerprint(cfg)
    if ours_sha == manifest.config_sha256:
        return
    ours, theirs = canonical_config(cfg) or {}, {}
    saved = store / "config.json"
    if saved.is_file():
        theirs = canonical_config(saved) or {}
    diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    shown = ", ".join(f"{k}: model {ours.get(k)!r}, store {theirs.get(k)!r}" for k in diff[:6]) or "see the two configs"
    raise ConfigMismatchError(
        f"the model's config (sha256 {str(ours_sha)[:12]}...) is not the one the weight store at {store} was converted "
        f"from (sha256 {manifest.config_sha256[:12]}...): {shown}. Build the model from {saved} "
        f"(AutoConfig.from_pretrained({str(store)!r})), or convert this model's checkpoint"
    )
