"""Node-wide probes: GPUs and CUDA versions, libcufile, the nvidia-fs driver, container markers.

Each probe is a function over a *root* directory (``/`` on a real node; a fake tree in
tests) and never raises. torch is imported only inside :func:`probe_gpus`; libcufile is
found without being loaded. KvikIO lives in :mod:`~gds_offload.node.kvikio_child` and
``cufile.json`` in :mod:`~gds_offload.io.kvikio.cufile_config`.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from gds_offload.node.reader import Reader, env_map

__all__ = [
    "GpuInfo",
    "GpuProbe",
    "LibcufileProbe",
    "NvidiaFsProbe",
    "ContainerProbe",
    "probe_gpus",
    "probe_libcufile",
    "probe_nvidia_fs",
    "probe_container",
]


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


# --------------------------------------------------------------------------------------
# GPUs
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
    text = Reader(root).text("/proc/driver/nvidia/version")
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


# --------------------------------------------------------------------------------------
# libcufile
# --------------------------------------------------------------------------------------
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
    env = env_map(env)
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


# --------------------------------------------------------------------------------------
# nvidia-fs and container
# --------------------------------------------------------------------------------------
def probe_nvidia_fs(root: Path = Path("/")) -> NvidiaFsProbe:
    """Whether the nvidia-fs kernel driver is loaded, its version and device nodes.

    Args:
        root: root of the ``/proc``, ``/sys`` and ``/dev`` trees.

    Returns:
        The facts; ``stats_readable`` is False when ``/proc/driver/nvidia-fs/stats``
        exists but needs root.
    """
    return read_nvidia_fs(Reader(root))


def read_nvidia_fs(reader: Reader) -> NvidiaFsProbe:
    """:func:`probe_nvidia_fs` through ``reader``, which records the files it could not read."""
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
    return NvidiaFsProbe(bool(evidence), version, tuple(evidence), devices, stats_readable)


def _first_version(text: str) -> str:
    match = re.search(r"([0-9]+\.[0-9]+(?:\.[0-9]+)*)", text)
    return match.group(1) if match else text.strip().splitlines()[0] if text.strip() else ""


def probe_container(root: Path = Path("/")) -> ContainerProbe:
    """Container markers, ``/run/udev`` and WSL.

    Args:
        root: root of the tree to look at.

    Returns:
        The facts.
    """
    reader = Reader(root)
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
