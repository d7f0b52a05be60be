"""Node probes for GPUDirect Storage: one truth about the node, shared by ``gds-check`` and ``mode="auto"``.

Every probe is a function over a *root* directory (``/`` on a real node; a fake tree in
tests) and never raises: a probe that cannot look returns a result that says why.
Nothing here imports torch or KvikIO at module import time. torch is imported inside
:func:`probe_gpus`; KvikIO is imported only in a child process (:func:`probe_kvikio`),
because ``cuFileDriverOpen`` can hang on a node without a working NVIDIA driver and a
broken install can crash the importing process.

The decision is :func:`node_verdict` (one path) or :func:`collect_node` plus
:func:`decide` (several paths, as the CLI does):

* ``gds``: the direct GPU<->NVMe path will be used;
* ``compat``: offloading works, through a bounce buffer or on CPU; the reason names
  the first missing piece;
* ``unusable``: the offloader cannot work at this path.

Boundary functions that need hardware (GPU list, libcufile search, the KvikIO child,
free space) are fields of :class:`Probes`; tests replace them and hand fake
``/proc``, ``/sys``, ``/etc``, ``/dev`` and ``/run`` trees through ``root``.
"""
from __future__ import annotations

import errno
import glob
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal, Mapping, Sequence

from gds_offload.store import default_spill_dir  # one definition, shared with attach()

__all__ = [
    "Status",
    "Mode",
    "CheckResult",
    "Verdict",
    "GpuInfo",
    "GpuProbe",
    "LibcufileProbe",
    "KvikioProbe",
    "NvidiaFsProbe",
    "CufileConfig",
    "ContainerProbe",
    "MountEntry",
    "BlockDevice",
    "PathProbe",
    "GpuTopology",
    "Affinity",
    "NodeReport",
    "Probes",
    "DEFAULT_PROBES",
    "GDS_LOCAL_FSTYPES",
    "GDS_DISTRIBUTED_FSTYPES",
    "MIN_FREE_BYTES",
    "default_spill_dir",
    "probe_gpus",
    "probe_libcufile",
    "probe_kvikio",
    "probe_nvidia_fs",
    "read_cufile_config",
    "strip_json_comments",
    "probe_container",
    "read_mounts",
    "find_mount",
    "probe_block_device",
    "probe_o_direct",
    "probe_path",
    "gpu_topology",
    "pcie_affinity",
    "collect_node",
    "decide",
    "report_checks",
    "worst_verdict",
    "node_verdict",
]

Status = Literal["ok", "warn", "fail", "skip"]
Mode = Literal["gds", "compat", "unusable"]

#: Local filesystems GDS drives directly when they sit on NVMe / NVMe-oF (ext4 in
#: ``data=ordered`` mode only).
GDS_LOCAL_FSTYPES = frozenset({"ext4", "xfs"})
#: Distributed filesystems with GDS support from their vendors (DDN EXAScaler is
#: Lustre, IBM Storage Scale is gpfs). NFS counts only when mounted with ``proto=rdma``.
GDS_DISTRIBUTED_FSTYPES = frozenset({"lustre", "gpfs", "wekafs", "beegfs"})
#: Below this many free bytes a spill directory is unusable (not one slot fits).
MIN_FREE_BYTES = 1 << 20
#: Below this many free bytes the free-space check warns.
LOW_FREE_BYTES = 1 << 30

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_CHILD_MARK = "GDS_CHECK_JSON "


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckResult:
    """One line of the node report.

    Attributes:
        name: stable identifier of the check (``gpu``, ``nvidia-fs``, ``filesystem``...).
        status: ``ok``, ``warn`` (works, but not the fast path or not advisable),
            ``fail`` (the offloader cannot work) or ``skip`` (could not look).
        detail: what was found, with the file or call it came from.
        hint: what to change, empty when nothing needs changing.
    """

    name: str
    status: Status
    detail: str
    hint: str = ""


@dataclass(frozen=True)
class Verdict:
    """What the offloader will do at a path, and why.

    Attributes:
        mode: ``gds`` (direct path), ``compat`` (bounce buffer or CPU) or ``unusable``.
        reason: one line; for ``compat``/``unusable`` it names the first missing piece.
        fix: one line saying what to change (or that nothing needs changing).
        checks: every check that led here, in report order.
    """

    mode: Mode
    reason: str
    fix: str
    checks: tuple[CheckResult, ...]


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as torch sees it.

    Attributes:
        index: CUDA device index (after ``CUDA_VISIBLE_DEVICES``).
        name: model, e.g. ``NVIDIA H200``.
        total_memory_bytes: device memory.
        pci_bus_id: ``dddd:bb:dd.f`` in lower case, ``""`` when torch does not say.
        compute_capability: ``"9.0"``, ``""`` when unknown.
    """

    index: int
    name: str
    total_memory_bytes: int
    pci_bus_id: str = ""
    compute_capability: str = ""


@dataclass(frozen=True)
class GpuProbe:
    """The GPUs and CUDA versions visible to this process.

    Attributes:
        gpus: the devices; empty when ``torch.cuda.is_available()`` is false.
        torch_version: ``torch.__version__``, ``""`` when torch is missing.
        cuda_runtime: ``torch.version.cuda`` (``""`` for a CPU-only torch build).
        cuda_driver: ``cuDriverGetVersion`` of ``libcuda.so.1``, e.g. ``"12.8"``.
        kernel_driver: NVIDIA kernel module version from ``/proc/driver/nvidia/version``.
        error: why no GPU was found, when that has a reason beyond "none present".
    """

    gpus: tuple[GpuInfo, ...] = ()
    torch_version: str = ""
    cuda_runtime: str = ""
    cuda_driver: str = ""
    kernel_driver: str = ""
    error: str = ""

    @property
    def available(self) -> bool:
        """Whether at least one CUDA GPU is usable."""
        return bool(self.gpus)


@dataclass(frozen=True)
class LibcufileProbe:
    """Where libcufile (the cuFile user-space library) was found.

    Attributes:
        found: a ``libcufile.so*`` exists where the dynamic loader or KvikIO looks.
        path: the file.
        version: library version when known (wheel metadata or file name).
        source: ``wheel nvidia-cufile-cu12``, ``ldconfig``, ``CUDA toolkit`` or ``LD_LIBRARY_PATH``.
        searched: where it looked, for the message when nothing was found.
    """

    found: bool
    path: str = ""
    version: str = ""
    source: str = ""
    searched: tuple[str, ...] = ()


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


@dataclass(frozen=True)
class NvidiaFsProbe:
    """The nvidia-fs kernel driver, from ``/proc`` and ``/sys``.

    Attributes:
        loaded: ``/proc/driver/nvidia-fs`` or ``/sys/module/nvidia_fs`` exists.
        version: from ``/proc/driver/nvidia-fs/version`` or ``/sys/module/nvidia_fs/version``.
        evidence: the paths that proved it loaded (or were looked at).
        devices: ``/dev/nvidia-fs*`` nodes.
        stats_readable: ``/proc/driver/nvidia-fs/stats`` could be read; None when absent.
    """

    loaded: bool
    version: str = ""
    evidence: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    stats_readable: bool | None = None


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


@dataclass(frozen=True)
class ContainerProbe:
    """Container facts that decide whether cuFile can see the NVMe drives.

    Attributes:
        in_container: a container runtime marker was found.
        evidence: which marker (``/.dockerenv``, ``/run/.containerenv``, ``/proc/1/cgroup``).
        udev_readable: ``/run/udev`` exists and is readable (KvikIO and cuFile need it).
        wsl: running under Windows Subsystem for Linux (no GDS there).
    """

    in_container: bool
    evidence: str = ""
    udev_readable: bool = False
    wsl: bool = False


@dataclass(frozen=True)
class MountEntry:
    """One line of ``/proc/mounts``."""

    source: str
    mountpoint: str
    fstype: str
    options: tuple[str, ...]


@dataclass(frozen=True)
class BlockDevice:
    """The block device behind a filesystem, resolved through sysfs.

    Attributes:
        dev: ``MAJ:MIN`` of ``st_dev``.
        disk: the whole-disk name (``nvme0n1`` for ``nvme0n1p2``; ``md0`` for RAID).
        members: for md/dm devices, the disks underneath.
        nvme: the disk, or every member, is an NVMe namespace.
        pci_address: the PCI function of the (first) controller, ``""`` if none.
        pci_path: host bridge then PCI functions from the root port down to the controller.
        numa_node: the controller's NUMA node, None when unknown or ``-1``.
        error: why it could not be resolved.
    """

    dev: str
    disk: str = ""
    members: tuple[str, ...] = ()
    nvme: bool = False
    pci_address: str = ""
    pci_path: tuple[str, ...] = ()
    numa_node: int | None = None
    error: str = ""


@dataclass(frozen=True)
class PathProbe:
    """Everything about one spill directory.

    Attributes:
        path: the directory as given (absolute).
        exists: it exists (possibly because this probe created it).
        created: this probe created it (mode 0700).
        is_dir: it is a directory.
        writable: a file could be created and removed in it.
        read_only_mount: its mount has the ``ro`` option.
        free_bytes: bytes available to unprivileged users, None when unknown.
        total_bytes: filesystem size, None when unknown.
        fstype: from the longest matching ``/proc/mounts`` entry.
        mountpoint: that entry's mount point.
        mount_source: that entry's source (``/dev/nvme0n1p1``).
        mount_options: that entry's options.
        o_direct: whether an aligned O_DIRECT write worked; None when not tested.
        o_direct_detail: how it was tested, or the error.
        device: the block device behind it, None for virtual filesystems.
        error: the first error met (creation, stat...).
    """

    path: str
    exists: bool = False
    created: bool = False
    is_dir: bool = False
    writable: bool = False
    read_only_mount: bool = False
    free_bytes: int | None = None
    total_bytes: int | None = None
    fstype: str = ""
    mountpoint: str = ""
    mount_source: str = ""
    mount_options: tuple[str, ...] = ()
    o_direct: bool | None = None
    o_direct_detail: str = ""
    device: BlockDevice | None = None
    error: str = ""


@dataclass(frozen=True)
class GpuTopology:
    """Where a GPU sits on the PCIe tree.

    Attributes:
        index: CUDA device index.
        pci_path: host bridge then PCI functions down to the GPU (empty when unknown).
        numa_node: the GPU's NUMA node, None when unknown.
    """

    index: int
    pci_path: tuple[str, ...] = ()
    numa_node: int | None = None


@dataclass(frozen=True)
class Affinity:
    """How close a GPU is to the drive behind a spill directory.

    ``link`` uses ``nvidia-smi topo -m`` words: ``PIX`` (one PCIe switch between them),
    ``PXB`` (several switches, no host bridge), ``PHB`` (through the CPU's host
    bridge), ``NODE`` (different host bridges, same NUMA node), ``SYS`` (across NUMA
    nodes: cuFile bounces such transfers), ``unknown`` (sysfs did not say).

    Attributes:
        gpu_index: CUDA device index.
        path: the spill directory.
        disk: the drive behind it.
        link: see above.
        hops: PCIe hops between them (None when unknown).
        gpu_numa: the GPU's NUMA node.
        drive_numa: the drive controller's NUMA node.
    """

    gpu_index: int
    path: str
    disk: str
    link: Literal["PIX", "PXB", "PHB", "NODE", "SYS", "unknown"]
    hops: int | None = None
    gpu_numa: int | None = None
    drive_numa: int | None = None

    @property
    def rank(self) -> tuple[int, int]:
        """Sort key: closer links first, then fewer hops."""
        order = ("PIX", "PXB", "PHB", "NODE", "SYS", "unknown")
        return (order.index(self.link), self.hops if self.hops is not None else 99)


@dataclass(frozen=True)
class NodeReport:
    """All facts about a node and its spill directories; input to :func:`decide`.

    Attributes:
        root: the root the ``/proc``, ``/sys``... trees were read under.
        env: the environment variables that matter (``KVIKIO_*``, ``CUFILE_*``...).
        probe_driver: whether the KvikIO child was asked to open the cuFile driver.
        gpu: GPUs and CUDA versions.
        libcufile: where libcufile is.
        kvikio: KvikIO and cuFile driver, from the child process.
        nvidia_fs: the kernel driver.
        cufile_config: ``cufile.json``.
        container: container markers, ``/run/udev``, WSL.
        paths: one entry per spill directory, in the order given.
        gpu_topology: PCIe position and NUMA node of each GPU.
        affinities: every (GPU, path) pair.
        unreadable: files that existed but could not be read (run as root to read them).
        is_root: whether the probe ran with euid 0.
    """

    root: str
    env: Mapping[str, str]
    probe_driver: bool
    gpu: GpuProbe
    libcufile: LibcufileProbe
    kvikio: KvikioProbe
    nvidia_fs: NvidiaFsProbe
    cufile_config: CufileConfig
    container: ContainerProbe
    paths: tuple[PathProbe, ...]
    gpu_topology: tuple[GpuTopology, ...] = ()
    affinities: tuple[Affinity, ...] = ()
    unreadable: tuple[str, ...] = ()
    is_root: bool = False


# --------------------------------------------------------------------------------------
# Small helpers (never raise)
# --------------------------------------------------------------------------------------
class _Reader:
    """Reads small files under a root and remembers which ones were unreadable."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.unreadable: list[str] = []

    def at(self, absolute: str) -> Path:
        """The path of ``absolute`` (``/proc/...``) under the root."""
        return self.root / absolute.lstrip("/")

    def text(self, absolute: str | Path, limit: int = 65536) -> str | None:
        """File content (first ``limit`` bytes), or None when missing or unreadable."""
        path = absolute if isinstance(absolute, Path) else self.at(absolute)
        try:
            with open(path, "rb") as fh:
                return fh.read(limit).decode("utf-8", "replace")
        except PermissionError:
            self.unreadable.append(str(path))
            return None
        except OSError:
            return None


def _env_map(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _int_or_none(text: str | None) -> int | None:
    try:
        value = int((text or "").strip())
    except ValueError:
        return None
    return value if value >= 0 else None


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _flag(value: object) -> bool | None:
    """A cufile.json / environment truth value as bool, None when not one."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    return None


# --------------------------------------------------------------------------------------
# Probes
# --------------------------------------------------------------------------------------
def _cuda_driver_version() -> str:
    """``cuDriverGetVersion`` of libcuda.so.1 as ``"12.8"``; ``""`` when unavailable."""
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
            return ""
        major, rest = divmod(version.value, 1000)
        return f"{major}.{rest // 10}"
    except Exception:  # noqa: BLE001 - a probe never raises
        return ""


def probe_gpus(root: Path = Path("/")) -> GpuProbe:
    """List CUDA GPUs through torch, plus driver and runtime versions.

    No GPU is a normal answer (``GpuProbe.gpus == ()``), never an exception.

    Args:
        root: root of the ``/proc`` tree (for the NVIDIA kernel module version).

    Returns:
        The GPUs and versions; ``error`` says why none were found when there is more
        to say than "none present".
    """
    kernel = ""
    text = _Reader(root).text("/proc/driver/nvidia/version")
    if text:
        match = re.search(r"Kernel Module(?: for [^\s]+)?\s+([0-9][0-9.]+)", text)
        kernel = match.group(1) if match else text.splitlines()[0].strip()
    driver = _cuda_driver_version()
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        return GpuProbe(cuda_driver=driver, kernel_driver=kernel,
                        error=f"torch is not importable ({type(exc).__name__}: {exc})")
    runtime = str(getattr(torch.version, "cuda", None) or "")
    base = GpuProbe(torch_version=str(torch.__version__), cuda_runtime=runtime,
                    cuda_driver=driver, kernel_driver=kernel)
    try:
        if not torch.cuda.is_available():
            why = "torch.cuda.is_available() is False"
            if not runtime:
                why += f"; torch {torch.__version__} is a CPU-only build"
            return replace(base, error=why)
        gpus = tuple(_gpu_info(torch, i) for i in range(torch.cuda.device_count()))
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        return replace(base, error=f"CUDA query failed ({type(exc).__name__}: {exc})")
    return replace(base, gpus=gpus)


def _gpu_info(torch_module, index: int) -> GpuInfo:
    props = torch_module.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    dev = getattr(props, "pci_device_id", None)
    dom = getattr(props, "pci_domain_id", None)
    bdf = f"{dom:04x}:{bus:02x}:{dev:02x}.0" if None not in (bus, dev, dom) else ""
    return GpuInfo(
        index=index,
        name=str(props.name),
        total_memory_bytes=int(props.total_memory),
        pci_bus_id=bdf,
        compute_capability=f"{props.major}.{props.minor}",
    )


def probe_libcufile(root: Path = Path("/"), env: Mapping[str, str] | None = None) -> LibcufileProbe:
    """Find libcufile where KvikIO and the dynamic loader look, without loading it.

    Order: the ``nvidia-cufile-cu12``/``-cu13`` wheel under ``sys.path`` (what KvikIO's
    wheels load), ``ldconfig -p``, ``LD_LIBRARY_PATH``, the CUDA toolkit under
    ``<root>/usr/local/cuda*``.

    Args:
        root: root for the CUDA toolkit directories.
        env: environment (for ``LD_LIBRARY_PATH``); ``os.environ`` when None.

    Returns:
        Where it was found, or everywhere it was looked for.
    """
    env = _env_map(env)
    searched: list[str] = []
    for entry in sys.path:
        nvidia_dir = Path(entry) / "nvidia" if entry else None
        if nvidia_dir is None or not nvidia_dir.is_dir():
            continue
        # CUDA 12 wheels: nvidia/cufile/lib; CUDA 13 wheels: nvidia/cu13/lib.
        searched.append(str(nvidia_dir / "*" / "lib"))
        hits = sorted(nvidia_dir.glob("*/lib/libcufile.so*"))
        if hits:
            return LibcufileProbe(True, str(hits[0]), _wheel_version(), "wheel nvidia-cufile", tuple(searched))
    searched.append("ldconfig -p")
    hit = _ldconfig_lookup("libcufile.so")
    if hit:
        return LibcufileProbe(True, hit, _version_from_name(hit), "ldconfig", tuple(searched))
    extra = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    toolkit = sorted(glob.glob(str(root / "usr/local/cuda*/targets/*/lib"))) + sorted(
        glob.glob(str(root / "usr/local/cuda*/lib64")))
    for lib_dir, source in [(d, "LD_LIBRARY_PATH") for d in extra] + [(d, "CUDA toolkit") for d in toolkit]:
        searched.append(lib_dir)
        hits = sorted(Path(lib_dir).glob("libcufile.so*"))
        if hits:
            return LibcufileProbe(True, str(hits[0]), _version_from_name(str(hits[0])), source, tuple(searched))
    return LibcufileProbe(False, searched=tuple(searched))


def _wheel_version() -> str:
    from importlib import metadata

    for dist in ("nvidia-cufile-cu12", "nvidia-cufile-cu13", "nvidia-cufile"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - a probe never raises
            break
    return ""


def _version_from_name(path: str) -> str:
    real = os.path.realpath(path)
    match = re.search(r"\.so\.([0-9][0-9.]*)$", real)
    return match.group(1) if match else ""


def _ldconfig_lookup(soname: str) -> str:
    exe = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in out.splitlines():
        name, _, target = line.strip().partition(" => ")
        if name.startswith(soname) and target:
            return target.strip()
    return ""


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
    child_env = dict(_env_map(env))
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


def probe_nvidia_fs(root: Path = Path("/")) -> NvidiaFsProbe:
    """Whether the nvidia-fs kernel driver is loaded, its version and device nodes.

    Args:
        root: root of the ``/proc``, ``/sys`` and ``/dev`` trees.

    Returns:
        The facts; ``stats_readable`` is False when ``/proc/driver/nvidia-fs/stats``
        exists but needs root.
    """
    probe, _ = _probe_nvidia_fs(_Reader(root))
    return probe


def _probe_nvidia_fs(reader: _Reader) -> tuple[NvidiaFsProbe, _Reader]:
    evidence: list[str] = []
    version = ""
    proc_dir = reader.at("/proc/driver/nvidia-fs")
    sys_dir = reader.at("/sys/module/nvidia_fs")
    if proc_dir.is_dir():
        evidence.append("/proc/driver/nvidia-fs")
        text = reader.text("/proc/driver/nvidia-fs/version")
        if text:
            version = _first_version(text)
    if sys_dir.is_dir():
        evidence.append("/sys/module/nvidia_fs")
        if not version:
            version = _first_version(reader.text("/sys/module/nvidia_fs/version") or "")
    stats_readable: bool | None = None
    if (proc_dir / "stats").exists():
        stats_readable = reader.text("/proc/driver/nvidia-fs/stats", limit=4096) is not None
    devices = tuple(sorted(
        ("/dev/" + p.name for p in reader.at("/dev").glob("nvidia-fs*")),
        key=lambda s: (len(s), s)))
    return NvidiaFsProbe(bool(evidence), version, tuple(evidence), devices, stats_readable), reader


def _first_version(text: str) -> str:
    match = re.search(r"([0-9]+\.[0-9]+(?:\.[0-9]+)*)", text)
    return match.group(1) if match else text.strip().splitlines()[0] if text.strip() else ""


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
    env = _env_map(env)
    configured = env.get("CUFILE_ENV_PATH_JSON", "").strip()
    shown = configured or "/etc/cufile.json"
    reader = _Reader(root)
    path = reader.at(shown) if shown.startswith("/") else Path(shown)
    if not path.exists():
        return CufileConfig(shown, False)
    text = reader.text(path, limit=1 << 20)
    if text is None:
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


_MISSING = object()


def probe_container(root: Path = Path("/")) -> ContainerProbe:
    """Container markers, ``/run/udev`` and WSL.

    Args:
        root: root of the tree to look at.

    Returns:
        The facts.
    """
    reader = _Reader(root)
    evidence = ""
    if reader.at("/.dockerenv").exists():
        evidence = "/.dockerenv"
    elif reader.at("/run/.containerenv").exists():
        evidence = "/run/.containerenv"
    else:
        cgroup = reader.text("/proc/1/cgroup") or ""
        for marker in ("docker", "kubepods", "containerd", "libpod", "lxc"):
            if marker in cgroup:
                evidence = f"/proc/1/cgroup mentions {marker}"
                break
    udev = reader.at("/run/udev")
    udev_readable = udev.is_dir() and os.access(udev, os.R_OK | os.X_OK)
    release = (reader.text("/proc/sys/kernel/osrelease") or "").lower()
    wsl = "microsoft" in release or "wsl" in release
    return ContainerProbe(bool(evidence), evidence, udev_readable, wsl)


def read_mounts(root: Path = Path("/")) -> tuple[MountEntry, ...]:
    """Parse ``<root>/proc/mounts`` (octal escapes such as ``\\040`` decoded).

    Args:
        root: root of the ``/proc`` tree.

    Returns:
        The entries in file order; empty when unreadable.
    """
    text = _Reader(root).text("/proc/mounts", limit=1 << 22) or ""
    entries = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        source, mountpoint, fstype, options = (_unescape(p) for p in parts[:4])
        entries.append(MountEntry(source, mountpoint, fstype, tuple(options.split(","))))
    return tuple(entries)


def _unescape(field_text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def find_mount(path: Path, mounts: Sequence[MountEntry]) -> MountEntry | None:
    """The mount that holds ``path``: longest mount point that is a path prefix.

    Later entries win on ties (a mount stacked over another).

    Args:
        path: an absolute path (resolved by the caller).
        mounts: from :func:`read_mounts`.

    Returns:
        The entry, or None when nothing matches.
    """
    target = Path(os.path.normpath(str(path)))
    best: MountEntry | None = None
    best_len = -1
    for entry in mounts:
        mp = Path(os.path.normpath(entry.mountpoint))
        if target == mp or mp in target.parents:
            depth = len(mp.parts)
            if depth >= best_len:
                best, best_len = entry, depth
    return best


def probe_block_device(st_dev: int, root: Path = Path("/")) -> BlockDevice | None:
    """Resolve ``st_dev`` to a disk through ``<root>/sys/dev/block/MAJ:MIN``.

    Partitions resolve to their disk; md/dm devices to their member disks (through
    ``slaves/``). The PCI path is read from the resolved sysfs path, the NUMA node from
    the controller's ``numa_node``.

    Args:
        st_dev: ``os.stat(path).st_dev``.
        root: root of the ``/sys`` tree.

    Returns:
        The device, or None for a virtual filesystem (major 0: tmpfs, overlay, NFS...).
    """
    major, minor = os.major(st_dev), os.minor(st_dev)
    dev = f"{major}:{minor}"
    if major == 0:
        return None
    link = root / "sys/dev/block" / dev
    if not link.exists():
        return BlockDevice(dev, error=f"/sys/dev/block/{dev} not found")
    disk_dir = _disk_dir(Path(os.path.realpath(link)))
    members = _members(disk_dir, root)
    controllers = [m for m in members] if members else [disk_dir]
    nvme = all(c.name.startswith("nvme") for c in controllers)
    pci_path = _pci_path(controllers[0])
    pci_address = pci_path[-1] if len(pci_path) > 1 else ""
    numa = None
    if pci_address:
        numa = _int_or_none(_Reader(root).text(_pci_dir(controllers[0]) / "numa_node"))
    return BlockDevice(dev, disk_dir.name, tuple(m.name for m in members), nvme,
                       pci_address, pci_path, numa)


def _disk_dir(resolved: Path) -> Path:
    return resolved.parent if (resolved / "partition").exists() else resolved


def _members(disk_dir: Path, root: Path, depth: int = 0) -> list[Path]:
    slaves = disk_dir / "slaves"
    if depth > 4 or not slaves.is_dir():
        return []
    found: list[Path] = []
    for slave in sorted(slaves.iterdir()):
        member = _disk_dir(Path(os.path.realpath(slave)))
        found.extend(_members(member, root, depth + 1) or [member])
    return found


def _pci_path(sysfs_path: Path) -> tuple[str, ...]:
    parts = sysfs_path.parts
    start = next((i for i, p in enumerate(parts) if _HOST_BRIDGE.match(p)), None)
    if start is None:
        return ()
    chain = [parts[start]]
    for part in parts[start + 1:]:
        if _BDF.match(part):
            chain.append(part)
        elif len(chain) > 1:
            break
    return tuple(chain)


def _pci_dir(sysfs_path: Path) -> Path:
    parts = sysfs_path.parts
    last = max((i for i, p in enumerate(parts) if _BDF.match(p)), default=None)
    return Path(*parts[:last + 1]) if last is not None else sysfs_path


def probe_o_direct(directory: Path) -> tuple[bool | None, str]:
    """Whether the filesystem under ``directory`` accepts an aligned O_DIRECT write.

    Tries ``open(dir, O_TMPFILE|O_RDWR|O_DIRECT)`` (leaves nothing behind), then a
    named temporary file reopened with ``O_DIRECT``; writes one 4 KiB page-aligned block.
    ``EINVAL`` from the open or the write means no.

    Args:
        directory: an existing, writable directory.

    Returns:
        ``(True|False, how)``, or ``(None, why)`` when the test itself could not run.
    """
    if not hasattr(os, "O_DIRECT"):
        return None, "this platform has no O_DIRECT"
    flags = os.O_RDWR | os.O_DIRECT
    block = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    try:
        try:
            fd = os.open(directory, os.O_TMPFILE | flags, 0o600)
            how = "O_TMPFILE"
        except OSError:
            return _o_direct_named(directory, flags, block)
        return _o_direct_write(fd, how, block)
    finally:
        block.close()


def _o_direct_named(directory: Path, flags: int, block: mmap.mmap) -> tuple[bool | None, str]:
    try:
        handle, name = tempfile.mkstemp(prefix=".gds-check-", dir=directory)
    except OSError as exc:
        return None, f"could not create a test file: {exc.strerror}"
    os.close(handle)
    try:
        try:
            fd = os.open(name, flags)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False, "open(O_DIRECT) failed with EINVAL"
            return None, f"open(O_DIRECT) failed: {exc.strerror}"
        return _o_direct_write(fd, "named temporary file", block)
    finally:
        try:
            os.unlink(name)
        except OSError:
            pass


def _o_direct_write(fd: int, how: str, block: mmap.mmap) -> tuple[bool | None, str]:
    try:
        os.write(fd, block)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False, f"open(O_DIRECT) worked but a 4 KiB aligned write failed with EINVAL ({how})"
        return None, f"4 KiB O_DIRECT write failed: {exc.strerror} ({how})"
    finally:
        os.close(fd)
    return True, f"4 KiB aligned write accepted ({how})"


def _statvfs_space(path: Path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def probe_path(
    path: Path,
    *,
    root: Path = Path("/"),
    disk_space: Callable[[Path], tuple[int, int]] = _statvfs_space,
    create: bool = True,
) -> PathProbe:
    """Probe a spill directory: existence (creating it 0700), writability, space, mount, O_DIRECT, device.

    Args:
        path: the directory (a real path; only ``/proc`` and ``/sys`` are read under ``root``).
        root: root of the ``/proc`` and ``/sys`` trees.
        disk_space: ``path -> (free_bytes, total_bytes)``; ``statvfs`` by default.
        create: create the directory (and parents) with mode 0700 when missing.

    Returns:
        The facts; ``error`` holds the first problem met.
    """
    path = Path(os.path.abspath(os.path.expanduser(str(path))))
    probe = PathProbe(str(path))
    created = False
    if not os.path.lexists(path):
        if not create:
            return replace(probe, error=f"{path} does not exist")
        try:
            os.makedirs(path, mode=0o700)
            created = True
        except OSError as exc:
            return replace(probe, error=f"{path} does not exist and cannot be created: {exc.strerror or exc}")
    real = Path(os.path.realpath(path))
    mount = find_mount(real, read_mounts(root))
    if mount is not None:
        probe = replace(probe, fstype=mount.fstype, mountpoint=mount.mountpoint,
                        mount_source=mount.source, mount_options=mount.options,
                        read_only_mount="ro" in mount.options)
    probe = replace(probe, exists=True, created=created, is_dir=real.is_dir())
    if not probe.is_dir:
        return replace(probe, error=f"{path} exists but is not a directory")
    try:
        free, total = disk_space(real)
        probe = replace(probe, free_bytes=int(free), total_bytes=int(total))
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        probe = replace(probe, error=f"free space unknown: {exc}")
    writable, why = _try_write(real)
    probe = replace(probe, writable=writable and not probe.read_only_mount)
    if not writable:
        probe = replace(probe, error=probe.error or why)
    if writable:
        o_direct, detail = probe_o_direct(real)
        probe = replace(probe, o_direct=o_direct, o_direct_detail=detail)
    try:
        probe = replace(probe, device=probe_block_device(os.stat(real).st_dev, root))
    except OSError as exc:
        probe = replace(probe, device=BlockDevice("?", error=str(exc)))
    return probe


def _try_write(directory: Path) -> tuple[bool, str]:
    if not os.access(directory, os.W_OK | os.X_OK):
        return False, f"{directory} is not writable by uid {os.geteuid()}"
    try:
        handle, name = tempfile.mkstemp(prefix=".gds-check-", dir=directory)
    except OSError as exc:
        return False, f"cannot create a file in {directory}: {exc.strerror or exc}"
    os.close(handle)
    try:
        os.unlink(name)
    except OSError:
        pass
    return True, ""


def gpu_topology(gpu: GpuInfo, root: Path = Path("/")) -> GpuTopology:
    """PCIe path and NUMA node of a GPU from ``<root>/sys/bus/pci/devices/<bdf>``.

    Args:
        gpu: the GPU (its ``pci_bus_id`` is needed).
        root: root of the ``/sys`` tree.

    Returns:
        The topology; empty fields when sysfs does not know the device.
    """
    if not gpu.pci_bus_id:
        return GpuTopology(gpu.index)
    link = root / "sys/bus/pci/devices" / gpu.pci_bus_id.lower()
    if not link.exists():
        return GpuTopology(gpu.index)
    real = Path(os.path.realpath(link))
    return GpuTopology(gpu.index, _pci_path(real), _int_or_none(_Reader(root).text(real / "numa_node")))


def pcie_affinity(gpu: GpuTopology, path: PathProbe) -> Affinity:
    """Classify the link between a GPU and the drive behind a spill directory.

    Args:
        gpu: from :func:`gpu_topology`.
        path: from :func:`probe_path`.

    Returns:
        The :class:`Affinity` (``link="unknown"`` when either side has no PCI path).
    """
    device = path.device
    disk = device.disk if device else ""
    drive_numa = device.numa_node if device else None
    if device is None or not device.pci_path or not gpu.pci_path:
        link = "unknown"
        if gpu.numa_node is not None and drive_numa is not None:
            link = "NODE" if gpu.numa_node == drive_numa else "SYS"
        return Affinity(gpu.index, path.path, disk, link, None, gpu.numa_node, drive_numa)
    a, b = gpu.pci_path, device.pci_path
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    # Links walked from one device up to the nearest common bridge and down again; with no
    # common host bridge, up to each root plus one link between the CPUs' host bridges.
    hops = (len(a) - common) + (len(b) - common) if common else len(a) + len(b) - 1
    if common == 0:
        same = gpu.numa_node is None or drive_numa is None or gpu.numa_node == drive_numa
        link = "NODE" if same else "SYS"
    elif common == 1:
        link = "PHB"
    elif len(a) - common <= 2 and len(b) - common <= 2:
        link = "PIX"  # they part below one switch: its downstream port, then the device
    else:
        link = "PXB"
    return Affinity(gpu.index, path.path, disk, link, hops, gpu.numa_node, drive_numa)


# --------------------------------------------------------------------------------------
# Collecting
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Probes:
    """The boundary functions :func:`collect_node` calls; tests replace any of them.

    Attributes:
        gpus: ``root -> GpuProbe`` (default :func:`probe_gpus`, imports torch).
        libcufile: ``(root, env) -> LibcufileProbe`` (default :func:`probe_libcufile`).
        kvikio: ``(env, probe_driver, timeout_s) -> KvikioProbe`` (default
            :func:`probe_kvikio`, a child process).
        disk_space: ``path -> (free_bytes, total_bytes)`` (default ``os.statvfs``).
    """

    gpus: Callable[[Path], GpuProbe] = probe_gpus
    libcufile: Callable[[Path, Mapping[str, str]], LibcufileProbe] = probe_libcufile
    kvikio: Callable[[Mapping[str, str], bool, float], KvikioProbe] = (
        lambda env, probe_driver, timeout_s: probe_kvikio(env=env, probe_driver=probe_driver, timeout_s=timeout_s))
    disk_space: Callable[[Path], tuple[int, int]] = _statvfs_space


DEFAULT_PROBES = Probes()

#: Environment variables that change what KvikIO/cuFile do (reported, and some decide).
RELEVANT_ENV = (
    "KVIKIO_COMPAT_MODE",
    "KVIKIO_NTHREADS",
    "KVIKIO_TASK_SIZE",
    "KVIKIO_GDS_THRESHOLD",
    "CUFILE_ENV_PATH_JSON",
    "CUFILE_FORCE_COMPAT_MODE",
    "CUFILE_ALLOW_COMPAT_MODE",
    "CUFILE_USE_PCIP2PDMA",
    "CUFILE_LOGGING_LEVEL",
    "CUDA_VISIBLE_DEVICES",
    "GDS_OFFLOAD_DIR",
)


def collect_node(
    paths: Sequence[Path],
    *,
    root: Path = Path("/"),
    env: Mapping[str, str] | None = None,
    probe_driver: bool = True,
    timeout_s: float = 10.0,
    probes: Probes = DEFAULT_PROBES,
) -> NodeReport:
    """Run every probe once for the node and each spill directory.

    Args:
        paths: spill directories (created 0700 when missing).
        root: root of the ``/proc``, ``/sys``, ``/etc``, ``/dev``, ``/run`` trees.
        env: environment; ``os.environ`` when None.
        probe_driver: let the KvikIO child open the cuFile driver.
        timeout_s: limit for the KvikIO child.
        probes: boundary functions (replace them in tests).

    Returns:
        The facts, ready for :func:`decide`.
    """
    env = _env_map(env)
    root = Path(root)
    reader = _Reader(root)
    gpu = _guard(lambda: probes.gpus(root), lambda e: GpuProbe(error=f"GPU probe failed: {e}"))
    libcufile = _guard(lambda: probes.libcufile(root, env), lambda e: LibcufileProbe(False, searched=(f"error: {e}",)))
    kvikio = _guard(lambda: probes.kvikio(env, probe_driver, timeout_s),
                    lambda e: KvikioProbe(False, error=f"KvikIO probe failed: {e}"))
    nvidia_fs, _ = _guard(lambda: _probe_nvidia_fs(reader), lambda e: (NvidiaFsProbe(False), reader))
    config = _guard(lambda: read_cufile_config(root, env),
                    lambda e: CufileConfig("/etc/cufile.json", False, error=str(e)))
    container = _guard(lambda: probe_container(root), lambda e: ContainerProbe(False, f"probe failed: {e}"))
    path_probes = tuple(
        _guard(lambda p=p: probe_path(Path(p), root=root, disk_space=probes.disk_space),
               lambda e, p=p: PathProbe(str(p), error=f"path probe failed: {e}"))
        for p in paths)
    topology = tuple(gpu_topology(g, root) for g in gpu.gpus)
    affinities = tuple(pcie_affinity(t, p) for t in topology for p in path_probes if p.exists)
    return NodeReport(
        root=str(root),
        env={k: env[k] for k in RELEVANT_ENV if k in env},
        probe_driver=probe_driver,
        gpu=gpu,
        libcufile=libcufile,
        kvikio=kvikio,
        nvidia_fs=nvidia_fs,
        cufile_config=config,
        container=container,
        paths=path_probes,
        gpu_topology=topology,
        affinities=affinities,
        unreadable=tuple(dict.fromkeys(reader.unreadable)),
        is_root=os.geteuid() == 0,
    )


def _guard(call, fallback):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        return fallback(f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------------------
# Deciding
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Finding:
    """A check plus, when it blocks something, the verdict line it forces."""

    check: CheckResult
    blocks: Literal["", "gds", "usable"] = ""
    reason: str = ""
    fix: str = ""


_COMPAT_STILL_WORKS = "offloading still works through the compat path"


def _node_findings(report: NodeReport) -> list[_Finding]:
    """Findings that do not depend on the spill directory, in blocking order."""
    found: list[_Finding] = []
    found.append(_gpu_finding(report))
    found.append(_nvidia_driver_finding(report))
    found.append(_libcufile_finding(report))
    found.append(_kvikio_finding(report))
    found.extend(_env_findings(report))
    found.append(_wsl_finding(report))
    found.extend(_nvidia_fs_findings(report))
    found.append(_udev_finding(report))
    found.append(_container_finding(report))
    found.extend(_cufile_json_findings(report))
    return found


def _gpu_finding(report: NodeReport) -> _Finding:
    gpu = report.gpu
    versions = f"CUDA runtime {gpu.cuda_runtime or 'none'}, driver {gpu.cuda_driver or 'unknown'}"
    if gpu.available:
        names = "; ".join(f"GPU{g.index} {g.name} {_fmt_bytes(g.total_memory_bytes)}"
                          + (f" @ {g.pci_bus_id}" if g.pci_bus_id else "") for g in gpu.gpus)
        return _Finding(CheckResult("gpu", "ok", f"{names} (torch {gpu.torch_version}, {versions})"))
    visible = report.env.get("CUDA_VISIBLE_DEVICES")
    detail = f"no CUDA GPU ({gpu.error or 'none found'}); {versions}"
    hint = "run on a node with an NVIDIA GPU and a CUDA build of torch"
    if report.container.in_container:
        hint = "start the container with --gpus all (NVIDIA Container Toolkit) and a CUDA build of torch"
    if visible is not None and visible.strip() in ("", "-1", "none"):
        hint = f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU; unset it"
    return _Finding(CheckResult("gpu", "warn", detail, hint), "gds",
                    f"no GPU ({gpu.error or 'torch.cuda.is_available() is False'})",
                    f"{_COMPAT_STILL_WORKS} (activations stay on CPU); for GDS {hint}")


def _nvidia_driver_finding(report: NodeReport) -> _Finding:
    gpu = report.gpu
    if gpu.kernel_driver:
        return _Finding(CheckResult("nvidia-driver", "ok",
                                    f"NVIDIA kernel module {gpu.kernel_driver} (/proc/driver/nvidia/version)"))
    status: Status = "warn" if gpu.available else "skip"
    return _Finding(CheckResult("nvidia-driver", status,
                                "/proc/driver/nvidia/version not found: NVIDIA kernel module not loaded",
                                "install the NVIDIA driver (nvidia-smi must work)"))


def _libcufile_finding(report: NodeReport) -> _Finding:
    lib = report.libcufile
    if lib.found:
        version = report.kvikio.libcufile_version or lib.version or "version unknown"
        return _Finding(CheckResult("libcufile", "ok", f"{lib.path} ({lib.source}, {version})"))
    where = ", ".join(lib.searched[-4:]) if lib.searched else "nowhere"
    fix = "pip install nvidia-cufile-cu12 (comes with kvikio-cu12), or install libcufile from the CUDA toolkit"
    return _Finding(CheckResult("libcufile", "warn", f"libcufile.so not found (searched {where})", fix),
                    "gds", "libcufile not found (cuFile user-space library missing)", fix)


def _kvikio_finding(report: NodeReport) -> _Finding:
    kv = report.kvikio
    if kv.importable:
        detail = f"kvikio {kv.version}; compat_mode={kv.compat_mode or '?'}"
        if kv.compat_preferred is not None:
            detail += f", is_compat_mode_preferred()={kv.compat_preferred}"
        return _Finding(CheckResult("kvikio", "ok", detail))
    fix = "pip install 'gds_offload[cu12]' (kvikio-cu12, cupy-cuda12x)"
    detail = kv.error or "import kvikio failed"
    return _Finding(CheckResult("kvikio", "warn", detail, fix), "gds", f"KvikIO not importable ({detail})", fix)


def _env_findings(report: NodeReport) -> list[_Finding]:
    env = report.env
    found = []
    compat = env.get("KVIKIO_COMPAT_MODE", "").strip().lower()
    if compat in _TRUE:
        fix = "unset KVIKIO_COMPAT_MODE (or set it to AUTO)"
        found.append(_Finding(CheckResult("env", "warn", f"KVIKIO_COMPAT_MODE={env['KVIKIO_COMPAT_MODE']} forces POSIX I/O", fix),
                              "gds", f"KVIKIO_COMPAT_MODE={env['KVIKIO_COMPAT_MODE']} forces compat mode", fix))
    if _flag(env.get("CUFILE_FORCE_COMPAT_MODE", "")) is True:
        fix = "unset CUFILE_FORCE_COMPAT_MODE"
        found.append(_Finding(CheckResult("env", "warn", "CUFILE_FORCE_COMPAT_MODE=true makes cuFile bounce every I/O", fix),
                              "gds", "CUFILE_FORCE_COMPAT_MODE=true forces cuFile's compat mode", fix))
    if not found:
        shown = ", ".join(f"{k}={v}" for k, v in env.items() if k.startswith(("KVIKIO_", "CUFILE_"))) or "none set"
        found.append(_Finding(CheckResult("env", "ok", f"KvikIO/cuFile overrides: {shown}")))
    return found


def _wsl_finding(report: NodeReport) -> _Finding:
    if not report.container.wsl:
        return _Finding(CheckResult("wsl", "ok", "not Windows Subsystem for Linux"))
    fix = "run on native Linux; WSL has no GPUDirect Storage"
    return _Finding(CheckResult("wsl", "warn", "running under WSL (/proc/sys/kernel/osrelease)", fix),
                    "gds", "WSL does not support GPUDirect Storage", fix)


def _p2pdma_enabled(report: NodeReport) -> bool:
    settings = report.cufile_config.settings
    env_value = _flag(report.env.get("CUFILE_USE_PCIP2PDMA", ""))
    return bool(env_value or _flag(settings.get("properties.use_pci_p2pdma", False))
                or _flag(settings.get("block.nvme.use_pci_p2pdma", False)))


def _nvidia_fs_findings(report: NodeReport) -> list[_Finding]:
    nfs = report.nvidia_fs
    kv = report.kvikio
    found: list[_Finding] = []
    p2p_confirmed = _p2pdma_enabled(report) and kv.driver_ok and kv.gds_available is True
    if nfs.loaded:
        detail = f"loaded ({', '.join(nfs.evidence)}{', version ' + nfs.version if nfs.version else ''})"
        status: Status = "ok"
        hint = ""
        if nfs.stats_readable is False:
            detail += "; /proc/driver/nvidia-fs/stats unreadable without root"
            hint = "run gds-check as root to read nvidia-fs stats"
        found.append(_Finding(CheckResult("nvidia-fs", status, detail, hint)))
    elif p2p_confirmed:
        found.append(_Finding(CheckResult(
            "nvidia-fs", "ok", "not loaded; cufile.json enables PCI P2PDMA and cuFile reports GDS available")))
    else:
        fix = "load the GDS kernel driver: modprobe nvidia-fs (package nvidia-fs / nvidia-gds)"
        if report.container.in_container:
            fix = "load nvidia-fs on the host (modprobe nvidia-fs); containers share the host kernel"
        if _p2pdma_enabled(report):
            fix += "; P2PDMA is enabled in cufile.json but the driver probe did not confirm it"
        found.append(_Finding(
            CheckResult("nvidia-fs", "warn", "nvidia-fs kernel driver not loaded (/proc/driver/nvidia-fs missing)", fix),
            "gds", "nvidia-fs kernel driver not loaded (/proc/driver/nvidia-fs missing)", fix))
    if nfs.devices:
        found.append(_Finding(CheckResult("nvidia-fs-devices", "ok",
                                          f"{len(nfs.devices)} device nodes ({nfs.devices[0]}..{nfs.devices[-1]})")))
    elif nfs.loaded and not p2p_confirmed:
        fix = ("pass them to the container: --device /dev/nvidia-fs0 ... --device /dev/nvidia-fsN"
               if report.container.in_container else "reload nvidia-fs so that udev creates /dev/nvidia-fs*")
        found.append(_Finding(CheckResult("nvidia-fs-devices", "warn", "no /dev/nvidia-fs* device nodes", fix),
                              "gds", "no /dev/nvidia-fs* device nodes (cuFile cannot reach nvidia-fs)", fix))
    else:
        found.append(_Finding(CheckResult("nvidia-fs-devices", "skip", "no /dev/nvidia-fs* (nvidia-fs not in use)")))
    return found


def _udev_finding(report: NodeReport) -> _Finding:
    if report.container.udev_readable:
        return _Finding(CheckResult("udev", "ok", "/run/udev readable"))
    if report.container.in_container:
        fix = "mount it into the container: -v /run/udev:/run/udev:ro"
    else:
        fix = "start systemd-udevd (cuFile reads the udev database to map files to NVMe devices)"
    detail = "/run/udev missing or unreadable: cuFile cannot map files to NVMe devices and KvikIO falls back to compat"
    return _Finding(CheckResult("udev", "warn", detail, fix), "gds", "/run/udev not readable", fix)


def _container_finding(report: NodeReport) -> _Finding:
    c = report.container
    if not c.in_container:
        return _Finding(CheckResult("container", "ok", "not in a container"))
    return _Finding(CheckResult("container", "ok", f"in a container ({c.evidence}); see docker/README.md for the run flags"))


def _cufile_json_findings(report: NodeReport) -> list[_Finding]:
    cfg = report.cufile_config
    if not cfg.found:
        return [_Finding(CheckResult("cufile.json", "warn", f"{cfg.path} not found: cuFile uses built-in defaults",
                                     "install one (docker/cufile.json is tuned for offloading) or set CUFILE_ENV_PATH_JSON"))]
    if not cfg.parsed:
        return [_Finding(CheckResult("cufile.json", "warn", cfg.error, "fix the file; cuFile falls back to defaults"))]
    shown = ", ".join(f"{k.split('.', 1)[-1]}={json.dumps(v)}" for k, v in cfg.settings.items()
                      if not k.startswith("denylist.") or v)
    found = [_Finding(CheckResult("cufile.json", "ok", f"{cfg.path}: {shown or 'no behaviour-changing settings'}"))]
    if _flag(cfg.settings.get("properties.force_compat_mode", False)) is True:
        fix = f"set properties.force_compat_mode to false in {cfg.path}"
        found.append(_Finding(CheckResult("cufile.json", "warn", "properties.force_compat_mode=true", fix),
                              "gds", f"{cfg.path} sets force_compat_mode=true", fix))
    level = str(cfg.settings.get("logging.level", "")).upper()
    if level in ("DEBUG", "TRACE", "INFO"):
        found.append(_Finding(CheckResult("cufile.json", "warn", f"logging.level={level} slows every I/O",
                                          f"set logging.level to ERROR in {cfg.path}")))
    return found


def _path_findings(report: NodeReport, path: PathProbe) -> list[_Finding]:
    """Findings for one spill directory, in blocking order."""
    where = path.path
    fix_path = "pass --path (or set GDS_OFFLOAD_DIR) to a writable directory on an NVMe ext4/xfs filesystem"
    if not path.exists:
        reason = path.error or f"{where} does not exist"
        return [_Finding(CheckResult("path", "fail", reason, fix_path), "usable", reason, fix_path)]
    if not path.is_dir:
        return [_Finding(CheckResult("path", "fail", path.error, fix_path), "usable", path.error, fix_path)]
    found = [_Finding(CheckResult("path", "ok", f"{where} exists" + (" (created, mode 0700)" if path.created else "")))]
    if path.read_only_mount:
        reason = f"{where} is on a read-only mount ({path.mountpoint}, options {','.join(path.mount_options)})"
        found.append(_Finding(CheckResult("writable", "fail", reason, fix_path), "usable", reason, fix_path))
    elif not path.writable:
        reason = path.error or f"{where} is not writable"
        found.append(_Finding(CheckResult("writable", "fail", reason, fix_path), "usable", reason, fix_path))
    else:
        found.append(_Finding(CheckResult("writable", "ok", f"can create files in {where}")))
    found.append(_space_finding(path, fix_path))
    found.extend(_filesystem_findings(report, path))
    return found


def _space_finding(path: PathProbe, fix_path: str) -> _Finding:
    if path.free_bytes is None:
        return _Finding(CheckResult("free-space", "skip", path.error or "statvfs failed"))
    detail = f"{_fmt_bytes(path.free_bytes)} free of {_fmt_bytes(path.total_bytes)}"
    if path.free_bytes < MIN_FREE_BYTES:
        reason = f"{path.path} has no free space ({detail})"
        return _Finding(CheckResult("free-space", "fail", reason, "free space or " + fix_path), "usable", reason,
                        "free space on that filesystem or " + fix_path)
    if path.free_bytes < LOW_FREE_BYTES:
        return _Finding(CheckResult("free-space", "warn", detail, "activations of a large model need tens of GiB"))
    return _Finding(CheckResult("free-space", "ok", detail))


def _filesystem_findings(report: NodeReport, path: PathProbe) -> list[_Finding]:
    found: list[_Finding] = []
    fstype = path.fstype or "unknown"
    opts = set(path.mount_options)
    where = f"{path.path} ({fstype} at {path.mountpoint or '?'})"
    fix_fs = "put the spill directory on ext4 (data=ordered) or xfs on an NVMe drive (--path / GDS_OFFLOAD_DIR)"
    if path.fstype in GDS_LOCAL_FSTYPES:
        if path.fstype == "ext4" and "data=journal" in opts:
            fix = "remount ext4 with data=ordered (GDS does not support data=journal)"
            found.append(_Finding(CheckResult("filesystem", "warn", f"{where}: ext4 data=journal", fix),
                                  "gds", "ext4 mounted with data=journal (GDS needs data=ordered)", fix))
        else:
            found.append(_Finding(CheckResult("filesystem", "ok", f"{where}: GDS-supported (on NVMe or NVMe-oF)")))
    elif path.fstype in GDS_DISTRIBUTED_FSTYPES:
        found.append(_Finding(CheckResult("filesystem", "ok", f"{where}: distributed filesystem with GDS support")))
    elif path.fstype.startswith("nfs") and "proto=rdma" in opts:
        found.append(_Finding(CheckResult("filesystem", "ok", f"{where}: NFS over RDMA (GDS-supported)")))
    else:
        why = {"tmpfs": "tmpfs lives in RAM and has no block device",
               "overlay": "overlayfs (a container's root) hides the NVMe device",
               "nfs": "NFS without proto=rdma", "nfs4": "NFS without proto=rdma"}.get(
            path.fstype, f"{fstype} is not a GDS-supported filesystem")
        reason = f"filesystem {fstype} does not support GDS ({why})"
        if path.o_direct is False:
            reason = f"filesystem {fstype} does not accept O_DIRECT"
        fix = fix_fs
        if path.fstype == "overlay":
            fix = "bind-mount an NVMe ext4/xfs directory into the container (-v /mnt/nvme:/mnt/nvme) and point --path at it"
        found.append(_Finding(CheckResult("filesystem", "warn", f"{where}: {why}", fix), "gds", reason, fix))
    found.append(_o_direct_finding(path, fstype))
    found.extend(_device_findings(report, path))
    found.extend(_denylist_findings(report, path))
    return found


def _o_direct_finding(path: PathProbe, fstype: str) -> _Finding:
    if path.o_direct is True:
        return _Finding(CheckResult("o_direct", "ok", path.o_direct_detail))
    if path.o_direct is None:
        return _Finding(CheckResult("o_direct", "skip", path.o_direct_detail or "not tested (path not writable)"))
    fix = "use ext4/xfs on NVMe; without O_DIRECT every transfer goes through the page cache"
    return _Finding(CheckResult("o_direct", "warn", path.o_direct_detail, fix), "gds",
                    f"filesystem {fstype} does not accept O_DIRECT", fix)


def _device_findings(report: NodeReport, path: PathProbe) -> list[_Finding]:
    dev = path.device
    if dev is None:
        return [_Finding(CheckResult("block-device", "skip", "no block device (virtual or network filesystem)"))]
    if dev.error:
        return [_Finding(CheckResult("block-device", "skip", f"{dev.dev}: {dev.error}"))]
    members = f" over {', '.join(dev.members)}" if dev.members else ""
    where = f"{dev.disk}{members} ({dev.dev}{', PCI ' + dev.pci_address if dev.pci_address else ''}" \
            f"{', NUMA ' + str(dev.numa_node) if dev.numa_node is not None else ''})"
    if dev.nvme:
        return [_Finding(CheckResult("block-device", "ok", f"NVMe: {where}"))]
    if path.fstype in GDS_LOCAL_FSTYPES:
        fix = "put the spill directory on a filesystem on an NVMe (or NVMe-oF / RAID0-of-NVMe) drive"
        return [_Finding(CheckResult("block-device", "warn", f"not NVMe: {where}", fix), "gds",
                         f"block device {dev.disk} is not NVMe (GDS reads and writes NVMe directly)", fix)]
    return [_Finding(CheckResult("block-device", "ok", f"{where} (not NVMe; the filesystem decides)"))]


def _denylist_findings(report: NodeReport, path: PathProbe) -> list[_Finding]:
    settings = report.cufile_config.settings
    hits = []
    if path.fstype and path.fstype in (settings.get("denylist.filesystems") or []):
        hits.append(f"denylist.filesystems lists {path.fstype}")
    if path.mountpoint and path.mountpoint in (settings.get("denylist.mounts") or []):
        hits.append(f"denylist.mounts lists {path.mountpoint}")
    dev = path.device
    if dev and dev.disk and any(dev.disk in str(d) for d in settings.get("denylist.devices") or []):
        hits.append(f"denylist.devices lists {dev.disk}")
    if not hits:
        return []
    fix = f"remove it from the denylist in {report.cufile_config.path}"
    return [_Finding(CheckResult("cufile.json", "warn", "; ".join(hits), fix), "gds",
                     f"{report.cufile_config.path} {hits[0]}", fix)]


def _driver_finding(report: NodeReport) -> _Finding:
    kv = report.kvikio
    if not report.probe_driver:
        return _Finding(CheckResult("kvikio-driver", "skip", "cuFile driver not probed (probe_driver=False)"))
    if not kv.importable:
        return _Finding(CheckResult("kvikio-driver", "skip", "KvikIO not importable"))
    fix_hang = "check `dmesg` and the nvidia-fs module; set KVIKIO_COMPAT_MODE=ON to skip cuFile"
    if kv.timed_out:
        return _Finding(CheckResult("kvikio-driver", "warn", kv.error, fix_hang), "gds",
                        "cuFile driver probe timed out", fix_hang)
    if not kv.driver_ok:
        detail = kv.error or "the cuFile driver stage did not finish"
        return _Finding(CheckResult("kvikio-driver", "warn", detail, fix_hang), "gds",
                        f"cuFile driver probe failed ({detail})", fix_hang)
    detail = f"is_gds_available={kv.gds_available}, is_compat_mode_preferred()={kv.compat_preferred}"
    if kv.properties.get("major_version"):
        detail += f", cuFile driver {kv.properties.get('major_version')}.{kv.properties.get('minor_version')}"
    shown = ("allow_compat_mode", "poll_mode", "max_device_cache_size", "max_pinned_memory_size")
    if kv.gds_available:
        detail += "".join(f", {k}={kv.properties[k]}" for k in shown if k in kv.properties)
    if kv.compat_preferred:
        fix = "see the udev/nvidia-fs/libcufile lines above; KvikIO's AUTO mode picks POSIX when any is missing"
        if report.env.get("KVIKIO_COMPAT_MODE"):
            fix = "unset KVIKIO_COMPAT_MODE"
        return _Finding(CheckResult("kvikio-driver", "warn", detail, fix), "gds",
                        f"KvikIO prefers compat mode (compat_mode={kv.compat_mode or '?'})", fix)
    if kv.gds_available is not True:
        fix = "cuFile could not open the GDS driver; run gdscheck -p (gds-tools) and read cufile.log"
        return _Finding(CheckResult("kvikio-driver", "warn", detail, fix), "gds",
                        "cuFile reports GDS unavailable (is_gds_available=False)", fix)
    return _Finding(CheckResult("kvikio-driver", "ok", detail))


def _affinity_findings(report: NodeReport, path: PathProbe) -> list[_Finding]:
    pairs = [a for a in report.affinities if a.path == path.path]
    if not pairs:
        return []
    found = []
    for a in pairs:
        numa = f"GPU NUMA {a.gpu_numa if a.gpu_numa is not None else '?'}, drive NUMA " \
               f"{a.drive_numa if a.drive_numa is not None else '?'}"
        detail = f"GPU{a.gpu_index} -> {a.disk or '?'}: {a.link}" + (f", {a.hops} PCIe hops" if a.hops is not None else "") \
                 + f" ({numa})"
        if a.link == "SYS":
            found.append(_Finding(CheckResult("gpu-affinity", "warn", detail,
                                              "use a drive on the GPU's NUMA node; cross-socket transfers are bounced")))
        else:
            found.append(_Finding(CheckResult("gpu-affinity", "ok" if a.link != "unknown" else "skip", detail)))
    return found


def _recommendation_findings(report: NodeReport) -> list[_Finding]:
    """One ``GPU -> drive`` line per GPU when several spill directories were given."""
    paths = {a.path for a in report.affinities}
    if len(paths) < 2:
        return []
    lines = []
    for topo in report.gpu_topology:
        options = sorted((a for a in report.affinities if a.gpu_index == topo.index), key=lambda a: a.rank)
        if options:
            best = options[0]
            lines.append(f"GPU{topo.index} -> {best.path} ({best.disk or '?'}, {best.link})")
    if not lines:
        return []
    return [_Finding(CheckResult("recommendation", "ok", "; ".join(lines)))]


def _findings_for(report: NodeReport, index: int) -> list[_Finding]:
    path = report.paths[index]
    found = _node_findings(report) + _path_findings(report, path)
    found.append(_driver_finding(report))
    found.extend(_affinity_findings(report, path))
    found.extend(_recommendation_findings(report))
    return found


def decide(report: NodeReport, index: int = 0) -> Verdict:
    """The verdict for ``report.paths[index]``.

    ``unusable`` when the first path finding that blocks usability fires (missing and
    not creatable, not a directory, read-only mount, not writable, no free space);
    otherwise ``compat`` with the first GDS blocker in this order: GPU, libcufile,
    KvikIO, KVIKIO_COMPAT_MODE/CUFILE_FORCE_COMPAT_MODE, WSL, nvidia-fs, its device
    nodes, /run/udev, cufile.json force_compat_mode, filesystem type, O_DIRECT, NVMe
    device, cufile.json denylist, and (when the report was made with
    ``probe_driver``) the KvikIO driver probe; otherwise ``gds``.

    Args:
        report: from :func:`collect_node`.
        index: which spill directory.

    Returns:
        The verdict, with every check.

    Raises:
        IndexError: ``index`` is out of range for ``report.paths`` (a caller bug).
    """
    if not 0 <= index < len(report.paths):
        raise IndexError(f"index={index} out of range: the report has {len(report.paths)} path(s)")
    found = _findings_for(report, index)
    checks = tuple(f.check for f in found)
    fatal = next((f for f in found if f.blocks == "usable"), None)
    if fatal is not None:
        return Verdict("unusable", fatal.reason, fatal.fix, checks)
    blocker = next((f for f in found if f.blocks == "gds"), None)
    if blocker is not None:
        return Verdict("compat", blocker.reason, blocker.fix, checks)
    path = report.paths[index]
    reason = (f"GPU, libcufile, nvidia-fs and KvikIO present; {path.path} is {path.fstype}"
              f"{' on ' + path.device.disk if path.device and path.device.disk else ''} with O_DIRECT")
    if not report.probe_driver:
        reason += " (cuFile driver not probed)"
    return Verdict("gds", reason, "nothing to fix: mode='auto' will use GPUDirect Storage", checks)


def report_checks(report: NodeReport) -> tuple[CheckResult, ...]:
    """Every check of a multi-path report, node checks once, then each path's.

    With several paths, path checks are named ``name@path``. With one path this is
    ``decide(report).checks``.

    Args:
        report: from :func:`collect_node`.

    Returns:
        The checks in report order.
    """
    if len(report.paths) == 1:
        return tuple(f.check for f in _findings_for(report, 0))
    checks = [f.check for f in _node_findings(report)]
    checks.append(_driver_finding(report).check)
    for path in report.paths:
        for f in _path_findings(report, path) + _affinity_findings(report, path):
            checks.append(replace(f.check, name=f"{f.check.name}@{path.path}"))
    checks.extend(f.check for f in _recommendation_findings(report))
    return tuple(checks)


_SEVERITY = {"gds": 0, "compat": 1, "unusable": 2}


def worst_verdict(verdicts: Sequence[Verdict]) -> Verdict:
    """The most severe of several verdicts (``unusable`` > ``compat`` > ``gds``); first wins ties.

    Args:
        verdicts: at least one.

    Returns:
        That verdict.

    Raises:
        ValueError: ``verdicts`` is empty.
    """
    if not verdicts:
        raise ValueError("worst_verdict needs at least one verdict, got none")
    return max(verdicts, key=lambda v: _SEVERITY[v.mode])


def node_verdict(
    path: Path,
    *,
    root: Path = Path("/"),
    env: Mapping[str, str] | None = None,
    probe_driver: bool = True,
    timeout_s: float = 10.0,
    probes: Probes = DEFAULT_PROBES,
) -> Verdict:
    """Decide what the offloader can do at ``path`` on this node.

    The offloader's ``mode="auto"`` and ``gds-check`` both call this. It never raises
    for node problems: they become checks and a verdict.

    Args:
        path: the spill directory (created 0700 when missing).
        root: root of the ``/proc``, ``/sys``, ``/etc``, ``/dev``, ``/run`` trees.
        env: environment; ``os.environ`` when None.
        probe_driver: let a child process open the cuFile driver through KvikIO (it
            can hang without a working NVIDIA driver; the child is killed after
            ``timeout_s``).
        timeout_s: limit for that child.
        probes: boundary functions (replace them in tests to simulate a node).

    Returns:
        ``gds``, ``compat`` or ``unusable`` with a one-line reason and fix.

    Example:
        >>> v = node_verdict(Path("/mnt/nvme/spill"))  # doctest: +SKIP
        >>> v.mode, v.reason
        ('compat', 'no GPU (torch.cuda.is_available() is False ...)')
    """
    report = collect_node([path], root=root, env=env, probe_driver=probe_driver,
                          timeout_s=timeout_s, probes=probes)
    return decide(report, 0)
