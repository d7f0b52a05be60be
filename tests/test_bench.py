"""The benchmark suite: the per-mode child-process runner, ``gds-offload bench`` and
``demo``, the plot, the machine description, and the examples (each run as a script).

Sizes are tiny: these tests check that every piece runs and that the modes compute
bit-identical losses; the performance figures come from running the commands.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gds_offload.bench.machine import describe_machine
from gds_offload.bench.train.child import exact_in_process, run_here
from gds_offload.bench.train.runner import run_mode
from gds_offload.bench.train.spec import RunResult, RunSpec, compare_losses, expand_modes, parse_mode
from gds_offload.cli import main
from gds_offload.io.kvikio.engine import kvikio_status
from gds_offload.models.gpt import GPTConfig, lm_loss, make_gpt, synthetic_batch

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(layers=2, hidden=64, heads=2, seq=64, vocab=256, batch=2, steps=2, warmup=1, min_bytes=0, dropout=0.1)
TINY_ARGS = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64", "--vocab", "256", "--batch", "2",
             "--steps", "2", "--warmup", "1", "--min-bytes", "0"]


def _quiet(_event: dict) -> None:
    pass


# ---------------------------------------------------------------------- runner (child processes)
def test_modes_in_child_processes_agree_bit_for_bit(tmp_path) -> None:
    base = RunSpec("keep", path=str(tmp_path), progress=True, **TINY)
    events: list[dict] = []
    results = [run_mode(replace(base, mode=m), on_event=events.append, timeout_s=300) for m in ("keep", "offload:posix", "recompute")]
    for r in results:
        assert r.status == "ok", r.error
        assert len(r.losses_hex) == 3 and len(r.step_s) == 2 and r.median_step_s > 0
        assert r.peak_activation_bytes is not None and r.memory_source.startswith("VmHWM")
        assert r.returncode == 0
    keep, off, rec = results
    assert compare_losses(results) == {"keep": True, "offload:posix": True, "recompute": True}
    assert off.engine == "posix" and off.gds is False
    assert off.offload["bytes_offloaded"] > 0 and off.offload["steps"] == 2  # measured steps only
    assert off.layer_names == rec.layer_names == ["blocks.0", "blocks.1"]
    assert keep.offload is None and keep.engine is None
    steps = [e for e in events if e["event"] == "step"]
    assert [e["phase"] for e in steps[:3]] == ["warmup", "measure", "measure"]
    assert "offload" in steps[3] and steps[4]["offload"]["peak_resident_bytes"] > 0


def test_failing_child_is_an_error_row() -> None:
    r = run_mode(RunSpec("keep", model="no_such_module_xyz:make", **TINY), timeout_s=120)
    assert r.status == "error" and "no_such_module_xyz" in r.error and r.returncode == 1


def test_killed_child_is_an_error_row() -> None:
    r = run_mode(RunSpec("keep", **(TINY | {"steps": 10_000})), timeout_s=4)
    assert r.status == "error" and "timed out" in r.error


# ---------------------------------------------------------------------- runner (in this process)
@pytest.mark.parametrize("mode", ["offload:host"] + (["offload:compat"] if kvikio_status()[0] else []))
def test_other_engines_in_process(mode: str, tmp_path) -> None:
    keep = run_here(RunSpec("keep", **TINY), emit=_quiet)
    got = run_here(RunSpec(mode, path=str(tmp_path), measure_memory=False, **TINY), emit=_quiet)
    assert got.losses_hex == keep.losses_hex and got.params_digest == keep.params_digest
    assert got.offload["bytes_offloaded"] > 0
    assert got.peak_activation_bytes is None and got.memory_source.startswith("not measured")


def test_memory_peak_counts_from_before_the_first_step() -> None:
    """What the first step allocates and keeps (as an engine keeps buffers for reuse) is in the
    peak, as it is in the process's highest point: the baseline is taken before the first step,
    with the model and AdamW state built, not after the warm-up."""
    from gds_offload.bench.train.workload import Workload, build_workload

    held: list[torch.Tensor] = []

    def holding(spec: RunSpec) -> Workload:
        wl = build_workload(spec)

        def loss_fn(model: torch.nn.Module, batch: object) -> torch.Tensor:
            if not held:
                held.append(torch.ones(64 << 20, dtype=torch.uint8))  # written, so resident
            return wl.loss_fn(model, batch)

        return replace(wl, loss_fn=loss_fn)

    got = run_here(RunSpec("keep", **TINY), emit=_quiet, workload=holding)
    assert held and got.memory_source.startswith("VmHWM - VmRSS before the first step")
    assert got.peak_activation_bytes is not None and got.peak_activation_bytes >= 64 << 20, got.peak_activation_bytes


def test_adamw_with_its_state_built_trains_bit_identically() -> None:
    """The bench builds AdamW's state before the baseline (it is not activation memory); every
    loss, weight and moment is the same as with the state created by the first step."""
    from gds_offload.bench.train.memory import adamw_with_state

    cfg = GPTConfig(2, 64, 2, 32, 256, 0.1)

    def train(prebuilt: bool) -> list[torch.Tensor]:
        model = make_gpt(cfg, seed=0)
        params = list(model.parameters())
        opt = adamw_with_state(params, 1e-3) if prebuilt else torch.optim.AdamW(params, lr=1e-3)
        seen = []
        for i in range(3):
            torch.manual_seed(i)
            loss = lm_loss(model, synthetic_batch(cfg, 2, i))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen.append(loss.detach())
        return seen + [p.detach().clone() for p in params] + [t for st in opt.state.values() for t in st.values()]

    fresh, prebuilt = train(False), train(True)
    assert len(fresh) == len(prebuilt) == 3 + 4 * len(list(make_gpt(cfg, seed=0).parameters()))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(fresh, prebuilt))


def test_adaptive_runs_or_is_unavailable(tmp_path) -> None:
    from gds_offload.bench.train.spec import Unavailable

    try:
        got = run_here(RunSpec("adaptive", path=str(tmp_path), **TINY), emit=_quiet)
    except Unavailable as exc:
        assert "adaptive" in str(exc)
        return
    assert got.losses_hex == run_here(RunSpec("keep", **TINY), emit=_quiet).losses_hex


def test_save_on_cpu_needs_cuda() -> None:
    from gds_offload.bench.train.spec import Unavailable

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: save_on_cpu runs there")
    with pytest.raises(Unavailable, match="needs --device cuda"):
        run_here(RunSpec("save_on_cpu", **TINY), emit=_quiet)


def test_hf_models_by_name() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    for name, first in (("llama", "model.layers.0"), ("gpt2", "transformer.h.0")):
        spec = RunSpec("recompute", model=name, **TINY)
        got = run_here(spec, emit=_quiet)
        assert got.layer_names[0] == first
        assert got.losses_hex == run_here(replace(spec, mode="keep"), emit=_quiet).losses_hex


# A user factory for --model test_bench:<name> (the factory contract).
def factory_pair(spec):
    cfg = GPTConfig(spec.layers, spec.hidden, spec.heads, spec.seq, spec.vocab, spec.dropout)

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = make_gpt(cfg, seed=spec.seed)

        def forward(self, tokens):
            logits = self.gpt(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return WithLoss(), lambda step: synthetic_batch(cfg, spec.batch, seed=step)


def factory_triple(spec):
    from gds_offload.models.gpt import lm_loss

    cfg = GPTConfig(spec.layers, spec.hidden, spec.heads, spec.seq, spec.vocab, spec.dropout)
    return make_gpt(cfg, seed=spec.seed), lambda step: synthetic_batch(cfg, spec.batch, seed=step), lm_loss


def test_user_factory_contract(tmp_path) -> None:
    a = run_here(RunSpec("offload:posix", model=f"{__name__}:factory_pair", path=str(tmp_path), **TINY), emit=_quiet)
    b = run_here(RunSpec("keep", model=f"{__name__}:factory_triple", **TINY), emit=_quiet)
    assert a.layer_names == ["gpt.blocks.0", "gpt.blocks.1"]
    assert a.losses_hex == b.losses_hex


def test_mode_parsing() -> None:
    assert parse_mode("offload") == ("offload", "auto")
    assert parse_mode("offload:posix") == ("offload", "posix")
    assert parse_mode("recompute") == ("recompute", None)
    assert parse_mode("adaptive") == ("adaptive", "auto") and parse_mode("adaptive:posix") == ("adaptive", "posix")
    with pytest.raises(ValueError, match="offload:<auto"):
        parse_mode("offload:nvme")
    with pytest.raises(ValueError, match="unknown"):
        parse_mode("keepall")
    modes = expand_modes(["keep", "offload:*", "keep", "recompute"], "cpu", None)
    assert modes[0] == "keep" and modes[-1] == "recompute" and "offload:posix" in modes and "offload:host" in modes
    assert "offload:gds" not in modes and len(modes) == len(set(modes))


def test_compare_losses_flags_a_difference() -> None:
    ok = dict(status="ok", losses_hex=["0x1.0p+0"], params_digest="d")
    rows = [RunResult("keep", **ok), RunResult("a", **ok), RunResult("b", **(ok | {"losses_hex": ["0x1.1p+0"]})),
            RunResult("c", **(ok | {"params_digest": "e"})), RunResult("d", status="error")]
    assert compare_losses(rows) == {"keep": True, "a": True, "b": False, "c": False, "d": None}


# ---------------------------------------------------------------------- commands
def assert_exact(summary: dict) -> None:
    """Every offload mode's losses and weights equal keep's: across processes, or, where torch's
    kernels gave other last bits in another process (it happens with or without the offloader,
    see gds_offload/bench/train/runner.py's module doc), in the bench's own check in one process."""
    from gds_offload.bench.train.suite import unexplained_differences

    assert unexplained_differences(summary) == [], summary
    for mode, row in summary["modes"].items():
        assert row["losses_agree"] is True or row.get("exact_in_process") is True, (mode, row)


def test_bench_command_writes_json_and_plot(tmp_path, capsys) -> None:
    missing = tmp_path / "r" / "bench.json"
    assert main(["bench", *TINY_ARGS, "--modes", "keep", "--out", str(missing)]) == 2, "a given --out's folder must exist"
    assert f"--out {missing}: its parent {tmp_path / 'r'} does not exist" in capsys.readouterr().err and not missing.parent.exists()
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", *TINY_ARGS, "--modes", "keep,offload:host", "--path", str(tmp_path),
               "--out", str(out), "--plot", str(png)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["modes"] == ["keep", "offload:host"] and "bench" in doc["command"]
    assert_exact(doc["summary"])
    assert doc["summary"]["modes"]["offload:host"]["step_ratio"] > 0
    assert doc["machine"]["cpu_cores"] >= 1 and doc["machine"]["torch"] == torch.__version__
    assert [r["status"] for r in doc["results"]] == ["ok", "ok"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "offload:host" in text and "yes" in text
    assert f"results: {out}, plot: {png}" in text, "where it wrote, as absolute paths"


def test_rounds_interleave_and_ratios_are_taken_within_a_round() -> None:
    from gds_offload.bench.train.suite import combine_rounds, round_order, summarize

    assert [round_order(["keep", "a", "b"], k) for k in range(4)] == [
        ["keep", "a", "b"], ["a", "b", "keep"], ["b", "keep", "a"], ["keep", "a", "b"]]

    def row(mode: str, k: int, step: float, peak: int, hexes: str = "0x1.0p+0") -> RunResult:
        return RunResult(mode, "ok", median_step_s=step, step_s=[step, step], peak_activation_bytes=peak,
                         losses_hex=[hexes], params_digest="d", tokens_per_step=10, round=k)

    # Round 2 is a slow spell for every mode: per-round ratios are unaffected, pooled medians are not.
    rows = [row("keep", 0, 1.0, 100), row("a", 0, 1.1, 40), row("a", 1, 1.2, 50), row("keep", 1, 1.0, 100),
            row("keep", 2, 2.0, 100), row("a", 2, 2.0, 30, "0x1.1p+0")]
    s = summarize(rows)
    a = s["modes"]["a"]
    assert s["rounds"] == 3 and a["step_ratios"] == pytest.approx([1.1, 1.2, 1.0])
    assert a["step_ratio"] == pytest.approx(1.1) and a["memory_ratio"] == pytest.approx(0.4)
    assert a["losses_agree"] is False and s["modes"]["keep"]["losses_agree"] is True  # one round differed
    assert s["all_losses_agree"] is False
    combined = {r.mode: r for r in combine_rounds(rows)}
    assert len(combined["a"].step_s) == 6 and combined["a"].median_step_s == pytest.approx(1.2)
    assert combined["a"].peak_activation_bytes == 40 and combined["a"].tokens_per_s == pytest.approx(10 / 1.2)
    failed = combine_rounds(rows + [RunResult("a", "error", "boom", round=3)])
    assert [r.status for r in failed if r.mode == "a"] == ["error"]
    assert summarize(rows + [RunResult("a", "error", "boom", round=3)])["failed"] == ["a"]


def test_bench_command_rounds(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "bench.json"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the children inherit it; each records what torch used
    rc = main(["bench", *TINY_ARGS, "--modes", "keep,offload:host", "--rounds", "2", "--path", str(tmp_path),
               "--out", str(out), "--plot", ""])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [(r["mode"], r["round"]) for r in doc["results"]] == [
        ("keep", 0), ("offload:host", 0), ("offload:host", 1), ("keep", 1)]
    assert doc["summary"]["rounds"] == 2 and len(doc["summary"]["modes"]["offload:host"]["step_ratios"]) == 2
    assert [r["torch_threads"] for r in doc["results"]] == [1, 1, 1, 1]
    text = " ".join(capsys.readouterr().out.split())  # the title may wrap
    assert "2 interleaved rounds" in text and "torch threads: 1" in text


def test_bench_command_paired(tmp_path, capsys) -> None:
    """--paired: offloaded and paused steps alternate (ABBA) in the offload child; all steps stay exact."""
    out = tmp_path / "bench.json"
    args = [a if a != "2" or i != TINY_ARGS.index("--steps") + 1 else "4" for i, a in enumerate(TINY_ARGS)]
    rc = main(["bench", *args, "--modes", "keep,offload:posix", "--paired", "--path", str(tmp_path), "--out", str(out), "--plot", ""])
    assert rc == 0
    doc = json.loads(out.read_text())
    keep, off = doc["results"]
    assert len(keep["step_s"]) == 4 and keep["paired_keep_s"] == []
    assert len(off["step_s"]) == len(off["paired_keep_s"]) == 2
    assert off["offload"]["steps"] == 2 and off["peak_activation_bytes"] is not None  # paused steps are not offloaded
    assert_exact(doc["summary"])  # every step, offloaded or paused, equals keep's
    ratios = doc["summary"]["modes"]["offload:posix"]["paired_ratios"]
    assert ratios == pytest.approx([a / b for a, b in zip(off["step_s"], off["paired_keep_s"])])
    assert "paired" in capsys.readouterr().out.split("results:")[0]


def test_bench_command_rejects_unknown_mode(capsys) -> None:
    assert main(["bench", "--modes", "keep,teleport", "--out", "", "--plot", ""]) == 2
    assert "teleport" in capsys.readouterr().err


def test_demo_command(tmp_path, capsys) -> None:
    rc = main(["demo", *TINY_ARGS, "--mode", "host", "--path", str(tmp_path), "--out", ""])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "loss curves agree" in text and "I/O hidden behind compute" in text
    assert "NO" not in text or "bit-identical in one process (2 steps" in text, text  # see assert_exact
    assert "offloaded / paused, 1 pair" in text


def test_exact_in_process_compares_every_loss_and_gradient(tmp_path, monkeypatch) -> None:
    spec = RunSpec("offload:posix", path=str(tmp_path), **TINY)
    assert exact_in_process(spec)
    # An offloader that changes saved bytes must be caught: corrupt every read (fault injection).
    # Each write lands before write() returns, so backward reads every tensor back (a write still
    # in flight would serve its tensor from memory, and a slow drive would hide the corruption).
    import gds_offload.activations.offloader as hooks_mod
    from gds_offload.io.faults import Fault, FaultyEngine

    class Settled(FaultyEngine):
        def _submit_write(self, src, slot, ready):  # noqa: ANN001, ANN202
            future = super()._submit_write(src, slot, ready)
            future.exception()
            return future

    real = hooks_mod.make_engine
    monkeypatch.setattr(hooks_mod, "make_engine", lambda *a, **kw: Settled(real(*a, **kw), [Fault("read", "corrupt", 1, 0)]))
    assert not exact_in_process(spec)
    with pytest.raises(ValueError, match="offload mode"):
        exact_in_process(RunSpec("keep", **TINY))


def test_demo_checks_in_one_process_when_processes_disagree(tmp_path, capsys, monkeypatch) -> None:
    """A loss difference between processes (kernels, not the offloader) is re-checked in one
    process; the demo passes only if that check is exact."""
    import gds_offload.bench.train.child as child
    import gds_offload.bench.train.spec as bench_spec

    monkeypatch.setattr(bench_spec, "compare_losses", lambda results, reference="keep": {r.mode: r.mode == "keep" for r in results})
    rc = main(["demo", *TINY_ARGS, "--mode", "posix", "--path", str(tmp_path)])
    text = capsys.readouterr().out
    assert "bit-identical in one process" in text and rc == 0, text
    monkeypatch.setattr(child, "exact_in_process", lambda spec, steps=2: False)
    rc = main(["demo", *TINY_ARGS, "--mode", "posix", "--path", str(tmp_path)])
    assert rc == 1 and "NOT bit-identical in one process" in capsys.readouterr().out


def test_bench_checks_in_one_process_when_processes_disagree(tmp_path, capsys, monkeypatch) -> None:
    """bench, like demo: an offload mode whose losses differ from keep's process is re-checked in
    one process; the run fails only if that check fails (or the mode cannot be checked)."""
    import gds_offload.bench.train.suite as suite
    from gds_offload.bench.train.suite import unexplained_differences

    # The names the bench's suite calls: the cross-process comparison, then the one-process check.
    monkeypatch.setattr(suite, "compare_losses", lambda results, reference="keep": {r.mode: r.mode == "keep" for r in results})
    out = tmp_path / "bench.json"
    rc = main(["bench", *TINY_ARGS, "--modes", "keep,offload:posix", "--path", str(tmp_path), "--out", str(out)])
    row = json.loads(out.read_text())["summary"]["modes"]["offload:posix"]
    assert rc == 0 and row["losses_agree"] is False and row["exact_in_process"] is True
    text = "".join(capsys.readouterr())
    assert "checking in one process" in text and "bit-identical in one process" in text
    monkeypatch.setattr(suite, "exact_in_process", lambda spec, steps=2: False)
    rc = main(["bench", *TINY_ARGS, "--modes", "keep,offload:posix", "--path", str(tmp_path), "--out", str(out)])
    assert rc == 1 and json.loads(out.read_text())["summary"]["modes"]["offload:posix"]["exact_in_process"] is False
    assert "NOT bit-identical in one process" in "".join(capsys.readouterr())
    # recompute has no offloader to take out: a difference there stays unexplained.
    summary = {"modes": {"keep": {"losses_agree": True}, "recompute": {"losses_agree": False},
                         "adaptive": {"losses_agree": False, "exact_in_process": True}}}
    assert unexplained_differences(summary) == ["recompute"]


def test_io_hidden_fraction() -> None:
    from gds_offload.bench.train.demo_view import io_hidden_fraction

    assert io_hidden_fraction({"write_s": 1.0, "read_s": 1.0, "io_wait_s": 0.5}) == 0.75
    assert io_hidden_fraction({"write_s": 0.0, "read_s": 0.0, "io_wait_s": 0.0}) is None
    assert io_hidden_fraction({"write_s": 0.1, "read_s": 0.1, "io_wait_s": 1.0}) == 0.0


# ---------------------------------------------------------------------- plot, machine
def test_plot_from_dicts(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    from gds_offload.bench.docs.plot import plot_results

    rows = [
        {"mode": "keep", "status": "ok", "median_step_s": 1.0, "peak_activation_bytes": 2 << 30},
        {"mode": "offload:posix", "status": "ok", "median_step_s": 1.1, "peak_activation_bytes": 1 << 29, "paired_ratio": 1.04},
        {"mode": "adaptive", "status": "unavailable"},
    ]
    out = plot_results(rows, tmp_path / "x" / "p.png")
    assert out.stat().st_size > 1000


def test_machine_description(tmp_path) -> None:
    m = describe_machine(tmp_path)
    assert m.cpu_cores and m.ram_bytes and m.path == str(tmp_path)
    assert m.filesystem  # from /proc/mounts
    json.dumps(m.as_dict())


# ---------------------------------------------------------------------- examples
@pytest.mark.parametrize("script", ["train_loop.py", "grad_accumulation.py", "amp_bf16.py", "hf_trainer.py"])
def test_example_runs(script: str, tmp_path) -> None:
    if script == "hf_trainer.py":
        pytest.importorskip("transformers", reason="transformers is not installed")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--steps", "2", "--path", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "offloaded" in proc.stdout
