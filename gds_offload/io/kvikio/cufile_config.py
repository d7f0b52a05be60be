"""``cufile.json``: found the way cuFile finds it, parsed the way cuFile parses it.

cuFile accepts ``//`` and ``/* */`` comments that the standard :mod:`json` module
rejects; :func:`strip_json_comments` removes them. :func:`read_cufile_config` reports
only the settings that change what cuFile does (:data:`CUFILE_REPORTED_KEYS`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

__all__ = ["CufileConfig", "CUFILE_REPORTED_KEYS", "strip_json_comments", "read_cufile_config"]

_MISSING = object()


@dataclass(frozen=True)
class CufileConfig:
    """``cufile.json`` as cuFile will read it.

    Attributes:
        path: where it was looked for (``CUFILE_ENV_PATH_JSON`` or ``/etc/cufile.json``).
        found: the file exists.
        parsed: it parsed as JSON after ``//`` comments were stripped.
        settings: the settings that change behaviour, as dotted keys
            (``properties.allow_compat_mode``...).
        error: the parse or read error.
    """

    path: str
    found: bool
    parsed: bool = False
    settings: Mapping[str, object] = field(default_factory=dict)
    error: str = ""


def strip_json_comments(text: str) -> str:
    """Remove ``//`` line comments and ``/* */`` block comments outside JSON strings.

    cuFile's parser accepts these in ``cufile.json``; the standard ``json`` module does
    not. Line breaks are kept so parse errors still point at the right line.

    Args:
        text: the file content.

    Returns:
        Plain JSON text.
    """
    out: list[str] = []
    i, n = 0, len(text)
    in_string = False
    while i < n:
        ch = text[i]
        if in_string:
            out.append(ch)
            if ch == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 2
                continue
            if ch == '"':
                in_string = False
            i += 1
            continue
        if ch == '"':
            in_string = True
            out.append(ch)
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            block = text[i:n if end < 0 else end + 2]
            out.append("\n" * block.count("\n"))
            i = n if end < 0 else end + 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


#: cufile.json settings reported because they change what cuFile does.
CUFILE_REPORTED_KEYS = (
    "properties.allow_compat_mode",
    "properties.force_compat_mode",
    "properties.use_pci_p2pdma",
    "properties.use_poll_mode",
    "properties.poll_mode_max_size_kb",
    "properties.max_direct_io_size_kb",
    "properties.max_device_cache_size_kb",
    "properties.per_buffer_cache_size_kb",
    "properties.max_device_pinned_mem_size_kb",
    "properties.io_batchsize",
    "execution.max_io_threads",
    "execution.parallel_io",
    "execution.max_io_queue_depth",
    "logging.level",
    "logging.dir",
    "profile.cufile_stats",
    "profile.nvtx",
    "fs.generic.posix_unaligned_writes",
    "block.nvme.use_pci_p2pdma",
    "denylist.drivers",
    "denylist.devices",
    "denylist.mounts",
    "denylist.filesystems",
)


def read_cufile_config(root: Path = Path("/"), env: Mapping[str, str] | None = None) -> CufileConfig:
    """Read ``cufile.json`` the way cuFile finds it.

    ``CUFILE_ENV_PATH_JSON`` when set (taken relative to ``root``), else
    ``<root>/etc/cufile.json``. ``//`` comments are stripped before parsing.

    Args:
        root: root of the ``/etc`` tree.
        env: environment; ``os.environ`` when None.

    Returns:
        The settings listed in :data:`CUFILE_REPORTED_KEYS` that the file sets.
    """
    env = os.environ if env is None else env
    configured = env.get("CUFILE_ENV_PATH_JSON", "").strip()
    shown = configured or "/etc/cufile.json"
    path = root / shown.lstrip("/") if shown.startswith("/") else Path(shown)
    if not path.exists():
        return CufileConfig(shown, False)
    try:
        with open(path, "rb") as fh:
            text = fh.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return CufileConfig(shown, True, error=f"{shown} is not readable by uid {os.geteuid()}")
    try:
        data = json.loads(strip_json_comments(text))
    except ValueError as exc:
        return CufileConfig(shown, True, error=f"{shown} is not valid JSON after stripping // comments: {exc}")
    if not isinstance(data, dict):
        return CufileConfig(shown, True, error=f"{shown} holds a {type(data).__name__}, expected an object")
    settings: dict[str, object] = {}
    for key in CUFILE_REPORTED_KEYS:
        node: object = data
        for part in key.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            settings[key] = node
    return CufileConfig(shown, True, True, settings)
