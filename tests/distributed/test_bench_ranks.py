"""``gds-offload bench --nproc 2`` on the CPU (gloo): every mode on one process and on two DDP
ranks in one run, exact against ``keep`` in each setting; a failing rank named in its row."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.procs import clean_env

from gds_offload.bench.docs.report import load_sections, render_page
from gds_offload.bench.train.ranks_runner import RankedResult, combine_ranks
from gds_offload.bench.train.ranks_suite import one_process_path, ranks_agree, summarize_settings
from gds_offload.bench.train.runner import RunResult

TINY = ["--layers", "2", "--hidden", "64", "--seq", "64", "--batch", "2", "--vocab", "256", "--steps", "2", "--warmup", "1",
        "--min-bytes", "0", "--plot", ""]


def _factory(tmp_path: Path, name: str, refuse_if: str, why: str) -> str:
    """A ``--model name:make`` factory (the built-in GPT) that raises ``why`` in the processes where
    ``refuse_if`` holds; returns the PYTHONPATH that makes it importable."""
    (tmp_path / f"{name}.py").write_text(
        "import os\n"
        "from gds_offload.models.gpt import GPTConfig, lm_loss, make_gpt, synthetic_batch\n"
        "def make(spec):\n"
        f"    if {refuse_if}:\n"
        f"        raise RuntimeError({why!r})\n"
        "    cfg = GPTConfig(spec.layers, spec.hidden, spec.heads, spec.seq, spec.vocab, spec.dropout)\n"
        "    return make_gpt(cfg, seed=spec.seed), lambda i: synthetic_batch(cfg, spec.batch, spec.seed + 1 + i), lm_loss\n"
    )
    return f"{tmp_path}:{clean_env()['PYTHONPATH']}"


def _bench(args: list[str], tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "ranks.json"
    proc = subprocess.run([sys.executable, "-m", "gds_offload.cli", "bench", "--nproc", "2", *TINY, "--out", str(out), *args],
                          env=clean_env(GDS_OFFLOAD_DIR=str(tmp_path / "default"), COLUMNS="200", **env),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return proc, json.loads(out.read_text()) if out.exists() else {}


def test_bench_on_two_ranks(tmp_path):
    proc, doc = _bench(["--modes", "keep,offload:posix", "--paired", "--title", "Two ranks"], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert doc["kind"] == "bench-ranks" and doc["nproc"] == 2
    runs = {(r["mode"], r["nproc"]): r for r in doc["results"]}
    assert sorted(runs) == [("keep", 1), ("keep", 2), ("offload:posix", 1), ("offload:posix", 2)]
    assert all(r["status"] == "ok" for r in runs.values()), [r["error"] for r in runs.values()]
    # One process computes as one rank does: the same torch thread count everywhere.
    assert {r["torch_threads"] for r in runs.values()} | {x["torch_threads"] for r in runs.values() for x in r["ranks"]} == {doc["torch_threads"]}
    for n in (1, 2):  # exact within each setting: rank 0's losses (and every rank's) equal keep's
        assert runs[("offload:posix", n)]["losses_hex"] == runs[("keep", n)]["losses_hex"]
        assert doc["summary"]["settings"][str(n)]["modes"]["offload:posix"]["losses_agree"] is True
    two, keep_two = runs[("offload:posix", 2)], runs[("keep", 2)]
    assert [x["losses_hex"] for x in two["ranks"]] == [x["losses_hex"] for x in keep_two["ranks"]]
    assert len(two["ranks"]) == 2 and two["ranks"][0]["losses_hex"] != two["ranks"][1]["losses_hex"]  # each rank its own batches
    assert "," not in two["params_digest"]  # DDP kept the ranks' weights equal
    assert two["offload"]["bytes_offloaded"] > 0 and all(x["offload"]["bytes_offloaded"] > 0 for x in two["ranks"])
    # Step 0 trains the same weights on the same batch in both settings.
    assert runs[("keep", 1)]["losses_hex"][0] == keep_two["losses_hex"][0]
    scaling = doc["summary"]["scaling"]["offload:posix"]
    assert scaling["n_over_1"] == scaling["x_keep_2"] / scaling["x_keep_1"]
    # --paired: one paused step beside the offloaded one, on every rank at once, and still exact.
    assert len(two["paired_keep_s"]) == 1 and all(len(x["paired_keep_s"]) == 1 for x in two["ranks"])
    assert scaling["paired_n_over_1"] == scaling["paired_2"] / scaling["paired_1"]
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == ["rank0", "rank1"]  # each rank its own directory
    # The performance page renders it as its own table.
    results = tmp_path / "results"
    results.mkdir()
    (results / "ranks-2.json").write_text(json.dumps(doc))
    page = render_page(load_sections(results), tmp_path, command="gds-offload report")
    assert "## Two ranks" in page and "| mode | processes | step (median) | x keep | x keep, 2 ranks / 1 process | x keep, paired |" in page
    assert "| offload:posix | 2 |" in page and page.count("| yes |") == 4


def test_a_failing_rank_is_named(tmp_path):
    pythonpath = _factory(tmp_path, "rank_one_fails", "os.environ.get('RANK') == '1'", "rank one refuses")
    proc, doc = _bench(["--modes", "keep", "--model", "rank_one_fails:make"], tmp_path, PYTHONPATH=pythonpath)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    one, two = sorted(doc["results"], key=lambda r: r["nproc"])
    assert one["status"] == "ok" and two["status"] == "error"
    assert two["error"].startswith("rank 1: RuntimeError: rank one refuses"), two["error"]
    assert "rank 1: RuntimeError: rank one refuses" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "gds_offload.cli", "bench", "--nproc", "2", "--modes", "keep,nope"], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "mode 'nope' is unknown" in bad.stderr, bad.stderr  # before any rank starts


def test_termination_signal_stops_every_rank(tmp_path):
    """SIGTERM to ``bench --nproc 2`` while its ranks train: torchrun and both ranks are stopped and
    reaped, and the command exits 128 + 15 with one line."""
    from helpers.procs import alive, children, cmdline, cpu_seconds

    # The one-process run fails at once (it is not a rank), so the ranks' run is the one under way.
    pythonpath = _factory(tmp_path, "ranks_only", "'RANK' not in os.environ", "ranks only")
    env = clean_env(GDS_OFFLOAD_DIR=str(tmp_path / "default"), PYTHONPATH=pythonpath)
    proc = subprocess.Popen([sys.executable, "-m", "gds_offload.cli", "bench", "--nproc", "2", *TINY, "--steps", "100000",
                             "--modes", "keep", "--model", "ranks_only:make", "--out", ""],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
            ranks = [k for k in children(proc.pid) if "ranks_runner" in cmdline(k) and "bench.train.torchrun" not in cmdline(k)]
            # Past their start-up (imports and gloo, about 2 CPU-seconds each): the ranks train now.
            if len(ranks) == 2 and all(cpu_seconds(k) >= 4 for k in ranks):
                break
            time.sleep(0.2)
        family = children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-2000:])
    deadline = time.monotonic() + 10
    while any(alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in family if alive(p)], "a rank outlived the command"
    assert "Traceback" not in err and err.strip().splitlines()[-1].endswith("stopped by SIGTERM"), err[-2000:]


def _row(mode: str, nproc: int, step_s: float, losses: list[list[str]], k: int = 0) -> RankedResult:
    ranks = [{"losses_hex": x} for x in losses] if nproc > 1 else []
    return RankedResult(mode, "ok", step_s=[step_s], median_step_s=step_s, losses_hex=losses[0], params_digest="d",
                        nproc=nproc, ranks=ranks, round=k)


def test_summary_compares_every_rank_and_the_two_settings():
    """Without torchrun: x keep per setting, their ratio, and a difference on rank 1 alone is a difference."""
    rows = [_row("keep", 1, 1.0, [["a"]]), _row("offload:posix", 1, 1.2, [["a"]]),
            _row("keep", 2, 2.0, [["a"], ["b"]]), _row("offload:posix", 2, 2.6, [["a"], ["c"]])]
    got = summarize_settings(rows, 2)
    assert got["settings"]["1"]["modes"]["offload:posix"]["losses_agree"] is True
    assert got["settings"]["2"]["modes"]["offload:posix"]["losses_agree"] is False  # rank 1 differs
    assert got["all_losses_agree"] is False and ranks_agree(rows[2:]) == {"keep": True, "offload:posix": False}
    scaling = got["scaling"]["offload:posix"]
    assert abs(scaling["x_keep_1"] - 1.2) < 1e-12 and abs(scaling["x_keep_2"] - 1.3) < 1e-12
    assert abs(scaling["n_over_1"] - 1.3 / 1.2) < 1e-12 and len(scaling["n_over_1_per_round"]) == 1


def test_one_process_spills_where_rank_0_does(tmp_path):
    assert one_process_path(str(tmp_path / "nvme{local_rank}"), 2) == str(tmp_path / "nvme0")
    assert one_process_path(str(tmp_path), 2) == str(tmp_path)
    assert one_process_path(None, 2) is None and one_process_path("auto", 2) == "auto"


def test_the_job_row_takes_each_steps_slowest_rank():
    a = RunResult("keep", "ok", step_s=[1.0, 3.0, 2.0], peak_activation_bytes=10, params_digest="x", losses_hex=["0"], tokens_per_step=8)
    b = RunResult("keep", "ok", step_s=[2.0, 1.0, 2.5], peak_activation_bytes=30, params_digest="y", losses_hex=["1"], tokens_per_step=8)
    job = combine_ranks([a, b])
    assert job.step_s == [2.0, 3.0, 2.5] and job.median_step_s == 2.5 and job.tokens_per_s == 8 / 2.5
    assert job.peak_activation_bytes == 30 and job.losses_hex == ["0"] and job.params_digest == "x,y"
    assert combine_ranks([a, a]).params_digest == "x"
