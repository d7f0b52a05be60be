"""KvikIO and the cuFile driver, asked in a child process.

KvikIO is never imported by ``gds-check`` itself: ``cuFileDriverOpen`` can hang on a
node without a working NVIDIA driver and a broken install can crash the importing
process, so :func:`probe_kvikio` runs a short script in a child interpreter, kills it
after a timeout and quotes its stderr and ``cufile.log`` when it fails.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from gds_offload.node.reader import env_map

__all__ = ["KvikioProbe", "probe_kvikio"]

_CHILD_MARK = "GDS_CHECK_JSON "


@dataclass(frozen=True)
class KvikioProbe:
    """What KvikIO says about itself and cuFile, asked in a child process.

    Attributes:
        importable: ``import kvikio`` succeeded in the child.
        version: ``kvikio.__version__``.
        compat_mode: ``kvikio.defaults.get("compat_mode")`` (``AUTO``, ``ON``, ``OFF``).
        compat_preferred: ``kvikio.defaults.is_compat_mode_preferred()``.
        libcufile_version: ``kvikio.cufile_driver.libcufile_version()``, e.g. ``"1.14"``.
        driver_ran: whether the cuFile driver stage ran (``probe_driver=True``).
        driver_ok: the driver stage finished (no timeout, no crash).
        gds_available: ``kvikio.cufile_driver.properties.is_gds_available``.
        properties: the other readable ``kvikio.cufile_driver`` properties.
        timed_out: the child was killed after ``timeout_s``.
        error: what went wrong, with the child's stderr or cuFile log tail.
    """

    importable: bool
    version: str = ""
    compat_mode: str = ""
    compat_preferred: bool | None = None
    libcufile_version: str = ""
    driver_ran: bool = False
    driver_ok: bool = False
    gds_available: bool | None = None
    properties: Mapping[str, object] = field(default_factory=dict)
    timed_out: bool = False
    error: str = ""


_KVIKIO_CHILD = r"""
import json, sys
MARK = sys.argv[1]
driver = sys.argv[2] == "1"
out = {"stage": "import"}
def emit():
    sys.stdout.write("\n" + MARK + json.dumps(out, default=str) + "\n")
    sys.stdout.flush()
try:
    import kvikio, kvikio.defaults
except BaseException as exc:
    out["error"] = "import kvikio failed: %s: %s" % (type(exc).__name__, exc)
    emit()
    raise SystemExit(0)
out["importable"] = True
out["version"] = str(getattr(kvikio, "__version__", ""))
try:
    mode = kvikio.defaults.get("compat_mode")
    out["compat_mode"] = getattr(mode, "name", str(mode))
    out["compat_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
except BaseException as exc:
    out["error"] = "kvikio.defaults failed: %s: %s" % (type(exc).__name__, exc)
try:
    import kvikio.cufile_driver as drv
    major, minor = drv.libcufile_version()
    if major or minor:
        out["libcufile_version"] = "%d.%d" % (major, minor)
except BaseException as exc:
    out["error"] = "kvikio.cufile_driver unavailable: %s: %s" % (type(exc).__name__, exc)
    drv = None
out["stage"] = "driver"
emit()
if driver and drv is not None:
    props = {}
    errors = {}
    for name in ("is_gds_available", "major_version", "minor_version", "allow_compat_mode",
                 "poll_mode", "poll_thresh_size", "max_device_cache_size",
                 "per_buffer_cache_size", "max_pinned_memory_size"):
        try:
            props[name] = drv.get(name)
        except BaseException as exc:
            errors[name] = "%s: %s" % (type(exc).__name__, exc)
    out["properties"] = props
    out["property_errors"] = errors
    out["driver_ok"] = True
out["stage"] = "done"
emit()
"""


def probe_kvikio(
    *, env: Mapping[str, str] | None = None, probe_driver: bool = True, timeout_s: float = 10.0
) -> KvikioProbe:
    """Ask KvikIO, in a child process, whether it imports and what it would do.

    The child imports kvikio, reads ``compat_mode`` and ``is_compat_mode_preferred()``
    and, when ``probe_driver``, the ``kvikio.cufile_driver`` properties (which open
    the cuFile driver). It runs with its own temporary working directory so that
    cuFile's ``cufile.log`` lands there; its tail is quoted on failure.

    Args:
        env: environment for the child; ``os.environ`` when None.
        probe_driver: also open the cuFile driver (can hang without a working driver).
        timeout_s: the child is killed after this many seconds.

    Returns:
        What the child said; ``timed_out``/``error`` when it did not finish.
    """
    child_env = dict(env_map(env))
    workdir = tempfile.mkdtemp(prefix="gds-check-")
    cmd = [sys.executable, "-c", _KVIKIO_CHILD, _CHILD_MARK, "1" if probe_driver else "0"]
    timed_out = False
    try:
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=child_env, cwd=workdir, stdin=subprocess.DEVNULL)
    except OSError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        return KvikioProbe(False, error=f"could not start {sys.executable}: {exc}")
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        timed_out = True
        child.kill()
        try:
            stdout, stderr = child.communicate(timeout=2.0)
        except subprocess.TimeoutExpired:  # stuck in the kernel: leave it, keep what it said
            stdout, stderr = _decode(exc.stdout), _decode(exc.stderr)
    code = None if timed_out else child.returncode
    log_tail = _tail(Path(workdir) / "cufile.log")
    shutil.rmtree(workdir, ignore_errors=True)
    answer = _last_marked_json(stdout)
    error = str(answer.get("error", ""))
    if timed_out:
        error = (f"the KvikIO child did not finish within {timeout_s:g} s at stage "
                 f"'{answer.get('stage', 'start')}' (cuFileDriverOpen can hang without a working NVIDIA driver)")
    elif code not in (0, None) and answer.get("stage") != "done":
        error = f"the KvikIO child exited with {code} at stage '{answer.get('stage', 'start')}'"
    if error and (stderr.strip() or log_tail):
        error += "; " + " | ".join(x for x in (_last_lines(stderr), log_tail) if x)
    props = answer.get("properties") or {}
    return KvikioProbe(
        importable=bool(answer.get("importable")),
        version=str(answer.get("version", "")),
        compat_mode=str(answer.get("compat_mode", "")),
        compat_preferred=answer.get("compat_preferred"),
        libcufile_version=str(answer.get("libcufile_version", "")),
        driver_ran=probe_driver,
        driver_ok=bool(answer.get("driver_ok")) and not timed_out,
        gds_available=props.get("is_gds_available") if "is_gds_available" in props else None,
        properties={k: v for k, v in props.items() if k != "is_gds_available"},
        timed_out=timed_out,
        error=error,
    )


def _decode(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def _last_marked_json(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith(_CHILD_MARK):
            try:
                value = json.loads(line[len(_CHILD_MARK):])
            except ValueError:
                continue
            return value if isinstance(value, dict) else {}
    return {}


def _last_lines(text: str, count: int = 2) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-count:])


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return ("cufile.log: " + _last_lines(text)) if text.strip() else ""
