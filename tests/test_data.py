"""The input side (gds_offload.data): shard files, the writer, the DALI token loader on the
CPU (its GPU reader in the ``gpu``/``gds`` tests), bad input, resumption, the path check,
``gds-offload shards`` and the runner's ``--data``.

Every loader test checks what was served against the files themselves: no window repeated,
none dropped, per rank too (where ranks hold fewer windows than others they repeat the start
of their stream: tests/test_data_hardening.py).
"""
from __future__ import annotations

import importlib.util
import json
import struct
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.gates import cuda_test

from gds_offload.cli import main
from gds_offload.data.format import MANIFEST_NAME, ShardError, read_shard_header, scan_shards, write_shard
from gds_offload.data.loader import TokenLoader
from gds_offload.data.order import plan_epoch
from gds_offload.data.writer import BYTE_VOCAB, EOT, ShardWriter, synthetic_tokens, text_documents, write_shards
from gds_offload.io.layout import ALIGN

#: Tests that read shards through DALI (building a loader and checking files does not need it).
requires_dali = pytest.mark.skipif(
    importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None,
    reason="NVIDIA DALI is not installed (pip install 'gds_offload[data]')",
)


def synthetic(path: Path, tokens: int = 20_000, *, seq: int = 32, per_file: int = 50, vocab: int = 4096, seed: int = 0):
    return write_shards(path, synthetic_tokens(tokens, vocab=vocab, seed=seed), seq=seq, vocab=vocab,
                        tokenizer="synthetic", windows_per_file=per_file)


def all_windows(path: Path) -> Counter:
    """Every window of the directory's files, as a multiset of tuples."""
    return Counter(map(tuple, np.concatenate([np.load(f.path) for f in scan_shards(path).files]).tolist()))


def served(batches) -> list[tuple[int, ...]]:
    """The windows of ``batches`` (input_ids plus the last label) in order."""
    out = []
    for b in batches:
        assert b["input_ids"].dtype == torch.int64 and torch.equal(b["input_ids"][:, 1:], b["labels"][:, :-1])
        out.extend(map(tuple, torch.cat([b["input_ids"], b["labels"][:, -1:]], 1).tolist()))
    return out


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    synthetic(tmp_path / "s")  # 624 windows of 33 tokens: 12 files of 50, one of 24
    return tmp_path / "s"


# ---------------------------------------------------------------------- files and the writer
def test_shard_file_is_an_aligned_npy(tmp_path: Path) -> None:
    rows = np.arange(3 * 9, dtype=np.uint16).reshape(3, 9)
    info = write_shard(tmp_path / "a.npy", rows)
    raw = (tmp_path / "a.npy").read_bytes()
    assert info.data_offset == ALIGN and struct.unpack("<H", raw[8:10])[0] + 10 == ALIGN
    assert raw[ALIGN:] == rows.tobytes()
    assert np.array_equal(np.load(tmp_path / "a.npy"), rows)
    assert read_shard_header(tmp_path / "a.npy") == info


def test_text_shards_are_the_byte_stream_cut_into_overlapping_windows(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(bytes(range(256)) * 3)
    b.write_text("hello, shards\n" * 40)
    summary = write_shards(tmp_path / "out", text_documents([a, b]), seq=16, vocab=BYTE_VOCAB, tokenizer="bytes",
                           windows_per_file=7)
    stream = np.concatenate([np.frombuffer(a.read_bytes(), np.uint8), [EOT], np.frombuffer(b.read_bytes(), np.uint8), [EOT]])
    windows = np.concatenate([np.load(f.path) for f in summary.files])
    n = (stream.size - 1) // 16
    assert windows.shape == (n, 17) and windows.dtype == np.uint16
    assert all(np.array_equal(windows[i], stream[i * 16 : i * 16 + 17]) for i in range(n))
    assert summary.tail_tokens == stream.size - (n * 16 + 1)
    assert [f.windows for f in summary.files] == [7] * (n // 7) + ([n % 7] if n % 7 else [])
    doc = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert doc["vocab"] == BYTE_VOCAB and doc["windows"] == n and doc["tail_tokens_left_out"] == summary.tail_tokens
    assert scan_shards(tmp_path / "out").tokenizer == "bytes"


def test_default_files_fill_whole_pages(tmp_path: Path) -> None:
    summary = synthetic(tmp_path / "s", 300_000, seq=512, per_file=None)
    assert summary.windows_per_file == 2048  # 2048 rows of 1026 bytes = 513 pages
    assert all(f.nbytes % ALIGN == 0 for f in summary.files[:-1])


def test_writer_refuses_too_little_text_and_old_shards(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ShardError, match="shorter than one window"):
        write_shards(tmp_path / "o", text_documents([short]), seq=64, vocab=BYTE_VOCAB, tokenizer="bytes")
    synthetic(tmp_path / "s")
    with pytest.raises(ShardError, match="already holds shards.*--overwrite"):
        synthetic(tmp_path / "s")
    np.save(tmp_path / "s" / "mine.npy", np.zeros(3))
    with pytest.raises(ShardError, match="mine.npy, which is not a shard"):
        write_shards(tmp_path / "s", [np.zeros(100, np.uint16)], seq=4, vocab=10, tokenizer="x", overwrite=True)
    with pytest.raises(ShardError, match=r"missing\.txt does not exist"):
        list(text_documents([tmp_path / "missing.txt"]))
    with pytest.raises(ShardError, match="outside"):
        ShardWriter(tmp_path / "v", seq=4, vocab=10, tokenizer="x").add(np.array([3, 10]))


# ---------------------------------------------------------------------- bad input
def _corrupt(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("case", ["missing", "empty", "dtype", "no-rows", "one-d", "mixed-seq", "header", "magic", "truncated",
                                  "not-in-manifest", "missing-from-manifest"])
def test_bad_input_names_the_file(tmp_path: Path, shards: Path, case: str) -> None:
    bad = shards / "shard-000003.npy"
    if case == "missing":
        shards, bad = tmp_path / "nowhere", tmp_path / "nowhere"
    elif case == "empty":
        shards = bad = tmp_path / "empty"
        shards.mkdir()
    elif case == "dtype":
        np.save(bad, np.zeros((50, 33), dtype=np.float32))
    elif case == "no-rows":
        np.save(bad, np.zeros((0, 33), dtype=np.uint16))
    elif case == "one-d":
        np.save(bad, np.zeros(20, dtype=np.uint16))
    elif case == "mixed-seq":
        write_shard(bad, np.zeros((50, 17), dtype=np.uint16))
    elif case == "header":
        _corrupt(bad, 10, b"{'descr': <<garbage")
    elif case == "magic":
        _corrupt(bad, 0, b"PK\x03\x04")
    elif case == "truncated":
        bad.write_bytes(bad.read_bytes()[:-100])
    elif case == "not-in-manifest":
        bad = shards / "zzz.npy"
        write_shard(bad, np.zeros((5, 33), dtype=np.uint16))
    elif case == "missing-from-manifest":
        bad.unlink()
    expected = {"missing": "does not exist", "empty": "holds no .npy shards", "dtype": "dtype <f4", "no-rows": "shorter than one window",
                "one-d": "1-D array", "mixed-seq": "windows of 17 tokens", "header": "corrupted .npy header",
                "magic": "not a .npy file", "truncated": "truncated", "not-in-manifest": "not listed in shards.json",
                "missing-from-manifest": "listed in shards.json but missing"}[case]
    with pytest.raises(ShardError, match=expected) as info:
        TokenLoader(shards, batch_size=4)
    assert str(bad) in str(info.value)


def test_without_dali_the_loader_says_how_to_install_it(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import nvidia.dali now raises ImportError
    loader = TokenLoader(shards, batch_size=4)  # checking the files needs no DALI
    with pytest.raises(ValueError, match=r"pip install 'gds_offload\[data\]'"):
        next(iter(loader))
    assert loader.step == 0


def test_wrong_seq_and_bad_arguments(shards: Path) -> None:
    with pytest.raises(ShardError, match="not seq 64; pass --seq 32"):
        TokenLoader(shards, batch_size=4, seq=64)
    with pytest.raises(ValueError, match="batch_size=0"):
        TokenLoader(shards, batch_size=0)
    with pytest.raises(ValueError, match="shard_id=3 must be in"):
        TokenLoader(shards, batch_size=4, shard_id=3, num_shards=2)
    with pytest.raises(ShardError, match="cannot feed num_shards=20"):
        TokenLoader(shards, batch_size=4, num_shards=20)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TokenLoader(shards, batch_size=4, device="cpu", reader="gpu")


@requires_dali
# ---------------------------------------------------------------------- one epoch: everything, once
@pytest.mark.parametrize("batch,pool_files", [(7, 3), (64, 1), (1000, 8)])
def test_one_epoch_serves_every_window_once(shards: Path, batch: int, pool_files: int) -> None:
    loader = TokenLoader(shards, batch_size=batch, pool_files=pool_files, device="cpu")
    got = served(loader)
    assert Counter(got) == all_windows(shards) and len(got) == 624
    assert loader.step == -(-624 // batch) == loader.plan(0).steps
    assert loader.epoch == 1 and loader.window == 0
    second = served(loader)
    assert Counter(second) == all_windows(shards) and second != got  # a new epoch, a new order


@requires_dali
def test_ranks_split_the_windows_exactly(shards: Path) -> None:
    per_rank = [served(TokenLoader(shards, batch_size=5, seed=3, shard_id=r, num_shards=3)) for r in range(3)]
    plans = [plan_epoch(tuple(f.windows for f in scan_shards(shards).files), epoch=0, seed=3, shard_id=r, num_shards=3,
                        batch=5, pool_files=8) for r in range(3)]
    # Each rank's own stream (its files' windows) first: together, every window once; then repeats to match the most.
    assert sum((Counter(w[: p.rank_windows]) for w, p in zip(per_rank, plans)), Counter()) == all_windows(shards)
    assert sum(p.rank_windows for p in plans) == 624
    assert [len(w) for w in per_rank] == [p.windows for p in plans] == [max(p.rank_windows for p in plans)] * 3
    assert sorted(i for p in plans for i in p.files) == list(range(13))


@requires_dali
def test_drop_last_gives_every_rank_the_same_whole_batches(shards: Path) -> None:
    with pytest.warns(UserWarning, match="leaves out"):
        loaders = [TokenLoader(shards, batch_size=8, shard_id=r, num_shards=2, drop_last=True) for r in range(2)]
        counts = [len(lo) for lo in loaders]
    batches = [[b["input_ids"].shape[0] for b in lo] for lo in loaders]
    assert counts[0] == counts[1] == len(batches[0]) == len(batches[1]) and set(batches[0] + batches[1]) == {8}


@requires_dali
def test_order_is_a_function_of_the_seed(shards: Path) -> None:
    a = served(TokenLoader(shards, batch_size=16, seed=1))
    assert served(TokenLoader(shards, batch_size=16, seed=1)) == a
    assert served(TokenLoader(shards, batch_size=16, seed=2)) != a
    plain = served(TokenLoader(shards, batch_size=16, shuffle=False))
    assert plain == [tuple(w) for f in scan_shards(shards).files for w in np.load(f.path).tolist()]


@requires_dali
def test_tokens_above_2_15_survive(tmp_path: Path) -> None:
    synthetic(tmp_path / "big", 5_000, seq=16, per_file=40, vocab=65536)
    got = served(TokenLoader(tmp_path / "big", batch_size=9))
    assert Counter(got) == all_windows(tmp_path / "big") and max(max(w) for w in got) >= 1 << 15


@requires_dali
# ---------------------------------------------------------------------- resumption
def test_state_dict_resumes_exactly_mid_epoch_and_across_epochs(shards: Path) -> None:
    reference = TokenLoader(shards, batch_size=10, pool_files=2)
    stream = reference.batches()
    expected = [served([next(stream)]) for _ in range(150)]  # 63 batches per epoch: over two epoch ends
    for cut in (0, 1, 17, 63, 64, 100):
        first = TokenLoader(shards, batch_size=10, pool_files=2)
        it = first.batches()
        for _ in range(cut):
            next(it)
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
        resumed = TokenLoader(shards, batch_size=10, pool_files=2)
        resumed.load_state_dict(state)
        again = resumed.batches()
        assert [served([next(again)]) for _ in range(20)] == expected[cut : cut + 20], cut
        started = TokenLoader(shards, batch_size=10, pool_files=2, start_step=cut).batches()
        assert served([next(started)]) == expected[cut]


def test_a_state_from_another_order_is_refused(shards: Path, tmp_path: Path) -> None:
    state = TokenLoader(shards, batch_size=10).state_dict()
    with pytest.raises(ValueError, match="seed=0 there, 1 here"):
        TokenLoader(shards, batch_size=10, seed=1).load_state_dict(state)
    other = tmp_path / "other"
    synthetic(other, 19_000)
    with pytest.raises(ValueError, match="taken on other shards"):
        TokenLoader(other, batch_size=10).load_state_dict(state)
    with pytest.raises(ValueError, match="not a gds_offload.data.TokenLoader/2 state"):
        TokenLoader(shards, batch_size=10).load_state_dict({"epoch": 3})


# ---------------------------------------------------------------------- the GPU reader
@pytest.mark.dali
@requires_dali
@cuda_test
def test_gpu_reader_serves_what_the_cpu_reader_serves(shards: Path) -> None:
    gpu = TokenLoader(shards, batch_size=16, device="cuda", reader="gpu")
    batches = list(gpu)
    assert all(b["input_ids"].is_cuda for b in batches)
    assert served(batches) == served(TokenLoader(shards, batch_size=16, device="cpu"))


@pytest.mark.gds
@pytest.mark.dali
@requires_dali
@cuda_test
def test_gds_reader_path_reports_its_reader(shards: Path) -> None:
    from gds_offload.data.check import input_path_status

    status = input_path_status(shards)
    assert status.reader in ("gds", "gpu-compat") and status.facts["gpu"]


# ---------------------------------------------------------------------- the path check
def test_input_path_status_reasons(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gds_offload.data import check
    from gds_offload.node.system import GpuInfo, GpuProbe, LibcufileProbe, NvidiaFsProbe

    no_gpu = check.input_path_status(shards)
    if not torch.cuda.is_available():
        assert no_gpu.reader == "cpu" and "no CUDA GPU" in no_gpu.reason and not no_gpu.gds
    assert check.input_path_status(shards.parent / "nowhere").reader == "unusable"
    monkeypatch.setattr(check, "probe_gpus", lambda root=None: GpuProbe(gpus=(GpuInfo(0, "H200", 1 << 40),)))
    monkeypatch.setattr(check, "probe_libcufile", lambda root=None: LibcufileProbe(True, "/x/libcufile.so.0", "1.13", "wheel"))
    monkeypatch.setattr(check, "probe_nvidia_fs", lambda root=None: NvidiaFsProbe(False))
    status = check.input_path_status(shards)
    assert status.reader == "gpu-compat" and "nvidia-fs" in status.reason and status.facts["gpu"] == "H200"
    monkeypatch.setattr(check, "probe_libcufile", lambda root=None: LibcufileProbe(False, searched=("ldconfig -p",)))
    assert "libcufile" in check.input_path_status(shards).reason
    monkeypatch.setattr(check, "dali_version", lambda: None)
    missing = check.input_path_status(shards)
    assert missing.reader == "unusable" and "[data]" in missing.fix


# ---------------------------------------------------------------------- the command
def test_shards_command_writes_checks_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.txt").write_text("the input side through GDS\n" * 200)
    assert main(["shards", str(tmp_path / "t"), "--text", str(text), "--seq", "64", "--windows-per-file", "20"]) == 0
    assert "windows of 65 uint16 tokens" in capsys.readouterr().out
    assert scan_shards(tmp_path / "t").vocab == BYTE_VOCAB
    assert main(["shards", str(tmp_path / "y"), "--synthetic", "3000", "--seq", "16", "--vocab", "100"]) == 0
    capsys.readouterr()
    assert scan_shards(tmp_path / "y").sources == ("--synthetic 3000 --seed 0",)
    assert main(["shards", "--check", str(tmp_path / "y"), "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["reader"] in ("cpu", "gds", "gpu-compat")
    assert main(["shards", str(tmp_path / "y"), "--synthetic", "3000"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["shards"]) == 2


@requires_dali
def test_bench_document_renders_on_the_performance_page(shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gds_offload.bench.data import bench
    from gds_offload.bench.docs.report import Section, render_section
    from gds_offload.bench.train.spec import RunResult

    def fake_demo(s, device, steps, timeout_s):  # the demo model takes minutes on a CPU
        from gds_offload.bench.train.spec import RunSpec

        spec = RunSpec(mode="keep", seq=s.seq, batch=4, steps=steps, data=str(s.directory))
        return spec, RunResult("keep", "ok", tokens_per_s=1000.0, step_s=[0.1, 0.1])

    monkeypatch.setattr(bench, "demo_step", fake_demo)
    doc = bench.run_loader_bench(shards, batches=(4,), rounds=1, workers=(0,), command="gds-offload shards --bench x")
    assert doc["kind"] == "table" and doc["command"] == "gds-offload shards --bench x"
    assert {"title", "about", "commit", "machine", "started", "wall_s"} <= set(doc)
    rows = doc["table"]["rows"]
    assert len(rows) == 3 and all(isinstance(v, str) for r in rows for v in r)
    assert {m["tokens"] for m in doc["measurements"]} == {624 * 32}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    page = "\n".join(render_section(Section(tmp_path / "r.json", doc), tmp_path))
    assert "| TokenLoader (DALI CPU reader) | 4 |" in page and "gds-offload shards --bench x" in page


@requires_dali
# ---------------------------------------------------------------------- training from shards
def test_runner_trains_from_shards(shards: Path) -> None:
    from dataclasses import replace

    from gds_offload.bench.train.child import run_here
    from gds_offload.bench.train.data import StepBatches
    from gds_offload.bench.train.spec import RunSpec
    from gds_offload.bench.train.workload import build_workload

    spec = RunSpec(mode="keep", layers=1, hidden=32, heads=2, seq=32, vocab=4096, batch=3, steps=2, warmup=1,
                   data=str(shards), measure_memory=False)
    assert RunSpec.from_json(spec.to_json()) == spec
    wl = build_workload(spec)
    in_order = [wl.batch_fn(i) for i in range(5)]
    assert all(b.shape == (3, 33) for b in in_order)
    assert torch.equal(build_workload(spec).batch_fn(3), in_order[3])  # a function of the step
    assert Counter(map(tuple, torch.cat(in_order).tolist())) <= all_windows(shards)
    hf = StepBatches(shards, model="gpt2", batch=3, seq=32, vocab=4096, seed=0, device="cpu")(0)
    assert torch.equal(hf["input_ids"], in_order[0][:, :-1]) and hf["labels"] is hf["input_ids"]
    result = run_here(spec, emit=lambda ev: None)
    assert result.status == "ok" and len(result.losses) == 3
    assert len(result.input_wait_s) == spec.steps and all(w >= 0 for w in result.input_wait_s)
    with pytest.raises(ValueError, match="pass --vocab 4096"):
        build_workload(replace(spec, vocab=100))
