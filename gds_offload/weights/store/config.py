"""The model config a weight store belongs to: its fingerprint, and the copies kept beside it.

``config_sha256`` in the manifest identifies the model config the weights belong to:
:func:`config_fingerprint` (the config with keys that do not change what the weights mean,
such as ``transformers_version`` or ``dtype``, removed; canonical JSON; SHA-256). A model
whose config differs is refused by :func:`check_config`, the differences listed, an
architecture change (``model_type``) first.

The store also keeps the checkpoint's ``config.json`` and ``generation_config.json``, byte
for byte, and the manifest records each one's SHA-256 (``None``: the checkpoint had none,
and then neither has the store). :func:`check_copied` refuses a store whose copy is not the
one recorded, so a config left by an earlier store, or put there later, is never mistaken
for the store's own. Stores of format 1 recorded no ``generation_config.json`` hash; theirs
is not checked. :func:`generation_config` reads the copies back as ``transformers`` reads the
checkpoint's, so a streamed model's ``generate`` has the defaults the resident model's has.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from gds_offload.weights.errors import ConfigMismatchError, StoreFormatError
from gds_offload.weights.store.trust import open_dir, read_file

__all__ = [
    "CONFIG_NAME",
    "GENERATION_CONFIG_NAME",
    "VOLATILE_CONFIG_KEYS",
    "canonical_config",
    "check_config",
    "check_copied",
    "config_fingerprint",
    "generation_config",
]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
#: The most bytes a config file copied into a store may have.
CONFIG_LIMIT = 16 << 20
#: Config keys ignored by :func:`config_fingerprint`: they change neither the tensors'
#: names, shapes nor meaning (the dtype is checked tensor by tensor instead).
VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "use_cache", "attn_implementation"}
)
#: Differences :func:`check_config` names before "and N more".
_SHOWN = 6


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


def check_copied(dfd: int, store: Path, recorded: dict[str, str | None]) -> None:
    """Refuse the store in ``store`` (``dfd``: its descriptor) when a config file it holds
    (``config.json``, ``generation_config.json``) is not the one its manifest records: ``recorded``
    maps each file checked to the SHA-256 the manifest has for it (``None``: none, so there must be
    no such file). A missing copy is fine: the fingerprint still identifies the config.

    Raises:
        StoreFormatError: names the file, both hashes (or that none was recorded) and the fix.
    """
    for name, want in recorded.items():
        data = read_file(dfd, store, name, limit=CONFIG_LIMIT)
        if data is None:
            continue
        got = hashlib.sha256(data).hexdigest()
        if want is None:
            raise StoreFormatError(
                f"{store / name} is not this store's: the manifest ({store / 'manifest.json'}) records no {name} (the "
                f"checkpoint it was converted from had none), yet there is one (sha256 {got[:12]}...), left by another "
                f"store or put there since. Remove it (the model's config is then not checked), or convert the checkpoint again"
            )
        if got != want:
            raise StoreFormatError(
                f"{store / name} (sha256 {got[:12]}...) is not the {name} this store was converted from (sha256 "
                f"{want[:12]}... in {store / 'manifest.json'}): it was replaced or edited since. Put the checkpoint's "
                f"{name} back, or convert the checkpoint again"
            )


def generation_config(store: Path) -> Any:
    """The ``GenerationConfig`` that ``transformers``' ``from_pretrained`` gives a model of the
    checkpoint the store at ``store`` was converted from (its ``adjust_generation_fn``): from the
    store's copy of ``generation_config.json``, else the generation settings of its ``config.json``
    (older checkpoints keep them there). ``None`` without transformers or either file. The copies
    are the ones the manifest records (:func:`check_copied`, at :func:`~gds_offload.weights.store.manifest.read_manifest`).
    """
    try:
        from transformers import GenerationConfig
    except ImportError:
        return None
    try:
        return GenerationConfig.from_pretrained(store)
    except OSError:  # none, or not JSON: transformers then reads config.json's settings too
        pass
    if not (store / CONFIG_NAME).is_file():
        return None
    return GenerationConfig.from_pretrained(store, config_file_name=CONFIG_NAME, _from_model_config=True)


def _store_config(store: Path) -> dict[str, Any]:
    """The store's ``config.json`` as a dict (read as :mod:`~gds_offload.weights.store.trust` reads files); ``{}`` if none."""
    dfd = open_dir(store)
    try:
        data = read_file(dfd, store, CONFIG_NAME, limit=CONFIG_LIMIT)
    finally:
        os.close(dfd)
    try:
        d = json.loads(data) if data is not None else {}
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def check_config(model: Any, config_sha256: str | None, store: Path) -> None:
    """Refuse a model whose ``config`` is not the one the store at ``store`` was converted from
    (``config_sha256``: its fingerprint, as the manifest records it).

    No check when the model has no config. When the store records none (its checkpoint had no
    ``config.json``), a warning says that the model's config cannot be checked.

    Raises:
        ConfigMismatchError: names the differing keys (``model_type`` first: another architecture)
            and how to build the right model.
    """
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return
    if config_sha256 is None:
        warnings.warn(
            f"the weight store at {store} records no model config (the checkpoint it was converted from had no "
            f"config.json), so the model's config is not checked against it; build the model from the checkpoint's "
            f"config, or convert a checkpoint that has its config.json",
            stacklevel=3,
        )
        return
    ours_sha = config_fingerprint(cfg)
    if ours_sha == config_sha256:
        return
    ours = canonical_config(cfg) or {}
    stored = _store_config(store)
    theirs = (canonical_config(stored) or {}) if stored else {}
    diff = sorted((k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)), key=lambda k: (k != "model_type", k))
    shown = ", ".join(f"{k}: model {ours.get(k)!r}, store {theirs.get(k)!r}" for k in diff[:_SHOWN]) or "see the two configs"
    if len(diff) > _SHOWN:
        shown += f", and {len(diff) - _SHOWN} more"
    if "model_type" in diff:
        shown = f"another architecture ({shown})"
    saved = store / CONFIG_NAME
    raise ConfigMismatchError(
        f"the model's config (sha256 {str(ours_sha)[:12]}...) is not the one the weight store at {store} was converted "
        f"from (sha256 {config_sha256[:12]}...): {shown}. Build the model from {saved} "
        f"(AutoConfig.from_pretrained({str(store)!r})), or convert this model's checkpoint"
    )
