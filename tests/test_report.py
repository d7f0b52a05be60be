"""The performance page is generated: every figure on it comes from a committed result file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gds_offload.bench.docs.report import load_sections, render_page

REPO = Path(__file__).resolve().parent.parent


def test_committed_page_is_what_the_results_give() -> None:
    """docs/performance.md is exactly `gds-offload report`'s output for docs/results/. (Whether
    each result still measures the code is `report --check`'s other half, which fails until the
    results are rerun after a change to the code they measure: see the stale-result tests.)"""
    done = subprocess.run(
        [sys.executable, "-m", "gds_offload.cli", "report", "--check", "--ignore-stale"], cwd=REPO, capture_output=True, text=True, timeout=60
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


def test_a_result_measured_otherwise_says_how_its_memory_was_measured(tmp_path: Path) -> None:
    """The method names one definition of peak memory; a result file whose runs measured it
    otherwise (an older definition) carries a ``memory`` line saying how."""
    from gds_offload.bench.machine import CPU_SOURCE

    doc = json.loads((REPO / "docs/results/ceiling-100MBps.json").read_text())
    (tmp_path / "now.json").write_text(json.dumps(doc | {"title": "Now", "results": [r | {"memory_source": CPU_SOURCE} for r in doc["results"]]}))
    old = "VmHWM - VmRSS after warm-up (MALLOC_MMAP_THRESHOLD_=65536)"
    (tmp_path / "then.json").write_text(json.dumps(doc | {"title": "Then", "results": [r | {"memory_source": old} for r in doc["results"]]}))
    page = render_page(load_sections(tmp_path), tmp_path, command="gds-offload report")
    now, then = page.split("## Now")[1].split("## Then")[0], page.split("## Then")[1]
    assert "* memory:" not in now and f"* memory: {old}\n" in then


def test_a_result_without_a_command_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"rows": []}')
    done = subprocess.run(
        [sys.executable, "-m", "gds_offload.cli", "report", "--results", str(tmp_path), "--out", str(tmp_path / "p.md")],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and "bad.json" in done.stderr and "command" in done.stderr


def test_targets_render_met_missed_and_out_of_reach(tmp_path: Path) -> None:
    """A target whose ceiling (the same work with no data movement) is below its need is shown
    as out of reach, not as a miss the method could fix; the others as met or missed."""
    (tmp_path / "t.json").write_text(json.dumps({
        "kind": "table", "title": "T", "command": "gds-offload t", "table": {"columns": ["a"], "rows": [["1"]]},
        "targets": [
            {"target": "fast", "need": 2.0, "value": 2.5, "ceiling": 3.0, "met": True},
            {"target": "slow", "need": 2.0, "value": 1.5, "ceiling": 3.0, "met": False},
            {"target": "bound", "need": 2.0, "value": 1.2, "ceiling": 1.1, "met": False},
            {"target": "absent", "need": 1.0, "value": None, "met": None},
        ],
    }))
    page = render_page(load_sections(tmp_path), tmp_path, command="gds-offload report")
    assert "| fast | >= 2 | 2.50 | 3.00 | met |" in page
    assert "| slow | >= 2 | 1.50 | 3.00 | missed |" in page
    assert "| bound | >= 2 | 1.20 | 1.10 | out of reach here: a ceiling, measured in the same run, is below the need |" in page
    assert "| absent | >= 1 | - | - | not run |" in page


def test_a_bar_in_a_cell_is_escaped_and_the_plot_beside_the_result_is_shown(tmp_path: Path) -> None:
    """``1 - |p/m - 1|`` in a target's name stays one cell; a result written elsewhere (``--out
    /elsewhere/t.json``, its ``plot`` there) shows the PNG copied beside its JSON, and none if none is."""
    results = tmp_path / "results"
    results.mkdir()
    doc = {"kind": "table", "title": "T", "command": "gds-offload t", "plot": "/elsewhere/t.png",
           "table": {"columns": ["a|b"], "rows": [["x|y"]]}, "targets": [{"target": "1 - |p/m - 1|", "need": 0.8, "value": 0.9, "met": True}]}
    (results / "t.json").write_text(json.dumps(doc))
    page = render_page(load_sections(results), tmp_path, command="gds-offload report")
    assert "| a\\|b |\n| --- |\n| x\\|y |" in page and "| 1 - \\|p/m - 1\\| | >= 0.8 | 0.90 | met |" in page
    assert "t.png" not in page
    (results / "t.png").write_bytes(b"png")
    page = render_page(load_sections(results), tmp_path, command="gds-offload report")
    assert "![T](results/t.png)" in page


def test_readme_headline_is_spliced_between_its_markers(tmp_path: Path) -> None:
    """`gds-offload report` rewrites only the README's headline block, from the same result
    files as the page, and refuses a README without the markers."""
    from gds_offload.bench.docs.headline import END, START

    results = tmp_path / "results"
    results.mkdir()
    (results / "w.json").write_text(json.dumps({
        "kind": "table", "title": "Weights (cpu)", "command": "gds-offload bench-weights", "table": {"columns": ["a"], "rows": [["1"]]},
        "targets": [{"target": "a", "need": 2.0, "value": 2.5, "met": True}, {"target": "b", "need": 2.0, "value": 1.0, "ceiling": 1.5, "met": False}],
    }))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\nstale\n{END}\noutro\n")
    args = ["report", "--results", str(results), "--out", str(tmp_path / "docs" / "perf.md"), "--readme", str(readme)]
    run = [sys.executable, "-m", "gds_offload.cli"]
    assert subprocess.run([*run, *args, "--check"], capture_output=True, timeout=60).returncode == 1
    assert subprocess.run([*run, *args], capture_output=True, timeout=60).returncode == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "stale" not in text
    assert "| [Weights (cpu)](docs/perf.md#weights-cpu) | 1 of 2 targets met, 1 out of reach on this machine |" in text
    assert subprocess.run([*run, *args, "--check"], capture_output=True, timeout=60).returncode == 0
    readme.write_text("no markers\n")
    done = subprocess.run([*run, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "headline results" in done.stderr


def test_headline_of_each_committed_result() -> None:
    """Every committed result file gives the README a headline line (none is silently dropped)."""
    from gds_offload.bench.docs.headline import headline

    for section in load_sections(REPO / "docs" / "results"):
        assert headline(section.doc), section.path.name


def test_commit_is_dirty_for_code_changes_not_for_result_files(tmp_path: Path) -> None:
    """A run that rewrites docs/results/ (the previous command's output) still names a clean
    commit; a changed source file marks it +dirty."""
    from gds_offload.bench.docs.report import current_commit

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "a.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "init")
    (tmp_path / "docs" / "results" / "a.json").write_text('{"new": 1}')
    commit = current_commit(tmp_path)
    assert commit and not commit.endswith("+dirty")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert str(current_commit(tmp_path)).endswith("+dirty")


def test_result_files_with_the_old_seconds_keys_render_as_new_ones(tmp_path: Path) -> None:
    """Times were once named ``*_seconds`` in result files; they are ``*_s`` now. A committed
    file of either naming renders to the same section."""
    from gds_offload.bench.docs.report import current_keys

    # docs/results/train-demo.json as measured at 8c87b65, when times were *_seconds.
    old = json.loads((REPO / "tests/fixtures/train-demo-seconds-keys.json").read_text())
    assert "step_seconds" in json.dumps(old), "the fixture is of the old naming"
    new = current_keys(old)
    text = json.dumps(new)
    assert "_seconds" not in text and '"step_s"' in text and '"io_wait_s"' in text
    for name, doc in (("old", old), ("new", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "demo.json").write_text(json.dumps(doc))
    pages = [render_page(load_sections(tmp_path / name), tmp_path / name, command="gds-offload report") for name in ("old", "new")]
    assert pages[0] == pages[1]
    assert "| offload:posix |" in pages[0] and "exact" in pages[0]


def test_the_gpu_section_says_plainly_that_no_gpu_figure_exists_until_one_does(tmp_path: Path) -> None:
    from gds_offload.bench.docs.report import Section, gpu_section

    cpu = Section(tmp_path / "a.json", {"command": "x", "machine": {"gpus": []}})
    text = "\n".join(gpu_section([cpu]))
    assert "## GPU" in text and "No GPU figure exists yet" in text and "scripts/gpu_check.sh OUTDIR" in text
    gpu = Section(tmp_path / "b.json", {"command": "x", "machine": {"gpus": ["NVIDIA H200"]}})
    text = "\n".join(gpu_section([cpu, gpu]))
    assert "NVIDIA H200" in text and "No GPU figure" not in text


def test_every_path_a_result_exercises_exists() -> None:
    """The paths a benchmark's results record as measured (``exercises``) are the repository's:
    a path moved or renamed without updating the table would never mark a result stale."""
    from gds_offload.bench.docs.stale import EXERCISES

    missing = [(cmd, p) for cmd, paths in EXERCISES.items() for p in paths if not (REPO / p).exists()]
    assert not missing, missing


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def test_report_check_fails_on_a_result_measured_before_the_last_change_to_its_code(tmp_path: Path, capsys) -> None:
    """`report --check` fails on a result whose commit is older than the last commit that changed
    a path it exercises (recorded in the result, or, in an older result, the paths of its
    command); a change elsewhere, a result file rerun and committed, and a result whose commit
    this clone lacks do not make one stale. ``--ignore-stale`` lists them and passes."""
    from gds_offload.cli import main

    repo = tmp_path
    (repo / "gds_offload" / "activations").mkdir(parents=True)
    (repo / "gds_offload" / "weights").mkdir(parents=True)
    (repo / "gds_offload" / "activations" / "a.py").write_text("x = 1\n")
    (repo / "gds_offload" / "weights" / "w.py").write_text("y = 1\n")
    results = repo / "docs" / "results"
    results.mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "code")
    measured = _git(repo, "rev-parse", "--short", "HEAD")

    def result(name: str, commit: str, **extra: object) -> None:
        (results / f"{name}.json").write_text(json.dumps({
            "kind": "table", "title": name, "command": "gds-offload bench --steps 3", "commit": commit,
            "table": {"columns": ["a"], "rows": [["1"]]}, **extra,
        }))

    result("recorded", measured, exercises=["gds_offload/activations"])
    result("older", measured)  # no exercises: those of `gds-offload bench`
    result("unknown", "0" * 40, exercises=["gds_offload/activations"])
    args = ["report", "--results", str(results), "--out", str(repo / "docs" / "perf.md"), "--readme", ""]

    def check(*more: str) -> tuple[int, str]:
        capsys.readouterr()
        rc = main([*args, "--check", *more])
        return rc, capsys.readouterr().err

    assert main(args) == 0
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "results and page")
    rc, err = check()
    assert rc == 0, err
    assert f"unknown.json: not checked: commit {'0' * 40} is not in this clone" in err

    (repo / "gds_offload" / "weights" / "w.py").write_text("y = 2\n")
    _git(repo, "commit", "-qam", "weights only")
    assert check()[0] == 0, "a change to code no result exercises"

    (repo / "gds_offload" / "activations" / "a.py").write_text("x = 2\n")
    _git(repo, "commit", "-qam", "the offloader changes")
    changed = _git(repo, "rev-parse", "--short", "HEAD")
    rc, err = check()
    assert rc == 1
    assert f"recorded.json: stale: measured at {measured}, and {changed} changed gds_offload/activations since" in err
    assert f"older.json: stale: measured at {measured}, and {changed} changed gds_offload/activations, gds_offload/io" in err
    assert "unknown.json: stale" not in err
    rc, err = check("--ignore-stale")
    assert rc == 0 and "recorded.json: stale" in err

    rerun = _git(repo, "rev-parse", "--short", "HEAD")
    result("recorded", rerun, exercises=["gds_offload/activations"])
    result("older", rerun)
    assert main(args) == 0
    _git(repo, "commit", "-qam", "results rerun")
    assert check()[0] == 0, "results measured at the last change, committed after it"


def test_result_files_record_the_paths_they_exercise(tmp_path: Path) -> None:
    """A `gds-offload bench` result names the paths its figures depend on, and those are the
    paths `report --check` compares with the commits since (the activation half, its I/O, the bench)."""
    from gds_offload.bench.docs.stale import exercised_paths
    from gds_offload.bench.train.spec import RunSpec
    from gds_offload.bench.train.suite import results_doc

    doc = results_doc("bench", 0.0, (0.0, 0.0, 0.0), out="", title="", about="", command="gds-offload bench", spec=RunSpec("keep"),
                      path=None, modes=[], summary={}, results=[])
    assert doc["exercises"] == exercised_paths("bench")
    assert {"gds_offload/activations", "gds_offload/io", "gds_offload/bench/train"} <= set(doc["exercises"])


def test_the_page_opens_with_how_fast_against_what() -> None:
    """The first section of the committed page is the summary table, a row per job and result with
    this project's figure and each peer measured beside it, in the order a user asks: training with
    activations offloaded first, then generation, LoRA and full fine-tuning."""
    from gds_offload.bench.docs.report import load_sections
    from gds_offload.bench.docs.summary import summary_rows

    rows = summary_rows(load_sections(REPO / "docs" / "results"))
    jobs = [r[0].split(":")[0] for r in rows]
    assert jobs == sorted(jobs, key=["train a model, activations offloaded", "generate, weights streamed",
                                      "LoRA fine-tuning, weights streamed", "full fine-tuning, weights streamed"].index)  # fmt: skip
    assert set(jobs) == {"train a model, activations offloaded", "generate, weights streamed", "LoRA fine-tuning, weights streamed",
                         "full fine-tuning, weights streamed"}  # fmt: skip
    against = " ".join(r[2] for r in rows)
    for peer in ("recompute", "save_on_cpu", "Accelerate", "AirLLM", "DeepSpeed ZeRO-Inference", "DeepSpeed ZeRO-Infinity"):
        assert peer in against, peer
    page = (REPO / "docs" / "performance.md").read_text()
    assert page.index("## How fast, against what") < page.index("## Method")
