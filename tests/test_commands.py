"""The ``gds-offload`` commands at their edges: signals, arguments refused before any work, sizes
that cannot fit, and what they print.

Commands that train (``demo``, ``bench``, ``rok``, ``bench-weights``) run each mode in a child
process; a termination signal to the command must stop and reap those children and leave
nothing behind. Every bad argument is refused (exit 2, naming the flag) before the first child
starts.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.procs import alive, children, cmdline, cpu_seconds

from gds_offload.bench.train.demo_view import PAIRED_NOTE
from gds_offload.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
TINY_ARGS = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64", "--vocab", "256", "--batch", "2",
             "--warmup", "1", "--min-bytes", "0"]


# ---------------------------------------------------------------------------- signals
def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    """The command as a user starts it from a terminal: with SIGINT's default disposition, which
    a runner started in the background (``nohup``, ``cmd &`` without job control) would
    otherwise pass down as ignored, and Python then installs no KeyboardInterrupt handler."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120")
    return subprocess.Popen([sys.executable, "-m", "gds_offload.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
    except OSError:
        return False


def _wait_until(proc: subprocess.Popen[str], done: Callable[[], object], what: str,
                *, idle_s: float = 30, cpu_s: float = 120) -> None:
    """Poll until ``done()`` is true. A busy machine stretches the wall time the command takes,
    not the CPU time it needs, so the limits are not on wall time: the test fails when the
    command and its children have used ``cpu_s`` CPU-seconds (a loop), or when for ``idle_s``
    they used none and none was runnable (a hang)."""
    start = used = cpu_seconds(proc.pid)
    moved = time.monotonic()
    while not done():
        family = [proc.pid, *children(proc.pid)]
        now = sum(cpu_seconds(p) for p in family)
        if now != used or any(_running(p) for p in family):
            used, moved = now, time.monotonic()
        stuck = f"was idle for {idle_s:.0f} s" if time.monotonic() - moved > idle_s else ""
        if stuck or now - start > cpu_s:
            proc.kill()
            raise AssertionError(f"waiting for {what}: the command {stuck or f'used {cpu_s:.0f} CPU-seconds'}")
        time.sleep(0.2)


def _wait_for_child(proc: subprocess.Popen[str], marker: str) -> int:
    kids: list[int] = []

    def found() -> bool:
        assert proc.poll() is None, f"the command ended early: {proc.communicate()}"
        kids.extend(k for k in children(proc.pid) if marker in cmdline(k))
        return bool(kids)

    _wait_until(proc, found, f"a child process running {marker}")
    return kids[0]


def _stderr_at_exit(proc: subprocess.Popen[str]) -> str:
    """What the command wrote on stderr, once it has exited (its pipes are drained meanwhile)."""
    streams: list[tuple[str, str]] = []

    def exited() -> bool:
        try:
            streams.append(proc.communicate(timeout=0.2))
        except subprocess.TimeoutExpired:
            return False
        return True

    _wait_until(proc, exited, "the command to exit")
    return streams[0][1]


SIGNALLED = {
    "demo": (["demo", *TINY_ARGS, "--steps", "100000", "--mode", "posix"], "gds_offload.bench.train.child"),
    "bench": (["bench", *TINY_ARGS, "--steps", "100000", "--modes", "keep", "--out", "out.json", "--plot", "out.png"],
              "gds_offload.bench.train.child"),
    "rok": (["rok", "--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "64", "--vocab", "256", "--batches", "2",
             "--placements", "keep", "--steps", "100000", "--warmup", "1", "--out", "rok.json", "--plot", "rok.png"],
            "gds_offload.bench.train.child"),
    "bench-weights": (["bench-weights", "--tiny", "--modes", "resident", "--repeats", "100000", "--workdir", "{tmp}/wd"],
                      "gds_offload.bench.weights.child"),
}


@pytest.mark.parametrize(
    ("command", "signum"),
    [("demo", signal.SIGTERM), ("demo", signal.SIGHUP), ("demo", signal.SIGINT),
     ("bench", signal.SIGTERM), ("rok", signal.SIGTERM), ("bench-weights", signal.SIGTERM)],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else v,
)
def test_termination_signal_stops_the_command_and_its_children(command: str, signum: signal.Signals, tmp_path) -> None:
    """The signal reaches the running child, which is reaped; the command prints one line, exits
    128 + the signal number, and leaves no process and no file: no orphaned child training on,
    no traceback."""
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
    # Past its start (about a CPU-second), on an idle or a busy machine alike.
    _wait_until(proc, lambda: cpu_seconds(child) >= 1, "the child to run")
    family = children(proc.pid)
    assert child in family
    proc.send_signal(signum)
    err = _stderr_at_exit(proc)
    assert proc.returncode == 128 + signum, (proc.returncode, err[-2000:])
    deadline = time.monotonic() + 5
    while any(alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in family if alive(p)], "a child outlived the command"
    lines = [line for line in err.strip().splitlines() if "it/s]" not in line]  # save_pretrained's progress bar
    # Progress lines may come first (bench-weights logs its phases); the stop is one line, the last.
    assert "Traceback" not in err and sum(command in line and signum.name in line for line in lines) == 1, err
    assert signum.name in lines[-1] and command in lines[-1], lines
    assert os.listdir(spill) == [] and os.listdir(cwd) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_ctrl_c_in_any_command_is_one_line_and_exit_130(command: str, monkeypatch, capsys) -> None:
    import importlib

    module = importlib.import_module(COMMANDS[command])

    def interrupted(_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "run", interrupted)
    argv = [command] + {"convert": ["in", "out"], "export": ["store", "out"], "plan": ["store", "--memory", "1GiB"]}.get(command, [])  # their positional arguments
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
    """An odd count runs (``--steps 3`` is not refused): its last measured step is offloaded and
    unpaired."""
    rc = main(["demo", *TINY_ARGS, "--steps", str(steps), "--mode", "posix", "--path", str(tmp_path), "--out", ""])
    text = capsys.readouterr().out
    assert rc == 0, text
    pairs = steps // 2
    assert ("offloaded / paused, 1 pair" in text) == (pairs == 1), text
    assert "even number" not in text


def test_demo_off_a_terminal_prints_a_plain_line_per_step(tmp_path, capsys) -> None:
    """Off a terminal (pytest captures stdout) the demo prints its title once, then one plain line
    per run, setup and step, and no half-drawn table: every table border ends its line."""
    assert main(["demo", *TINY_ARGS, "--steps", "2", "--mode", "host", "--path", str(tmp_path), "--out", ""]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines.count(PAIRED_NOTE) == 1, "the paused steps are explained once, before the first one"
    for line in lines:
        stripped = line.rstrip()
        assert "┘" not in stripped or stripped.endswith("┘"), line
    assert sum(line.startswith("gds-offload demo: ") for line in lines) == 1, lines
    for run in ("run 1/2: keep", "run 2/2: offload:host"):
        steps = [line for line in lines if line.startswith(f"{run}: step ")]
        assert [s.split()[4] for s in steps] == ["1", "2", "3"], lines  # 1 warm-up + 2 measured steps, each a line
        assert any(line.startswith(f"{run}: starting") for line in lines)


def test_the_small_demo_says_why_nothing_moved_and_where_it_wrote(tmp_path, capsys) -> None:
    """The issue's small demo: every saved tensor falls under min_bytes, and the summary says so
    and what to change; the results and their plot are written where the last line says."""
    out = tmp_path / "demo.json"
    rc = main(["demo", "--layers", "2", "--hidden", "128", "--seq", "64", "--batch", "2", "--mode", "posix", "--path", str(tmp_path),
               "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "Nothing was offloaded" in text and "every saved tensor was smaller than min_bytes (1 MiB)" in text, text
    assert "Pass --min-bytes 0" in text and "offloaded / paused: the offload run alternates steps" in text
    assert json.loads(out.read_text())["kind"] == "demo"
    png = out.with_suffix(".png")
    assert text.splitlines()[-1] == f"results: {out}, plot: {png}" and png.read_bytes()[:4] == b"\x89PNG"


def test_the_default_demo_is_the_short_run_and_full_the_long_one() -> None:
    from gds_offload.cli import build_parser
    from gds_offload.commands.demo import run_lengths
    from gds_offload.commands.run_args import base_spec

    for argv, want in ((["demo"], (256, 4, 1, 4)), (["demo", "--full"], (512, 4, 2, 8)), (["demo", "--full", "--steps", "3"], (512, 4, 2, 3))):
        args = build_parser().parse_args(argv)
        run_lengths(args)
        spec = base_spec(args, "cpu")
        assert (spec.seq, spec.batch, spec.warmup, spec.steps) == want, argv
        assert (spec.layers, spec.hidden) == (12, 768), "GPT-2 small's depth and width either way"


def test_the_demo_tables_fit_80_columns_without_cutting_a_cell() -> None:
    import io

    from rich.console import Console

    from gds_offload.bench.train.demo_view import LiveView, render_summary
    from gds_offload.bench.train.spec import RunResult

    screen = io.StringIO()
    console = Console(file=screen, width=80, force_terminal=False)
    view = LiveView(console, "gds-offload demo: gpt layers=12 hidden=768 heads=12 seq=256 batch=4 on cpu, 1 warm-up + 4 steps per run")
    view.label, view.setup = "run 2/2: offload:auto", {"engine": "posix", "gds": False, "engine_reason": "the model is on the CPU"}
    big = {"resident_bytes": 1020 << 20, "peak_resident_bytes": 1020 << 20, "write_gbps": 12.34, "read_gbps": 23.45}
    for i, phase in enumerate(["warmup", "measure", "paused", "paused", "measure"]):
        view.rows.append({"step": 100 + i, "phase": phase, "loss": 10.123456, "step_s": 123.45, "rss_bytes": 1020 << 20, "offload": big})
    console.print(view.render())
    stats = {"steps": 4, "peak_resident_bytes": 1020 << 20, "io_wait_s": 0.1, "write_s": 1.0, "read_s": 1.0, "engine": "posix", "gds": False}
    stats |= {k: 1020 << 20 for k in ("bytes_packed", "bytes_offloaded", "bytes_deduplicated", "bytes_forwarded", "bytes_read", "bytes_kept")}
    keep = RunResult("keep", "ok", median_step_s=123.456, peak_activation_bytes=1020 << 20, input_wait_s=[0.0001])
    off = RunResult("offload:compat", "ok", median_step_s=123.456, peak_activation_bytes=1020 << 20, input_wait_s=[0.0001],
                    step_s=[1.0, 1.0], paired_keep_s=[1.0, 1.0], offload=stats)  # fmt: skip
    console.print(render_summary(keep, off, True))
    text = screen.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80, text
    for cell in ("10.123456", "123.45 s", "1020 MiB", "12.3/23.4", "paused", "warm-up", "offload", "peak held", "offloaded / paused, 2 pairs"):
        assert cell in text, (cell, text)


def test_demo_into_a_pipe_shows_each_step_as_it_runs_and_stops_on_a_line_of_its_own(tmp_path) -> None:
    """``gds-offload demo`` with stdout and stderr into one pipe (a log file, CI): the first step's
    line arrives while the run goes on; SIGTERM then ends it with "stopped by SIGTERM" at the start
    of a line, not glued to a table border."""
    proc = subprocess.Popen([sys.executable, "-m", "gds_offload.cli", "demo", *TINY_ARGS, "--steps", "100000", "--mode", "posix",
                             "--path", str(tmp_path)], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        _wait_until(proc, lambda: any(": step 1 (" in line for line in lines), "the first step's line")
        assert proc.poll() is None, "the line came only at the end"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(lines)[-2000:]
    stop = [line for line in lines if "stopped by SIGTERM" in line]
    assert stop == ["gds-offload demo: stopped by SIGTERM\n"], "".join(lines)[-2000:]


# ---------------------------------------------------------------------------- arguments, before any work
class _WorkStarted(Exception):
    """Raised by the stand-ins of the functions that start the real work."""


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any child run, engine measurement or weight benchmark fails the test: arguments must be refused first."""
    import gds_offload.bench.weights.bench as weights_bench
    from gds_offload.bench import io as io_bench
    from gds_offload.bench import procs
    from gds_offload.bench.train import rok, runner

    def started(*_a: object, **_kw: object) -> None:
        raise _WorkStarted("work started before the arguments were checked")

    # procs.run_child: every benchmark child starts there (the one child protocol).
    for module, name in ((procs, "run_child"), (runner, "run_mode"), (rok, "run_mode"), (io_bench, "run_bench"), (weights_bench, "run_bench")):
        monkeypatch.setattr(module, name, started)


def _exit_code(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.err + captured.out


ZERO_OR_NEGATIVE = [
    *[["demo", flag, value] for flag in ("--layers", "--batch", "--seq", "--hidden", "--vocab", "--heads", "--steps", "--warmup")
      for value in ("0", "-3")],
    ["bench", "--layers", "0"], ["bench", "--rounds", "0"], ["bench", "--timeout", "0"],
    ["rok", "--layers", "0"], ["rok", "--steps", "0"], ["rok", "--heads", "-1"],
    ["bench-io", "--tensor-sizes", "0"], ["bench-io", "--repeats", "0"], ["bench-io", "--tensor-sizes", "1MiB,0"],
    ["bench-io", "--size", "0"], ["bench-io", "--chunk-sizes", "0"],
    ["bench-weights", "--hidden", "0"], ["bench-weights", "--prompt-len", "0"], ["bench-weights", "--new-tokens", "0"],
    ["bench-weights", "--layers", "-1"], ["bench-weights", "--batch-sizes", "1,0"], ["bench-weights", "--slots", "0"],
]


@pytest.mark.parametrize("argv", ZERO_OR_NEGATIVE, ids=" ".join)
def test_zero_and_negative_sizes_are_errors_naming_the_flag(argv: list[str], no_work: None, capsys) -> None:
    """Zero never means "the default": demo --layers 0 does not run the full default model, and
    bench-io --tensor-sizes 0 does not skip every engine and exit 0."""
    code, text = _exit_code(argv, capsys)
    assert code == 2, text
    assert argv[1] in text, text


LATE = [
    (["--path", "{file}"], "--path"),
    (["--policy", "bogus"], "--policy"),
    (["--keep-last", "-1"], "--keep-last"),
    (["--num-threads", "0"], "--num-threads"),
    (["--device", "tpu"], "--device"),
    (["--model", "bogus"], "--model"),
    (["--model", "no_such_module_here:make"], "--model"),
    (["--min-bytes", "lots"], "--min-bytes"),
    (["--max-bandwidth", "fast"], "--max-bandwidth"),
]


_ROK_HAS_NO = ("--policy", "--keep-last", "--num-threads", "--min-bytes")


@pytest.mark.parametrize(
    ("command", "extra", "flag"),
    [(c, e, f) for c in ("demo", "bench", "rok") for e, f in LATE if not (c == "rok" and f in _ROK_HAS_NO)],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments_refused_before_any_run(command: str, extra: list[str], flag: str, tmp_path, no_work: None, capsys) -> None:
    """Every argument is checked before the first child starts: a bad --path, --policy,
    --keep-last, --num-threads, --device or --model is not found only after the keep baseline ran."""
    afile = tmp_path / "file"
    afile.write_text("x")
    extra = [e.replace("{file}", str(afile)) for e in extra]
    size = ["--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "32", "--vocab", "64"]
    argv = {"demo": ["demo", *size, "--batch", "1"], "bench": ["bench", *size, "--batch", "1", "--modes", "keep,offload:posix",
                                                               "--out", "", "--plot", ""],
            "rok": ["rok", *size, "--batches", "1", "--placements", "keep,all", "--out", str(tmp_path / "r.json"),
                    "--plot", str(tmp_path / "r.png")]}[command] + extra
    code, text = _exit_code(argv, capsys)
    assert code == 2, text
    assert flag in text, text
    assert sorted(os.listdir(tmp_path)) == ["file"]


@pytest.mark.parametrize("command", ["demo", "bench", "rok"])
def test_a_model_that_cannot_fit_is_refused_with_the_estimate(command: str, tmp_path, no_work: None, capsys) -> None:
    """Sizes are checked against the memory there is before anything runs, and the message
    gives the estimate: no child starts only to die, or to swap the machine."""
    size = ["--layers", "8", "--hidden", "4096", "--heads", "32", "--seq", "4096", "--vocab", "32000"]
    argv = {"demo": ["demo", *size, "--batch", "64", "--device", "cpu"],
            "bench": ["bench", *size, "--batch", "64", "--modes", "keep", "--out", "", "--plot", "", "--device", "cpu"],
            "rok": ["rok", *size, "--batches", "64", "--placements", "keep", "--out", str(tmp_path / "r.json"),
                    "--plot", str(tmp_path / "r.png")]}[command]
    code, text = _exit_code(argv, capsys)
    assert code == 2, text
    assert "keep needs about" in text and "is available (MemAvailable" in text and "--batch" in text, text


def test_memory_estimate_matches_a_measured_keep_run() -> None:
    """The estimate the refusal relies on is within a factor of 1.5 of a peak measured in a child
    process (as bench measures it: VmHWM with MALLOC_MMAP_THRESHOLD_ set).

    The measured peak also holds the first step's one-time allocations (torch's kernels and
    thread pools: 16 to 30 MB here, whatever the batch), which the estimate counts in
    ``PROCESS_BYTES``; at batch 32 the activations are about 200 MB, so that constant cannot
    decide the comparison (at batch 8 it was a third of the figure)."""
    from gds_offload.bench.train.runner import run_mode
    from gds_offload.bench.train.spec import RunSpec
    from gds_offload.models.gpt import GPTConfig, estimate_memory

    spec = RunSpec("keep", layers=3, hidden=128, heads=2, seq=128, vocab=2048, batch=32, steps=2, warmup=1)
    measured = run_mode(spec, timeout_s=300).peak_activation_bytes
    est = estimate_memory(GPTConfig(3, 128, 2, 128, 2048), 32).activation_bytes
    assert measured is not None and est / 1.5 < measured < est * 1.5, (measured, est)


# ---------------------------------------------------------------------------- bench-io
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_bench_io_refuses_a_size_larger_than_the_free_space(tmp_path, no_work: None, capsys) -> None:
    """bench-io checks free space first, rather than filling the drive and dying with a raw CalledProcessError."""
    from helpers.disks import tmpfs

    with tmpfs(tmp_path / "small", "16m") as small:
        code, text = _exit_code(["bench-io", "--path", str(small), "--size", "64MiB", "--engines", "posix"], capsys)
        assert os.listdir(small) == []
    assert code == 2 and "--size" in text and "free" in text, text


def test_bench_io_raw_pass_leaves_no_name_on_disk(spill_dir, monkeypatch) -> None:
    """The raw fio/dd pass writes an unnamed file (O_TMPFILE, or unlinked at once): nothing has a
    name while it runs, so a kill -9 leaves nothing behind (no named file of --size bytes)."""
    from gds_offload.bench import raw_io

    seen: list[tuple[list[str], list[str]]] = []
    real_run = subprocess.run

    def watching(cmd, *a, **kw):
        seen.append((list(cmd), os.listdir(spill_dir)))
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(raw_io.subprocess, "run", watching)
    try:
        raw = raw_io.raw_direct_bandwidth(spill_dir, 1 << 20)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the raw tool cannot run O_DIRECT here: {exc.stderr}")
    assert raw["write_gbps"] > 0 and raw["read_gbps"] > 0
    assert len(seen) == 2 and all(listing == [] for _, listing in seen), seen
    assert all(any("/proc/self/fd/" in part for part in cmd) for cmd, _ in seen), seen
    assert os.listdir(spill_dir) == []
