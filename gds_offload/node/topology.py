"""GPU <-> drive affinity: where GPUs and NVMe controllers sit on the PCIe tree.

:func:`gpu_topology` reads a GPU's PCIe path and NUMA node from
``<root>/sys/bus/pci/devices``; :func:`pcie_affinity` classifies the link between a
GPU and the drive behind a spill directory with ``nvidia-smi topo -m`` words;
:func:`best_affinities` picks the closest spill directory per GPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from gds_offload.node.paths import PathProbe
from gds_offload.node.reader import Reader, int_or_none, sysfs_pci_path
from gds_offload.node.system import GpuInfo

__all__ = ["GpuTopology", "Affinity", "gpu_topology", "pcie_affinity", "best_affinities"]


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


# nvidia-smi topo -m's words for a PCIe link, nearest first; see Affinity.
Link = Literal["PIX", "PXB", "PHB", "NODE", "SYS", "unknown"]


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
    link: Link
    hops: int | None = None
    gpu_numa: int | None = None
    drive_numa: int | None = None

    @property
    def rank(self) -> tuple[int, int]:
        """Sort key: closer links first, then fewer hops."""
        order = ("PIX", "PXB", "PHB", "NODE", "SYS", "unknown")
        return (order.index(self.link), self.hops if self.hops is not None else 99)


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
    return GpuTopology(gpu.index, sysfs_pci_path(real), int_or_none(Reader(root).text(real / "numa_node")))


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
    link: Link
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


def best_affinities(gpus: Sequence[GpuTopology], affinities: Sequence[Affinity]) -> tuple[Affinity, ...]:
    """The closest spill directory of each GPU (by :attr:`Affinity.rank`; first given wins ties).

    Args:
        gpus: the GPUs, in the order of the answer.
        affinities: every (GPU, path) pair, from :func:`pcie_affinity`.

    Returns:
        One affinity per GPU that has any, in ``gpus`` order.
    """
    best = []
    for topo in gpus:
        options = sorted((a for a in affinities if a.gpu_index == topo.index), key=lambda a: a.rank)
        if options:
            best.append(options[0])
    return tuple(best)
