"""Node probes for GPUDirect Storage: one truth about the node, shared by ``gds-check`` and ``mode="auto"``.

This module is the stable import point; the code lives in modules with one job each:

* :mod:`~gds_offload.node.system`: GPUs and CUDA versions, libcufile, nvidia-fs, container;
* :mod:`~gds_offload.node.kvikio_child`: KvikIO and the cuFile driver, in a child process;
* :mod:`~gds_offload.io.kvikio.cufile_config`: ``cufile.json``;
* :mod:`~gds_offload.node.paths`: spill directories (mounts, block device, O_DIRECT, space);
* :mod:`~gds_offload.node.topology`: GPU <-> drive PCIe/NUMA affinity;
* :mod:`~gds_offload.node.collect`: :class:`NodeReport`, the :class:`Probes` boundary,
  :func:`collect_node`;
* :mod:`~gds_offload.node.findings`: the checks (:class:`CheckResult`);
* :mod:`~gds_offload.node.verdict`: :func:`decide`, :func:`node_verdict`,
  :func:`report_checks`, :func:`worst_verdict` (:class:`Verdict`).

Every probe is a function over a *root* directory (``/`` on a real node; a fake tree in
tests) and never raises. Nothing here imports torch or KvikIO at module import time:
torch is imported inside :func:`probe_gpus`, KvikIO only in a child process
(:func:`probe_kvikio`).
"""
from __future__ import annotations

from gds_offload.io.kvikio.cufile_config import (
    CUFILE_REPORTED_KEYS,  # noqa: F401 - importable here before the split
    CufileConfig,
    read_cufile_config,
    strip_json_comments,
)
from gds_offload.node.collect import (
    DEFAULT_PROBES,
    RELEVANT_ENV,  # noqa: F401 - importable here before the split
    NodeReport,
    Probes,
    collect_node,
)
from gds_offload.node.findings import (
    GDS_DISTRIBUTED_FSTYPES,
    GDS_LOCAL_FSTYPES,
    LOW_FREE_BYTES,  # noqa: F401 - importable here before the split
    MIN_FREE_BYTES,
    CheckResult,
    Status,
)
from gds_offload.node.kvikio_child import KvikioProbe, probe_kvikio
from gds_offload.node.paths import (
    BlockDevice,
    MountEntry,
    PathProbe,
    default_spill_dir,
    find_mount,
    probe_block_device,
    probe_o_direct,
    probe_path,
    read_mounts,
)
from gds_offload.node.system import (
    ContainerProbe,
    GpuInfo,
    GpuProbe,
    LibcufileProbe,
    NvidiaFsProbe,
    probe_container,
    probe_gpus,
    probe_libcufile,
    probe_nvidia_fs,
)
from gds_offload.node.topology import Affinity, GpuTopology, gpu_topology, pcie_affinity
from gds_offload.node.verdict import Mode, Verdict, decide, node_verdict, report_checks, worst_verdict

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
