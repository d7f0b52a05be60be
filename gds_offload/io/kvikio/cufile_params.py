"""cuFile's own POSIX fallback: turned off for a strict ``mode="gds"``, or read for ``auto``.

KvikIO with compat mode off raises when *it* cannot use cuFile, but cuFile has a fallback
of its own: with ``properties.allow_compat_mode`` true (NVIDIA's default, and
``docker/cufile.json``), a file cuFile cannot drive directly (no nvidia-fs, an unsupported
filesystem, a denylisted mount) is served through cuFile's POSIX path and host bounce
buffers, and nothing tells the caller. KvikIO 26.10 has no per-handle report of it
(``kvikio._lib.file_handle.CuFile`` exposes no ``is_compat_mode_preferred``; only
``kvikio.cufile_driver.properties.allow_compat_mode``, which opens the driver).

So the ``gds`` engine decides before the driver opens, with the parameter API of cuFile
1.14 (CUDA 12.9, ``cufile.h``): ``cuFileSetParameterBool`` stages a value that applies when
the driver opens and wins over environment variables and ``cufile.json``;
``cuFileGetParameterBool`` returns the runtime value once the driver is open. The driver
is process-wide: staging ``allow_compat_mode=false`` holds for every cuFile user of the
process (KvikIO handles in compat mode ``ON`` never call cuFile and are not affected).

Never called without a GPU: the engine asks only when CUDA is available (the library
loads anywhere, but nothing on a machine without the driver should touch cuFile).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Mapping

from gds_offload.io.kvikio.cufile_config import read_cufile_config

__all__ = ["CompatFallback", "compat_fallback", "load_libcufile"]

#: ``CUFileBoolConfigParameter_t`` (cufile.h, cuFile 1.14).
PARAM_ALLOW_COMPAT_MODE = 1
PARAM_FORCE_COMPAT_MODE = 2
#: ``CUfileOpError``: ``CU_FILE_SUCCESS``, and ``CUFILEOP_BASE_ERR + 26``.
CU_FILE_SUCCESS = 0
CU_FILE_DRIVER_ALREADY_OPEN = 5026


class _CUfileError(ctypes.Structure):
    """``CUfileError_t``: ``{CUfileOpError err; CUresult cu_err;}``, returned by value."""

    _fields_ = [("err", ctypes.c_int), ("cu_err", ctypes.c_int)]


@dataclass(frozen=True)
class CompatFallback:
    """Whether cuFile can still serve a file through its POSIX path without saying so.

    Attributes:
        off: cuFile will fail (and the engine raise) rather than fall back.
        detail: how that is known, or why it is not off (with the fix).
    """

    off: bool
    detail: str


def load_libcufile() -> Any | None:
    """The cuFile library KvikIO uses (``libcufile.so.0``), or ``None`` when it does not load.

    ``import kvikio`` loads it (through ``cuda.pathfinder`` for the wheel); ``dlopen`` of
    the same soname then returns that very library, so a parameter staged here is the one
    KvikIO's driver open sees.
    """
    try:
        return ctypes.CDLL("libcufile.so.0")
    except OSError:
        pass
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return ctypes.CDLL(load_nvidia_dynamic_lib("cufile").abs_path)
    except Exception:  # noqa: BLE001 - any failure means "not loadable"
        return None


def _bool_api(lib: Any) -> tuple[Any, Any] | None:
    setter, getter = getattr(lib, "cuFileSetParameterBool", None), getattr(lib, "cuFileGetParameterBool", None)
    if setter is None or getter is None:
        return None
    setter.argtypes, setter.restype = [ctypes.c_int, ctypes.c_bool], _CUfileError
    getter.argtypes, getter.restype = [ctypes.c_int, ctypes.POINTER(ctypes.c_bool)], _CUfileError
    return setter, getter


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _from_config(env: Mapping[str, str]) -> CompatFallback:
    """What ``cufile.json`` (and ``CUFILE_FORCE_COMPAT_MODE``) will make of the fallback at driver open."""
    cfg = read_cufile_config(env=env)
    if _truthy(env.get("CUFILE_FORCE_COMPAT_MODE")):
        return CompatFallback(False, "CUFILE_FORCE_COMPAT_MODE is set: cuFile serves every file through POSIX")
    if not cfg.parsed:
        why = cfg.error or f"{cfg.path} not found"
        return CompatFallback(False, f"no readable cufile.json ({why}): cuFile's default allow_compat_mode is true")
    allow = cfg.settings.get("properties.allow_compat_mode", True)  # absent: cuFile's default, true
    force = cfg.settings.get("properties.force_compat_mode", False)
    if force is True:
        return CompatFallback(False, f"{cfg.path} sets properties.force_compat_mode true: cuFile serves every file through POSIX")
    if allow is False:
        return CompatFallback(True, f"{cfg.path} sets properties.allow_compat_mode false")
    return CompatFallback(False, f"{cfg.path} leaves properties.allow_compat_mode true: cuFile may serve a file through POSIX unannounced")


def compat_fallback(*, disable: bool, lib: Any = None, env: Mapping[str, str] | None = None) -> CompatFallback:
    """Turn cuFile's compat fallback off (``disable``), or say what it will be.

    ``disable=True`` (a strict ``gds`` engine): stage ``allow_compat_mode=false`` and
    ``force_compat_mode=false``; when the driver is already open, read the values it runs
    with. Without the parameter API (cuFile before 1.14), only ``cufile.json`` can say.

    ``disable=False`` (``auto`` resolved to ``gds``): change nothing; what ``cufile.json``
    (and ``CUFILE_FORCE_COMPAT_MODE``) will make of it when the driver opens. A driver
    opened earlier in the process with other settings is not seen.

    Args:
        lib: the cuFile library (``None``: :func:`load_libcufile`).
        env: environment (``None``: ``os.environ``).
    """
    env = os.environ if env is None else env
    if not disable:
        # Observing only: staging any value (even to probe whether the driver is open) would
        # override cufile.json, so what cufile.json says is the answer.
        return _from_config(env)
    lib = lib if lib is not None else load_libcufile()
    if lib is None:
        return CompatFallback(False, "libcufile.so.0 does not load, so cuFile's compat fallback cannot be turned off")
    api = _bool_api(lib)
    if api is None:
        found = _from_config(env)
        if found.off:
            return found
        return CompatFallback(False, f"this cuFile has no cuFileSetParameterBool (cuFile 1.14, CUDA 12.9, added it), and {found.detail}")
    setter, getter = api
    err = setter(PARAM_ALLOW_COMPAT_MODE, False).err
    if err == CU_FILE_SUCCESS:
        err = setter(PARAM_FORCE_COMPAT_MODE, False).err
        if err != CU_FILE_SUCCESS:
            return CompatFallback(False, f"cuFileSetParameterBool(force_compat_mode, false) failed (cuFile error {err})")
        return CompatFallback(True, "allow_compat_mode and force_compat_mode staged false before the cuFile driver opened")
    if err != CU_FILE_DRIVER_ALREADY_OPEN:
        return CompatFallback(False, f"cuFileSetParameterBool(allow_compat_mode, false) failed (cuFile error {err})")
    return _running(getter, "the cuFile driver was already open in this process")


def _running(getter: Any, where: str) -> CompatFallback:
    allow, force = ctypes.c_bool(True), ctypes.c_bool(False)
    e1 = getter(PARAM_ALLOW_COMPAT_MODE, ctypes.byref(allow)).err
    e2 = getter(PARAM_FORCE_COMPAT_MODE, ctypes.byref(force)).err
    if e1 != CU_FILE_SUCCESS or e2 != CU_FILE_SUCCESS:
        return CompatFallback(False, f"{where}, and cuFileGetParameterBool failed (cuFile errors {e1}, {e2})")
    if force.value:
        return CompatFallback(False, f"{where} with force_compat_mode true: every file goes through POSIX")
    if allow.value:
        return CompatFallback(
            False, f"{where} with allow_compat_mode true (something opened it before this engine): cuFile may serve a file through POSIX unannounced"
        )
    return CompatFallback(True, f"{where} with allow_compat_mode false")
