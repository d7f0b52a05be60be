"""The end-of-run skip summary groups each reason as missing hardware, missing privileges, or set-up."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.skips import group_of, summary

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize(("reason", "group"), [
    ("needs an NVIDIA GPU (CUDA): torch.cuda.is_available() is False", "hardware"),
    ("needs the nvidia-fs kernel driver (/proc/driver/nvidia-fs) and GDS_TEST_DIR", "hardware"),
    ("needs root to mount a tmpfs", "privileges"),
    ("needs root privileges and a cgroup v1 memory hierarchy", "privileges"),
    ("transformers is not installed (pip install 'gds_offload[hf]')", "set-up"),
    ("needs DeepSpeed's async_io op built beforehand", "set-up"),
    ("DeepSpeed's ops are not built in /root/.cache/torch_extensions (needs libaio-dev)", "set-up"),
])  # fmt: skip
def test_each_reason_has_its_group(reason: str, group: str) -> None:
    assert group_of(reason) == group


def test_the_summary_counts_each_group_and_the_set_up_skips() -> None:
    lines, setup = summary(["needs root to mount tmpfs"] * 2 + ["peft is not installed"])
    assert setup == 1
    assert lines == ["skipped for privileges: 2", "  2 x needs root to mount tmpfs", "skipped for set-up: 1", "  1 x peft is not installed"]


_CASES = '''
import pytest
def test_hardware(): pytest.skip("needs an NVIDIA GPU (CUDA)")
def test_root(): pytest.skip("needs root to mount a tmpfs")
def test_runs(): pass
@pytest.mark.slow
def test_slow(): pass
'''


def _run_suite(tmp_path: Path, extra: str, strict: bool) -> subprocess.CompletedProcess[str]:
    """A small suite run with this suite's own conftest as a plugin (its summary, strictness, slow deselection)."""
    (tmp_path / "test_cases.py").write_text(_CASES + extra)
    env = dict(os.environ, PYTHONPATH=str(TESTS), GDS_OFFLOAD_STRICT_SKIPS="1" if strict else "0")
    env.pop("GDS_OFFLOAD_SLOW", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull,
                           str(tmp_path / "test_cases.py")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


def test_strict_fails_a_passing_run_on_a_set_up_skip_only(tmp_path: Path) -> None:
    """``.ci/run`` sets ``GDS_OFFLOAD_STRICT_SKIPS=1``: hardware and privileges skips pass, a missing package fails the run."""
    lenient = _run_suite(tmp_path, "", strict=True)
    assert lenient.returncode == 0, lenient.stdout
    assert "skipped for hardware: 1" in lenient.stdout and "skipped for privileges: 1" in lenient.stdout and "1 deselected" in lenient.stdout
    setup = 'def test_package(): pytest.skip("peft is not installed")\n'
    assert _run_suite(tmp_path, setup, strict=False).returncode == 0
    failed = _run_suite(tmp_path, setup, strict=True)
    assert failed.returncode == 1 and "skipped for set-up: 1" in failed.stdout and "the run fails" in failed.stdout, failed.stdout
