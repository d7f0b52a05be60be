"""The performance page is generated: every figure on it comes from a committed result file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gds_offload.bench.report import load_sections, render_page

REPO = Path(__file__).resolve().parent.parent


def test_committed_page_is_what_the_results_give() -> None:
    """docs/performance.md is exactly `gds-offload report`'s output for docs/results/."""
    done = subprocess.run(
        [sys.executable, "-m", "gds_offload.cli", "report", "--check"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_each_section_names_command_commit_and_machine(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    doc = json.loads((REPO / "docs/results/ceiling-100MBps.json").read_text())
    (results / "a.json").write_text(json.dumps(doc))
    (results / "b.json").write_text(json.dumps({
        "kind": "table", "title": "A table", "command": "gds-offload x --y", "commit": "abc1234",
        "machine": doc["machine"], "table": {"columns": ["mode", "tok/s"], "rows": [["drive", "2.5"]]},
    }))
    page = render_page(load_sections(results), tmp_path, command="gds-offload report")
    for needle in (doc["command"], str(doc["commit"]), "| drive | 2.5 |", "`gds-offload x --y`", "`abc1234`",
                   doc["machine"]["cpu_model"], "[`a.json`](results/a.json)"):
        assert needle in page, needle
    assert page.count("* machine: ") == 2


def test_a_result_without_a_command_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"rows": []}')
    done = subprocess.run(
        [sys.executable, "-m", "gds_offload.cli", "report", "--results", str(tmp_path), "--out", str(tmp_path / "p.md")],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and "bad.json" in done.stderr and "command" in done.stderr
