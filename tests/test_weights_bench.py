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
                       "--raw-depths", "2", "--workdir", str(work), "--out", str(out)])  # fmt: skip
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    doc = json.loads(out.read_text())
    rows = {r["mode"]: r for r in doc["results"]}
    assert rc == 0 and set(rows) == {"resident", "drive", "accelerate-disk"}
    for r in rows.values():
        assert r["status"] == "ok" and r["matches_resident"] is True, r
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and len(r["tokens"][0]) == 4
        assert 0 <= r["cached_fraction_before"] < 0.5
    # The drive mode fills every layer once per forward (the next forward's first layers are prefetched at the end of each).
    assert rows["drive"]["store_bytes_per_forward"] == doc["model"]["layers_nbytes"]
    assert [p["when"] for p in doc["raw_read"]] == ["before", "after"] and all(p["bytes_per_s"] > 0 for p in doc["raw_read"])
    probe = doc["interference"]  # compute timed alone and beside reads: what bounds the drive's targets
    assert probe["alone_s"] > 0 and probe["with_reads_s"] > 0 and probe["read_bytes_per_s"] > 0
    assert probe["slowdown"] == probe["with_reads_s"] / probe["alone_s"]
    # What gds-offload report renders.
    assert doc["kind"] == "table" and doc["command"].startswith("gds-offload bench-weights --tiny")
    assert {"title", "about", "commit", "machine", "started", "wall_s"} <= set(doc) and doc["plot"] == out.with_suffix(".png").as_posix()
    assert out.with_suffix(".png").stat().st_size > 0
    table = doc["table"]
    assert len(table["columns"]) == len(table["rows"][0]) and [r[0] for r in table["rows"]] == ["resident", "streamed-drive", "accelerate-disk"]
    assert all(isinstance(v, str) for row in table["rows"] for v in row) and table["rows"][1][-1] == "yes"
    assert {t["target"].split(":")[0] for t in doc["targets"]} == {"decode batch 1"}  # batch 2 only: no batch >= 8 targets
    from gds_offload.bench.report import Section, render_section

    page = "\n".join(render_section(Section(out, doc), tmp_path))
    assert "| streamed-drive | 2 |" in page and "gds-offload bench-weights --tiny" in page


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
