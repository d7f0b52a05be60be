"""The weight benchmarks' working directories, memory groups and flags, at their edges.

* The default working directory is the user's own: ``<tmp>/gds_offload-bench-weights[-tiny]-<uid>``,
  made 0700, and refused (exit 2, before anything is read from it) when another user made it,
  as ``attach()`` refuses such a default spill directory.
* A benchmark child's memory group is made inside the group its parent runs in, so a cap
  cannot lift the child above the parent's own limit (a real parent group, a real child in it,
  a grandchild that allocates more than the parent's limit).
* The group of a parent killed with ``SIGKILL`` is removed, and said, at the next capped start.
* Every flag is checked before the first child starts: ``--memory-limit 0`` is an error, never
  "no cap"; an empty ``--path``/``--workdir`` is never "the default".
"""
from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from helpers.gates import requires_root

from gds_offload.bench.cgroup import CGROUP_V1_MEMORY, cap_available
from gds_offload.cli import main

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


class _Started(Exception):
    """Raised by the stand-ins of whatever would start a benchmark's work."""


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Any weight benchmark, child run, sweep or engine measurement fails the test; the spec a
    weight benchmark would have run with is not recorded (it never gets that far)."""
    import gds_offload.bench.procs as procs
    import gds_offload.bench.weights.bench as weights_bench
    import gds_offload.bench.weights.finetune as finetune_bench
    from gds_offload.bench import io as io_bench
    from gds_offload.bench.train import rok, runner

    def started(*_a: object, **_kw: object) -> None:
        raise _Started("work started before the arguments were checked")

    for module, name in ((weights_bench, "run_bench"), (finetune_bench, "run_finetune_bench"), (procs, "run_child"),
                         (runner, "run_mode"), (rok, "run_mode"), (io_bench, "run_bench")):  # fmt: skip
        monkeypatch.setattr(module, name, started)
    return []


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The weight benchmarks record the spec they would run with, and run nothing."""
    import gds_offload.bench.weights.bench as weights_bench
    import gds_offload.bench.weights.finetune as finetune_bench

    seen: list[Any] = []

    def record(spec: Any, *_a: object, **_kw: object) -> dict[str, Any]:
        seen.append(spec)
        raise _Started("recorded")

    monkeypatch.setattr(weights_bench, "run_bench", record)
    monkeypatch.setattr(finetune_bench, "run_finetune_bench", record)
    return seen


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    got = capsys.readouterr()
    return code, got.out + got.err


# ---------------------------------------------------------------------------- working directories
@pytest.mark.parametrize("command", ["bench-weights", "bench-finetune"])
def test_default_workdir_is_private_and_per_user(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorded: list[Any]) -> None:
    """No flag: the command works in ``<tmp>/gds_offload-bench-weights-tiny-<uid>``, made 0700 whatever the umask."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = os.umask(0o022)
    try:
        with pytest.raises(_Started):
            main([command, "--tiny"])
    finally:
        os.umask(old)
    (spec,) = recorded
    want = tmp_path / f"gds_offload-bench-weights-tiny-{os.getuid()}"
    assert Path(spec.workdir) == want
    st = want.lstat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


@requires_root
@pytest.mark.parametrize("command", ["bench-weights", "bench-finetune"])
def test_default_workdir_made_by_another_user_is_refused_unread(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                no_work: list[Any], capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Another user made the default directory first and left a FIFO where the store's manifest
    goes: the command exits 2 naming the directory and its owner, and opens nothing in it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    other = 4242
    planted = tmp_path / f"gds_offload-bench-weights-tiny-{os.getuid()}"
    (planted / "store").mkdir(parents=True)
    os.mkfifo(planted / "store" / "manifest.json")
    for p in (planted, planted / "store", planted / "store" / "manifest.json"):
        os.chown(p, other, other)
    code, text = _exit([command, "--tiny"], capsys)
    assert code == 2, text
    assert str(planted) in text and f"belongs to uid {other}" in text and "--workdir" in text, text


@pytest.mark.parametrize("command", ["bench-weights", "bench-finetune"])
def test_workdir_flag_is_checked_as_attach_checks_a_spill_directory(command: str, tmp_path: Path, no_work: list[Any],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """An empty --workdir is not the current directory; a world-writable one without the sticky bit is refused."""
    code, text = _exit([command, "--tiny", "--workdir", ""], capsys)
    assert code == 2 and "--workdir '' is empty" in text, text
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    code, text = _exit([command, "--tiny", "--workdir", str(open_dir)], capsys)
    assert code == 2 and f"--workdir {open_dir} is world-writable" in text, text


# ---------------------------------------------------------------------------- flags, before any child
LIMITS = ["0", "0GiB", "", "1MiB", "63MiB", "lots", "-1GiB"]


@pytest.mark.parametrize("command", ["bench-weights", "bench-finetune"])
@pytest.mark.parametrize("limit", LIMITS, ids=lambda v: v or "empty")
def test_memory_limit_refused_before_any_child(command: str, limit: str, tmp_path: Path, no_work: list[Any],
                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """``--memory-limit 0`` (or empty) is an error, not "no cap"; a limit under 64 MiB is refused
    up front, not when the first capped child starts after the resident one ran."""
    code, text = _exit([command, "--tiny", "--workdir", str(tmp_path / "w"), f"--memory-limit={limit}"], capsys)
    assert code == 2, text
    assert "--memory-limit" in text and len(text.strip().splitlines()) == 1, text


def test_run_rounds_checks_the_cap_before_the_first_child(tmp_path: Path) -> None:
    """The API as the commands: ``run_bench``/``run_finetune_bench`` (through :func:`run_rounds`)
    refuse a cap under 64 MiB before the uncapped resident child runs, not when the first capped one starts."""
    from gds_offload.bench.weights.bench import run_rounds
    from gds_offload.errors import ConfigError

    ran: list[str] = []
    with pytest.raises(ConfigError, match="below 64 MiB"):
        run_rounds(["resident", "drive"], 1, memory_limit=1 << 20, workdir=tmp_path, say=lambda text: None,
                   run=lambda mode, cap: ran.append(mode) or [])  # fmt: skip
    assert ran == []


def test_memory_cap_refused_where_no_group_can_be_made(tmp_path: Path) -> None:
    from gds_offload.bench.cgroup import check_limit
    from gds_offload.errors import ConfigError

    with pytest.raises(ConfigError, match="--memory-limit 1GiB: cannot cap memory: no cgroup v1 memory hierarchy"):
        check_limit(1 << 30, root=tmp_path, name="--memory-limit 1GiB")


BAD_WEIGHTS_FLAGS = [
    (["--dtype", "float8"], "--dtype"),
    (["--engine", "fast"], "--engine"),
    (["--raw-depths", "x"], "--raw-depths"),
    (["--raw-depths", "0"], "--raw-depths"),
    (["--raw-depths", ""], "--raw-depths"),
]


@pytest.mark.parametrize(("extra", "flag"), BAD_WEIGHTS_FLAGS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bench_weights_flags_refused_before_any_child(extra: list[str], flag: str, tmp_path: Path, no_work: list[Any],
                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    code, text = _exit(["bench-weights", "--tiny", "--workdir", str(tmp_path / "w"), *extra], capsys)
    assert code == 2 and flag in text and "Traceback" not in text, text
    assert not (tmp_path / "w").exists()  # refused before the directory is made


def test_bench_weights_cuda_without_a_gpu_refused(tmp_path: Path, no_work: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, text = _exit(["bench-weights", "--tiny", "--workdir", str(tmp_path / "w"), "--device", "cuda"], capsys)
    assert code == 2 and "--device cuda" in text, text


SIZE = ["--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "32", "--vocab", "64"]


@pytest.mark.parametrize("argv", [
    ["rok", *SIZE, "--batches", "1", "--placements", "keep,all", "--memory", "0"],
    ["rok", *SIZE, "--batches", "1", "--placements", "keep,all", "--memory", ""],
    ["bench", *SIZE, "--batch", "1", "--modes", "keep,offload:posix", "--out", "", "--plot", "", "--path", ""],
    ["bench-io", "--path", "", "--size", "1MiB", "--no-raw"],
], ids=lambda v: " ".join(x for x in v if x not in SIZE))  # fmt: skip
def test_activation_commands_refuse_zero_and_empty(argv: list[str], tmp_path: Path, no_work: list[Any],
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """rok --memory 0 is not "every memory"; an empty --path is not the current directory or the default."""
    if argv[0] == "rok":
        argv = [*argv, "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]
    code, text = _exit(argv, capsys)
    flag = "--memory" if "--memory" in argv else "path"
    assert code == 2 and flag in text, text


# ---------------------------------------------------------------------------- memory groups (root, cgroup v1)
needs_cgroup = pytest.mark.skipif(not cap_available()[0], reason=f"needs root and cgroup v1: {cap_available()[1]}")


def _memory_line(pid: int | str = "self") -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        parts = line.split(":", 2)
        if "memory" in parts[1].split(","):
            return parts[2]
    raise AssertionError(f"no memory line in /proc/{pid}/cgroup")


def _group_dir(line: str) -> Path:
    return CGROUP_V1_MEMORY / line.lstrip("/")


def _remove_tree(group: Path) -> None:
    """Remove ``group`` and the groups inside it (deepest first); they must hold no processes."""
    if not group.exists():
        return
    for top, dirs, _ in sorted(os.walk(group), key=lambda w: -len(w[0])):
        for d in dirs:
            (Path(top) / d).rmdir()
    group.rmdir()


@requires_root
@needs_cgroup
def test_memory_cap_is_made_inside_the_callers_own_group() -> None:
    from gds_offload.bench.cgroup import MemoryCap

    cap = MemoryCap(256 << 20)
    try:
        assert cap.path.parent == _group_dir(_memory_line())
        assert (cap.path / "memory.limit_in_bytes").read_text().strip() == str(256 << 20)
    finally:
        cap.close()
    assert not cap.path.exists()


#: The child a parent group holds: once moved (a line on stdin), it caps a grandchild at 2 GiB.
_CAPPING_CHILD = """
import json, os, sys
from gds_offload.bench.procs import run_child
sys.stdin.readline()
run = run_child([sys.executable, "-c", sys.argv[1]], env=dict(os.environ), memory_limit=2 << 30, timeout_s=300)
print(json.dumps({"rc": run.returncode, "out": run.out, "limit": run.cap.limit_bytes}), flush=True)
"""
#: Allocates (and touches) 1 GiB; the first process the kernel kills when its group is out of memory.
_HOG = """
import sys
open("/proc/self/oom_score_adj", "w").write("1000")
sys.stdin.readline()
hog = b"x" * (1 << 30)
print("allocated", len(hog), flush=True)
"""


@requires_root
@needs_cgroup
def test_capped_child_cannot_escape_the_parents_limit() -> None:
    """A parent group of 600 MiB; a real child in it caps a grandchild at 2 GiB; the grandchild
    allocates 1 GiB. It is killed inside the parent's limit: it did not escape it."""
    parent = _group_dir(_memory_line()) / f"gds_offload-test-parent-{os.getpid()}"
    limit = 600 << 20
    parent.mkdir()
    try:
        (parent / "memory.limit_in_bytes").write_text(str(limit))
        if (parent / "memory.memsw.limit_in_bytes").exists():
            (parent / "memory.memsw.limit_in_bytes").write_text(str(limit))  # no swapping out of it
        child = subprocess.Popen([sys.executable, "-c", _CAPPING_CHILD, _HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=_env())  # fmt: skip
        try:
            (parent / "cgroup.procs").write_text(str(child.pid))  # the child's pid; never this process's
            out, err = child.communicate("go\n", timeout=300)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["limit"] == 2 << 30
        assert "allocated" not in got["out"], "the grandchild allocated 1 GiB under a 600 MiB parent"
        assert got["rc"] == -signal.SIGKILL, got
        peak = int((parent / "memory.max_usage_in_bytes").read_text())
        assert limit - (16 << 20) <= peak <= limit, f"the parent's peak {peak} is not at its limit {limit}: reached and held"
        assert not [d for d in parent.iterdir() if d.is_dir()], "the child removed its group"
    finally:
        _remove_tree(parent)


#: A benchmark parent whose capped child, once in its group, reports itself on a FIFO and waits.
_PARENT = """
import os, sys
from gds_offload.bench.procs import run_child
child = '''
import os, signal, sys
from gds_offload.bench.procs import die_with_parent
die_with_parent()
sys.stdin.readline()
with open(sys.argv[1], "w") as fifo:
    fifo.write(str(os.getpid()) + "\\\\n")
signal.pause()
'''
run_child([sys.executable, "-c", child, sys.argv[1]], env=dict(os.environ), memory_limit=256 << 20, timeout_s=600)
"""


def _read_line(fd: int, timeout_s: float) -> str:
    """A line from ``fd``, failing the test (not hanging it) if none comes in ``timeout_s``."""
    buf = b""
    while not buf.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], timeout_s)
        assert ready, f"nothing on the FIFO within {timeout_s} s"
        buf += os.read(fd, 4096)
    return buf.decode().strip()


def _wait_gone(pid: int, timeout_s: float) -> None:
    """Until process ``pid`` (not this one's child) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        assert ready, f"process {pid} still runs {timeout_s} s after its parent was killed"
    finally:
        os.close(fd)


@requires_root
@needs_cgroup
def test_group_of_a_sigkilled_parent_is_removed_and_said_at_the_next_start(tmp_path: Path) -> None:
    """kill -9 of a benchmark parent leaves its child's memory group; the next capped start
    (:func:`run_rounds`) removes it and says so."""
    from gds_offload.bench.weights.bench import run_rounds

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # read-write: never blocks, never sees EOF
    group = None
    try:
        parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(fifo)], env=_env())
        try:
            child_pid = int(_read_line(fd, 120))
            group = _group_dir(_memory_line(child_pid))
            assert group.name.startswith(f"gds_offload-bench-{parent.pid}-"), group
        finally:
            parent.kill()  # SIGKILL: no finally block of its own runs
            parent.wait()
        _wait_gone(child_pid, 60)  # the child dies with its parent
        assert group.is_dir(), "the killed parent's group is left behind"
        said: list[str] = []
        run_rounds(["drive"], 1, memory_limit=256 << 20, workdir=tmp_path, say=said.append, run=lambda mode, cap: [])
        assert not group.exists()
        assert any(str(group) in line and f"benchmark parent {parent.pid}" in line for line in said), said
    finally:
        os.close(fd)
        if group is not None and group.exists():
            group.rmdir()


@requires_root
@needs_cgroup
def test_stale_group_removal_spares_live_parents_and_busy_groups() -> None:
    """A group of a live parent is kept; one named after a live pid with another start time is a
    reused pid's, so stale, and removed; a stale group that still holds a process is left, named."""
    from gds_offload.bench.cgroup import remove_stale_groups

    own = _group_dir(_memory_line())
    start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no process now
    live = own / f"gds_offload-bench-{os.getpid()}-t{start}-9001"
    reused = own / f"gds_offload-bench-{os.getpid()}-t{start + 1}-9002"
    busy = own / f"gds_offload-bench-{gone.pid}-t1-9003"
    sleeper = None
    try:
        for g in (live, reused, busy):
            g.mkdir()
        sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        (busy / "cgroup.procs").write_text(str(sleeper.pid))
        said = remove_stale_groups()
        assert live.is_dir() and not reused.exists() and busy.is_dir()
        assert any(str(reused) in line and "removed" in line for line in said), said
        assert any(str(busy) in line and "still holds processes" in line and str(sleeper.pid) in line for line in said), said
    finally:
        if sleeper is not None:
            sleeper.communicate("")
        for g in (live, reused, busy):
            if g.exists():
                g.rmdir()


#: A child of the protocol that echoes the spec it was given back as its result.
_ECHO_CHILD = """
import json, sys
from gds_offload.bench import procs
spec = json.loads(procs.read_spec(sys.argv[1:], "echo", "echo the spec"))
procs.emit({"event": "result", "result": {"n": len(spec["payload"]), "head": spec["payload"][:8]}})
"""


def test_a_spec_over_the_kernels_argument_limit_reaches_the_child_through_a_file(tmp_path: Path) -> None:
    """Linux refuses one argument over 128 KiB (E2BIG); a benchmark's spec may carry its
    micro-batches. Over the limit it travels as ``--spec @FILE``, which the child reads and removes."""
    import gds_offload.bench.procs as procs

    payload = "0123456789" * 30_000  # 300 kB
    spec = json.dumps({"payload": payload})
    cmd = procs.child_command("x", spec)
    assert cmd[-1].startswith("@") and len(cmd[-1]) < 4096
    script = tmp_path / "echo.py"
    script.write_text(_ECHO_CHILD)
    run = procs.run_child([sys.executable, str(script), "--spec", cmd[-1]], env=procs.child_env(), memory_limit=None, timeout_s=120)
    got = run.last("result")
    assert got is not None, run.failure()
    assert got["result"] == {"n": len(payload), "head": payload[:8]}
    assert not Path(cmd[-1][1:]).exists(), "the child removed the spec's file"
    assert procs.child_command("x", '{"a": 1}')[-1] == '{"a": 1}'  # a short spec stays on the command line
