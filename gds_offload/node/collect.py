"""Collecting: run every probe once for the node and each spill directory.

:func:`collect_node` returns a :class:`NodeReport`, the facts
:func:`~gds_offload.node.verdict.decide` turns into checks and a verdict. The probes
that need hardware (GPU list, libcufile search, the KvikIO child, free space) are fields
of :class:`Probes`, the injection boundary: tests replace them and hand fake ``/proc``,
``/sys``, ``/etc``, ``/dev`` and ``/run`` trees through ``root``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence, TypeVar

from gds_offload.io.directory import Origin
from gds_offload.io.kvikio.cufile_config import CufileConfig, read_cufile_config
from gds_offload.node.kvikio_child import KvikioProbe, probe_kvikio
from gds_offload.node.paths import PathProbe, probe_path, statvfs_space
from gds_offload.node.reader import Reader, env_map
from gds_offload.node.system import (
    ContainerProbe,
    GpuProbe,
    LibcufileProbe,
    NvidiaFsProbe,
    probe_container,
    probe_gpus,
    probe_libcufile,
    read_nvidia_fs,
)
from gds_offload.node.topology import Affinity, GpuTopology, gpu_topology, pcie_affinity

__all__ = ["NodeReport", "Probes", "DEFAULT_PROBES", "RELEVANT_ENV", "collect_node"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class NodeReport:
    """All facts about a node and its spill directories; input to :func:`~gds_offload.node.verdict.decide`.

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
    disk_space: Callable[[Path], tuple[int, int]] = statvfs_space


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
    origin: Origin = "--path",
) -> NodeReport:
    """Run every probe once for the node and each spill directory. Changes nothing.

    Args:
        paths: spill directories (a missing one is reported as attach would create it).
        root: root of the ``/proc``, ``/sys``, ``/etc``, ``/dev``, ``/run`` trees.
        env: environment; ``os.environ`` when None.
        probe_driver: let the KvikIO child open the cuFile driver.
        timeout_s: limit for the KvikIO child.
        probes: boundary functions (replace them in tests).
        origin: where ``paths`` came from (``--path``, ``GDS_OFFLOAD_DIR``, ``default``): the
            name the directory verdicts use (:func:`gds_offload.io.directory.check_dir`).

    Returns:
        The facts, ready for :func:`~gds_offload.node.verdict.decide`.
    """
    env = env_map(env)
    root = Path(root)
    reader = Reader(root)
    gpu = _guard(lambda: probes.gpus(root), lambda e: GpuProbe(error=f"GPU probe failed: {e}"))
    libcufile = _guard(lambda: probes.libcufile(root, env), lambda e: LibcufileProbe(False, searched=(f"error: {e}",)))
    kvikio = _guard(lambda: probes.kvikio(env, probe_driver, timeout_s),
                    lambda e: KvikioProbe(False, error=f"KvikIO probe failed: {e}"))
    nvidia_fs = _guard(lambda: read_nvidia_fs(reader), lambda e: NvidiaFsProbe(False))
    config = _guard(lambda: read_cufile_config(root, env),
                    lambda e: CufileConfig("/etc/cufile.json", False, error=str(e)))
    container = _guard(lambda: probe_container(root), lambda e: ContainerProbe(False, f"probe failed: {e}"))

    def path_probe(p: Path) -> PathProbe:
        return _guard(lambda: probe_path(Path(p), root=root, disk_space=probes.disk_space, origin=origin),
                      lambda e: PathProbe(str(p), error=f"path probe failed: {e}"))

    path_probes = tuple(path_probe(p) for p in paths)
    topology = tuple(gpu_topology(g, root) for g in gpu.gpus)
    affinities = tuple(pcie_affinity(t, p) for t in topology for p in path_probes if p.is_dir)
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


def _guard(call: Callable[[], _T], fallback: Callable[[str], _T]) -> _T:
    """``call()``, or ``fallback("Type: message")`` when it raises: a probe never raises."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        return fallback(f"{type(exc).__name__}: {exc}")
