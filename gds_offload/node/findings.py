"""The checks: turn a :class:`~gds_offload.node.collect.NodeReport` into report lines.

Each rule reads the collected facts and returns a :class:`Finding`: a
:class:`CheckResult` (one line of the report) plus, when the fact blocks something, the
verdict line it forces (``blocks="usable"``: the offloader cannot work at the path;
``blocks="gds"``: only the compat path works). The rules are listed in blocking order;
:mod:`~gds_offload.node.verdict` picks the first blocker.

All of ``gds-check``'s rules stay in this one module (node, spill directory, then driver and
affinity), so the blocking order the verdict depends on reads from top to bottom.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Mapping

from gds_offload.node.collect import NodeReport
from gds_offload.node.paths import PathProbe
from gds_offload.node.topology import best_affinities
from gds_offload.units import format_bytes

__all__ = [
    "Status",
    "CheckResult",
    "Finding",
    "GDS_LOCAL_FSTYPES",
    "GDS_DISTRIBUTED_FSTYPES",
    "MIN_FREE_BYTES",
    "LOW_FREE_BYTES",
    "node_findings",
    "path_findings",
    "driver_finding",
    "affinity_findings",
    "recommendation_findings",
]

Status = Literal["ok", "warn", "fail", "skip"]

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

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


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
class Finding:
    """A check plus, when it blocks something, the verdict line it forces."""

    check: CheckResult
    blocks: Literal["", "gds", "usable"] = ""
    reason: str = ""
    fix: str = ""


_COMPAT_STILL_WORKS = "offloading still works through the compat path"



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
# Node checks
# --------------------------------------------------------------------------------------
def node_findings(report: NodeReport) -> list[Finding]:
    """Findings that do not depend on the spill directory, in blocking order."""
    found: list[Finding] = []
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


def _gpu_finding(report: NodeReport) -> Finding:
    gpu = report.gpu
    versions = f"CUDA runtime {gpu.cuda_runtime or 'none'}, driver {gpu.cuda_driver or 'unknown'}"
    if gpu.available:
        names = "; ".join(f"GPU{g.index} {g.name} {format_bytes(g.total_memory_bytes, missing='unknown')}"
                          + (f" @ {g.pci_bus_id}" if g.pci_bus_id else "") for g in gpu.gpus)
        return Finding(CheckResult("gpu", "ok", f"{names} (torch {gpu.torch_version}, {versions})"))
    visible = report.env.get("CUDA_VISIBLE_DEVICES")
    detail = f"no CUDA GPU ({gpu.error or 'none found'}); {versions}"
    hint = "run on a node with an NVIDIA GPU and a CUDA build of torch"
    if report.container.in_container:
        hint = "start the container with --gpus all (NVIDIA Container Toolkit) and a CUDA build of torch"
    if visible is not None and visible.strip() in ("", "-1", "none"):
        hint = f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU; unset it"
    return Finding(CheckResult("gpu", "warn", detail, hint), "gds",
                   f"no GPU ({gpu.error or 'torch.cuda.is_available() is False'})",
                   f"{_COMPAT_STILL_WORKS} (activations stay on CPU); for GDS {hint}")


def _nvidia_driver_finding(report: NodeReport) -> Finding:
    gpu = report.gpu
    if gpu.kernel_driver:
        return Finding(CheckResult("nvidia-driver", "ok",
                                   f"NVIDIA kernel module {gpu.kernel_driver} (/proc/driver/nvidia/version)"))
    status: Status = "warn" if gpu.available else "skip"
    return Finding(CheckResult("nvidia-driver", status,
                               "/proc/driver/nvidia/version not found: NVIDIA kernel module not loaded",
                               "install the NVIDIA driver (nvidia-smi must work)"))


def _libcufile_finding(report: NodeReport) -> Finding:
    lib = report.libcufile
    if lib.found:
        version = report.kvikio.libcufile_version or lib.version or "version unknown"
        return Finding(CheckResult("libcufile", "ok", f"{lib.path} ({lib.source}, {version})"))
    where = ", ".join(lib.searched[-4:]) if lib.searched else "nowhere"
    fix = "pip install nvidia-cufile-cu12 (comes with kvikio-cu12), or install libcufile from the CUDA toolkit"
    return Finding(CheckResult("libcufile", "warn", f"libcufile.so not found (searched {where})", fix),
                   "gds", "libcufile not found (cuFile user-space library missing)", fix)


def _kvikio_finding(report: NodeReport) -> Finding:
    kv = report.kvikio
    if kv.importable:
        detail = f"kvikio {kv.version}; compat_mode={kv.compat_mode or '?'}"
        if kv.compat_preferred is not None:
            detail += f", is_compat_mode_preferred()={kv.compat_preferred}"
        return Finding(CheckResult("kvikio", "ok", detail))
    fix = "pip install 'gds_offload[cu12]' (kvikio-cu12, cupy-cuda12x)"
    detail = kv.error or "import kvikio failed"
    return Finding(CheckResult("kvikio", "warn", detail, fix), "gds", f"KvikIO not importable ({detail})", fix)


def _env_findings(report: NodeReport) -> list[Finding]:
    env = report.env
    found = []
    compat = env.get("KVIKIO_COMPAT_MODE", "").strip().lower()
    if compat in _TRUE:
        fix = "unset KVIKIO_COMPAT_MODE (or set it to AUTO)"
        found.append(Finding(CheckResult("env", "warn", f"KVIKIO_COMPAT_MODE={env['KVIKIO_COMPAT_MODE']} forces POSIX I/O", fix),
                             "gds", f"KVIKIO_COMPAT_MODE={env['KVIKIO_COMPAT_MODE']} forces compat mode", fix))
    if _flag(env.get("CUFILE_FORCE_COMPAT_MODE", "")) is True:
        fix = "unset CUFILE_FORCE_COMPAT_MODE"
        found.append(Finding(CheckResult("env", "warn", "CUFILE_FORCE_COMPAT_MODE=true makes cuFile bounce every I/O", fix),
                             "gds", "CUFILE_FORCE_COMPAT_MODE=true forces cuFile's compat mode", fix))
    if not found:
        shown = ", ".join(f"{k}={v}" for k, v in env.items() if k.startswith(("KVIKIO_", "CUFILE_"))) or "none set"
        found.append(Finding(CheckResult("env", "ok", f"KvikIO/cuFile overrides: {shown}")))
    return found


def _wsl_finding(report: NodeReport) -> Finding:
    if not report.container.wsl:
        return Finding(CheckResult("wsl", "ok", "not Windows Subsystem for Linux"))
    fix = "run on native Linux; WSL has no GPUDirect Storage"
    return Finding(CheckResult("wsl", "warn", "running under WSL (/proc/sys/kernel/osrelease)", fix),
                   "gds", "WSL does not support GPUDirect Storage", fix)


def _p2pdma_enabled(report: NodeReport) -> bool:
    settings = report.cufile_config.settings
    env_value = _flag(report.env.get("CUFILE_USE_PCIP2PDMA", ""))
    return bool(env_value or _flag(settings.get("properties.use_pci_p2pdma", False))
                or _flag(settings.get("block.nvme.use_pci_p2pdma", False)))


def _nvidia_fs_findings(report: NodeReport) -> list[Finding]:
    nfs = report.nvidia_fs
    kv = report.kvikio
    found: list[Finding] = []
    p2p_confirmed = _p2pdma_enabled(report) and kv.driver_ok and kv.gds_available is True
    if nfs.loaded:
        detail = f"loaded ({', '.join(nfs.evidence)}{', version ' + nfs.version if nfs.version else ''})"
        status: Status = "ok"
        hint = ""
        if nfs.stats_readable is False:
            detail += "; /proc/driver/nvidia-fs/stats unreadable without root"
            hint = "run gds-check as root to read nvidia-fs stats"
        found.append(Finding(CheckResult("nvidia-fs", status, detail, hint)))
    elif p2p_confirmed:
        found.append(Finding(CheckResult(
            "nvidia-fs", "ok", "not loaded; cufile.json enables PCI P2PDMA and cuFile reports GDS available")))
    else:
        fix = "load the GDS kernel driver: modprobe nvidia-fs (package nvidia-fs / nvidia-gds)"
        if report.container.in_container:
            fix = "load nvidia-fs on the host (modprobe nvidia-fs); containers share the host kernel"
        if _p2pdma_enabled(report):
            fix += "; P2PDMA is enabled in cufile.json but the driver probe did not confirm it"
        found.append(Finding(
            CheckResult("nvidia-fs", "warn", "nvidia-fs kernel driver not loaded (/proc/driver/nvidia-fs missing)", fix),
            "gds", "nvidia-fs kernel driver not loaded (/proc/driver/nvidia-fs missing)", fix))
    if nfs.devices:
        found.append(Finding(CheckResult("nvidia-fs-devices", "ok",
                                         f"{len(nfs.devices)} device nodes ({nfs.devices[0]}..{nfs.devices[-1]})")))
    elif nfs.loaded and not p2p_confirmed:
        fix = ("pass them to the container: --device /dev/nvidia-fs0 ... --device /dev/nvidia-fsN"
               if report.container.in_container else "reload nvidia-fs so that udev creates /dev/nvidia-fs*")
        found.append(Finding(CheckResult("nvidia-fs-devices", "warn", "no /dev/nvidia-fs* device nodes", fix),
                             "gds", "no /dev/nvidia-fs* device nodes (cuFile cannot reach nvidia-fs)", fix))
    else:
        found.append(Finding(CheckResult("nvidia-fs-devices", "skip", "no /dev/nvidia-fs* (nvidia-fs not in use)")))
    return found


def _udev_finding(report: NodeReport) -> Finding:
    if report.container.udev_readable:
        return Finding(CheckResult("udev", "ok", "/run/udev readable"))
    if report.container.in_container:
        fix = "mount it into the container: -v /run/udev:/run/udev:ro"
    else:
        fix = "start systemd-udevd (cuFile reads the udev database to map files to NVMe devices)"
    detail = "/run/udev missing or unreadable: cuFile cannot map files to NVMe devices and KvikIO falls back to compat"
    return Finding(CheckResult("udev", "warn", detail, fix), "gds", "/run/udev not readable", fix)


def _container_finding(report: NodeReport) -> Finding:
    c = report.container
    if not c.in_container:
        return Finding(CheckResult("container", "ok", "not in a container"))
    return Finding(CheckResult("container", "ok", f"in a container ({c.evidence}); see docker/README.md for the run flags"))


def _cufile_json_findings(report: NodeReport) -> list[Finding]:
    cfg = report.cufile_config
    if not cfg.found:
        return [Finding(CheckResult("cufile.json", "warn", f"{cfg.path} not found: cuFile uses built-in defaults",
                                    "install one (docker/cufile.json is tuned for offloading) or set CUFILE_ENV_PATH_JSON"))]
    if not cfg.parsed:
        return [Finding(CheckResult("cufile.json", "warn", cfg.error, "fix the file; cuFile falls back to defaults"))]
    shown = ", ".join(f"{k.split('.', 1)[-1]}={json.dumps(v)}" for k, v in cfg.settings.items()
                      if not k.startswith("denylist.") or v)
    found = [Finding(CheckResult("cufile.json", "ok", f"{cfg.path}: {shown or 'no behaviour-changing settings'}"))]
    if _flag(cfg.settings.get("properties.force_compat_mode", False)) is True:
        fix = f"set properties.force_compat_mode to false in {cfg.path}"
        found.append(Finding(CheckResult("cufile.json", "warn", "properties.force_compat_mode=true", fix),
                             "gds", f"{cfg.path} sets force_compat_mode=true", fix))
    level = str(cfg.settings.get("logging.level", "")).upper()
    if level in ("DEBUG", "TRACE", "INFO"):
        found.append(Finding(CheckResult("cufile.json", "warn", f"logging.level={level} slows every I/O",
                                         f"set logging.level to ERROR in {cfg.path}")))
    return found


# --------------------------------------------------------------------------------------
# Spill-directory checks
# --------------------------------------------------------------------------------------
def path_findings(report: NodeReport, path: PathProbe) -> list[Finding]:
    """Findings for one spill directory, in blocking order."""
    where = path.path
    fix_path = "pass --path (or set GDS_OFFLOAD_DIR) to a writable directory on an NVMe ext4/xfs filesystem"
    if path.problem:  # what attach() would refuse it with: the same words (gds_offload.io.directory.check_dir)
        fix = path.fix or fix_path
        return [Finding(CheckResult("path", "fail", path.problem, fix), "usable", path.problem, fix)]
    if not path.exists and not path.would_create:
        reason = path.error or f"{where} does not exist"
        return [Finding(CheckResult("path", "fail", reason, fix_path), "usable", reason, fix_path)]
    if not path.is_dir:
        return [Finding(CheckResult("path", "fail", path.error, fix_path), "usable", path.error, fix_path)]
    if path.exists:
        found = [Finding(CheckResult("path", "ok", f"{where} exists"))]
    else:
        found = [Finding(CheckResult("path", "ok", f"{where}: missing, would be created 0700 (by attach) under {path.probed}; "
                                                   f"the checks below are of {path.probed}"))]
    if path.read_only_mount:
        reason = f"{where} is on a read-only mount ({path.mountpoint}, options {','.join(path.mount_options)})"
        found.append(Finding(CheckResult("writable", "fail", reason, fix_path), "usable", reason, fix_path))
    elif not path.writable:
        reason = path.error or f"{where} is not writable"
        found.append(Finding(CheckResult("writable", "fail", reason, fix_path), "usable", reason, fix_path))
    else:
        found.append(Finding(CheckResult("writable", "ok", f"can create files in {where}")))
    found.append(_space_finding(path, fix_path))
    found.extend(_filesystem_findings(report, path))
    return found


def _space_finding(path: PathProbe, fix_path: str) -> Finding:
    if path.free_bytes is None:
        return Finding(CheckResult("free-space", "skip", path.error or "statvfs failed"))
    detail = f"{format_bytes(path.free_bytes, missing='unknown')} free of {format_bytes(path.total_bytes, missing='unknown')}"
    if path.free_bytes < MIN_FREE_BYTES:
        reason = f"{path.path} has no free space ({detail})"
        return Finding(CheckResult("free-space", "fail", reason, "free space or " + fix_path), "usable", reason,
                       "free space on that filesystem or " + fix_path)
    if path.free_bytes < LOW_FREE_BYTES:
        return Finding(CheckResult("free-space", "warn", detail, "activations of a large model need tens of GiB"))
    return Finding(CheckResult("free-space", "ok", detail))


def _filesystem_findings(report: NodeReport, path: PathProbe) -> list[Finding]:
    found: list[Finding] = []
    fstype = path.fstype or "unknown"
    opts = set(path.mount_options)
    where = f"{path.path} ({fstype} at {path.mountpoint or '?'})"
    fix_fs = "put the spill directory on ext4 (data=ordered) or xfs on an NVMe drive (--path / GDS_OFFLOAD_DIR)"
    if path.fstype in GDS_LOCAL_FSTYPES:
        if path.fstype == "ext4" and "data=journal" in opts:
            fix = "remount ext4 with data=ordered (GDS does not support data=journal)"
            found.append(Finding(CheckResult("filesystem", "warn", f"{where}: ext4 data=journal", fix),
                                 "gds", "ext4 mounted with data=journal (GDS needs data=ordered)", fix))
        else:
            found.append(Finding(CheckResult("filesystem", "ok", f"{where}: GDS-supported (on NVMe or NVMe-oF)")))
    elif path.fstype in GDS_DISTRIBUTED_FSTYPES:
        found.append(Finding(CheckResult("filesystem", "ok", f"{where}: distributed filesystem with GDS support")))
    elif path.fstype.startswith("nfs") and "proto=rdma" in opts:
        found.append(Finding(CheckResult("filesystem", "ok", f"{where}: NFS over RDMA (GDS-supported)")))
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
        found.append(Finding(CheckResult("filesystem", "warn", f"{where}: {why}", fix), "gds", reason, fix))
    found.append(_o_direct_finding(path, fstype))
    found.extend(_device_findings(report, path))
    found.extend(_denylist_findings(report, path))
    return found


def _o_direct_finding(path: PathProbe, fstype: str) -> Finding:
    if path.o_direct is True:
        return Finding(CheckResult("o_direct", "ok", path.o_direct_detail))
    if path.o_direct is None:
        return Finding(CheckResult("o_direct", "skip", path.o_direct_detail or "not tested (path not writable)"))
    fix = "use ext4/xfs on NVMe; without O_DIRECT every transfer goes through the page cache"
    return Finding(CheckResult("o_direct", "warn", path.o_direct_detail, fix), "gds",
                   f"filesystem {fstype} does not accept O_DIRECT", fix)


def _device_findings(report: NodeReport, path: PathProbe) -> list[Finding]:
    dev = path.device
    if dev is None:
        return [Finding(CheckResult("block-device", "skip", "no block device (virtual or network filesystem)"))]
    if dev.error:
        return [Finding(CheckResult("block-device", "skip", f"{dev.dev}: {dev.error}"))]
    members = f" over {', '.join(dev.members)}" if dev.members else ""
    where = f"{dev.disk}{members} ({dev.dev}{', PCI ' + dev.pci_address if dev.pci_address else ''}" \
            f"{', NUMA ' + str(dev.numa_node) if dev.numa_node is not None else ''})"
    if dev.nvme:
        return [Finding(CheckResult("block-device", "ok", f"NVMe: {where}"))]
    if path.fstype in GDS_LOCAL_FSTYPES:
        fix = "put the spill directory on a filesystem on an NVMe (or NVMe-oF / RAID0-of-NVMe) drive"
        return [Finding(CheckResult("block-device", "warn", f"not NVMe: {where}", fix), "gds",
                        f"block device {dev.disk} is not NVMe (GDS reads and writes NVMe directly)", fix)]
    return [Finding(CheckResult("block-device", "ok", f"{where} (not NVMe; the filesystem decides)"))]


def _listed(settings: Mapping[str, object], key: str) -> list[str]:
    """A cufile.json denylist as strings; cuFile reads only arrays there, so anything else lists nothing."""
    value = settings.get(key)
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else []


def _denylist_findings(report: NodeReport, path: PathProbe) -> list[Finding]:
    settings = report.cufile_config.settings
    hits = []
    if path.fstype and path.fstype in _listed(settings, "denylist.filesystems"):
        hits.append(f"denylist.filesystems lists {path.fstype}")
    if path.mountpoint and path.mountpoint in _listed(settings, "denylist.mounts"):
        hits.append(f"denylist.mounts lists {path.mountpoint}")
    dev = path.device
    if dev and dev.disk and any(dev.disk in d for d in _listed(settings, "denylist.devices")):
        hits.append(f"denylist.devices lists {dev.disk}")
    if not hits:
        return []
    fix = f"remove it from the denylist in {report.cufile_config.path}"
    return [Finding(CheckResult("cufile.json", "warn", "; ".join(hits), fix), "gds",
                    f"{report.cufile_config.path} {hits[0]}", fix)]


# --------------------------------------------------------------------------------------
# cuFile driver, affinity and recommendation
# --------------------------------------------------------------------------------------
def driver_finding(report: NodeReport) -> Finding:
    """The cuFile driver as the KvikIO child saw it (``skip`` unless the report was made with ``probe_driver``)."""
    kv = report.kvikio
    if not report.probe_driver:
        return Finding(CheckResult("kvikio-driver", "skip", "cuFile driver not probed (probe_driver=False)"))
    if not kv.importable:
        return Finding(CheckResult("kvikio-driver", "skip", "KvikIO not importable"))
    fix_hang = "check `dmesg` and the nvidia-fs module; set KVIKIO_COMPAT_MODE=ON to skip cuFile"
    if kv.timed_out:
        return Finding(CheckResult("kvikio-driver", "warn", kv.error, fix_hang), "gds",
                       "cuFile driver probe timed out", fix_hang)
    if not kv.driver_ok:
        detail = kv.error or "the cuFile driver stage did not finish"
        return Finding(CheckResult("kvikio-driver", "warn", detail, fix_hang), "gds",
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
        return Finding(CheckResult("kvikio-driver", "warn", detail, fix), "gds",
                       f"KvikIO prefers compat mode (compat_mode={kv.compat_mode or '?'})", fix)
    if kv.gds_available is not True:
        fix = "cuFile could not open the GDS driver; run gdscheck -p (gds-tools) and read cufile.log"
        return Finding(CheckResult("kvikio-driver", "warn", detail, fix), "gds",
                       "cuFile reports GDS unavailable (is_gds_available=False)", fix)
    return Finding(CheckResult("kvikio-driver", "ok", detail))


def affinity_findings(report: NodeReport, path: PathProbe) -> list[Finding]:
    """One ``gpu-affinity`` line per GPU for the drive behind ``path``; they never block."""
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
            found.append(Finding(CheckResult("gpu-affinity", "warn", detail,
                                             "use a drive on the GPU's NUMA node; cross-socket transfers are bounced")))
        else:
            found.append(Finding(CheckResult("gpu-affinity", "ok" if a.link != "unknown" else "skip", detail)))
    return found


def recommendation_findings(report: NodeReport) -> list[Finding]:
    """One ``GPU -> drive`` line per GPU when several spill directories were given."""
    paths = {a.path for a in report.affinities}
    if len(paths) < 2:
        return []
    lines = [f"GPU{a.gpu_index} -> {a.path} ({a.disk or '?'}, {a.link})"
             for a in best_affinities(report.gpu_topology, report.affinities)]
    if not lines:
        return []
    return [Finding(CheckResult("recommendation", "ok", "; ".join(lines)))]
