"""The spill store (``gds_offload.io.spill``): unnamed 0600 files, O_DIRECT and its fallback,
directory checks, free-space errors, slot reuse, striping, and cleanup when the process dies."""
from __future__ import annotations

import fcntl
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.disks import fstype, is_root, tmpfs
from helpers.gates import FILE_ENGINE_MODES, requires_root

from gds_offload.errors import ConfigError, SpillSpaceError
from gds_offload.io import make_engine
from gds_offload.io.directory import prepare_dir
from gds_offload.io.layout import ALIGN
from gds_offload.io.spill import GROW_BYTES, SpillStore

REPO = Path(__file__).resolve().parent.parent


def _free_bytes(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


# ------------------------------------------------------------------------------ the files
def test_o_direct_is_used_on_a_real_filesystem(spill_dir: Path) -> None:
    kind = fstype(spill_dir)
    if kind not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"needs a drive with ext4/xfs/btrfs for O_DIRECT; {spill_dir} is on {kind}")
    store = SpillStore([spill_dir])
    try:
        f = store.files[0]
        assert f.direct and f.note == ""
        assert fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT, "the spill file descriptor lacks O_DIRECT"
    finally:
        store.close()


def test_spill_file_is_unnamed_and_private(spill_dir: Path) -> None:
    store = SpillStore([spill_dir])
    try:
        f = store.files[0]
        assert stat.S_IMODE(os.fstat(f.fd).st_mode) == 0o600
        assert os.listdir(spill_dir) == [], "the spill file must have no name"
        assert os.fstat(f.fd).st_nlink == 0
        store.allocate(5 * ALIGN)
        assert os.fstat(f.fd).st_size == store.file_bytes() == GROW_BYTES
    finally:
        store.close()
    assert f.fd == -1
    with pytest.raises(SpillSpaceError, match="closed"):
        store.allocate(ALIGN)
    store.close()  # idempotent


def test_direct_false_opens_buffered(spill_dir: Path) -> None:
    store = SpillStore([spill_dir], direct=False)
    try:
        f = store.files[0]
        assert not f.direct and "not requested" in f.note
        assert not fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        store.close()


def test_virtual_store_has_no_files() -> None:
    store = SpillStore([])
    assert store.virtual and store.files[0].fd == -1
    slot = store.allocate(10)
    assert slot.nbytes == ALIGN and slot.file.describe() == "host buffer pool #0"
    store.free(slot)
    store.close()


# ------------------------------------------------------------------- filesystems (root only)
@pytest.fixture
def mount(spill_dir: Path) -> Iterator[Callable[[str, str], Path]]:
    """``mount(fstype, options) -> Path``: a fresh filesystem under ``spill_dir``, unmounted afterwards."""
    mounted: list[Path] = []

    def do(fstype: str, options: str) -> Path:
        d = spill_dir / f"{fstype}-{len(mounted)}"
        d.mkdir(mode=0o700)
        proc = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, str(d)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"needs root to mount tmpfs (mount -t {fstype} failed: {proc.stderr.strip()})")
        mounted.append(d)
        return d

    yield do
    for d in reversed(mounted):
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _posix_roundtrip(store: SpillStore, sizes: list[int]) -> None:
    engine = make_engine("posix")
    try:
        for n in sizes:
            t = torch.randint(0, 256, (n,), dtype=torch.uint8)
            slot = store.allocate(n)
            engine.write(t, slot).wait()
            out = torch.empty_like(t)
            engine.read(out, slot).wait()
            assert torch.equal(out, t), n
    finally:
        engine.close()


@requires_root
@pytest.mark.root
def test_tmpfs_spill_and_its_space_limit(mount: Callable[[str, str], Path]) -> None:
    d = mount("tmpfs", "size=64m,mode=0700")
    store = SpillStore([d])
    try:
        f = store.files[0]
        # Linux >= 6.6 accepts O_DIRECT on tmpfs; older kernels refuse it and the store says why.
        assert f.direct or ("refused O_DIRECT" in f.note and "tmpfs" in f.note), f.note
        _posix_roundtrip(store, [1, 4095, 12345, 1 << 20])
        with pytest.raises(SpillSpaceError, match=rf"no room for {100 << 20} bytes .*{d}: No space left on device"):
            store.allocate(100 << 20)
    finally:
        store.close()


@requires_root
@pytest.mark.root
def test_buffered_fallback_records_why(mount: Callable[[str, str], Path]) -> None:
    d = mount("ramfs", "mode=0700")  # ramfs refuses O_DIRECT on every kernel
    store = SpillStore([d])
    try:
        f = store.files[0]
        assert not f.direct
        assert f.note == f"{d} refused O_DIRECT (ramfs); using buffered I/O"
        assert not fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT
        assert stat.S_IMODE(os.fstat(f.fd).st_mode) == 0o600 and os.listdir(d) == []
        _posix_roundtrip(store, [1, 4095, 12345, 9 << 20])
    finally:
        store.close()


# ------------------------------------------------------------------------ directory checks
def test_directory_checks(spill_dir: Path) -> None:
    missing = spill_dir / "missing"
    with pytest.raises(ConfigError, match=rf"path='{missing}' does not exist"):
        SpillStore([missing])
    assert prepare_dir(missing, create=True) == missing
    assert stat.S_IMODE(missing.stat().st_mode) == 0o700

    a_file = spill_dir / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        SpillStore([a_file])

    open_dir = spill_dir / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ConfigError, match=r"world-writable \(mode 777\) without the sticky bit.*chmod 700"):
        SpillStore([open_dir])
    open_dir.chmod(0o1777)  # like /tmp: others cannot remove or replace our files
    SpillStore([open_dir]).close()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a symlink to another user")
def test_symlink_owned_by_another_user_is_refused(spill_dir: Path) -> None:
    target = spill_dir / "real"
    target.mkdir(mode=0o700)
    mine = spill_dir / "mine"
    mine.symlink_to(target)
    SpillStore([mine]).close()  # our own symlink is fine
    theirs = spill_dir / "theirs"
    theirs.symlink_to(target)
    os.lchown(theirs, 12345, 12345)
    with pytest.raises(ConfigError, match=r"symlink owned by uid 12345, not by you .*refusing to follow it"):
        SpillStore([theirs])


# ------------------------------------------------------------------------------ free space
def test_free_space_check_names_path_needed_and_free(spill_dir: Path) -> None:
    huge = 1 << 60
    with pytest.raises(SpillSpaceError) as info:
        SpillStore([spill_dir], reserve_bytes=huge)
    msg = str(info.value)
    assert str(spill_dir) in msg and f"need {huge} bytes" in msg and "bytes free" in msg, msg
    assert os.listdir(spill_dir) == []
    SpillStore([spill_dir], reserve_bytes=1 << 20).close()  # a reserve that fits


# ------------------------------------------------------------------------ slots and reuse
def test_slots_are_aligned_and_disjoint(spill_dir: Path) -> None:
    store = SpillStore([spill_dir])
    try:
        slots = [store.allocate(n) for n in (0, 1, 4095, 4096, 4097, 123_457, 3 << 20)]
        for s, n in zip(slots, (0, 1, 4095, 4096, 4097, 123_457, 3 << 20)):
            assert s.offset % ALIGN == 0 and s.nbytes % ALIGN == 0 and s.nbytes >= max(n, 1)
        spans = sorted((s.offset, s.offset + s.nbytes) for s in slots)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "slots overlap"
        assert store.allocated_bytes() == sum(s.nbytes for s in slots)
    finally:
        store.close()


@pytest.mark.parametrize("ndirs", [1, 2])
def test_slot_reuse_keeps_the_file_flat(spill_dir: Path, ndirs: int) -> None:
    """Ten 'steps' of the same sizes, freed in a different order each step: the files stop growing."""
    dirs = [spill_dir / str(i) for i in range(ndirs)]
    for d in dirs:
        d.mkdir(mode=0o700)
    store = SpillStore(dirs)
    engine = make_engine("posix")
    rng = random.Random(5)
    sizes = [1 << 20, (3 << 20) + 5, 9 << 20, ALIGN, 123_457, 70 << 20, 17]
    src = torch.randint(0, 256, (max(sizes),), dtype=torch.uint8)
    try:
        high_water = []
        for _step in range(10):
            slots = [store.allocate(n) for n in sizes]
            for f in [engine.write(src[:n], s) for n, s in zip(sizes, slots)]:
                f.wait()
            rng.shuffle(slots)
            for s in slots[: len(slots) // 2]:  # half freed mid-step, as backward releases them
                store.free(s)
            extra = store.allocate(sizes[0])
            store.free(extra)
            for s in slots[len(slots) // 2 :]:
                store.free(s)
            assert store.allocated_bytes() == 0
            high_water.append(store.file_bytes())
        assert len(set(high_water)) == 1, f"spill file grew across steps: {high_water}"
        assert sum(os.fstat(f.fd).st_size for f in store.files) == high_water[0]
        assert all(f.free_bytes() == f.size for f in store.files), "free space did not coalesce"
    finally:
        engine.close()
        store.close()


@pytest.mark.parametrize("mode", FILE_ENGINE_MODES)
def test_striping_over_two_directories(mode: str, spill_dir: Path) -> None:
    dirs = [spill_dir / "a", spill_dir / "b"]
    for d in dirs:
        d.mkdir(mode=0o700)
    store = SpillStore(dirs)
    engine = make_engine(mode)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(6)
    try:
        srcs = [torch.randint(0, 256, ((1 << 20) + 3 * i,), dtype=torch.uint8, generator=gen) for i in range(8)]
        slots = [store.allocate(t.numel()) for t in srcs]
        for f in [engine.write(t, s) for t, s in zip(srcs, slots)]:
            f.wait()
        outs = [torch.empty_like(t) for t in srcs]
        for f in [engine.read(o, s) for o, s in zip(outs, slots)]:
            f.wait()
        assert all(torch.equal(a, b) for a, b in zip(srcs, outs))
        per_file = [sum(s.nbytes for s in slots if s.file is f) for f in store.files]
        assert all(n > 0 for n in per_file), f"bytes per directory: {per_file}"
        assert max(per_file) - min(per_file) <= max(s.nbytes for s in slots), f"unbalanced: {per_file}"
        for f in store.files:
            assert os.fstat(f.fd).st_blocks > 0, f"{f.dir} received no data"
    finally:
        engine.close()
        store.close()


# ------------------------------------------------------------------------------- crashes
_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    from gds_offload.io import make_engine
    from gds_offload.io.spill import SpillStore

    store = SpillStore([Path(sys.argv[1])])
    engine = make_engine("posix")
    t = torch.randint(0, 256, (int(sys.argv[2]) << 20,), dtype=torch.uint8)
    slots = [store.allocate(t.numel()) for _ in range(8)]  # 8 slots, rewritten forever
    rounds = 0
    while True:
        for f in [engine.write(t, s) for s in slots]:
            f.wait()
        rounds += 1
        if rounds == 1:
            print(store.file_bytes(), flush=True)
    """
)


def _open_files_under(d: Path) -> list[str]:
    """Every open file descriptor of any process whose target lies in ``d`` (as ``lsof +D`` would list)."""
    found = []
    prefix = str(d.resolve()) + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                found.append(f"pid {pid} fd {fd} -> {target}")
    return found


def _held_bytes(pid: int, d: Path) -> int:
    """Bytes of disk the files under ``d`` that process ``pid`` holds open take (named or not)."""
    prefix = str(d.resolve()) + "/"
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        link = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(link).startswith(prefix):
                held += os.stat(link).st_blocks * 512  # the open file itself, even unlinked
        except OSError:
            continue  # closed meanwhile
    return held


def test_killed_process_leaves_no_files_and_frees_the_space(spill_dir: Path) -> None:
    """A child writing its spill file round after round is killed: no name is left in the
    directory and no process holds a file there. Space is counted where no other writer
    changes it: the child's own file while it runs (its blocks, through /proc), and, as root,
    a private tmpfs whose free space is the child's alone, back to the byte once it is dead."""
    if is_root():
        with tmpfs(spill_dir / "private", "160m") as d:
            _kill_a_writing_child(d, slot_mib=16, counts_free_space=True)
    else:
        _kill_a_writing_child(spill_dir, slot_mib=64, counts_free_space=False)


def _kill_a_writing_child(d: Path, *, slot_mib: int, counts_free_space: bool) -> None:
    before = _free_bytes(d)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(d), str(slot_mib)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]  # the first round has landed; the next is under way
        assert line.strip(), f"child died before writing: {child.stderr.read()}"  # type: ignore[union-attr]
        spill_bytes = int(line)
        assert spill_bytes >= 8 * slot_mib << 20
        assert _held_bytes(child.pid, d) >= spill_bytes, "the child's spill file does not hold its bytes on disk"
        if counts_free_space:
            assert before - _free_bytes(d) >= spill_bytes, "the child's spill file uses the filesystem's space"
        held = _open_files_under(d)
        assert any(f"pid {child.pid} " in h and "(deleted)" in h for h in held), f"the child's spill file: {held}"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert os.listdir(d) == [], "a named file survived the crash"
    assert _open_files_under(d) == [], "some process still holds a spill file"  # so the kernel frees its blocks
    if counts_free_space:
        assert _free_bytes(d) == before, "the space came back once the child was dead"


def test_mount_of_matches_whole_path_components(mount: Callable[[str, str], Path]) -> None:
    """A directory whose name extends a mount point's (``.../tmpfs-0x`` beside a tmpfs at
    ``.../tmpfs-0``, like ``/mnt/nvme10`` beside ``/mnt/nvme1``) is not on that mount."""
    from gds_offload.io.directory import mount_of

    mounted = mount("tmpfs", "size=1m,mode=0700")
    beside = mounted.with_name(mounted.name + "x")
    beside.mkdir(mode=0o700)
    assert mount_of(mounted / "a")[1:] == (str(mounted.resolve()), "tmpfs")
    assert mount_of(beside)[1] != str(mounted.resolve()) and mount_of(beside)[2] != "tmpfs"
