"""Can DALI's GPUDirect Storage numpy reader work at a path? One answer, with its reasons.

:func:`input_path_status` looks at what the reader needs, in order: NVIDIA DALI installed
(a CUDA build), a CUDA GPU, ``libcufile`` (cuFile, which DALI's GPU reader opens), the
nvidia-fs driver (without it cuFile reads through a host bounce buffer, its compatibility
mode), and the filesystem under the path (GDS-supported type, ``O_DIRECT``), reusing the
probes of ``gds-check`` (:mod:`gds_offload.node.system`, :mod:`gds_offload.node.paths`).
It never raises and never loads CUDA itself beyond torch's ``cuda.is_available()``.
``gds-offload shards --check DIR`` prints it.
"""
from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from gds_offload.node.findings import GDS_DISTRIBUTED_FSTYPES, GDS_LOCAL_FSTYPES
from gds_offload.node.paths import probe_path
from gds_offload.node.system import probe_gpus, probe_libcufile, probe_nvidia_fs

__all__ = ["InputPathStatus", "input_path_status", "dali_version"]

#: ``gds``: GPU reader, direct path. ``gpu-compat``: GPU reader, cuFile through a host
#: bounce buffer. ``cpu``: DALI's CPU reader (the loader copies batches to the GPU, if any).
#: ``unusable``: no DALI, or no readable directory.
Reader = Literal["gds", "gpu-compat", "cpu", "unusable"]


@dataclass(frozen=True)
class InputPathStatus:
    """The answer for one path.

    Attributes:
        path: the directory asked about.
        reader: which read path the token loader gets there (see :data:`Reader`).
        gds: whether reads go from the drive to GPU memory with no host copy.
        reason: one sentence: why this reader and not a faster one.
        fix: what to change for the faster path, ``""`` when nothing.
        facts: each probe's finding, ``name -> detail``, in the order checked.
    """

    path: str
    reader: Reader
    gds: bool
    reason: str
    fix: str = ""
    facts: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def dali_version() -> str | None:
    """The installed NVIDIA DALI's version (found without importing it), None when absent."""
    from importlib import metadata

    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        return None
    for name in ("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110"):
        try:
            return f"{metadata.version(name)} ({name})"
        except metadata.PackageNotFoundError:
            continue
    return "unknown version"


def input_path_status(path: str | Path, *, root: Path = Path("/")) -> InputPathStatus:
    """Which read path DALI's numpy reader gets at ``path``, and why.

    Args:
        path: the shard directory (it must exist; nothing is created).
        root: root of the ``/proc``, ``/sys`` and ``/dev`` trees (fake trees in tests).
    """

    where = str(path)
    facts: dict[str, str] = {}
    dali = _safe(dali_version)
    facts["dali"] = dali or "not installed"
    probe = probe_path(Path(path), root=root)  # a probe creates nothing
    facts["path"] = probe.error or f"{probe.path}: {probe.fstype or 'unknown filesystem'} at {probe.mountpoint or '?'}"
    if dali is None:
        return InputPathStatus(where, "unusable", False, "NVIDIA DALI is not installed",
                               "pip install 'gds_offload[data]' (nvidia-dali-cuda120)", facts)
    if not Path(path).is_dir():  # the probe judges a missing directory by its ancestor; shards must exist
        return InputPathStatus(where, "unusable", False, probe.error or f"{where} is not a directory",
                               "pass the directory gds-offload shards wrote", facts)
    gpus = probe_gpus(root)
    facts["gpu"] = ", ".join(g.name for g in gpus.gpus) if gpus.available else (gpus.error or "no CUDA GPU visible to torch")
    cufile = probe_libcufile(root)
    facts["libcufile"] = f"{cufile.path} ({cufile.source})" if cufile.found else "not found in " + ", ".join(cufile.searched)
    nvfs = probe_nvidia_fs(root)
    facts["nvidia-fs"] = f"loaded {nvfs.version}".strip() if nvfs.loaded else "not loaded"
    fstype = probe.fstype
    direct_fs = fstype in GDS_LOCAL_FSTYPES or fstype in GDS_DISTRIBUTED_FSTYPES or (
        fstype.startswith("nfs") and "proto=rdma" in probe.mount_options)
    facts["filesystem"] = f"{fstype or 'unknown'}: {'GDS-supported' if direct_fs else 'not GDS-supported'}"
    facts["o_direct"] = probe.o_direct_detail or ("accepted" if probe.o_direct else "not tested")
    on_nvme = probe.device is not None and probe.device.nvme
    facts["block-device"] = (f"{probe.device.disk} ({'NVMe' if on_nvme else 'not NVMe'})" if probe.device is not None
                             else "none (virtual or network filesystem)")
    if not gpus.available:
        return InputPathStatus(where, "cpu", False, "no CUDA GPU: the loader runs DALI's CPU reader",
                               "run on a node with an NVIDIA GPU", facts)
    if not cufile.found:
        return InputPathStatus(where, "cpu", False, "libcufile not found: DALI's GPU reader cannot open cuFile",
                               "pip install nvidia-cufile-cu12 (or the CUDA toolkit's GDS package)", facts)
    if not nvfs.loaded:
        return InputPathStatus(where, "gpu-compat", False,
                               "nvidia-fs is not loaded: cuFile reads through a host bounce buffer (compatibility mode)",
                               "modprobe nvidia-fs (install nvidia-gds); see gds-check", facts)
    fs_fix = "put the shards on ext4 (data=ordered) or xfs on NVMe"
    if not direct_fs:
        return InputPathStatus(where, "gpu-compat", False,
                               f"filesystem {fstype or 'unknown'} is not GDS-supported: cuFile falls back to compatibility mode",
                               fs_fix, facts)
    if probe.o_direct is False:
        return InputPathStatus(where, "gpu-compat", False, f"filesystem {fstype} refuses O_DIRECT", fs_fix, facts)
    if fstype in GDS_LOCAL_FSTYPES and probe.device is not None and not on_nvme:
        return InputPathStatus(where, "gpu-compat", False, f"{probe.device.disk} is not an NVMe drive: GDS reads NVMe only",
                               fs_fix, facts)
    return InputPathStatus(where, "gds", True, "GPU, DALI, cuFile, nvidia-fs and a GDS filesystem: direct reads", "", facts)


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a probe never raises
        return None
