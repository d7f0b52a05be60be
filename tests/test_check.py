"""gds-check and the shared node probes (gds_offload/check/).

Node situations are simulated at the boundary: fake ``/proc``, ``/sys``, ``/etc``, ``/dev``
and ``/run`` trees under ``root`` (built in code here), plus injected GPU / libcufile /
KvikIO / free-space probes. Everything else (the spill directory, its O_DIRECT write,
``st_dev``) is real. Tests that mount a tmpfs need root and are marked ``root``; tests
that need an NVIDIA GPU or a GDS stack are marked ``gpu`` / ``gds``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from helpers.schema import schema_violations

import gds_offload.bench
from gds_offload.check.cli import main as check_main
from gds_offload.node import probes, reader
from gds_offload.node.probes import (
    BlockDevice,
    ContainerProbe,
    CufileConfig,
    GpuInfo,
    GpuProbe,
    GpuTopology,
    KvikioProbe,
    LibcufileProbe,
    NodeReport,
    NvidiaFsProbe,
    PathProbe,
    Probes,
    collect_node,
    decide,
    find_mount,
    node_verdict,
    pcie_affinity,
    probe_block_device,
    probe_kvikio,
    probe_o_direct,
    read_cufile_config,
    read_mounts,
    report_checks,
    strip_json_comments,
)

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30

# PCIe tree of the fake node: one switch under root port 00:01.0, GPU and NVMe on two of its
# downstream ports (nvidia-smi topo would say PIX).
GPU_BDF = "0000:03:00.0"
GPU_SYSFS = "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0"
NVME_SYSFS = "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:04:00.0"


def test_json_schema_is_a_valid_draft_2020_12_schema():
    """The published schema is itself valid (jsonschema's own meta-schema check), so a
    document's violations are the document's."""
    import jsonschema

    from gds_offload.check.report import JSON_SCHEMA

    jsonschema.Draft202012Validator.check_schema(JSON_SCHEMA)
    assert schema_violations({"schema": "gds-check/0"})  # wrong id, missing fields


# ------------------------------------------------------------------------------------------
# Fake node trees
# ------------------------------------------------------------------------------------------
def _write(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _link(link: Path, target_under_sys: str, sys_dir: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(sys_dir / target_under_sys, link.parent))


def make_node(
    root: Path,
    spill: Path,
    *,
    fstype: str = "ext4",
    options: str = "rw,relatime",
    mounts_text: str | None = None,
    nvidia_fs: bool = True,
    nvfs_devices: int = 16,
    udev: bool = True,
    docker: bool = False,
    cufile_json: str | None = "docker",
    nvme: bool = True,
) -> Path:
    """Build a fake /proc, /sys, /etc, /dev, /run tree for a node whose spill dir is ``spill``.

    The block device of ``spill``'s real ``st_dev`` is made to resolve to an NVMe
    partition (or a virtio disk with ``nvme=False``) sharing a PCIe switch with GPU0.
    """
    spill.mkdir(parents=True, exist_ok=True)
    sysd = root / "sys"
    if mounts_text is None:
        mounts_text = (f"/dev/vda / ext4 rw,relatime 0 0\n"
                       f"/dev/nvme0n1p1 {str(spill).replace(' ', chr(92) + '040')} {fstype} {options} 0 0\n")
    _write(root / "proc/mounts", mounts_text)
    _write(root / "proc/driver/nvidia/version",
           "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Thu Feb 20 2025\n")
    _write(root / "proc/sys/kernel/osrelease", "6.8.0-51-generic\n")
    _write(root / "proc/1/cgroup", "0::/init.scope\n")
    if nvidia_fs:
        _write(root / "proc/driver/nvidia-fs/version", "version: 2.24.3\n")
        _write(root / "proc/driver/nvidia-fs/stats", "GDS Version: 1.13.1.3\nNVFS statistics(ver: 4.0)\n")
        _write(root / "sys/module/nvidia_fs/version", "2.24.3\n")
    for i in range(nvfs_devices if nvidia_fs else 0):
        _write(root / f"dev/nvidia-fs{i}")
    _write(root / "dev/null")
    if udev:
        (root / "run/udev/data").mkdir(parents=True)
    if docker:
        _write(root / ".dockerenv")
    if cufile_json == "docker":
        _write(root / "etc/cufile.json", (REPO / "docker/cufile.json").read_text())
    elif cufile_json is not None:
        _write(root / "etc/cufile.json", cufile_json)
    # PCIe: GPU and NVMe controller under one switch.
    _write(sysd / GPU_SYSFS / "numa_node", "0\n")
    _link(sysd / "bus/pci/devices" / GPU_BDF, GPU_SYSFS, sysd)
    if nvme:
        _write(sysd / NVME_SYSFS / "numa_node", "0\n")
        disk_dir = f"{NVME_SYSFS}/nvme/nvme0/nvme0n1"
        part_dir = f"{disk_dir}/nvme0n1p1"
    else:
        disk_dir = "devices/pci0000:00/0000:00:02.0/virtio1/block/vda"
        part_dir = disk_dir
    _write(sysd / part_dir / "dev", "")
    if part_dir != disk_dir:
        _write(sysd / part_dir / "partition", "1\n")
    st = os.stat(spill)
    _link(sysd / "dev/block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", part_dir, sysd)
    return root


def fake_probes(
    *,
    gpu: bool = True,
    libcufile: bool = True,
    kvikio: bool = True,
    gds_available: bool = True,
    compat_preferred: bool = False,
    timed_out: bool = False,
    free_bytes: int = 500 * GIB,
) -> Probes:
    """Boundary probes of a node with an H200 and the cuFile stack (each piece switchable)."""
    gpus = (GpuInfo(0, "NVIDIA H200", 141 * GIB, GPU_BDF, "9.0"),) if gpu else ()

    def kvikio_probe(env, probe_driver, timeout_s):
        if not kvikio:
            return KvikioProbe(False, error="import kvikio failed: ModuleNotFoundError: No module named 'kvikio'")
        if timed_out:
            return KvikioProbe(True, "26.10.00", "AUTO", None, driver_ran=probe_driver, timed_out=True,
                               error=f"the KvikIO child did not finish within {timeout_s:g} s at stage 'driver'")
        return KvikioProbe(True, "26.10.00", "AUTO", compat_preferred, "1.13", driver_ran=probe_driver,
                           driver_ok=probe_driver, gds_available=gds_available if probe_driver else None,
                           properties={"major_version": 2, "minor_version": 24, "allow_compat_mode": True})

    return Probes(
        gpus=lambda root: GpuProbe(gpus, "2.9.1+cu128", "12.8", "12.8", "570.124.06",
                                   "" if gpu else "torch.cuda.is_available() is False"),
        libcufile=lambda root, env: (LibcufileProbe(True, "/usr/local/cuda/lib64/libcufile.so.0", "1.13.1", "ldconfig")
                                     if libcufile else LibcufileProbe(False, searched=("ldconfig -p",))),
        kvikio=kvikio_probe,
        disk_space=lambda path: (free_bytes, 1000 * GIB),
    )


@pytest.fixture(scope="module")
def needs_o_direct(tmp_path_factory):
    """Skip when the real temp filesystem rejects O_DIRECT (a gds verdict needs it)."""
    base = tmp_path_factory.mktemp("odirect")
    ok, how = probe_o_direct(base)
    if ok is not True:
        pytest.skip(f"the temp filesystem under {base} does not take O_DIRECT writes ({how})")


def verdict_for(tmp_path, *, env=None, probe_driver=False, probes_kw=None, **node_kw):
    spill = tmp_path / "spill"
    root = make_node(tmp_path / "root", spill, **node_kw)
    return node_verdict(spill, root=root, env=env or {}, probe_driver=probe_driver,
                        probes=fake_probes(**(probes_kw or {})))


def by_name(verdict, name):
    return [c for c in verdict.checks if c.name == name]


# ------------------------------------------------------------------------------------------
# The six node situations
# ------------------------------------------------------------------------------------------
def test_gds_ready_node(needs_o_direct, tmp_path):
    v = verdict_for(tmp_path)
    assert v.mode == "gds", (v.reason, v.checks)
    bad = [c for c in v.checks if c.status in ("warn", "fail")]
    assert bad == [], bad
    assert "ext4" in v.reason and "nvme0n1" in v.reason
    # The O_DIRECT probe ran for real on the real spill directory.
    assert by_name(v, "o_direct")[0].status == "ok"
    assert "PIX" in by_name(v, "gpu-affinity")[0].detail
    assert "2.24.3" in by_name(v, "nvidia-fs")[0].detail


def test_gds_ready_node_with_driver_probe(needs_o_direct, tmp_path):
    v = verdict_for(tmp_path, probe_driver=True)
    assert v.mode == "gds", v.reason
    assert by_name(v, "kvikio-driver")[0].status == "ok"


def test_node_without_nvidia_fs(tmp_path):
    v = verdict_for(tmp_path, nvidia_fs=False)
    assert v.mode == "compat"
    assert v.reason == "nvidia-fs kernel driver not loaded (/proc/driver/nvidia-fs missing)"
    assert "modprobe nvidia-fs" in v.fix


def test_docker_container_without_run_udev(tmp_path):
    v = verdict_for(tmp_path, docker=True, udev=False)
    assert v.mode == "compat"
    assert "/run/udev" in v.reason
    assert "-v /run/udev:/run/udev:ro" in v.fix
    assert "in a container (/.dockerenv)" in by_name(v, "container")[0].detail


def test_docker_container_without_nvidia_fs_devices(tmp_path):
    v = verdict_for(tmp_path, docker=True, nvfs_devices=0)
    assert v.mode == "compat"
    assert "/dev/nvidia-fs*" in v.reason
    assert "--device /dev/nvidia-fs0" in v.fix


def test_tmpfs_spill_dir(tmp_path):
    v = verdict_for(tmp_path, fstype="tmpfs", options="rw,nosuid,nodev")
    assert v.mode == "compat"
    assert v.reason.startswith("filesystem tmpfs")
    assert "ext4" in v.fix


def test_read_only_mount_is_unusable(tmp_path):
    # Root can write through a chmod 0500 directory, so read-only is simulated by the
    # mount's "ro" option in the fake /proc/mounts.
    v = verdict_for(tmp_path, options="ro,relatime")
    assert v.mode == "unusable"
    assert "read-only mount" in v.reason
    assert by_name(v, "writable")[0].status == "fail"


def test_full_disk_is_unusable(tmp_path):
    v = verdict_for(tmp_path, probes_kw={"free_bytes": 0})
    assert v.mode == "unusable"
    assert "no free space" in v.reason
    assert by_name(v, "free-space")[0].status == "fail"


# ------------------------------------------------------------------------------------------
# Other reasons and their order
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("piece, kwargs, expected", [
    ("gpu", {"probes_kw": {"gpu": False}}, "no GPU"),
    ("libcufile", {"probes_kw": {"libcufile": False}}, "libcufile not found"),
    ("kvikio", {"probes_kw": {"kvikio": False}}, "KvikIO not importable"),
    ("not nvme", {"nvme": False}, "block device vda is not NVMe"),
    ("data=journal", {"options": "rw,data=journal"}, "data=journal"),
    ("overlay", {"fstype": "overlay"}, "filesystem overlay"),
    ("nfs", {"fstype": "nfs4", "options": "rw,proto=tcp"}, "filesystem nfs4"),
    ("driver timeout", {"probe_driver": True, "probes_kw": {"timed_out": True}}, "timed out"),
    ("compat preferred", {"probe_driver": True, "probes_kw": {"compat_preferred": True}}, "prefers compat"),
    ("gds unavailable", {"probe_driver": True, "probes_kw": {"gds_available": False}}, "GDS unavailable"),
    ("KVIKIO_COMPAT_MODE", {"env": {"KVIKIO_COMPAT_MODE": "ON"}}, "KVIKIO_COMPAT_MODE=ON"),
    ("CUFILE_FORCE_COMPAT_MODE", {"env": {"CUFILE_FORCE_COMPAT_MODE": "true"}}, "CUFILE_FORCE_COMPAT_MODE"),
])
def test_compat_reason_names_the_missing_piece(tmp_path, piece, kwargs, expected):
    v = verdict_for(tmp_path, **kwargs)
    assert v.mode == "compat", piece
    assert expected in v.reason, (piece, v.reason)
    assert v.fix


def test_first_missing_piece_wins(tmp_path):
    v = verdict_for(tmp_path, nvidia_fs=False, fstype="tmpfs", probes_kw={"gpu": False})
    assert v.reason.startswith("no GPU")


def test_distributed_and_rdma_filesystems_are_gds_capable(needs_o_direct, tmp_path):
    for fstype, options in (("lustre", "rw"), ("wekafs", "rw"), ("nfs", "rw,vers=3,proto=rdma")):
        sub = tmp_path / fstype
        v = verdict_for(sub, fstype=fstype, options=options, nvme=False)
        assert v.mode == "gds", (fstype, v.reason)


def test_cufile_json_force_compat_and_denylist(tmp_path):
    text = '{"properties": {"force_compat_mode": true}}'
    v = verdict_for(tmp_path / "a", cufile_json=text)
    assert v.mode == "compat" and "force_compat_mode" in v.reason
    text = '{"denylist": {"filesystems": ["ext4"]}}'
    v = verdict_for(tmp_path / "b", cufile_json=text)
    assert v.mode == "compat" and "denylist.filesystems lists ext4" in v.reason


def test_missing_or_broken_cufile_json_only_warns(needs_o_direct, tmp_path):
    v = verdict_for(tmp_path / "a", cufile_json=None)
    assert v.mode == "gds"
    assert by_name(v, "cufile.json")[0].status == "warn"
    v = verdict_for(tmp_path / "b", cufile_json='{"logging": {"level": "ERROR",}}')
    assert v.mode == "gds"
    assert "not valid JSON" in by_name(v, "cufile.json")[0].detail


def test_p2pdma_without_nvidia_fs(needs_o_direct, tmp_path):
    text = '{"properties": {"use_pci_p2pdma": true}}'
    v = verdict_for(tmp_path / "a", nvidia_fs=False, cufile_json=text, probe_driver=True)
    assert v.mode == "gds", v.reason
    v = verdict_for(tmp_path / "b", nvidia_fs=False, cufile_json=text, probe_driver=False)
    assert v.mode == "compat" and "nvidia-fs" in v.reason
    assert "P2PDMA" in v.fix


def test_cuda_visible_devices_hint(tmp_path):
    v = verdict_for(tmp_path, env={"CUDA_VISIBLE_DEVICES": ""}, probes_kw={"gpu": False})
    assert "CUDA_VISIBLE_DEVICES" in by_name(v, "gpu")[0].hint


# ------------------------------------------------------------------------------------------
# Paths
# ------------------------------------------------------------------------------------------
def test_missing_dir_is_reported_not_created(tmp_path):
    """A check changes nothing: a missing directory is "missing, would be created 0700", and its
    nearest existing ancestor is what gets probed (gds-check must not create it, then say "exists")."""
    spill = tmp_path / "b"
    root = make_node(tmp_path / "root", tmp_path / "other")
    report = collect_node([spill], root=root, env={}, probe_driver=False, probes=fake_probes())
    probe = report.paths[0]
    assert not probe.exists and probe.would_create and probe.probed == str(tmp_path)
    assert not spill.exists() and sorted(os.listdir(tmp_path)) == ["other", "root"]
    v = decide(report, 0)
    assert v.mode != "unusable", v.reason
    path_line = by_name(v, "path")[0]
    assert path_line.status == "ok" and "missing, would be created 0700" in path_line.detail, path_line


def test_a_path_whose_parent_is_missing_is_named_as_attach_would_refuse_it(tmp_path):
    """--path /mnt/nvme9/spill (a mistyped drive): gds-check says what attach() would say, and creates nothing."""
    spill = tmp_path / "nvme9" / "spill"
    root = make_node(tmp_path / "root", tmp_path / "other")
    report = collect_node([spill], root=root, env={}, probe_driver=False, probes=fake_probes())
    probe = report.paths[0]
    assert not probe.would_create and f"its parent {tmp_path / 'nvme9'} does not exist" in probe.problem, probe
    assert f"the nearest existing parent is {tmp_path}" in probe.problem and not (tmp_path / "nvme9").exists()
    assert probe.problem.removeprefix(f"--path {spill}") == _attach_message(spill).removeprefix(f"path={str(spill)!r}")


def _attach_message(path):
    import torch

    import gds_offload

    with pytest.raises(gds_offload.ConfigError) as info:
        gds_offload.attach(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), path=path, mode="posix")
    return str(info.value)


def test_check_refuses_what_attach_refuses(tmp_path):
    """One truth: a world-writable directory without the sticky bit is unusable for gds-check
    too, with attach()'s own words (not compat for gds-check while attach refuses it)."""
    from gds_offload.io.directory import check_dir

    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    root = make_node(tmp_path / "root", tmp_path / "other")
    v = node_verdict(d, root=root, env={}, probe_driver=False, probes=fake_probes())
    assert v.mode == "unusable" and v.reason == check_dir(d, origin="--path").problem
    said = _attach_message(d)  # the same words, but for the name of the option and the alternative
    assert said.removeprefix(f"path={str(d)!r}").rsplit(", or ", 1)[0] == v.reason.removeprefix(f"--path {d}").rsplit(", or ", 1)[0]
    assert "world-writable (mode 777) without the sticky bit" in v.reason and "--path" in v.fix


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a symlink owned by another user (lchown)")
def test_check_refuses_a_symlink_owned_by_another_user(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, 12345, 12345)
    root = make_node(tmp_path / "root", tmp_path / "other")
    v = node_verdict(link, root=root, env={}, probe_driver=False, probes=fake_probes())
    assert v.mode == "unusable" and "symlink owned by uid 12345" in v.reason, v.reason
    assert "symlink owned by uid 12345" in _attach_message(link)


def test_regular_file_and_uncreatable_path_are_unusable(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    root = make_node(tmp_path / "root", tmp_path / "other")
    for path, words in ((afile, "not a directory"), (afile / "sub", "cannot be created")):
        v = node_verdict(path, root=root, env={}, probe_driver=False, probes=fake_probes())
        assert v.mode == "unusable", path
        assert words in v.reason
        assert "--path" in v.fix


def test_o_direct_probe_real_and_fallback(tmp_path, monkeypatch):
    ok, how = probe_o_direct(tmp_path)
    if ok is not True:
        pytest.skip(f"the filesystem under {tmp_path} rejects O_DIRECT here: {how}")
    assert "O_TMPFILE" in how
    # Without O_TMPFILE (open(dir, O_RDWR) fails with EISDIR) the named-file fallback runs.
    monkeypatch.setattr(os, "O_TMPFILE", 0)
    ok, how = probe_o_direct(tmp_path)
    assert ok is True and "named temporary file" in how
    assert list(tmp_path.iterdir()) == []


def test_mounts_longest_prefix_and_escapes(tmp_path):
    _write(tmp_path / "proc/mounts",
           "/dev/vda / ext4 rw 0 0\n"
           "/dev/nvme0n1 /mnt/nvme ext4 rw 0 0\n"
           "/dev/nvme1n1 /mnt/nvme\\0401 xfs rw 0 0\n"
           "tmpfs /mnt/nvme/scratch tmpfs rw 0 0\n")
    mounts = read_mounts(tmp_path)
    assert mounts[2].mountpoint == "/mnt/nvme 1"
    assert find_mount(Path("/mnt/nvme/a"), mounts).fstype == "ext4"
    assert find_mount(Path("/mnt/nvme 1/a"), mounts).fstype == "xfs"
    assert find_mount(Path("/mnt/nvme1"), mounts).mountpoint == "/"  # a prefix string is not a parent
    assert find_mount(Path("/mnt/nvme/scratch/x"), mounts).fstype == "tmpfs"


def test_md_raid_of_nvme_resolves_members(tmp_path):
    sysd = tmp_path / "sys"
    md = "devices/virtual/block/md0"
    for i, port in enumerate(("0000:02:10.0", "0000:02:18.0")):
        ctrl = f"devices/pci0000:00/0000:00:01.0/0000:01:00.0/{port}/0000:0{4 + i}:00.0"
        _write(sysd / ctrl / "numa_node", "1\n")
        disk = f"{ctrl}/nvme/nvme{i}/nvme{i}n1"
        _write(sysd / disk / "dev", "")
        _link(sysd / md / "slaves" / f"nvme{i}n1", disk, sysd)
    _write(sysd / md / "dev", "")
    _link(sysd / "dev/block/9:0", md, sysd)
    dev = probe_block_device(os.makedev(9, 0), tmp_path)
    assert dev.disk == "md0" and dev.members == ("nvme0n1", "nvme1n1") and dev.nvme
    assert dev.pci_address == "0000:04:00.0" and dev.numa_node == 1
    assert probe_block_device(os.makedev(0, 45), tmp_path) is None  # tmpfs/overlay
    assert "not found" in probe_block_device(os.makedev(8, 0), tmp_path).error


def test_pcie_affinity_classes():
    hb, rp = "pci0000:00", "0000:00:01.0"
    path = lambda pci, numa=0: PathProbe("/spill", exists=True,  # noqa: E731
                                         device=BlockDevice("259:0", "nvme0n1", nvme=True, pci_path=pci, numa_node=numa))
    gpu = GpuTopology(0, (hb, rp, "0000:01:00.0", "0000:02:08.0", "0000:03:00.0"), 0)
    assert pcie_affinity(gpu, path((hb, rp, "0000:01:00.0", "0000:02:10.0", "0000:04:00.0"))).link == "PIX"
    deep = (hb, rp, "0000:01:00.0", "0000:02:10.0", "0000:05:00.0", "0000:06:00.0", "0000:07:00.0")
    assert pcie_affinity(gpu, path(deep)).link == "PXB"
    assert pcie_affinity(gpu, path((hb, "0000:00:03.0", "0000:08:00.0"))).link == "PHB"
    assert pcie_affinity(gpu, path(("pci0000:80", "0000:80:01.0", "0000:81:00.0"), 0)).link == "NODE"
    far = pcie_affinity(gpu, path(("pci0000:80", "0000:80:01.0", "0000:81:00.0"), 1))
    assert far.link == "SYS" and far.hops == 7
    assert pcie_affinity(GpuTopology(0), path(())).link == "unknown"


def test_recommendation_picks_the_near_drive_per_gpu(tmp_path):
    near0 = ("pci0000:00", "0000:00:01.0", "0000:04:00.0")
    near1 = ("pci0000:80", "0000:80:01.0", "0000:84:00.0")
    paths = (
        PathProbe("/mnt/a", exists=True, is_dir=True, writable=True, free_bytes=GIB * 100, fstype="xfs",
                  o_direct=True, device=BlockDevice("259:0", "nvme0n1", nvme=True, pci_path=near0, numa_node=0)),
        PathProbe("/mnt/b", exists=True, is_dir=True, writable=True, free_bytes=GIB * 100, fstype="xfs",
                  o_direct=True, device=BlockDevice("259:1", "nvme1n1", nvme=True, pci_path=near1, numa_node=1)),
    )
    topo = (GpuTopology(0, ("pci0000:00", "0000:00:02.0", "0000:03:00.0"), 0),
            GpuTopology(1, ("pci0000:80", "0000:80:02.0", "0000:83:00.0"), 1))
    affinities = tuple(pcie_affinity(t, p) for t in topo for p in paths)
    gpus = tuple(GpuInfo(i, "NVIDIA H200", 141 * GIB) for i in range(2))
    report = NodeReport("/", {}, False, GpuProbe(gpus), LibcufileProbe(True, "x"), KvikioProbe(True),
                        NvidiaFsProbe(True, devices=("/dev/nvidia-fs0",)), CufileConfig("/etc/cufile.json", False),
                        ContainerProbe(False, udev_readable=True), paths, topo, affinities)
    checks = report_checks(report)
    rec = [c for c in checks if c.name == "recommendation"][0]
    assert rec.detail == "GPU0 -> /mnt/a (nvme0n1, PHB); GPU1 -> /mnt/b (nvme1n1, PHB)"
    assert any(c.name == "gpu-affinity@/mnt/b" and c.status == "warn" and "SYS" in c.detail for c in checks)
    assert decide(report, 1).mode == "gds"


# ------------------------------------------------------------------------------------------
# Parsing, robustness, privileges
# ------------------------------------------------------------------------------------------
def test_strip_json_comments_keeps_strings():
    text = '{\n // comment "x"\n "dir": "http://a//b", /* block\n */ "n": 1 // tail\n}'
    assert json.loads(strip_json_comments(text)) == {"dir": "http://a//b", "n": 1}
    assert strip_json_comments(text).count("\n") == text.count("\n")


def test_shipped_cufile_json_parses_and_reports_its_settings(tmp_path):
    _write(tmp_path / "etc/cufile.json", (REPO / "docker/cufile.json").read_text())
    cfg = read_cufile_config(tmp_path, {})
    assert cfg.parsed, cfg.error
    assert cfg.settings["properties.allow_compat_mode"] is True
    assert cfg.settings["properties.use_poll_mode"] is False
    assert cfg.settings["properties.max_direct_io_size_kb"] == 16384
    assert cfg.settings["logging.level"] == "ERROR"
    # CUFILE_ENV_PATH_JSON wins over /etc/cufile.json.
    _write(tmp_path / "opt/c.json", '{"logging": {"level": "TRACE"}}')
    assert read_cufile_config(tmp_path, {"CUFILE_ENV_PATH_JSON": "/opt/c.json"}).settings == {"logging.level": "TRACE"}


def test_probes_never_raise(tmp_path):
    def boom(*args, **kwargs):
        raise RuntimeError("driver exploded")

    spill = tmp_path / "spill"
    root = make_node(tmp_path / "root", spill)
    broken = Probes(gpus=boom, libcufile=boom, kvikio=boom, disk_space=boom)
    v = node_verdict(spill, root=root, env={}, probe_driver=True, probes=broken)
    assert v.mode == "compat"
    assert "driver exploded" in v.reason
    assert by_name(v, "free-space")[0].status == "skip"
    # An empty root (nothing under /proc or /sys) is an answer, not a crash.
    v = node_verdict(spill, root=tmp_path / "empty", env={}, probe_driver=False, probes=fake_probes())
    assert v.mode == "compat"


def test_unreadable_files_are_reported_as_needing_root(needs_o_direct, tmp_path, monkeypatch):
    spill = tmp_path / "spill"
    root = make_node(tmp_path / "root", spill)
    real_open = open

    def guarded(path, *args, **kwargs):
        if str(path).endswith("nvidia-fs/stats"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(reader, "open", guarded, raising=False)  # the module whose Reader opens files
    report = collect_node([spill], root=root, env={}, probe_driver=False, probes=fake_probes())
    assert report.unreadable == (str(root / "proc/driver/nvidia-fs/stats"),)
    check = [c for c in decide(report).checks if c.name == "nvidia-fs"][0]
    assert "unreadable without root" in check.detail and "root" in check.hint
    assert decide(report).mode == "gds"


def test_kvikio_child_answers_and_times_out():
    pytest.importorskip("kvikio", reason="KvikIO (kvikio-cu12) is not installed")
    answer = probe_kvikio(probe_driver=False, timeout_s=60)
    assert answer.importable, answer.error
    assert answer.compat_mode in ("AUTO", "ON", "OFF")
    late = probe_kvikio(probe_driver=True, timeout_s=0.01)
    assert late.timed_out and "did not finish within" in late.error


def test_check_modules_import_neither_torch_nor_kvikio():
    # Load gds_offload.check without running gds_offload/__init__.py (which attaches the
    # offloader and so imports torch): the checker's own modules must not import them.
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('gds_offload'); pkg.__path__ = [{str(REPO / 'gds_offload')!r}]\n"
        "sys.modules['gds_offload'] = pkg\n"
        "import gds_offload.check.cli, gds_offload.check.report, gds_offload.node.probes\n"
        "print(sorted(m for m in ('torch', 'kvikio', 'cupy', 'rich') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_the_check_package_does_not_import_torch():
    code = "import sys, gds_offload.check; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------
def _run_cli(*args, env_extra=None, timeout=120):
    env = dict(os.environ) | (env_extra or {})
    env.pop("KVIKIO_COMPAT_MODE", None)
    return subprocess.run([sys.executable, "-m", "gds_offload.check.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def _has_cuda_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda_gpu(), reason="this test expects a machine without a GPU")
def test_cli_json_on_a_cpu_machine(tmp_path):
    spill = tmp_path / "spill"
    done = _run_cli("--json", "--no-bench", env_extra={"GDS_OFFLOAD_DIR": str(spill)})
    assert done.returncode == 1, done.stderr
    doc = json.loads(done.stdout)
    assert schema_violations(doc) == []
    assert doc["verdict"] == "compat" and doc["exit_code"] == 1
    assert "no GPU" in doc["reason"]
    assert doc["paths"][0]["path"] == str(spill) and doc["paths"][0]["would_create"] and not spill.exists()
    assert doc["bandwidth"] == {} and doc["gpus"] == []
    assert {c["name"] for c in doc["checks"]} >= {"gpu", "libcufile", "kvikio", "nvidia-fs", "udev",
                                                   "cufile.json", "filesystem", "o_direct", "kvikio-driver"}
    assert not list(REPO.glob("cufile.log")), "the KvikIO child must not leave cufile.log in the cwd"


def test_cli_unusable_paths_exit_2(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    for path in (afile, afile / "below"):
        done = _run_cli("--json", "--no-bench", "--no-driver-probe", "--path", str(path))
        assert done.returncode == 2, done.stderr
        doc = json.loads(done.stdout)
        assert doc["verdict"] == "unusable" and schema_violations(doc) == []


def test_cli_table_and_usage_error(tmp_path):
    done = _run_cli("--no-bench", "--no-driver-probe", "--path", str(tmp_path), env_extra={"COLUMNS": "160"})
    assert done.returncode in (0, 1)
    assert "verdict:" in done.stdout and "o_direct" in done.stdout
    bad = _run_cli("--size", "lots")
    assert bad.returncode == 3 and "--size" in bad.stderr


def _fake_io_bench(calls):
    module = types.ModuleType("gds_offload.bench.io")

    def measure_engine(mode, path, total_bytes, tensor_bytes):
        calls.append((mode, Path(path), total_bytes, tensor_bytes))
        if mode == "posix":
            raise OSError("disk on fire")
        return {"engine": mode, "write_gbps": 1.5, "read_gbps": 2.5, "extra": "ignored"}

    def raw_direct_bandwidth(path, total_bytes):
        calls.append(("raw", Path(path), total_bytes, None))
        return {"write_gbps": 3.0, "read_gbps": 4.0}

    module.measure_engine = measure_engine
    module.raw_direct_bandwidth = raw_direct_bandwidth
    return module


def test_cli_bandwidth_uses_io_bench(tmp_path, monkeypatch, capsys):
    calls = []
    fake = _fake_io_bench(calls)
    monkeypatch.setitem(sys.modules, "gds_offload.bench.io", fake)
    # `from gds_offload.bench import io` reads the package attribute first (set once any
    # test imported the real module), then sys.modules.
    monkeypatch.setattr(gds_offload.bench, "io", fake, raising=False)
    monkeypatch.delenv("KVIKIO_COMPAT_MODE", raising=False)
    code = check_main(["--json", "--no-driver-probe", "--size", "1MiB", "--path", str(tmp_path)])
    doc = json.loads(capsys.readouterr().out)
    assert schema_violations(doc) == []
    assert code == doc["exit_code"]
    engines = [c[0] for c in calls]
    assert "posix" in engines and calls[0][2] == 1 << 20 and calls[0][3] == 1 << 20
    if "compat" in engines:
        assert doc["bandwidth"]["compat"] == {"engine": "compat", "write_gbps": 1.5, "read_gbps": 2.5}
    assert "disk on fire" in doc["bandwidth"]["posix"]["error"]
    if doc["paths"][0]["o_direct"]:
        assert doc["bandwidth"]["raw_o_direct"]["read_gbps"] == 4.0
    check = [c for c in doc["checks"] if c["name"] == "bandwidth"][0]
    assert check["status"] == "warn" and "posix" in check["detail"]


def test_cli_bandwidth_skips_without_io_bench(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gds_offload.bench.io", None)  # import fails
    monkeypatch.delattr(gds_offload.bench, "io", raising=False)
    check_main(["--json", "--no-driver-probe", "--size", "1MiB", "--path", str(tmp_path)])
    doc = json.loads(capsys.readouterr().out)
    check = [c for c in doc["checks"] if c["name"] == "bandwidth"][0]
    assert check["status"] == "skip" and "gds_offload.bench.io unavailable" in check["detail"]
    assert doc["bandwidth"] == {} and schema_violations(doc) == []


# ------------------------------------------------------------------------------------------
# Real mounts (root) and real hardware (gpu / gds)
# ------------------------------------------------------------------------------------------
@pytest.fixture
def tmpfs_mount(tmp_path):
    """Mount a small tmpfs; yields a function ``(size, ro=False) -> Path``."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mounted: list[Path] = []

    def mount(size: str, ro: bool = False) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"root but cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(target)
        (target / "spill").mkdir()
        if ro:
            subprocess.run(["mount", "-o", "remount,ro", str(target)], check=True)
        return target / "spill"

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", str(target)], check=False)


def _real_mounts_root(tmp_path: Path, spill: Path) -> Path:
    """A GDS-ready fake node whose /proc/mounts is the real one (real fstype and options)."""
    root = make_node(tmp_path / "realroot", spill)
    _write(root / "proc/mounts", Path("/proc/mounts").read_text())
    return root


@pytest.mark.root
def test_real_tmpfs_is_compat(tmp_path, tmpfs_mount):
    spill = tmpfs_mount("4m")
    v = node_verdict(spill, root=_real_mounts_root(tmp_path, spill), env={}, probe_driver=False, probes=fake_probes())
    assert v.mode == "compat" and v.reason.startswith("filesystem tmpfs")
    assert by_name(v, "block-device")[0].status == "skip"


@pytest.mark.root
def test_real_read_only_mount_is_unusable(tmp_path, tmpfs_mount):
    spill = tmpfs_mount("1m", ro=True)
    v = node_verdict(spill, root=_real_mounts_root(tmp_path, spill), env={}, probe_driver=False, probes=fake_probes())
    assert v.mode == "unusable" and "read-only" in v.reason


@pytest.mark.root
def test_real_full_disk_is_unusable(tmp_path, tmpfs_mount):
    spill = tmpfs_mount("256k")
    with open(spill / "fill", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    real = Probes(gpus=fake_probes().gpus, libcufile=fake_probes().libcufile, kvikio=fake_probes().kvikio)
    v = node_verdict(spill, root=_real_mounts_root(tmp_path, spill), env={}, probe_driver=False, probes=real)
    assert v.mode == "unusable" and "no free space" in v.reason


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda_gpu(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
def test_real_gpu_is_found(tmp_path):
    gpu = probes.probe_gpus()
    assert gpu.available and gpu.gpus[0].name and gpu.gpus[0].total_memory_bytes > 0
    assert gpu.cuda_runtime, "a CUDA build of torch reports torch.version.cuda"
    v = node_verdict(tmp_path, timeout_s=60)
    assert v.mode in ("gds", "compat")
    assert not v.reason.startswith("no GPU"), v.reason
    assert by_name(v, "gpu")[0].status == "ok"


@pytest.mark.gds
@pytest.mark.skipif(not Path("/proc/driver/nvidia-fs").exists() or not os.environ.get("GDS_TEST_DIR"),
                    reason="needs the nvidia-fs kernel driver (/proc/driver/nvidia-fs) and GDS_TEST_DIR "
                           "set to a directory on an NVMe ext4/xfs filesystem")
def test_real_gds_node():
    v = node_verdict(Path(os.environ["GDS_TEST_DIR"]), timeout_s=60)
    assert v.mode == "gds", (v.reason, v.fix)
