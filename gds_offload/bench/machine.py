"""What machine a benchmark ran on: CPU, memory, GPU, the spill drive and the software versions.

Every probe answers ``None`` (or a string saying why) rather than raising, so a
benchmark never fails for want of a fact about the machine.
"""
from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gds_offload import __version__
from gds_offload.io.directory import default_spill_dir
from gds_offload.node.probes import probe_path

__all__ = ["CPU_SOURCE", "CUDA_SOURCE", "Machine", "describe_machine", "describe"]

#: How a CPU peak is measured (``RunResult.memory_source``).
CPU_SOURCE = "VmHWM - VmRSS before the first step (model and AdamW state built, mode not set up; MALLOC_MMAP_THRESHOLD_=65536)"
#: How a CUDA peak is measured.
CUDA_SOURCE = "torch.cuda.max_memory_allocated - memory_allocated before the first step (model and AdamW state built, mode not set up)"


@dataclass(frozen=True)
class Machine:
    """The facts a benchmark result carries (see :func:`describe_machine`)."""

    hostname: str
    os: str
    python: str
    cpu_model: str | None
    cpu_cores: int | None
    #: CPUs this process may run on (affinity), what the benchmark really had.
    cpu_usable: int | None
    ram_bytes: int | None
    gpus: tuple[str, ...]
    cuda: str | None
    torch: str | None
    kvikio: str | None
    transformers: str | None
    gds_offload: str
    path: str | None
    filesystem: str | None
    mount_source: str | None
    drive: str | None
    o_direct: bool | None
    free_bytes: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_model(root: Path) -> str | None:
    try:
        for line in (root / "proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _ram_bytes(root: Path) -> int | None:
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    names = {"kvikio": ("kvikio-cu12", "kvikio-cu13", "kvikio")}.get(module, (module,))
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def _drive(path: Path, root: Path) -> dict[str, Any]:
    """Filesystem, device and O_DIRECT support of ``path``, from the ``gds-check`` probes."""
    try:
        p = probe_path(path, root=root)
    except Exception as exc:  # noqa: BLE001 - a probe never fails the benchmark
        return {"filesystem": f"unknown ({type(exc).__name__}: {exc})"}
    drive = None
    if p.device is not None:
        model = None
        disk = p.device.members[0] if p.device.members else p.device.disk
        if disk:
            try:
                model = (root / "sys/block" / disk / "device/model").read_text().strip()
            except OSError:
                model = None
        kind = "NVMe" if p.device.nvme else "block device"
        drive = f"{disk or p.device.dev} ({kind}{', ' + model if model else ''})"
    return {
        "filesystem": p.fstype or None,
        "mount_source": p.mount_source or None,
        "drive": drive,
        "o_direct": p.o_direct,
        "free_bytes": p.free_bytes,
    }


def describe_machine(path: str | os.PathLike[str] | None = None, *, root: Path = Path("/")) -> Machine:
    """Describe this machine and the spill directory ``path`` (default: the offloader's default).

    Never raises; unknown facts are ``None``.
    """

    gpus: tuple[str, ...] = ()
    cuda = torch_version = None
    try:
        import torch

        torch_version = torch.__version__
        cuda = torch.version.cuda
        if torch.cuda.is_available():
            gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except Exception:  # noqa: BLE001
        pass
    if path is None:

        path = default_spill_dir()
    drive = _drive(Path(path), root)
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return Machine(
        hostname=platform.node(),
        os=f"{platform.system()} {platform.release()}",
        python=platform.python_version(),
        cpu_model=_cpu_model(root),
        cpu_cores=os.cpu_count(),
        cpu_usable=usable,
        ram_bytes=_ram_bytes(root),
        gpus=gpus,
        cuda=cuda,
        torch=torch_version,
        kvikio=_version("kvikio"),
        transformers=_version("transformers"),
        gds_offload=__version__,
        path=str(path),
        filesystem=drive.get("filesystem"),
        mount_source=drive.get("mount_source"),
        drive=drive.get("drive"),
        o_direct=drive.get("o_direct"),
        free_bytes=drive.get("free_bytes"),
    )


def describe(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """:func:`describe_machine` as a plain dict (for JSON documents)."""
    return describe_machine(path).as_dict()
