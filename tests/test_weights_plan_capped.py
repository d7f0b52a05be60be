"""Planning inside the memory a user gives: ``from_pretrained(memory=M, workload=...)`` in a
process capped at ``M`` (a cgroup v1 memory group, page cache included) measures, plans, loads
and generates without being killed, its peak under the cap, its tokens the resident model's; a
measuring child killed by the kernel is reported as such, with the limit it ran under."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

from helpers.llama import converted, resident_model  # noqa: E402

from gds_offload.bench.cgroup import MemoryCap, cap_available  # noqa: E402
from gds_offload.weights import as_reference  # noqa: E402

CHILD = Path(__file__).parent / "helpers" / "capped_plan_child.py"
#: The tiny model's whole run in one process peaks near 270 MiB here; with the measurement in a
#: child beside it, near 430 MiB.
CAP_MIB = 350

_ok, _why = cap_available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"needs root privileges and a cgroup v1 memory hierarchy ({_why})")


@pytest.fixture(scope="module")
def ckpt_store() -> Iterator[tuple[Path, Path]]:
    with converted("plan-capped") as paths:
        yield paths


def _capped(ckpt: Path, store: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], int]:
    cap = MemoryCap(CAP_MIB << 20)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHILD.parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(CHILD), str(ckpt), str(store), f"{CAP_MIB}MiB", *extra], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        cap.add(proc.pid)
        out, err = proc.communicate("go\n", timeout=600)
    finally:
        proc.kill()
        report = cap.close()
    assert report.peak_bytes is not None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), report.peak_bytes


def test_from_pretrained_plans_loads_and_generates_under_the_memory_it_was_given(ckpt_store: tuple[Path, Path]) -> None:
    ckpt, store = ckpt_store
    done, peak = _capped(ckpt, store)
    assert done.returncode == 0, done.stderr[-2000:]
    assert peak <= CAP_MIB << 20
    result = json.loads(done.stdout.splitlines()[-1])
    ids = torch.randint(1, 200, (8, 8), generator=torch.Generator().manual_seed(0))
    ref = as_reference(resident_model(ckpt))
    for indices in result["micro_batches"]:
        want = ref.generate(ids[indices], attention_mask=torch.ones(len(indices), 8, dtype=torch.long), max_new_tokens=4,
                            do_sample=False, pad_token_id=0)  # fmt: skip
        for row, i in enumerate(indices):
            assert result["tokens"][i] == want[row, 8:].tolist(), f"prompt {i}"


def test_a_measuring_child_killed_by_the_kernel_is_named_with_the_limit(ckpt_store: tuple[Path, Path]) -> None:
    """With the measurement in a child (``isolate=True``), the pair passes the cap: the refusal says
    the kernel killed it, under which limit, and what to do."""
    ckpt, store = ckpt_store
    done, _ = _capped(ckpt, store, "isolate")
    assert done.returncode != 0
    assert f"the measuring process was killed (SIGKILL), most likely by the kernel's out-of-memory killer at this process group's memory limit of {CAP_MIB} MiB" in done.stderr


@pytest.fixture(scope="module")
def large_resident() -> Iterator[tuple[Path, Path]]:
    """The tiny Llama with a 400k vocabulary, untied: a resident group of about 200 MiB, which
    this process and the cap cannot hold together."""
    from helpers.disks import real_disk_base
    from helpers.llama import llama_config, save_checkpoint

    from gds_offload.weights import convert

    base = real_disk_base() / f"gds_offload-plan-capped-vocab-{os.getpid()}"
    ckpt = save_checkpoint(llama_config(vocab_size=400_000), base / "ckpt")
    convert(ckpt, base / "store")
    try:
        yield ckpt, base / "store"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_memory_below_the_resident_group_is_refused_before_it_is_loaded(large_resident: tuple[Path, Path]) -> None:
    """The floor is known from the store before anything is loaded: the process is refused with the
    memory to give, not killed while loading the resident group (it was, checked only after the load)."""
    ckpt, store = large_resident
    done, peak = _capped(ckpt, store)
    assert done.returncode == 1, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "memory counts this whole process" in done.stderr and "give at least" in done.stderr, done.stderr[-2000:]
    assert peak < (CAP_MIB << 20)
