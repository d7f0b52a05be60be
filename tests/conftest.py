"""Shared fixtures (helpers live in :mod:`helpers`: ``from helpers.disks import real_disk_base``, ...).

Fixtures:
    spill_dir: a private (0700) directory on the real disk, removed afterwards.
    engine_modes: parametrize a test over the engines that run here
        (posix; compat when KvikIO is usable; host).
    engine_and_store: ``(engine, store)`` for the current ``engine_modes`` value.
    engine: each drive engine that runs here (posix; compat where KvikIO is usable), by name.
    timing: ``drive`` (synchronize before backward: every offloaded tensor is read back from
        the drive) or ``natural`` (no forced timing); see :mod:`helpers.exact`.
    cuda_device: ``torch.device("cuda")``, or a skip naming the missing GPU.
    signal_handlers_are_restored (autouse): a test that leaves a SIGINT or SIGTERM
        handler changed fails, naming it, and the handler is put back, so the
        Ctrl-C tests that follow it see Python's own handler (which the session
        installs if it started with SIGINT ignored: see pytest_configure).
    a_hang_ends_the_run (autouse): a test still running after HANG_S seconds prints
        every thread's stack and ends the run, so a hang names itself at once.
"""
from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.disks import real_disk_base
from helpers.exact import TIMINGS
from helpers.gates import ENGINE_MODES, ENGINES
from helpers.skips import summary

from gds_offload.io import make_engine
from gds_offload.io.spill import SpillStore

_WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def pytest_configure(config: pytest.Config) -> None:
    # A suite started in the background by a shell without job control (as a CI runner may start
    # it) inherits SIGINT ignored, and Python then installs no Ctrl-C handler: the tests that press
    # Ctrl-C would see nothing happen. They stand for a user at a terminal, so give them Python's own.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    global _STDERR_FD
    _STDERR_FD = os.dup(2)  # the run's own stderr, which a test's captured output does not hide


_STDERR_FD = 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (minutes, gigabytes: the opt-in kind, each with a smaller twin that
    always runs) are deselected unless asked for with ``-m slow`` or ``GDS_OFFLOAD_SLOW=1``, so a
    normal run reports them as deselected, not as lost coverage."""
    if "slow" in (config.getoption("markexpr") or "") or os.environ.get("GDS_OFFLOAD_SLOW"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def _skip_reasons(terminalreporter: pytest.TerminalReporter) -> list[str]:
    reasons = []
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(rep, "longrepr", None)
        reasons.append(str(longrepr[2]).removeprefix("Skipped: ") if isinstance(longrepr, tuple) else str(longrepr))
    return reasons


def _strict() -> bool:
    return os.environ.get("GDS_OFFLOAD_STRICT_SKIPS") == "1"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """Say what the skips lost, by why (helpers/skips.py)."""
    lines, setup = summary(_skip_reasons(terminalreporter))
    for line in lines:
        terminalreporter.write_line(line)
    if setup and _strict():
        terminalreporter.write_line(f"{setup} tests skipped for set-up reasons (GDS_OFFLOAD_STRICT_SKIPS=1): install what they name; the run fails")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Strict (``GDS_OFFLOAD_STRICT_SKIPS=1``): a set-up skip fails a run that otherwise passed.
    (Decided here, before the terminal summary is written: the exit status is read after this hook.)"""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if _strict() and reporter is not None and exitstatus == 0 and summary(_skip_reasons(reporter))[1]:
        session.exitstatus = 1


#: The slowest test here takes a few minutes; one still running after this is stuck.
HANG_S = float(os.environ.get("GDS_OFFLOAD_TEST_HANG_S", "1200"))


@pytest.fixture(autouse=True)
def a_hang_ends_the_run() -> Iterator[None]:
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=_STDERR_FD)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def signal_handlers_are_restored() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in _WATCHED_SIGNALS}
    yield
    changed = {s: signal.getsignal(s) for s in _WATCHED_SIGNALS if signal.getsignal(s) is not before[s]}
    for s in changed:
        signal.signal(s, before[s])
    if changed:
        pytest.fail(
            "the test left signal handlers changed: "
            + ", ".join(f"{signal.Signals(s).name} = {h!r}" for s, h in changed.items())
        )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: sweeps that run thousands of tiny forwards, where thread wake-ups dominate."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def spill_dir() -> Iterator[Path]:
    """A private 0700 directory on the real disk (see :func:`helpers.disks.real_disk_base`), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="gds_offload-test-", dir=real_disk_base()))
    os.chmod(d, 0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=ENGINE_MODES)
def engine_modes(request: pytest.FixtureRequest) -> str:
    """One engine name per test instance: posix, compat (if KvikIO is usable), host."""
    return request.param


@pytest.fixture
def engine_and_store(engine_modes: str, spill_dir: Path):  # noqa: ANN201
    """``(engine, store)`` for the current engine; both closed afterwards."""
    engine = make_engine(engine_modes)  # type: ignore[arg-type]
    store = SpillStore([spill_dir] if engine.needs_files else [])
    try:
        yield engine, store
    finally:
        engine.close()  # waits for in-flight transfers first
        store.close()


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (CUDA): torch.cuda.is_available() is False")
    return torch.device("cuda")


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """Each drive engine that runs here (posix; compat where KvikIO is usable)."""
    return request.param


@pytest.fixture(params=TIMINGS)
def timing(request: pytest.FixtureRequest) -> str:
    """``drive`` (synchronize before backward; bytes read back) or ``natural`` (no forced timing)."""
    return request.param
