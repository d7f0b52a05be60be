"""The GPU tests cannot silently disappear: ``tests/test_gpu.py`` is collected, every test in it is
marked ``gpu`` or ``gds`` (so ``pytest -m "gpu or gds"``, which ``scripts/gpu_check.sh`` runs,
selects all of them and the CPU suite none of them), and on a machine without a GPU each one
skips with a reason naming the missing hardware.

Runs pytest on that module in a child process with a small plugin that records each test's
markers. Without CUDA the child runs the tests (all skip at once) and the JUnit report gives the
skip reasons; with CUDA it only collects them (running them twice would waste the GPU's time).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
NO_GPU = "needs an NVIDIA GPU (torch.cuda.is_available() is False)"

#: Written next to the child's junit report: records every collected item's markers (before
#: ``-m`` deselects any) and the items ``-m`` selected.
_PLUGIN = '''
import json, os
import pytest

_OUT = os.environ["GDS_GPU_STATIC_OUT"]
_seen = {}

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        _seen[item.nodeid] = sorted({m.name for m in item.iter_markers()})

def pytest_collection_finish(session):
    with open(_OUT, "w") as fh:
        json.dump({"all": _seen, "selected": [item.nodeid for item in session.items]}, fh)
'''


def _run_child(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    (tmp_path / "gpu_static_probe.py").write_text(_PLUGIN)
    out, xml = tmp_path / "markers.json", tmp_path / "junit.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["GDS_GPU_STATIC_OUT"] = str(out)
    cmd = [
        sys.executable, "-m", "pytest", "tests/test_gpu.py", "-m", "gpu or gds", "-q",
        "-p", "gpu_static_probe", "-p", "no:cacheprovider", f"--junitxml={xml}", *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), f"the child pytest collected nothing (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text()), xml


def test_gpu_tests_are_collected_marked_and_skip_naming_the_hardware(tmp_path: Path) -> None:
    has_gpu = torch.cuda.is_available()
    proc, seen, xml = _run_child(tmp_path, *(["--collect-only"] if has_gpu else []))
    assert proc.returncode == 0, f"child pytest failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    items = {nodeid: marks for nodeid, marks in seen["all"].items() if nodeid.startswith("tests/test_gpu.py::")}
    unmarked = sorted(n for n, marks in items.items() if "gpu" not in marks and "gds" not in marks)
    assert not unmarked, f"tests in test_gpu.py without a gpu/gds marker (the CPU suite would run them): {unmarked}"
    assert sorted(seen["selected"]) == sorted(items), "pytest -m 'gpu or gds' does not select every test of test_gpu.py"
    gpu = [n for n, marks in items.items() if "gpu" in marks]
    gds = [n for n, marks in items.items() if "gds" in marks]
    assert len(gpu) >= 20 and len(gds) >= 5, f"{len(gpu)} gpu and {len(gds)} gds tests collected; expected more:\n{sorted(items)}"
    for name in ("round_trips_cuda_tensors", "over_256_mib", "write_waits", "read_waits", "orders_io",
                 "bit_identical", "peak_gpu_memory", "cuda_events", "write_overlaps", "read_overlaps",
                 "device_buffers_on_a_gpu"):
        assert any(name in n for n in items), f"no test named *{name}* in test_gpu.py"
    if has_gpu:
        return

    cases = ET.parse(xml).getroot().iter("testcase")
    reasons = {}
    for case in cases:
        nodeid = f"tests/test_gpu.py::{case.get('name')}"
        skipped = case.find("skipped")
        assert skipped is not None, f"{nodeid} did not skip on a machine without a GPU: {ET.tostring(case, encoding='unicode')[:2000]}"
        reasons[nodeid] = skipped.get("message", "")
    assert sorted(reasons) == sorted(items), "the JUnit report and the collected tests disagree"
    for nodeid, reason in reasons.items():
        if "gds" in items[nodeid]:
            assert "GPUDirect Storage" in reason and "NVIDIA GPU" in reason, (nodeid, reason)
        else:
            assert NO_GPU in reason, (nodeid, reason)
