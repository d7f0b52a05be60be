"""Per-rank spill directories (gds_offload/activations/spill/ranks.py) and ``gds-check --ranks``, in one process.

The launches themselves (torchrun, srun, accelerate, Fabric, DeepSpeed) are in
``tests/distributed/``; here the launcher's environment is given explicitly.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gds_offload
from gds_offload.activations.spill.placement import AutoNode, DriveCandidate
from gds_offload.activations.spill.ranks import (
    RankEnv,
    auto_placement,
    node_placements,
    nvme_candidates,
    per_rank,
    place_rank,
    rank_env,
    rank_path,
)
from gds_offload.errors import ConfigError
from gds_offload.node.paths import BlockDevice, PathProbe
from gds_offload.node.topology import GpuTopology

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
SLURM = {"SLURM_PROCID": "5", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4"}
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", *SLURM, "SLURM_NPROCS", "SLURM_NODEID")


@pytest.fixture(autouse=True)
def _no_launch(monkeypatch, tmp_path):
    """No launcher variables from the outer environment; the default directory under tmp_path."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("GDS_OFFLOAD_DIR", str(tmp_path / "default"))


def test_rank_env_from_each_launcher():
    assert rank_env(TORCHRUN) == RankEnv("torchrun", 3, 1, 4, 2)
    assert rank_env(SLURM) == RankEnv("slurm", 5, 2, 8, 4)
    # srun torchrun ...: torchrun's variables describe the process
    assert rank_env({**SLURM, **TORCHRUN}).local_rank == 1
    assert rank_env({"SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "4(x2)"}).local_world_size == 4
    assert not rank_env({}).distributed and rank_env(TORCHRUN).distributed
    with pytest.raises(ConfigError, match="LOCAL_RANK='x' is not an integer"):
        rank_env({"LOCAL_RANK": "x"})


def test_templates_fill_from_the_launcher_and_name_the_missing_variable():
    assert place_rank("/mnt/nvme{local_rank}/spill", rank_env(TORCHRUN)).paths == (Path("/mnt/nvme1/spill"),)
    p = place_rank(["/mnt/a/{rank}", "/mnt/b/{rank}"], rank_env(SLURM))
    assert p.paths == (Path("/mnt/a/5"), Path("/mnt/b/5")) and p.how == "template"
    assert place_rank("/mnt/{{literal}}/{rank}", rank_env(TORCHRUN)).paths == (Path("/mnt/{literal}/3"),)
    with pytest.raises(ConfigError, match=r"neither LOCAL_RANK \(torchrun\) nor SLURM_LOCALID \(srun\) is set"):
        place_rank("/mnt/nvme{local_rank}/spill", rank_env({}))
    with pytest.raises(ConfigError, match="slurm set no SLURM_LOCALID"):
        place_rank("/mnt/nvme{local_rank}", rank_env({"SLURM_PROCID": "0"}))
    with pytest.raises(ConfigError, match=r"did you mean \{local_rank\}"):
        place_rank("/mnt/nvme{localrank}", rank_env(TORCHRUN))
    with pytest.raises(ConfigError, match="not a valid template"):
        place_rank("/mnt/nvme{", rank_env(TORCHRUN))
    # no field: as given, unchanged (attach keeps its own handling)
    plain = place_rank(["/mnt/a", "/mnt/b"], rank_env(TORCHRUN))
    assert not plain.changed and plain.paths == (Path("/mnt/a"), Path("/mnt/b"))


def test_per_rank_list_and_dict():
    env = rank_env(TORCHRUN)  # local rank 1
    assert place_rank(per_rank(["/a", "/b"]), env).paths == (Path("/b"),)
    assert place_rank(per_rank({"0": "/a", 1: ["/b", "/c"]}), env).paths == (Path("/b"), Path("/c"))  # a stripe of its own
    assert place_rank(per_rank({1: "/n{rank}"}), env).paths == (Path("/n3"),)
    with pytest.raises(ConfigError, match="entries for local ranks 0, but this process is local rank 1"):
        place_rank(per_rank(["/a"]), env)
    with pytest.raises(ConfigError, match="this process has none"):
        place_rank(per_rank(["/a"]), rank_env({}))
    with pytest.raises(ConfigError, match=r"is a dict; .*gds_offload.per_rank"):
        place_rank({0: "/a", 1: "/b"}, env)
    for bad, msg in ([[], "no entries"], ["/a", "one directory"], [{"x": "/a"}, "not a local rank"],
                     [{-1: "/a"}, "not a local rank"], [[[]], "non-empty list"], [[3], "must be a directory"]):
        with pytest.raises(ConfigError, match=msg):
            per_rank(bad)
    assert repr(per_rank(["/a", ["/b", "/c"]])) == "per_rank({0: '/a', 1: ['/b', '/c']})"


def test_default_path_is_per_rank_only_under_a_distributed_launch(tmp_path):
    assert rank_path(None, env={}) is None  # one process: attach's own default, unchanged
    got = rank_path(None, env=TORCHRUN)
    assert got == tmp_path / "default" / "rank3"
    for d in (got.parent, got):  # both private: the base is not left 0755 by mkdir(parents=True)
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert rank_path(None, env={**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}) is None
    # Lightning's launcher sets LOCAL_RANK and WORLD_SIZE, no RANK (before its process group exists)
    assert rank_path(None, env={"LOCAL_RANK": "1", "WORLD_SIZE": "2"}) == tmp_path / "default" / "local1"


def test_attach_under_torchrun_variables(tmp_path, monkeypatch):
    """attach() resolves path per rank: the default per rank, a template, per_rank, and a refused dict."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with gds_offload.attach(model, mode="posix") as off:
        assert off.config.paths == (tmp_path / "default" / "rank1",)
    (tmp_path / "nvme1").mkdir()
    with gds_offload.attach(model, path=str(tmp_path / "nvme{local_rank}"), mode="posix") as off:
        assert off.config.paths == (tmp_path / "nvme1",)
    with gds_offload.attach(model, path=gds_offload.per_rank([tmp_path / "x", [tmp_path / "nvme1", tmp_path]]), mode="posix") as off:
        assert off.config.paths == (tmp_path / "nvme1", tmp_path)
    with pytest.raises(ConfigError, match="per_rank"):
        gds_offload.attach(model, path={1: str(tmp_path)})
    # A named directory that does not exist is created 0700, as any explicit path is.
    with gds_offload.attach(model, path=str(tmp_path / "missing{rank}"), mode="posix") as off:
        assert off.config.paths == (tmp_path / "missing1",)
    assert (tmp_path / "missing1").stat().st_mode & 0o777 == 0o700


# ------------------------------------------------------------------------------------------
# "auto"
# ------------------------------------------------------------------------------------------
HB0, HB1 = "pci0000:00", "pci0000:80"


def _drive(name: str, pci: tuple[str, ...], numa: int, d: str) -> DriveCandidate:
    dev = BlockDevice("259:0", name, nvme=True, pci_path=pci, numa_node=numa)
    return DriveCandidate(Path(d), PathProbe(d, exists=True, device=dev))


def _gpu(i: int, pci: tuple[str, ...], numa: int) -> GpuTopology:
    return GpuTopology(i, pci, numa)


# Two sockets; on socket 0 one switch holds GPU0, GPU1 and nvme0; socket 1 has nvme1 and nvme2
# on its root ports and GPU2, GPU3 on their own.
SW0 = (HB0, "0000:00:01.0", "0000:01:00.0")
NODE = AutoNode(
    gpus=(
        _gpu(0, SW0 + ("0000:02:08.0", "0000:03:00.0"), 0),
        _gpu(1, SW0 + ("0000:02:0c.0", "0000:05:00.0"), 0),
        _gpu(2, (HB1, "0000:80:02.0", "0000:83:00.0"), 1),
        _gpu(3, (HB1, "0000:80:03.0", "0000:84:00.0"), 1),
    ),
    candidates=(
        _drive("nvme0n1", SW0 + ("0000:02:10.0", "0000:04:00.0"), 0, "/mnt/nvme0/gds"),
        _drive("nvme1n1", (HB1, "0000:80:01.0", "0000:81:00.0"), 1, "/mnt/nvme1/gds"),
        _drive("nvme2n1", (HB1, "0000:80:04.0", "0000:82:00.0"), 1, "/mnt/nvme2/gds"),
    ),
    default_dir=Path("/tmp/default"),
)


def test_auto_picks_the_closest_drive_and_spreads_ties():
    env = lambda r: RankEnv("torchrun", r, r, 4, 4)  # noqa: E731
    got = [auto_placement(env(r), NODE) for r in range(4)]
    assert [str(p.paths[0]) for p in got] == [
        "/mnt/nvme0/gds/rank0",  # PIX: the drive behind GPU0's own switch
        "/mnt/nvme0/gds/rank1",  # PIX too (same switch), rather than a drive on the other socket
        "/mnt/nvme1/gds/rank2",  # nvme1 and nvme2 are both PHB from GPU2 and GPU3 (nvme0: SYS):
        "/mnt/nvme2/gds/rank3",  # local rank l takes the (l mod 2)-th of them
    ], [p.how for p in got]
    assert got[0].how == "auto: GPU0 PIX to nvme0n1" and got[0].gpu == 0
    # The GPU the model is on wins over the local rank's number.
    assert auto_placement(env(0), NODE, gpu=2).gpu == 2
    # One visible GPU per process (CUDA_VISIBLE_DEVICES per rank): its own GPU 0.
    single = AutoNode(gpus=(NODE.gpus[2],), candidates=NODE.candidates, default_dir=Path("/tmp/default"))
    assert auto_placement(env(3), single).paths[0].parent.parent == Path("/mnt/nvme2")
    # Not distributed: no rank subdirectory.
    assert auto_placement(RankEnv(), NODE).paths == (Path("/mnt/nvme0/gds"),)


def test_auto_ties_are_shared_by_local_rank():
    same = (HB0, "0000:00:01.0", "0000:01:00.0")
    node = AutoNode(gpus=tuple(_gpu(i, (), None) for i in range(4)),
                     candidates=(_drive("nvme0n1", same, None, "/a"), _drive("nvme1n1", same, None, "/b")),
                     default_dir=Path("/tmp/d"))
    dirs = [auto_placement(RankEnv("torchrun", r, r, 4, 4), node).paths[0].parent for r in range(4)]
    assert dirs == [Path("/a"), Path("/b"), Path("/a"), Path("/b")]


def test_auto_without_gpus_or_drives_falls_back_to_the_default_per_rank():
    env = RankEnv("torchrun", 1, 1, 2, 2)
    cpu = auto_placement(env, AutoNode(default_dir=Path("/tmp/d")))
    assert cpu.paths == (Path("/tmp/d/rank1"),) and cpu.how == "auto: no GPU; default directory"
    assert cpu.create == (Path("/tmp/d"), Path("/tmp/d/rank1"))
    with pytest.warns(RuntimeWarning, match="found no writable NVMe"):
        none = auto_placement(env, AutoNode(gpus=NODE.gpus, default_dir=Path("/tmp/d")))
    assert none.paths == (Path("/tmp/d/rank1"),)
    # This machine (no GPU): attach(path="auto") spills to the default directory.
    assert rank_path("auto", env={}) == Path(os.environ["GDS_OFFLOAD_DIR"])


def _fake_mounts(root: Path, lines: list[str]) -> None:
    (root / "proc").mkdir(parents=True, exist_ok=True)
    (root / "proc/mounts").write_text("".join(line + "\n" for line in lines))


def test_nvme_candidates_from_mounts(tmp_path):
    root, default = tmp_path / "root", tmp_path / "tmp" / "gds_offload-x"
    mnt = {n: tmp_path / n for n in ("nvme0", "nvme1", "sata", "ro", "dup", "boot_like")}
    for d in mnt.values():
        d.mkdir()
    (tmp_path / "hosts").write_text("")
    (tmp_path / "tmp").mkdir()
    _fake_mounts(root, [
        f"/dev/nvme9n1p1 {tmp_path / 'tmp'} ext4 rw 0 0",          # holds the default directory
        f"/dev/nvme0n1 {mnt['nvme0']} xfs rw 0 0",
        f"/dev/nvme1n1 {mnt['nvme1']} ext4 rw,relatime 0 0",
        f"/dev/sda1 {mnt['sata']} ext4 rw 0 0",                    # not NVMe
        f"/dev/nvme2n1 {mnt['ro']} ext4 ro 0 0",                   # read-only
        f"/dev/nvme0n1 {mnt['dup']} xfs rw 0 0",                   # a second mount of nvme0
        f"/dev/nvme3n1 {tmp_path / 'hosts'} ext4 rw 0 0",          # a file (container bind mount)
        "tmpfs /dev/shm tmpfs rw 0 0",
    ])
    disks = {str(tmp_path / "tmp"): "nvme9n1", str(mnt["nvme0"]): "nvme0n1", str(mnt["nvme1"]): "nvme1n1",
             str(mnt["sata"]): "sda", str(mnt["ro"]): "nvme2n1", str(mnt["dup"]): "nvme0n1", str(tmp_path / "hosts"): "nvme3n1"}

    def device_of(mp: str) -> BlockDevice | None:
        name = disks.get(mp)
        return None if name is None else BlockDevice("259:0", name, nvme=name.startswith("nvme"))

    found, notes = nvme_candidates(default, root, device_of=device_of)
    uid = os.getuid()
    assert [c.dir for c in found] == [default, mnt["nvme0"] / f"gds_offload-{uid}", mnt["nvme1"] / f"gds_offload-{uid}"]
    assert [c.probe.device.disk for c in found] == ["nvme9n1", "nvme0n1", "nvme1n1"]
    assert notes == ()


def test_nvme_candidates_resolve_through_sysfs(tmp_path):
    """The default device lookup: st_dev -> /sys/dev/block -> an NVMe partition with a PCI path."""
    root, mnt = tmp_path / "root", tmp_path / "mnt"
    mnt.mkdir()
    _fake_mounts(root, [f"/dev/nvme0n1p1 {mnt} ext4 rw 0 0"])
    sysd = root / "sys"
    ctrl = "devices/pci0000:00/0000:00:01.0/0000:04:00.0"
    part = sysd / ctrl / "nvme/nvme0/nvme0n1/nvme0n1p1"
    part.mkdir(parents=True)
    (part / "partition").write_text("1\n")
    (sysd / ctrl / "numa_node").write_text("0\n")
    st = os.stat(mnt)
    link = sysd / "dev/block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(part, link.parent))
    found, _ = nvme_candidates(tmp_path / "elsewhere" / "d", root)
    assert len(found) == 1 and found[0].probe.device.disk == "nvme0n1"
    assert found[0].probe.device.pci_path == ("pci0000:00", "0000:00:01.0", "0000:04:00.0")


def test_node_placements_for_gds_check(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "1")
    rows = node_placements("/mnt/nvme{local_rank}/r{rank}", 2)
    assert [(p.rank, p.local_rank, str(p.paths[0])) for p in rows] == [(2, 0, "/mnt/nvme0/r2"), (3, 1, "/mnt/nvme1/r3")]


def test_gds_check_ranks_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "GDS_OFFLOAD_DIR": str(tmp_path / "d")}
    for k in LAUNCH_VARS:
        env.pop(k, None)
    run = lambda *a: subprocess.run([sys.executable, "-m", "gds_offload.check.cli", *a], env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    out = run("--ranks", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [
        {"rank": r, "local_rank": r, "gpu": None, "paths": [str(tmp_path / "d" / f"rank{r}")], "how": "default, per rank"}
        for r in (0, 1)
    ]
    assert not (tmp_path / "d").exists()  # shows, creates nothing
    table = run("--ranks", "2", "--path", "/mnt/nvme{local_rank}/spill")
    assert table.returncode == 0 and "/mnt/nvme1/spill" in table.stdout and "template" in table.stdout
    bad = run("--ranks", "2", "--path", "/mnt/{lr}")
    assert bad.returncode == 3 and "names {lr}" in bad.stderr


def test_all_ranks_stats_refused_without_a_process_group(tmp_path):
    assert not torch.distributed.is_initialized()
    with gds_offload.attach(torch.nn.Sequential(torch.nn.Linear(8, 8)), path=tmp_path, mode="posix") as off:
        with pytest.raises(ConfigError, match=r"none is initialised in this process; call torch.distributed.init_process_group\(\)"):
            off.stats(all_ranks=True)
        assert off.stats().ranks == 1
