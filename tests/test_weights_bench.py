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

from helpers.disks import real_disk_base  # noqa: E402
from helpers.gates import cuda_test  # noqa: E402

from gds_offload.bench.cgroup import MemoryCap, cap_available  # noqa: E402
from gds_offload.cli import main as cli_main  # noqa: E402


def test_bench_weights_tiny_end_to_end(tmp_path: Path) -> None:
    work = real_disk_base() / f"gds_offload-bench-weights-test-{os.getpid()}"
    out = tmp_path / "report.json"
    try:
        rc = cli_main(["bench-weights", "--tiny", "--modes", "resident,drive,accelerate-disk", "--batch-sizes", "2,3",
                       "--raw-depths", "2", "--workdir", str(work), "--out", str(out)])  # fmt: skip
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    doc = json.loads(out.read_text())
    assert rc == 0 and len(doc["results"]) == 6  # one row per mode and batch
    rows = {r["mode"]: r for r in doc["results"] if r["batch"] == 2}
    assert set(rows) == {"resident", "drive", "accelerate-disk"}
    for r in rows.values():
        assert r["status"] == "ok" and r["matches_resident"] is True, r
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and len(r["tokens"][0]) == 4
        assert 0 <= r["cached_fraction_before"] < 0.5
    # The drive mode fills every layer once per forward (the next forward's first layers are prefetched at the end of each).
    assert rows["drive"]["store_bytes_per_forward"] == doc["model"]["layers_nbytes"]
    # The decodes of both modes that read the drive, bracketed by raw passes of as many bytes.
    # (Uncapped, Accelerate's decodes may read nothing: the page cache holds the tiny checkpoint.)
    for r in doc["results"]:
        if r["mode"] in ("drive", "accelerate-disk"):
            floor = 0.0 if r["mode"] == "accelerate-disk" else 1e-9
            assert r["raw_paired_bytes_per_s"] > 0 and r["decode_read_vs_raw"] >= floor, r
        else:
            assert r["raw_paired_bytes_per_s"] is None and r["decode_read_vs_raw"] is None, r
    assert [p["when"] for p in doc["raw_read"]] == ["before", "after"] and all(p["bytes_per_s"] > 0 for p in doc["raw_read"])
    probe = doc["interference"]  # compute timed alone and beside reads: what bounds the drive's targets
    assert probe["alone_s"] > 0 and probe["with_reads_s"] > 0 and probe["read_bytes_per_s"] > 0
    assert probe["slowdown"] == probe["with_reads_s"] / probe["alone_s"]
    # What gds-offload report renders.
    assert doc["kind"] == "table" and doc["command"].startswith("gds-offload bench-weights --tiny")
    assert {"title", "about", "commit", "machine", "started", "wall_s"} <= set(doc) and doc["plot"] == out.with_suffix(".png").as_posix()
    assert out.with_suffix(".png").stat().st_size > 0
    table = doc["table"]
    assert len(table["columns"]) == len(table["rows"][0]) and [r[:2] for r in table["rows"]] == [[m, b] for m in ("resident", "streamed-drive", "accelerate-disk") for b in "23"]
    assert all(isinstance(v, str) for row in table["rows"] for v in row) and table["rows"][2][-1] == "yes"
    assert {t["target"].split(":")[0] for t in doc["targets"]} == {"decode batch 1"}  # batches 2 and 3: no batch >= 8 targets
    from gds_offload.bench.docs.report import Section, render_section

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


def test_streamed_drive_runs_under_a_memory_cgroup() -> None:
    """The drive mode in a child inside a cgroup v1 memory group: the cap is recorded and held,
    and its outputs equal the resident child's."""
    ok, why = cap_available()
    if not ok:
        pytest.skip(f"needs root and the cgroup v1 memory controller: {why}")
    from dataclasses import replace

    from gds_offload.bench.weights.bench import TINY, BenchSpec, prepare, run_inference_mode

    work = real_disk_base() / f"gds_offload-bench-weights-cap-{os.getpid()}"
    try:
        ckpt, store = prepare(TINY, work)
        spec = BenchSpec("resident", str(ckpt), str(store), str(work), batch_sizes=(2,), repeats=1, paired_raw=0)
        (ref,) = run_inference_mode(spec)
        (got,) = run_inference_mode(replace(spec, mode="drive"), memory_limit=1 << 30)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    assert ref.status == got.status == "ok", (ref.error, got.error)
    assert got.cgroup_limit_bytes == 1 << 30 and 0 < (got.cgroup_peak_bytes or 0) <= 1 << 30
    assert ref.cgroup_limit_bytes is None
    assert got.tokens == ref.tokens and got.logits_xxh3 == ref.logits_xxh3


def test_raw_read_passes_cycle_through_a_window() -> None:
    from gds_offload.bench.weights.drive import raw_read_bandwidth

    path = real_disk_base() / f"gds_offload-raw-{os.getpid()}.bin"
    try:
        path.write_bytes(os.urandom(20 << 20))
        mib = 1 << 20
        passes = raw_read_bandwidth(path, depths=(1, 3), chunk_bytes=4 * mib, max_bytes=13 * mib + 123, window_bytes=8 * mib)
    finally:
        path.unlink(missing_ok=True)
    assert [(r.depth, r.nbytes, r.window_bytes) for r in passes] == [(1, 13 * mib, 8 * mib), (3, 13 * mib, 12 * mib)]  # >= depth chunks
    assert all(r.seconds > 0 and r.bytes_per_s > 0 for r in passes)


def _row(mode: str, batch: int, prefill: float, decode: float, **kw: float) -> dict[str, object]:
    return {"mode": mode, "batch": batch, "rounds_ok": 1, "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode} | kw


def test_targets_and_their_bounds() -> None:
    """The decode-rate target uses the paired raw rate; each tokens/s target carries both bounds,
    and a target whose bound is below its need is out of reach, not missed."""
    from gds_offload.bench.docs.report import out_of_reach
    from gds_offload.bench.weights.doc import targets

    gb = 1e9
    report = {
        "model": {"layers_nbytes": 2 * gb, "largest_layer_nbytes": 0.25 * gb},
        "spec": {"prompt_len": 16, "new_tokens": 3, "slots": 2},
        "raw_read": [{"bytes_per_s": 1.0 * gb}, {"bytes_per_s": 1.5 * gb}],
        "summary": [
            _row("drive", 1, 10, 0.7, decode_read_bytes_per_s=1.4 * gb, decode_read_vs_raw=0.95, raw_paired_bytes_per_s=1.6 * gb),
            _row("drive", 8, 70, 6.0), _row("accelerate-disk", 1, 6, 0.4), _row("accelerate-disk", 8, 40, 3.5),
            _row("resident", 1, 60, 5), _row("resident", 8, 120, 40),
        ],
    }
    t = {x["target"]: x for x in targets(report)}
    read = t["decode batch 1: drive read rate / raw O_DIRECT rate around it"]
    assert read["value"] == 0.95 and read["met"] is True
    decode8, prefill8 = t["decode batch 8: tok/s / Accelerate's"], t["prefill batch 8: tok/s / Accelerate's"]
    # Fastest raw rate 1.6 GB/s (the paired one): 2 steps of 8 tokens, 2 x 2 GB less 2 prefetched
    # 0.25 GB layers -> 16 tokens per 3.5 GB -> 7.3 tok/s, over Accelerate's 3.5.
    assert decode8["drive_ceiling"] == pytest.approx(16 * 1.6 / 3.5 / 3.5) and decode8["ceiling"] == pytest.approx(40 / 3.5)
    assert decode8["met"] is False and not out_of_reach(decode8)
    report["summary"][3]["decode_tokens_per_s"] = 4.0  # Accelerate faster: 2x is beyond the drive
    assert out_of_reach({x["target"]: x for x in targets(report)}["decode batch 8: tok/s / Accelerate's"])
    report["summary"][3]["decode_tokens_per_s"] = 3.5
    # Prefill: 8 x 16 tokens per 2 GB forward less 0.5 GB prefetched -> 137 tok/s; resident 120: both above 2 x 40.
    assert prefill8["drive_ceiling"] == pytest.approx(8 * 16 * 1.6 / 1.5 / 40) and prefill8["ceiling"] == pytest.approx(3.0)
    assert prefill8["met"] is False and not out_of_reach(prefill8)
    # A round in which the streamer drew more than any raw pass raises the bound to that rate.
    report["results"] = [{"mode": "drive", "status": "ok", "decode_read_bytes_per_s": 1.2 * gb, "prefill_read_bytes": 2 * gb, "prefill_s": 1.0}]
    t = {x["target"]: x for x in targets(report)}
    assert t["decode batch 8: tok/s / Accelerate's"]["drive_ceiling"] == pytest.approx(16 * 2.0 / 3.5 / 3.5)
    del report["results"]
    del report["summary"][0]["decode_read_vs_raw"]  # older results: the best raw pass
    assert targets(report)[0]["value"] == pytest.approx(1.4 / 1.6)


def test_bench_finetune_tiny_end_to_end(tmp_path: Path) -> None:
    """LoRA steps in every mode's child: the streamed modes' losses and adapters equal resident's,
    each streamed layer is read again for backward, and Accelerate's disk offload under PEFT is
    reported as the failure it is (adapters left on the meta device), without failing the command."""
    pytest.importorskip("peft", reason="peft is not installed (pip install 'gds_offload[hf]')")
    work = real_disk_base() / f"gds_offload-bench-finetune-test-{os.getpid()}"
    out = tmp_path / "finetune.json"
    try:
        rc = cli_main(["bench-finetune", "--tiny", "--modes", "resident,drive,host,accelerate-disk", "--batch-sizes", "1,2",
                       "--steps", "1", "--workdir", str(work), "--out", str(out)])  # fmt: skip
        assert not list(work.glob("accelerate-offload-*"))  # its offload folders are removed
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    doc = json.loads(out.read_text())
    rows = {(r["mode"], r["batch"]): r for r in doc["results"]}
    assert rc == 0 and len(rows) == 8
    for mode in ("resident", "drive", "host"):
        for batch in (1, 2):
            r = rows[mode, batch]
            assert r["status"] == "ok" and r["matches_resident"] is True and r["tokens_per_s"] > 0 and len(r["losses"]) == 1, r
    # Backward reads every layer again but the `slots` still in the ring after the forward, which it copies.
    assert rows["drive", 1]["backward_reads_per_step"] == 4 - doc["spec"]["slots"] and rows["drive", 1]["store_bytes_per_step"] > 0
    assert rows["host", 1]["backward_reads_per_step"] == 0  # on the CPU the host tier keeps every layer: nothing to read
    assert rows["resident", 1]["losses"] != rows["resident", 2]["losses"]  # different batches, different losses
    failed = rows["accelerate-disk", 1]
    assert failed["status"] == "error" and "meta" in failed["error"] and rows["accelerate-disk", 2]["error"].startswith("not run after batch 1")
    assert doc["kind"] == "table" and doc["command"].startswith("gds-offload bench-finetune --tiny")
    from gds_offload.bench.docs.headline import headline
    from gds_offload.bench.docs.report import Section, render_section

    line = headline(doc)
    assert line is not None and "streamed-drive: " in line and "x resident's train tok/s at batch 2, exact" in line and "accelerate-disk: failed" in line
    page = "\n".join(render_section(Section(out, doc), tmp_path))
    assert "| streamed-drive | 2 |" in page and "| accelerate-disk | 1 | failed |" in page


def test_bench_finetune_with_gradient_checkpointing(tmp_path: Path) -> None:
    """--checkpointing: every layer is recomputed in backward, streamed ones bound again for it;
    still exact, and nothing is read again through the saved-tensor path."""
    pytest.importorskip("peft", reason="peft is not installed (pip install 'gds_offload[hf]')")
    work = real_disk_base() / f"gds_offload-bench-finetune-ckpt-{os.getpid()}"
    out = tmp_path / "ckpt.json"
    try:
        rc = cli_main(["bench-finetune", "--tiny", "--modes", "resident,drive", "--batch-sizes", "2", "--steps", "1", "--checkpointing",
                       "--workdir", str(work), "--out", str(out)])  # fmt: skip
        from gds_offload.weights import read_manifest

        sizes = [g.nbytes for g in read_manifest(work / "store").layers]
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    doc = json.loads(out.read_text())
    rows = {r["mode"]: r for r in doc["results"]}
    assert rc == 0 and doc["spec"]["checkpointing"] is True and "gradient checkpointing" in doc["title"]
    assert rows["drive"]["matches_resident"] is True and rows["drive"]["backward_reads_per_step"] == 0
    # A forward and a recompute per step, each starting from the `slots` layers the pass before left in the ring.
    slots = doc["spec"]["slots"]
    assert rows["drive"]["store_bytes_per_step"] == sum(sizes[slots:]) + sum(sizes[: len(sizes) - slots])


def test_bench_finetune_full_tiny_end_to_end(tmp_path: Path) -> None:
    """--full: every weight trained in each mode's child; StreamedTrainer's losses and final weights
    equal resident's bit for bit, it writes every streamed layer's weights and AdamW state each
    step, its training directory is removed; DeepSpeed ZeRO-Infinity (where installed) runs with
    its optimizer state on NVMe and its loss difference from resident is measured."""
    import importlib.util

    from gds_offload.bench.weights.peer_loaders import deepspeed_aio_built

    ds = importlib.util.find_spec("deepspeed") is not None and deepspeed_aio_built()[0]  # else the peer, not this test, is what is missing
    modes = "resident,drive" + (",deepspeed-infinity" if ds else "")
    work = real_disk_base() / f"gds_offload-bench-full-test-{os.getpid()}"
    out = tmp_path / "full.json"
    try:
        rc = cli_main(["bench-finetune", "--full", "--tiny", "--modes", modes, "--seq-len", "16", "--steps", "1", "--workdir", str(work),
                       "--out", str(out)])  # fmt: skip
        from gds_offload.weights import read_manifest

        streamed = sum(g.nbytes for g in read_manifest(work / "store").layers)
        assert not list(work.glob("full-*")) and not (work / "deepspeed-nvme").exists()  # training and export folders removed
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    doc = json.loads(out.read_text())
    rows = {r["mode"]: r for r in doc["results"]}
    assert rc == 0 and doc["spec"]["micro_batches"] == 2 and doc["spec"]["per_load"] == 2
    drive, resident = rows["drive"], rows["resident"]
    assert resident["status"] == "ok" and len(resident["losses"]) == 2 * 2 and resident["weights_xxh3"]
    assert drive["matches_resident"] is True and drive["losses"] == resident["losses"] and drive["weights_xxh3"] == resident["weights_xxh3"]
    assert drive["written_bytes_per_step"] >= 3 * streamed  # the next generation: weights, exp_avg, exp_avg_sq of every layer
    assert doc["spec"]["minimum_read_bytes_per_step"] == 5 * streamed
    targets = {t["target"].split(" (")[0]: t for t in doc["targets"]}
    assert targets["losses and final weights equal resident's"]["value"] == 1.0
    assert targets["streamed / resident train tok/s"]["value"] == drive["tokens_per_s"] / resident["tokens_per_s"]
    assert (targets["streamed / DeepSpeed ZeRO-Infinity train tok/s"]["value"] is None) == (not ds)
    if ds:
        assert rows["deepspeed-infinity"]["status"] == "ok", rows["deepspeed-infinity"]["error"]
        assert rows["deepspeed-infinity"]["settings"]["optimizer"] == "DeepSpeedCPUAdam"
        assert rows["deepspeed-infinity"]["max_loss_diff"] is not None
    from gds_offload.bench.docs.headline import headline
    from gds_offload.bench.docs.report import Section, render_section

    line = headline(doc)
    assert line is not None and line.startswith("streamed-drive exact, ") and "x resident's train tok/s" in line
    page = "\n".join(render_section(Section(out, doc), tmp_path))
    assert "| streamed-drive (StreamedTrainer) | 1 |" in page and "yes (bit for bit)" in page


@pytest.mark.parametrize(("args", "says"), [
    (["--checkpointing"], "StreamedTrainer does not train a gradient-checkpointed model"),
    (["--micro-batches", "2", "--per-load", "3"], "--per-load 3 is more than --micro-batches 2"),
    (["--modes", "resident,accelerate-disk"], "accelerate-disk"),
])  # fmt: skip
def test_bench_finetune_full_refuses_bad_flags_before_anything_runs(args: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "work"
    assert cli_main(["bench-finetune", "--full", "--tiny", "--workdir", str(work), *args]) == 2
    assert says in capsys.readouterr().out and not work.exists()


def test_an_engine_says_how_deep_it_reads() -> None:
    """The raw reference read beside a mode uses the engine's own depth (``Engine.depth``)."""
    from gds_offload.io.factory import make_engine
    from gds_offload.io.faults import FaultyEngine

    faulty = FaultyEngine(make_engine("posix", num_threads=3))  # owns, and closes, the posix engine
    try:
        assert faulty.inner.depth == 3 and faulty.depth == 3
    finally:
        faulty.close()


@cuda_test
def test_bench_weights_on_cuda_reads_as_deep_as_the_engine_and_skips_the_cpu_probe(tmp_path: Path) -> None:
    from gds_offload.io.kvikio.engine import DEFAULT_THREADS

    work = real_disk_base() / f"gds_offload-bench-weights-cuda-{os.getpid()}"
    out = tmp_path / "report.json"
    try:
        rc = cli_main(["bench-weights", "--tiny", "--device", "cuda", "--modes", "resident,drive", "--batch-sizes", "2",
                       "--raw-depths", "2", "--workdir", str(work), "--out", str(out)])  # fmt: skip
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    doc = json.loads(out.read_text())
    assert rc == 0 and {p["depth"] for p in doc["raw_read"] if p["when"] == "before"} == {2, DEFAULT_THREADS}
    assert "skipped" in doc["interference"] and "into host memory" in doc["about"]


def test_deepspeed_infinity_swaps_one_layer_at_a_time() -> None:
    """ZeRO-Infinity's sub-groups hold one decoder layer: with DeepSpeed's default (1e9 elements) the
    benchmark model is one sub-group, and the optimizer's NVMe swapper pins buffers of all of it."""
    import torch
    import transformers

    from gds_offload.bench.weights.bench import DEFAULT_MODEL, TINY
    from gds_offload.bench.weights.full import FullSpec
    from gds_offload.bench.weights.full_child import deepspeed_infinity_config, layer_numel

    for shape in (DEFAULT_MODEL, TINY):
        cfg = shape.config()
        with torch.device("meta"):
            layer = transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0]
        assert layer_numel(cfg) == sum(p.numel() for p in layer.parameters())
        spec = FullSpec(mode="deepspeed-infinity", checkpoint="c", store="s", workdir="w")
        ds = deepspeed_infinity_config(cfg, Path("/nvme"), spec, 1)
        assert ds["zero_optimization"]["sub_group_size"] == layer_numel(cfg)
        assert ds["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
