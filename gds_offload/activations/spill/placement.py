"""Where one rank spills (:class:`Placement`), and node NVMe auto-placement (``path="auto"``).

:func:`~gds_offload.activations.spill.ranks.place_rank` turns every form of ``attach(path=...)`` into a
:class:`Placement`. For ``"auto"`` it probes the node once (:func:`probe_node`: the GPUs'
PCIe positions, and one candidate directory per writable NVMe ext4/xfs drive from
``/proc/mounts`` and ``/sys``, :func:`nvme_candidates`) and asks :func:`auto_placement`
for the drive closest to the rank's GPU, by the same PCIe/NUMA affinity ``gds-check``
reports.

Contracts:

* Every rank computes the same answer from the same probes: no communication.
* Nothing is created here: a :class:`Placement` lists the directories to create
  (``create``, 0700, in order), and :func:`~gds_offload.activations.spill.ranks.rank_path` creates them.
* The node probe never raises: no GPU, or no usable drive, is an answer (the default
  directory, per rank under a distributed launch; with GPUs but no drive, a warning).
* Nothing here imports torch at module import (``gds-check --ranks`` places ranks too): the
  node probes (:mod:`gds_offload.node`) import it only to list GPUs.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gds_offload.io.directory import default_spill_dir
from gds_offload.node.paths import PathProbe, find_mount, probe_block_device, read_mounts
from gds_offload.node.system import probe_gpus
from gds_offload.node.topology import gpu_topology, pcie_affinity

__all__ = ["Placement", "AutoNode", "RankOf", "DriveCandidate", "auto_placement", "model_gpu", "nvme_candidates", "probe_node"]

#: Mount points ``"auto"`` never creates a directory in (system trees), unless the default
#: spill directory already lives there.
_SYSTEM_MOUNTS = ("/", "/boot", "/efi", "/usr", "/var", "/etc", "/home", "/opt", "/srv", "/snap", "/proc", "/sys", "/dev", "/run")
#: Local filesystems GDS drives directly (the same set as ``gds-check``'s filesystem check).
_GDS_FSTYPES = frozenset({"ext4", "xfs"})


class RankOf(Protocol):
    """What :func:`auto_placement` needs to know of the process it places (a
    :class:`~gds_offload.activations.spill.ranks.RankEnv`)."""

    @property
    def rank(self) -> int | None: ...

    @property
    def local_rank(self) -> int | None: ...

    @property
    def distributed(self) -> bool: ...

    @property
    def subdir(self) -> str: ...


# --------------------------------------------------------------------------------------
# Placement: the answer for one rank
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where one rank spills.

    Attributes:
        rank: global rank (None outside a launch).
        local_rank: rank on its node (None when unknown).
        paths: its spill directories (several: striped).
        how: how they were chosen (``default``, ``template``, ``per_rank``, ``auto: ...``).
        create: the directories the placement chose (the per-rank default, ``"auto"``), which
            :func:`~gds_offload.activations.spill.ranks.rank_path` creates (0700, in this order) when missing.
        gpu: the GPU ``"auto"`` placed it by, None otherwise.
        changed: the placement differs from ``path`` as given (False: leave ``path`` as it was).
    """

    rank: int | None
    local_rank: int | None
    paths: tuple[Path, ...]
    how: str
    create: tuple[Path, ...] = ()
    gpu: int | None = None
    changed: bool = True


# --------------------------------------------------------------------------------------
# "auto"
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DriveCandidate:
    """A directory on one NVMe drive that ``"auto"`` may spill to."""

    dir: Path
    probe: Any  # gds_offload.node.paths.PathProbe (device filled in)


@dataclass(frozen=True)
class AutoNode:
    """What ``"auto"`` knows about the node: its GPUs' PCIe positions and the NVMe candidates."""

    gpus: tuple[Any, ...] = ()  # gds_offload.node.topology.GpuTopology
    candidates: tuple[DriveCandidate, ...] = ()
    default_dir: Path = field(default_factory=default_spill_dir)
    notes: tuple[str, ...] = ()


def probe_node(root: Path = Path("/")) -> AutoNode:
    """Probe GPUs (through torch) and mounted NVMe filesystems; never raises."""

    base = default_spill_dir()
    try:
        gpus = tuple(gpu_topology(g, root) for g in probe_gpus(root).gpus)
    except Exception as exc:  # noqa: BLE001 - a probe never raises; no GPU is the answer
        return AutoNode(default_dir=base, notes=(f"GPU probe failed: {exc}",))
    if not gpus:
        return AutoNode(default_dir=base)
    candidates, notes = nvme_candidates(base, root)
    return AutoNode(gpus, candidates, base, notes)


def nvme_candidates(
    default_dir: Path, root: Path = Path("/"), *, device_of: Callable[[str], Any] | None = None
) -> tuple[tuple[DriveCandidate, ...], tuple[str, ...]]:
    """One spill directory per NVMe drive holding a writable ext4/xfs filesystem.

    A drive's directory is ``default_dir`` when that lives on it, else
    ``<mount point>/gds_offload-<uid>``. Skipped: read-only mounts, other filesystems,
    mount points that are files (container bind mounts of ``/etc/hosts``) or system
    trees (``/``, ``/boot``, ``/var``, ...), and mount points this user cannot write.

    Returns:
        The candidates (in ``/proc/mounts`` order, the default directory's drive first)
        and why others were skipped.
    """

    if device_of is None:
        device_of = lambda mountpoint: probe_block_device(os.stat(mountpoint).st_dev, root)  # noqa: E731
    mounts = read_mounts(root)
    existing = Path(default_dir)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    home = find_mount(Path(os.path.realpath(existing)), mounts)
    ordered = ([home] if home is not None else []) + [m for m in mounts if m is not home]
    found: list[DriveCandidate] = []
    notes: list[str] = []
    disks: set[str] = set()
    for m in ordered:
        if m.fstype not in _GDS_FSTYPES or "ro" in m.options or not os.path.isdir(m.mountpoint):
            continue
        try:
            device = device_of(m.mountpoint)
        except OSError:
            continue
        if device is None or not device.nvme or not device.disk or device.disk in disks:
            continue
        if m is home:
            target = Path(default_dir)
        elif m.mountpoint == "/" or any(m.mountpoint == s or m.mountpoint.startswith(s + "/") for s in _SYSTEM_MOUNTS[1:]):
            notes.append(f"{m.mountpoint} ({device.disk}): a system mount")
            continue
        else:
            target = Path(m.mountpoint) / f"gds_offload-{os.getuid()}"
        check = target if target.exists() else Path(m.mountpoint)
        if not os.access(check, os.W_OK | os.X_OK):
            notes.append(f"{check} ({device.disk}): not writable by uid {os.getuid()}")
            continue
        disks.add(device.disk)
        found.append(DriveCandidate(target, PathProbe(str(target), exists=True, is_dir=True, writable=True, fstype=m.fstype,
                                                  mountpoint=m.mountpoint, device=device)))
    return tuple(found), tuple(notes)


def auto_placement(env: RankOf, node: AutoNode, *, gpu: int | None = None) -> Placement:
    """``path="auto"``: the NVMe drive closest to this rank's GPU.

    What it picks, and why:

    * The rank's GPU: ``gpu`` (the device of the attached model's parameters), else the
      CUDA device numbered like its local rank (torchrun's convention), else GPU 0 when
      each process sees only its own GPU (``CUDA_VISIBLE_DEVICES`` per rank).
    * The drive: among :func:`nvme_candidates`, the closest by the PCIe/NUMA affinity
      ``gds-check`` reports (:func:`~gds_offload.node.topology.pcie_affinity`: ``PIX``
      before ``PXB``, ``PHB``, ``NODE``, ``SYS``, then fewer hops). A drive behind the
      GPU's own PCIe switch lets cuFile DMA peer to peer without crossing the CPU; a drive
      on the other socket makes cuFile bounce every transfer through host memory.
      Equally close drives are shared out by local rank (rank ``l`` takes the
      ``l mod n``-th of the ``n`` closest), so ranks spread over drives instead of all
      taking the first one.
    * The directory: the candidate's, plus ``rank<r>`` under a distributed launch.
    * No GPU (a CPU job, or no CUDA), or no writable NVMe ext4/xfs filesystem: the default
      directory (``$GDS_OFFLOAD_DIR``, else ``<tmp>/gds_offload-<uid>``), per rank under a
      distributed launch. With GPUs but no drive a warning says so.

    Every rank computes the same answer from the same probes: no communication needed.
    """
    def per_rank_dir(base: Path, how: str, **kw: Any) -> Placement:
        mine = base / env.subdir if env.distributed else base
        return Placement(env.rank, env.local_rank, (mine,), how, create=(base, mine) if mine != base else (base,), **kw)

    def fallback(why: str) -> Placement:
        return per_rank_dir(node.default_dir, f"auto: {why}; default directory")

    if not node.gpus:
        return fallback("no GPU")
    if not node.candidates:
        why = "no writable NVMe ext4/xfs filesystem" + (f" ({'; '.join(node.notes)})" if node.notes else "")
        warnings.warn(f"gds_offload: path='auto' found {why}; spilling to {node.default_dir}", RuntimeWarning, stacklevel=3)
        return fallback(why)

    local = env.local_rank or 0
    indices = [g.index for g in node.gpus]
    if gpu is not None and gpu in indices:
        index = gpu
    elif local in indices:
        index = local
    else:
        index = indices[local % len(indices)] if len(indices) > 1 else indices[0]
    topo = next(g for g in node.gpus if g.index == index)
    ranked = sorted(((pcie_affinity(topo, c.probe), i) for i, c in enumerate(node.candidates)), key=lambda a: (a[0].rank, a[1]))
    best = [(a, i) for a, i in ranked if a.rank == ranked[0][0].rank]
    affinity, i = best[local % len(best)]
    how = f"auto: GPU{index} {affinity.link} to {affinity.disk}" + (f", {len(best)} equally close" if len(best) > 1 else "")
    return per_rank_dir(node.candidates[i].dir, how, gpu=index)


def model_gpu(model: Any) -> int | None:
    """The CUDA index of ``model``'s first parameter, None when not on a GPU."""
    if model is None:
        return None
    param = next(iter(model.parameters()), None)
    if param is None or param.device.type != "cuda":
        return None
    return param.device.index if param.device.index is not None else 0
