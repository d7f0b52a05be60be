"""Byte sizes and bandwidths written by people: ``"40GiB"``, ``"200MB/s"``."""
from __future__ import annotations

import re

from gds_offload.errors import ConfigError

__all__ = ["checked_bool", "checked_int", "parse_bytes", "parse_bandwidth", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, name: str = "size") -> int:
    """Parse a non-negative byte count: an int, or a string such as ``"40GiB"``, ``"1.5 GB"``, ``"4096"``.

    Raises:
        ConfigError: the value is negative, not a number, or has an unknown unit.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is a bool; pass a byte count such as 4096 or '40GiB'")
    if isinstance(value, (int, float)):
        return _checked(value, value, name)
    if not isinstance(value, str):
        raise ConfigError(f"{name}={value!r} ({type(value).__name__}) is not a size; pass an int or a string like '40GiB'")
    m = _SIZE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(
            f"{name}={value!r} is not a size; write a number with an optional unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '40GiB' or '512MB'"
        )
    return _checked(float(m.group(1)) * _UNITS[unit], value, name)


def checked_int(name: str, value: object, *, low: int, what: str) -> int:
    """``value`` if it is an int (not a bool) ``>= low``; else :class:`ConfigError` naming ``name``,
    the value and ``what`` the argument means. No coercion: ``2.0`` and ``"2"`` are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} ({type(value).__name__}) must be an int >= {low} ({what})")
    if value < low:
        raise ConfigError(f"{name}={value!r} must be an int >= {low} ({what})")
    return value


def checked_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; else :class:`ConfigError` (``"no"`` is not false)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} ({type(value).__name__}) must be True or False")
    return value


#: Sizes above this (an exbibyte) are typos, not drives.
_MAX_BYTES = 1 << 60


def _checked(n: int | float, given: object, name: str) -> int:
    if n != n or n in (float("inf"), float("-inf")):
        raise ConfigError(f"{name}={given!r} is not a finite number; pass a byte count such as 4096 or '40GiB'")
    if n < 0:
        raise ConfigError(f"{name}={given!r} is negative; pass a byte count >= 0")
    if n > _MAX_BYTES:
        raise ConfigError(f"{name}={given!r} is larger than 1 EiB; pass a byte count such as 4096 or '40GiB'")
    return int(n)


def parse_bandwidth(value: int | float | str, *, name: str = "max_bandwidth") -> float:
    """Parse bytes per second: a number, or a string such as ``"200MB/s"`` or ``"1.5GiB/s"``.

    Raises:
        ConfigError: not a positive bandwidth.
    """
    text = value
    if isinstance(value, str):
        text = re.sub(r"\s*(/s|ps)\s*$", "", value.strip(), flags=re.IGNORECASE)
    rate = parse_bytes(text, name=name)
    if rate <= 0:
        raise ConfigError(f"{name}={value!r} must be positive (bytes per second, e.g. '200MB/s')")
    return float(rate)


def format_bytes(nbytes: float | None, *, missing: str = "-") -> str:
    """``1536 -> '1.5 KiB'``: binary units, three significant digits; ``None`` (not measured) -> ``missing``."""
    if nbytes is None:
        return missing
    step = 1024.0
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < step or unit == "TiB":
            if unit == "B" or abs(nbytes) >= 100:
                return f"{nbytes:.0f} {unit}"  # 1020 MiB, not 1.02e+03 MiB
            return f"{nbytes:.3g} {unit}"
        nbytes /= step
    raise AssertionError("unreachable")
