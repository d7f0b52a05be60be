"""The ``gds-offload`` commands at their edges: signals, arguments refused before any work, sizes
that cannot fit, and what they print.

Commands that train (``demo``, ``bench``, ``rok``, ``bench-weights``) run each mode in a child
process; a termination signal to the command must stop and reap those children and leave
nothing behind. Every bad argument is refused (exit 2, naming the flag) before the first child
starts.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gds_offload.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
TINY_ARGS = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64", "--vocab", "256", "--batch", "2",
             "--warmup", "1", "--min-bytes", "0"]


# ---------------------------------------------------------------------------- signals
def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found.extend(kids)
        todo.extend(kids)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120")
    return subprocess.Popen([sys.executable, "-m", "gds_offload.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_child(proc: subprocess.Popen[str], marker: str, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the command ended early: {proc.communicate()}"
        kids = [k for k in _children(proc.pid) if marker in _cmdline(k)]
        if kids:
            return kids[0]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no child process running {marker} after {timeout_s} s")


SIGNALLED = {
    "demo": (["demo", *TINY_ARGS, "--steps", "100000", "--mode", "posix"], "gds_offload.bench.runner"),
    "bench": (["bench", *TINY_ARGS, "--steps", "100000", "--modes", "keep", "--out", "out.json", "--plot", "out.png"],
              "gds_offload.bench.runner"),
    "rok": (["rok", "--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "64", "--vocab", "256", "--batches", "2",
             "--placements", "keep", "--steps", "100000", "--warmup", "1", "--out", "rok.json", "--plot", "rok.png"],
            "gds_offload.bench.runner"),
    "bench-weights": (["bench-weights", "--tiny", "--modes", "resident", "--repeats", "100000", "--workdir", "{tmp}/wd"],
                      "gds_offload.weights.bench"),
}


@pytest.mark.parametrize(
    ("command", "signum"),
    [("demo", signal.SIGTERM), ("demo", signal.SIGHUP), ("demo", signal.SIGINT),
     ("bench", signal.SIGTERM), ("rok", signal.SIGTERM), ("bench-weights", signal.SIGTERM)],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else v,
)
def test_termination_signal_stops_the_command_and_its_children(command: str, signum: signal.Signals, tmp_path) -> None:
    """The signal reaches the running child, which is reaped; the command prints one line, exits
    128 + the signal number, and leaves no process and no file (before: SIGTERM orphaned the
    child, which kept training; SIGINT printed a traceback)."""
    if command == "bench-weights":
        pytest.importorskip("transformers")
    spill, cwd = tmp_path / "spill", tmp_path / "cwd"
    spill.mkdir(mode=0o700)
    cwd.mkdir()
    args, marker = SIGNALLED[command]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if command != "bench-weights":
        args += ["--path", str(spill)]
    proc = _start(args, cwd)
    child = _wait_for_child(proc, marker)
    time.sleep(1.5)  # the child is training now
    family = _children(proc.pid)
    assert child in family
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 128 + signum, (proc.returncode, err[-2000:])
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in family if _alive(p)], "a child outlived the command"
    lines = [line for line in err.strip().splitlines() if "it/s]" not in line]  # save_pretrained's progress bar
    assert len(lines) == 1 and "Traceback" not in err, err
    assert signum.name in lines[0] and command in lines[0], lines
    assert os.listdir(spill) == [] and os.listdir(cwd) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_ctrl_c_in_any_command_is_one_line_and_exit_130(command: str, monkeypatch, capsys) -> None:
    import importlib

    module = importlib.import_module(COMMANDS[command])

    def interrupted(_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "run", interrupted)
    argv = [command] + (["in", "out"] if command == "convert" else [])
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and command in err, err


def test_ctrl_c_in_gds_check_is_one_line_and_exit_130(monkeypatch, capsys) -> None:
    import gds_offload.check.cli as check_cli

    def interrupted(*_a: object, **_kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(check_cli, "collect_node", interrupted)
    assert check_cli.main(["--no-bench"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gds-check" in err and "interrupted" in err, err


# ---------------------------------------------------------------------------- demo output
@pytest.mark.parametrize("steps", [1, 3])
def test_demo_takes_any_step_count_and_pairs_what_it_can(steps: int, tmp_path, capsys) -> None:
    """An odd count runs: its last measured step is offloaded and unpaired (before: ``--steps 3``
    was refused with "use an even number")."""
    rc = main(["demo", *TINY_ARGS, "--steps", str(steps), "--mode", "posix", "--path", str(tmp_path)])
    text = capsys.readouterr().out
    assert rc == 0, text
    pairs = steps // 2
    assert (f"same process ({pairs} pair)" in text) == (pairs == 1), text
    assert "even number" not in text


def test_demo_frames_end_their_lines(tmp_path, capsys) -> None:
    """Each run's last frame ends its line before the next run's header (before: "...┘gds-offload demo: ...")."""
    assert main(["demo", *TINY_ARGS, "--steps", "2", "--mode", "host", "--path", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for line in text.splitlines():
        stripped = line.rstrip()
        assert "┘" not in stripped or stripped.endswith("┘"), line
    assert sum(line.startswith("gds-offload demo: ") for line in text.splitlines()) == 2, text
