"""What :func:`~gds_offload.attach` was asked for, checked: :class:`OffloadConfig`.

:meth:`OffloadConfig.from_kwargs` checks every argument of ``attach`` but the model and its
layers before anything is allocated or created, so a bad argument costs nothing; the
commands call it before their first child process starts.
"""
from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gds_offload.activations.planning.planners import make_planner
from gds_offload.activations.planning.policy import Adaptive, Budget, OffloadAll, Policy, PolicyConfig
from gds_offload.errors import ConfigError
from gds_offload.io.directory import Origin, check_dir, spill_dir_origin
from gds_offload.io.factory import Mode, validate_mode
from gds_offload.units import checked_bool, checked_int, parse_bandwidth, parse_bytes

__all__ = ["OffloadConfig", "OnError", "DEFAULT_MIN_BYTES"]

#: Storages under this size stay in memory. Measured with ``gds-offload bench-io``:
#: below about 1 MiB per transfer the engines reach well under half of the drive's bandwidth.
DEFAULT_MIN_BYTES = 1 << 20

_POLICIES = ("all", "adaptive")

#: What a failed write does: keep the tensor in memory and warn once, or raise at the next hook.
OnError = Literal["fallback", "raise"]
_ON_ERROR: tuple[OnError, ...] = ("fallback", "raise")


@dataclass(frozen=True)
class OffloadConfig:
    """Everything :func:`~gds_offload.attach` was asked for, validated (build it with :meth:`from_kwargs`)."""

    paths: tuple[Path, ...]
    mode: Mode
    policy: str | Budget
    min_bytes: int
    keep_last: int
    prefetch_bytes: int | None
    max_bandwidth: float | None
    on_error: OnError
    num_threads: int | None = None
    verify: bool = False
    write_window: int | None = None
    #: Where ``paths`` came from (see :func:`~gds_offload.io.directory.check_dir`).
    origin: Origin = field(default="path", compare=False)

    @classmethod
    def from_kwargs(
        cls,
        *,
        path: Any = None,
        mode: str = "auto",
        policy: str | Budget = "all",
        budget: int | str | None = None,
        min_bytes: int | str = DEFAULT_MIN_BYTES,
        keep_last: int = 1,
        prefetch_bytes: int | str | None = None,
        max_bandwidth: float | str | None = None,
        on_error: str = "fallback",
        num_threads: int | None = None,
        verify: bool = False,
        write_window: int | str | None = None,
        origin: Origin = "path",
    ) -> OffloadConfig:
        """Validate :func:`~gds_offload.attach`'s keyword arguments (all but ``model`` and ``layers``)
        without allocating or creating anything. ``origin``: how an explicit ``path`` is named in
        messages (the commands pass ``"--path"``).

        Raises:
            ConfigError: the first bad argument, with its value and the fix; a spill directory
                :func:`~gds_offload.io.directory.check_dir` refuses.
        """
        engine_mode = validate_mode(mode)
        if budget is not None:
            if policy != "all":
                raise ConfigError(f"pass either budget={budget!r} or policy={policy!r}, not both")
            policy = Budget(budget)
        if not isinstance(policy, Budget) and (not isinstance(policy, str) or policy not in _POLICIES):
            hint = difflib.get_close_matches(str(policy), _POLICIES, n=1)
            raise ConfigError(
                f"policy={policy!r} is unknown; expected one of {', '.join(_POLICIES)} or gds_offload.Budget('40GiB')"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
            )
        checked_on_error = _checked_on_error(on_error)
        checked_int("keep_last", keep_last, low=0, what="layers kept in memory at the end")
        if num_threads is not None:
            checked_int("num_threads", num_threads, low=1, what="engine I/O threads; None for the engine's default")
        checked_bool("verify", verify)
        paths, origin = _checked_paths(path, origin)
        config = cls(
            paths=paths,
            mode=engine_mode,
            policy=policy,
            min_bytes=parse_bytes(min_bytes, name="min_bytes"),
            keep_last=keep_last,
            prefetch_bytes=None if prefetch_bytes is None else parse_bytes(prefetch_bytes, name="prefetch_bytes"),
            max_bandwidth=None if max_bandwidth is None else parse_bandwidth(max_bandwidth),
            on_error=checked_on_error,
            num_threads=num_threads,
            verify=verify,
            write_window=None if write_window is None else parse_bytes(write_window, name="write_window"),
            origin=origin,
        )
        if mode != "host":
            for d in paths:
                found = check_dir(d, origin=origin)
                if found.problem:
                    raise ConfigError(found.problem)
        return config

    def policy_config(self) -> PolicyConfig:
        """The frozen configuration of the policy asked for (a :class:`~gds_offload.activations.planning.policy.Budget` as given)."""
        if isinstance(self.policy, Budget):
            return self.policy
        if self.policy == "adaptive":
            return Adaptive(keep_last=self.keep_last)
        return OffloadAll(keep_last=self.keep_last)

    def make_policy(self) -> Policy:
        """A new planner for this configuration, with state of its own: never the user's ``Budget``
        itself, so one ``Budget`` given to two ``attach()`` calls shares no measurement."""
        return make_planner(self.policy_config())


def _checked_on_error(value: object) -> OnError:
    for choice in _ON_ERROR:
        if value == choice:
            return choice
    raise ConfigError(f"on_error={value!r} is unknown; expected 'fallback' or 'raise'")


def _checked_paths(path: Any, origin: Origin = "path") -> tuple[tuple[Path, ...], Origin]:
    """``path=`` as directories, and where they came from. Types and emptiness only; the
    directories themselves are judged by :func:`~gds_offload.io.directory.check_dir`."""
    if path is None:
        d, origin = spill_dir_origin()
        return (d,), origin
    items = [path] if isinstance(path, (str, bytes, os.PathLike)) else path
    if isinstance(items, (int, float)) or not isinstance(items, Sequence):
        raise ConfigError(
            f"path={path!r} ({type(path).__name__}) is not a directory; pass a str or pathlib.Path, or a list of them"
        )
    if not items:
        raise ConfigError("path=[] names no directory; pass a directory or a list of them")
    out = []
    for item in items:
        shown = f"path={item!r}" if item is path else f"path=[..., {item!r}, ...]"
        if isinstance(item, os.PathLike):
            item = os.fspath(item)
        if isinstance(item, bytes):
            raise ConfigError(f"{shown} is bytes; pass the directory as a str or pathlib.Path (e.g. os.fsdecode(...))")
        if not isinstance(item, str):
            raise ConfigError(f"{shown} ({type(item).__name__}) is not a directory; pass a str or pathlib.Path")
        if not item.strip():
            raise ConfigError(f"{shown} is empty; pass a directory (the current directory is not assumed), or leave "
                              "path unset for $GDS_OFFLOAD_DIR or <tmp>/gds_offload-<uid>")
        if "\0" in item:
            raise ConfigError(f"{shown} contains a NUL character; pass a real directory")
        out.append(Path(item).expanduser())
    return tuple(out), origin
