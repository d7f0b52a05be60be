"""gds-offload bench-weights end to end on the tiny model: every mode's child runs, reports its
figures, and its tokens match the resident model's."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'gds_offload[hf]')")

from conftest import real_disk_base  # noqa: E402

from gds_offload.cli import main as cli_main  # noqa: E402
from gds_offload.weights.cgroup import MemoryCap, cap_available  # noqa: E402


def test_bench_weights_tiny_end_to_end(tmp_path: Path) -> None:
    work = real_disk_base() / f"gds_offload-bench-weights-test-{os.getpid()}"
    out = tmp_path / "report.json"
    try:
        rc = cli_main(["bench-weights", "--tiny", "--modes", "resident,drive,accelerate-disk", "--batch-sizes", "2",
                       "--workdir", str(work), "--json", str(out)])  # fmt: skip
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert rc == 0 and set(rows) == {"resident", "drive", "accelerate-disk"}
    for r in rows.values():
        assert r["status"] == "ok" and r["matches_resident"] is True, r
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and len(r["tokens"][0]) == 4
    # The drive mode reads every layer once per forward: 1 prefill + 3 decode steps, over (16 + 3) tokens of 2 sequences.
    forwards, tokens = 4, 2 * (16 + 3)
    assert rows["drive"]["store_bytes_per_token"] == pytest.approx(forwards * report["model"]["layers_nbytes"] / tokens)
    assert report["command"].startswith("gds-offload bench-weights --tiny")


def test_memory_cap_refuses_the_caller_itself(tmp_path: Path) -> None:
    ok, why = cap_available(tmp_path)
    assert not ok and "no cgroup v1 memory hierarchy" in why
    if not cap_available()[0]:
        pytest.skip(cap_available()[1])
    cap = MemoryCap(256 << 20)
    try:
        with pytest.raises(ValueError, match="refusing to cap the calling process"):
            cap.add(os.getpid())
        assert (cap.path / "memory.limit_in_bytes").read_text().strip() == str(256 << 20)
    finally:
        cap.close()
    assert not cap.path.exists()
