"""The planner (gds_offload.weights.planning.planner): its choice on synthetic profiles (fake clocks and
bandwidths, so every expectation is arithmetic), its refusals, the profile a child process
measures, and ``gds-offload plan`` end to end on a tiny store."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.llama import assert_same_generation  # noqa: E402

from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.weights import convert, load_streamed  # noqa: E402
from gds_offload.weights.planning.options import KVPlacement  # noqa: E402
from gds_offload.weights.planning.planner import TIE, Choice, Fit, Generate, Profile, check_feasible, choose, estimate  # noqa: E402
from gds_offload.weights.planning.workload import profile_from, smallest_chunk  # noqa: E402
from gds_offload.weights.run.measure import measure  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


def _profile(**kw: object) -> Profile:
    """A 12-layer model: 100 MiB layers read at 1 GB/s (0.105 s each); a layer's decode step costs
    40 ms + 0.1 ms per sequence, its prefill 1 ms per token; 4 KiB of KV per position and layer."""
    base = dict(device="cpu", layers=12, layer_nbytes=100 * MiB, resident_nbytes=200 * MiB, hidden_nbytes=8192, kv_nbytes=4096,
                kv_record_nbytes=4096, logits_nbytes=64000, read_Bps=1e9, base_nbytes=500 * MiB, prefill=Fit(0.0, 1e-3),
                decode=Fit(0.04, 1e-4), head=Fit(0.01, 1e-4), prefill_transient_nbytes=100_000, decode_transient_nbytes=1000)  # fmt: skip
    return Profile(**(base | kw))  # type: ignore[arg-type]


W = Generate(prompts=512, prompt_len=64, new_tokens=32)


def test_compute_hides_the_reads_once_enough_sequences_share_a_load() -> None:
    p = _profile()
    one = estimate(p, W, Choice(1, 1, 0, 2, KVPlacement.DRIVE), 64 * GiB)
    many = estimate(p, W, Choice(64, 8, 0, 2, KVPlacement.DRIVE), 64 * GiB)
    assert one.bound == "drive" and many.bound == "compute"
    # One sequence per load: every decode step waits for 12 reads of 0.105 s.
    read = 100 * MiB / 1e9
    assert one.decode_s == pytest.approx(512 * 31 * (12 * max(0.04 + 1e-4 + 31 * 4096 / 1e9 * 0, read + (64 + 16) * 4096 / 1e9) + 0.0101), rel=0.05)
    assert many.tokens_per_s > 4 * one.tokens_per_s


def test_a_chunked_prefill_prices_its_first_chunk_as_a_prompt_and_the_others_on_a_cache() -> None:
    """A chunk on a cache costs 2 ms per token against a whole prompt's 1 ms: 64 positions in chunks
    of 16 at 32 sequences per load (no read, no KV traffic: compute-bound, one resident layer set)
    are one chunk at 1 ms and three at 2 ms per token, per layer."""
    p = _profile(layers=1, read_Bps=1e15, prefill_chunked=Fit(0.0, 2e-3), head=Fit(0.0, 0.0))
    w = Generate(prompts=32, prompt_len=64, new_tokens=1)
    chunked = estimate(p, w, Choice(32, 1, 1, 2, KVPlacement.DEVICE, prefill_chunk=16), 64 * GiB)
    assert chunked.prefill_s == pytest.approx(32 * 16 * 1e-3 + 3 * 32 * 16 * 2e-3)
    whole = estimate(p, w, Choice(32, 1, 1, 2, KVPlacement.DEVICE), 64 * GiB)
    assert whole.prefill_s == pytest.approx(32 * 64 * 1e-3)
    # Without a chunked fit, every chunk is priced as a prompt's tokens.
    assert estimate(replace(p, prefill_chunked=None), w, chunked.choice, 64 * GiB).prefill_s == pytest.approx(whole.prefill_s)


def test_each_prefill_chunk_ends_in_the_prefill_head_on_every_sequence() -> None:
    """A prefill (or a chunk of one) hands the head the strided last position of its hidden state,
    which a CPU computes one sequence at a time: each of the 4 chunks of 64 positions costs the
    prefill head of its 32 sequences, the decode steps the decode head. Priced with the decode
    head for every pass, a Granite shape's chunked plans ran at 0.78x their prediction; the
    planner then takes the whole prompt, which pays that head once."""
    p = _profile(layers=1, read_Bps=1e15, prefill_chunked=Fit(0.0, 1e-3), decode=Fit(0.0, 1e-4), head=Fit(0.0, 1e-4), prefill_head=Fit(0.0, 1e-2))
    w = Generate(prompts=32, prompt_len=64, new_tokens=3)
    chunked = estimate(p, w, Choice(32, 1, 1, 2, KVPlacement.DEVICE, prefill_chunk=16), 64 * GiB)
    assert chunked.prefill_s == pytest.approx(32 * 64 * 1e-3 + 4 * 32 * 1e-2)
    assert chunked.decode_s == pytest.approx(2 * (32 * 1e-4 + 32 * 1e-4))
    whole = estimate(p, w, Choice(32, 1, 1, 2, KVPlacement.DEVICE), 64 * GiB)
    assert whole.prefill_s == pytest.approx(32 * 64 * 1e-3 + 32 * 1e-2)
    # An older profile without it prices the prefill's head as the decode step's.
    assert estimate(replace(p, prefill_head=None), w, chunked.choice, 64 * GiB).prefill_s == pytest.approx(32 * 64 * 1e-3 + 4 * 32 * 1e-4)
    assert choose(p, w, 64 * GiB).choice.prefill_chunk is None
    assert profile_from(json.loads(json.dumps(asdict(p)))) == p


def test_a_cache_on_the_drive_adds_its_measured_cost_to_each_micro_batchs_layer() -> None:
    """Moving a layer's cache to and from the drive costs the layer's forward time, not only the
    drive's bandwidth (which compute hides): the profile's ``kv_drive`` seconds per byte moved,
    for each micro-batch at each layer and step, and nothing with the caches in memory."""
    p = _profile(layers=1, read_Bps=1e15, prefill=Fit(0.0, 0.0), decode=Fit(0.0, 0.0), head=Fit(0.0, 0.0), kv_drive=Fit(0.0, 1e-6))
    w = Generate(prompts=8, prompt_len=4, new_tokens=3)
    c = Choice(4, 2, 1, 2, KVPlacement.DRIVE)
    e = estimate(p, w, c, 64 * GiB)
    rec = p.kv_record_nbytes
    # Prefill: each micro-batch of 4 writes 4 positions. Decode steps 1 and 2: each reads 5 and 6
    # positions back and writes one.
    assert e.prefill_s == pytest.approx(2 * 4 * 4 * rec * 1e-6)
    assert e.decode_s == pytest.approx(2 * 4 * (5 + 1) * rec * 1e-6 + 2 * 4 * (6 + 1) * rec * 1e-6)
    memory = estimate(p, w, replace(c, kv=KVPlacement.DEVICE), 64 * GiB)
    assert memory.prefill_s == 0 and memory.decode_s == 0
    assert estimate(replace(p, kv_drive=None), w, c, 64 * GiB).decode_s == pytest.approx(0, abs=1e-9)


def test_the_prefill_head_is_timed_on_a_strided_last_position() -> None:
    """``time_head(positions=n)`` gives the head what a prefill's ``logits_to_keep=1`` gives it:
    the last of ``n`` positions, a view with the longer hidden state's strides."""
    from gds_offload.weights.run.profile import time_head

    head = torch.nn.Linear(16, 50, bias=False)
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    head.register_forward_pre_hook(lambda m, args: seen.append((tuple(args[0].shape), args[0].stride())))
    model = type("M", (), {"get_output_embeddings": lambda self: head})()
    cfg = type("C", (), {"get_text_config": lambda self, decoder: type("T", (), {"hidden_size": 16})()})()
    out = time_head(model, cfg, torch.float32, torch.device("cpu"), sizes=[2, 4], positions=8)
    assert [r for r, _ in out] == [2.0, 4.0] and all(t > 0 for _, t in out)
    assert set(seen) == {((2, 1, 16), (128, 16, 1)), ((4, 1, 16), (128, 16, 1))}, seen
    seen.clear()
    time_head(model, cfg, torch.float32, torch.device("cpu"), sizes=[2])
    assert seen[0] == ((2, 1, 16), (16, 16, 1)), seen


def test_the_choice_is_the_fastest_that_fits_and_says_why_the_others_lost() -> None:
    p = _profile()
    plan = choose(p, W, 2 * GiB)
    assert plan.predicted.fits and plan.predicted.peak_nbytes <= 0.9 * 2 * GiB
    everything = [estimate(p, W, Choice(b, n, r, s, kv, chunk), 2 * GiB)
                  for b in (1, 8, 64, 128, 256, 512) for n in (1, 2, 4, 8) for r in (0, 2, 4) for s in (1, 2)
                  for kv in (KVPlacement.DEVICE, KVPlacement.DRIVE) for chunk in (None, 8) if b * n <= 512]  # fmt: skip
    best_fitting = max(e.tokens_per_s for e in everything if e.fits)
    assert plan.predicted.tokens_per_s >= (1 - TIE) * best_fitting, "the simplest of the plans within 1% of the fastest"
    assert plan.alternatives and all(why for _, why in plan.alternatives)
    assert any("over memory" in why for _, why in plan.alternatives)
    assert {name for name, *_ in plan.curve} == {"KV on the device", "KV on the drive"}


def test_more_memory_never_plans_slower_and_a_big_one_keeps_everything_resident() -> None:
    p = _profile()
    speeds = [choose(p, W, m).predicted.tokens_per_s for m in (1 * GiB + 600 * MiB, 2 * GiB, 4 * GiB, 16 * GiB)]
    assert speeds == sorted(speeds)
    big = choose(p, W, 64 * GiB).choice
    assert big.resident_layers == 12 and big.kv is KVPlacement.DEVICE


def test_a_faster_drive_or_slower_compute_moves_the_bound() -> None:
    slow_drive = choose(_profile(read_Bps=1e7), Generate(64, 16, 8), 1 * GiB + 300 * MiB)  # too little to keep every layer
    assert slow_drive.choice.resident_layers < 12 and slow_drive.predicted.bound in ("drive", "memory")
    fast = choose(_profile(read_Bps=1e12), Generate(64, 16, 8), 2 * GiB)
    assert fast.predicted.bound == "compute"


def test_kv_moves_to_the_drive_when_memory_cannot_hold_it() -> None:
    p = _profile(read_Bps=1e10)  # a drive fast enough that reading the caches back beats small batches
    w = Generate(prompts=512, prompt_len=8, new_tokens=256)  # decode-heavy; 512 x 264 x 12 x 4 KiB = 6.2 GiB of KV
    c = choose(p, w, 2 * GiB + 512 * MiB).choice
    assert c.kv is KVPlacement.DRIVE and c.in_flight >= 256, "large micro-batches, their caches on the drive"
    assert choose(p, Generate(8, 16, 4), 64 * GiB).choice.kv is KVPlacement.DEVICE


def test_a_memory_too_small_for_any_plan_names_what_is_needed() -> None:
    with pytest.raises(ConfigError, match=r"memory=.*too small.*needs .*give at least"):
        choose(_profile(), W, 600 * MiB)


def test_bad_workloads_are_refused() -> None:
    for kw in ({"prompts": 0}, {"prompt_len": -1}, {"new_tokens": 1.5}, {"prompts": True}):
        with pytest.raises(ConfigError, match="must be an int >= 1"):
            Generate(**(dict(prompts=4, prompt_len=4, new_tokens=4) | kw))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kv=host: the planner models the cache on the device or the drive"):
        choose(_profile(), Generate(4, 4, 4), 4 * GiB, kv=(KVPlacement.HOST,))
    with pytest.raises(ConfigError, match="kv=host: the cost model prices the cache on the device or the drive only"):
        estimate(_profile(), Generate(4, 4, 4), Choice(4, 1, 0, 2, KVPlacement.HOST), 4 * GiB)


def test_scaling_compute_scales_the_prediction() -> None:
    p = _profile(read_Bps=1e15)  # reads cost nothing: all compute
    c = Choice(64, 8, 0, 2, KVPlacement.DEVICE)
    fast, slow = estimate(p, W, c, 64 * GiB), estimate(p.scaled(2.0), W, c, 64 * GiB)
    assert slow.total_s == pytest.approx(2 * fast.total_s, rel=1e-6)
    assert replace(p, read_Bps=1e15) == p


def test_the_peak_is_the_larger_phase_not_the_prefills_transient_on_the_full_caches() -> None:
    from gds_offload.weights.planning.cost import peak_nbytes

    p = _profile()
    device, drive = (Choice(32, 1, 0, 2, kv, 16) for kv in (KVPlacement.DEVICE, KVPlacement.DRIVE))
    short, longer = Generate(32, 64, 4), Generate(32, 64, 5)
    # The prefill's transient (32 x 16 tokens x 100 kB) outweighs the decode's: a few more new tokens
    # grow the caches the decode holds, not the peak.
    assert peak_nbytes(p, short, device) == peak_nbytes(p, longer, device)
    long_, longest = Generate(32, 64, 512), Generate(32, 64, 513)
    # Once the decode's caches dominate, each new position adds every sequence's keys and values
    # in every layer (and the growing copy of one micro-batch-layer's).
    assert peak_nbytes(p, longest, device) - peak_nbytes(p, long_, device) == (32 * 12 + 32) * 4096
    # On the drive only a few micro-batch-layers' worth are held: 3 copies plus the write in flight.
    assert peak_nbytes(p, longest, drive) - peak_nbytes(p, long_, drive) == 3 * 32 * 4096


def test_three_measured_sizes_price_each_size_by_its_neighbours() -> None:
    """A forward's cost per row changes with its size: with three sizes measured, a size is priced on
    the line through the two nearest (beyond them, the outer pair's); the JSON form round-trips."""
    f = Fit.through([(128, 0.177), (8, 0.035), (32, 0.061)])
    assert f.knots == ((8.0, 0.035), (32.0, 0.061), (128.0, 0.177))
    assert (f(8), f(32), f(128)) == pytest.approx((0.035, 0.061, 0.177))
    assert f(20) == pytest.approx(0.035 + 12 * (0.061 - 0.035) / 24)
    assert f(512) == pytest.approx(0.177 + 384 * (0.177 - 0.061) / 96)
    line = Fit.through([(8, 0.035), (32, 0.061)])
    assert line.knots == () and line(128) == pytest.approx(0.035 + 120 * (0.061 - 0.035) / 24)
    assert abs(line(128) - 0.177) > 0.01, "a line through the small sizes misprices the large one"
    p = _profile(decode=f)
    assert profile_from(json.loads(json.dumps(asdict(p)))) == p
    assert p.scaled(2.0).decode(64) == pytest.approx(2 * f(64))


# -- measured on a tiny store ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store() -> Iterator[Path]:
    base = real_disk_base() / f"gds_offload-planner-{os.getpid()}"
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=96, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(base / "ckpt")
    convert(base / "ckpt", base / "store")
    yield base / "store"
    shutil.rmtree(base, ignore_errors=True)


def test_the_measured_profile_is_the_models_and_a_plan_from_it_runs(store: Path, tmp_path: Path) -> None:
    w = Generate(prompts=12, prompt_len=8, new_tokens=4)
    seen: list[str] = []
    p = measure(store, w, progress=seen.append)
    assert any("prefill" in s for s in seen) and any("decode" in s for s in seen)
    m = json.loads((store / "manifest.json").read_text())
    assert p.layers == 4 and p.hidden_nbytes == 64 * 4 and p.kv_nbytes == 2 * 2 * 16 * 4 and p.logits_nbytes == 256 * 4
    assert p.layer_nbytes >= max(g["nbytes"] for g in m["groups"] if g["name"].startswith("model.layers."))
    assert p.read_Bps > 0 and p.base_nbytes > 0 and p.prefill.per_row >= 0 and p.decode(8) > 0
    assert len(p.prefill.knots) == 3, "prefill timed at 1, 4 and 12 prompts"
    assert p.prefill_chunked is not None and p.prefill_chunked(16) > 0, "a chunk on a cache timed apart"
    # The read rate is the three layers' read, not a forward's time that reused its variable
    # (it was the bytes of that read over the largest prefill's seconds).
    read_nbytes, read_s = p.measured["read"]
    assert read_nbytes == 3 * p.layer_nbytes and read_s not in {s for _, s, _ in p.measured["prefill"]}, p.measured
    # What the plan uses is the rate of the timed forwards' own fills, read beside their compute.
    beside_nbytes, beside_s = p.measured["read_beside_compute"]
    assert beside_nbytes >= 2 * p.layer_nbytes and p.read_Bps == beside_nbytes / beside_s
    # The head at the end of a prefill, and a decode step with its cache on the drive, timed apart.
    assert p.prefill_head is not None and p.prefill_head(8) > 0
    assert p.kv_drive is not None and len(p.measured["kv_drive"]) == 2 and all(b > 0 and s >= 0 for b, s in p.measured["kv_drive"])
    plan = choose(p, w, 8 * GiB)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(store)).eval()
    with load_streamed(skeleton, store, plan=plan) as lm:
        assert lm.stats().slots == min(plan.choice.slots, 4 - plan.choice.resident_layers) or plan.choice.resident_layers == 4
        out = lm.generate_many([torch.arange(1, 9)] * 12, max_new_tokens=4, kv_path=tmp_path / "kv", pad_token_id=0)
    assert len(out.tokens) == 12 and all(t.shape == (4,) for t in out.tokens)
    with pytest.raises(ConfigError, match="differs from the plan"):
        load_streamed(skeleton, store, plan=plan, slots=plan.choice.slots + 1)
    with pytest.raises(ConfigError, match="both choose the resident layers"):
        load_streamed(skeleton, store, plan=plan, max_memory="8GiB")


def test_the_finetune_profile_is_measured_from_the_store(store: Path) -> None:
    """LoRA on every linear layer: a layer's forward with grad and its backward are timed, and what
    autograd saves per token is counted; the sizes are the model's, as for generation."""
    from gds_offload.weights.planning.planner import Finetune

    p = measure(store, Finetune(sequences=8, seq=16, global_batch=4, lora_r=4))
    assert p.layers == 4 and p.hidden_nbytes == 64 * 4 and p.read_Bps > 0 and p.base_nbytes > 0
    assert p.train_forward.fixed + p.train_forward.per_row > 0 and p.train_backward.fixed + p.train_backward.per_row > 0
    assert p.saved_nbytes > 0 and p.trainable_nbytes > 0
    # The head and the model's loss, forward and backward: at least the logits and their gradient per token.
    assert p.head_train_nbytes >= 2 * p.logits_nbytes


def test_infeasible_input_is_refused_before_measuring(store: Path) -> None:
    with pytest.raises(ConfigError, match="needs 100 positions .* has 96"):
        check_feasible(store, Generate(4, 90, 10), 8 * GiB)
    from gds_offload.weights import plan

    said: list[str] = []
    with pytest.raises(ConfigError, match="below what any plan needs"):  # once the resident group is loaded
        plan(store, Generate(4, 8, 4), memory=1 * MiB, progress=said.append)
    assert said == ["loading the resident group"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gds_offload.cli", "plan", *args], capture_output=True, text=True, timeout=300)


def test_the_plan_command_prints_writes_json_and_a_png(store: Path, tmp_path: Path) -> None:
    proc = _cli(str(store), "--memory", "4GiB", "--prompts", "16", "--prompt-len", "8", "--new-tokens", "4",
                "--out", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "plan.png"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "plan:" in proc.stdout and "chosen" in proc.stdout
    assert "decode of" in proc.stderr, "progress on a non-terminal: one plain line per step"
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["choice"]["micro_batch"] >= 1 and doc["predicted"]["tokens_per_s"] > 0 and doc["command"].startswith("gds-offload plan")
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # loaded back the way it was saved: a path to load_streamed, from_pretrained and generate_many
    from helpers.llama import meta_skeleton

    from gds_offload.weights import Plan, from_pretrained

    saved = Plan.load(tmp_path / "plan.json")
    assert asdict(saved.choice) == doc["choice"] | {"kv": KVPlacement(doc["choice"]["kv"])}
    with load_streamed(meta_skeleton(store), store, plan=str(tmp_path / "plan.json")) as lm:
        assert lm.plan is not None and lm.plan.choice == saved.choice
        assert len(lm.stats().resident_layers) == saved.choice.resident_layers
    with from_pretrained(store.parent / "ckpt", store=store, plan=tmp_path / "plan.json", progress=False) as lm:
        assert lm.plan is not None and lm.plan.choice == saved.choice
    with pytest.raises(ConfigError, match="plan= and workload="):
        from_pretrained(store.parent / "ckpt", store=store, plan=saved, workload=saved.workload, progress=False)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is not a plan gds-offload plan --out wrote \(KeyError"):
        load_streamed(meta_skeleton(store), store, plan=tmp_path / "bad.json")


def test_the_plan_command_refuses_an_output_in_a_missing_folder(store: Path, tmp_path: Path) -> None:
    """A mistyped --out folder is refused before anything is measured, naming the nearest folder there is."""
    proc = _cli(str(store), "--memory", "4GiB", "--out", str(tmp_path / "nonexist" / "dir" / "p.json"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"its parent {tmp_path / 'nonexist' / 'dir'} does not exist; the nearest existing parent is {tmp_path}" in proc.stderr
    assert not (tmp_path / "nonexist").exists()


@pytest.mark.parametrize(
    "args, match",
    [
        (["--memory", "1MiB"], "below what any plan needs"),
        (["--memory", "0"], "--memory=0"),
        (["--memory", "lots"], "--memory='lots' is not a size"),
        (["--memory", "4GiB", "--prompt-len", "95"], "positions"),
        (["--memory", "4GiB", "--prompts", "0"], "prompts=0"),
    ],
)
def test_the_plan_command_refuses_in_one_line_with_exit_2(store: Path, args: list[str], match: str) -> None:
    proc = _cli(str(store), *args)
    lines = proc.stderr.strip().splitlines()
    if match == "below what any plan needs":  # known once the resident group is loaded (the process's own memory counts)
        assert lines[:1] == ["gds-offload plan: loading the resident group"], proc.stderr
        lines = lines[1:]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "measuring" not in proc.stderr and "prefill of" not in proc.stderr, "refused before anything is measured"
    import re

    assert re.search(match, proc.stderr), proc.stderr


def test_from_pretrained_converts_when_needed_plans_and_streams(store: Path, tmp_path: Path) -> None:
    from gds_offload.weights import as_reference, from_pretrained
    from gds_offload.weights.run.pretrained import stale_reason

    ckpt = store.parent / "ckpt"
    out = tmp_path / "store"
    said: list[str] = []
    w = Generate(prompts=6, prompt_len=8, new_tokens=3)
    lm = from_pretrained(ckpt, store=out, memory="8GiB", workload=w, progress=said.append)
    try:
        assert any("converting" in s and "no store yet" in s for s in said) and lm.plan is not None
        prompts = [torch.arange(1, 9) + i for i in range(6)]
        got = lm.generate_many(prompts, max_new_tokens=3, kv_path=tmp_path / "kv", pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    finally:
        lm.close()
    ref = as_reference(transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval())
    assert len(got.micro_batches) > 0 and len(got.outputs) == len(got.micro_batches)
    for j, mb in enumerate(got.micro_batches):
        want = ref.generate(mb.input_ids, attention_mask=mb.attention_mask, max_new_tokens=3, pad_token_id=0,
                            prefill_chunk_size=lm.plan.choice.prefill_chunk, output_scores=True, return_dict_in_generate=True)  # fmt: skip
        assert_same_generation(got.outputs[j], want, f"micro-batch {j}: ")
    assert stale_reason(ckpt, out) is None
    written = (out / "manifest.json").stat().st_mtime_ns
    from_pretrained(ckpt, store=out, memory="8GiB").close()  # fresh: not converted again
    assert (out / "manifest.json").stat().st_mtime_ns == written
    os.utime(ckpt / "model.safetensors")  # the checkpoint changed after the store was made
    assert stale_reason(ckpt, out) == "model.safetensors is newer than the store"
    said.clear()
    from_pretrained(ckpt, store=out, memory="8GiB", progress=said.append).close()
    assert any("newer than the store" in s for s in said) and stale_reason(ckpt, out) is None
    with pytest.raises(ConfigError, match="has no config.json"):
        from_pretrained(tmp_path, store=tmp_path / "other", memory="8GiB")


def test_a_run_slower_than_planned_plans_again_and_says_so(store: Path, tmp_path: Path) -> None:
    from gds_offload.weights import as_reference

    w = Generate(prompts=16, prompt_len=8, new_tokens=3)
    real = measure(store, w)
    optimistic = choose(real.scaled(0.01), w, 8 * GiB)  # believes compute 100x faster than it is
    streamed = replace(optimistic.choice, micro_batch=2, per_load=2, resident_layers=0, slots=2)  # waves of 4 prompts, every layer read
    optimistic = replace(optimistic, predicted=replace(optimistic.predicted, choice=streamed))
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(store)).eval()
    prompts = [torch.arange(1, 9) + i for i in range(16)]
    with load_streamed(skeleton, store, plan=optimistic) as lm:
        out = lm.generate_many(prompts, max_new_tokens=3, pad_token_id=0, kv_path=tmp_path / "kv", output_scores=True, return_dict_in_generate=True)
        replans = lm.stats().replans
    assert replans and "planned" in replans[0] and "the last 12 prompts run as" in replans[0]
    assert sorted(i for mb in out.micro_batches for i in mb.indices) == list(range(16)), "every prompt once"
    ref = as_reference(transformers.AutoModelForCausalLM.from_pretrained(store.parent / "ckpt").eval())
    assert len(out.outputs) == len(out.micro_batches)
    for j, mb in enumerate(out.micro_batches):
        want = ref.generate(mb.input_ids, attention_mask=mb.attention_mask, max_new_tokens=3, pad_token_id=0,
                            prefill_chunk_size=out.prefill_chunks[j], output_scores=True, return_dict_in_generate=True)  # fmt: skip
        assert_same_generation(out.outputs[j], want, f"micro-batch {j}: ")


def _train_profile(**kw: object) -> Profile:
    """The same model fine-tuned: a layer's forward 2 ms/token, backward 4 ms/token, 40 KB saved per token."""
    return _profile(train_forward=Fit(0.0, 2e-3), train_backward=Fit(0.0, 4e-3), saved_nbytes=40_000, train_transient_nbytes=100_000,
                    trainable_nbytes=10 * MiB, **kw)  # fmt: skip


def test_finetuning_is_compute_bound_when_a_layer_reads_faster_than_a_micro_batch_computes() -> None:
    from gds_offload.weights.planning.planner import Finetune

    w = Finetune(sequences=128, seq=256, global_batch=64, lora_r=8)
    p = _train_profile()
    plan = choose(p, w, 4 * GiB)
    assert plan.predicted.bound == "compute" and plan.predicted.fits
    # Per wave each streamed layer is read twice (forward, backward); compute of 256 tokens already takes 1.5 s, a read 0.1 s.
    one = estimate_ft(p, w, Choice(1, 1, 0, 2), 64 * GiB)
    assert one.total_s == pytest.approx(2 * 64 * 12 * 256 * 6e-3, rel=0.05)


def test_finetuning_offloads_activations_when_keeping_them_does_not_fit() -> None:
    from gds_offload.weights.planning.planner import Finetune

    w = Finetune(sequences=64, seq=1024, global_batch=64)
    keep_all = estimate_ft(_train_profile(), w, Choice(8, 1, 0, 2), 64 * GiB)
    assert keep_all.peak_nbytes > 4 * GiB  # 8 x 1024 tokens x 12 layers x 40 KB
    assert choose(_train_profile(), w, 1 * GiB + 400 * MiB).choice.offload_activations  # keeping even one micro-batch's does not fit


def test_a_finetune_peak_counts_every_micro_batchs_head_and_the_offloaders_bound() -> None:
    """The micro-batches of a wave run as a team, so each holds its head's and loss's memory at the
    same time; offloaded activations hold attach()'s bound, its 64 MiB write window included."""
    from gds_offload.weights.planning.cost import peak_finetune
    from gds_offload.weights.planning.planner import Finetune

    w = Finetune(sequences=64, seq=256, global_batch=64)
    p = replace(_train_profile(), head_train_nbytes=1e6, saved_nbytes=1000.0)
    one, two = (peak_finetune(p, w, Choice(1, n, 0, 1, offload_activations=True)) for n in (1, 2))
    layer = 256 * 1000  # one micro-batch's saved bytes in a layer: the last layer kept and two read in backward per micro-batch
    assert two - one == 256 * 1e6 + 3 * layer
    kept = peak_finetune(p, w, Choice(1, 1, 0, 1, offload_activations=False))
    assert one - kept == 64 * MiB + 3 * layer - 12 * layer


def estimate_ft(p: Profile, w: Any, c: Choice, memory: int) -> Any:
    from gds_offload.weights.planning.cost import estimate_finetune

    return estimate_finetune(p, w, c, memory)


def test_from_pretrained_says_each_phase_unless_told_not_to(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """Off a terminal (pytest's capture): one line per phase on stderr, with no progress= given;
    progress=False: nothing; a logger: a record per phase."""
    import logging

    from gds_offload.weights import from_pretrained

    ckpt, out = store.parent / "ckpt", tmp_path / "s"
    from_pretrained(ckpt, store=out, memory="8GiB").close()
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("from_pretrained: ")]
    assert said == [f"from_pretrained: converting {ckpt} into {out} (no store yet)", f"from_pretrained: loading {out} on cpu"]
    from_pretrained(ckpt, store=out, memory="8GiB", progress=False).close()
    assert "from_pretrained" not in capsys.readouterr().err
    logger = logging.getLogger("gds_offload.test.progress")
    with caplog.at_level(logging.INFO, logger=logger.name):
        from_pretrained(ckpt, store=out, memory="8GiB", progress=logger).close()
    assert caplog.messages == [f"from_pretrained: loading {out} on cpu"]
    with pytest.raises(ConfigError, match="progress='yes'"):
        from_pretrained(ckpt, store=out, memory="8GiB", progress="yes")  # type: ignore[arg-type]


def test_on_a_terminal_each_phase_is_a_bar_left_as_one_line() -> None:
    import io

    from rich.console import Console

    from gds_offload.weights.run.progress import reporter

    screen = io.StringIO()
    say = reporter(True, name="from_pretrained", console=Console(file=screen, force_terminal=True, width=100))
    with say.phase("converting ckpt into store") as phase:
        phase.bytes("model.layers.0", 512 << 10, 1 << 20)
    with say.phase("measuring the model") as phase:
        phase.step("prefill of 4 x 16 tokens")
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", screen.getvalue())
    assert "converting ckpt into store" in text and "512 KiB of 1 MiB (model.layers.0)" in text and "done converting ckpt into store" in text
    assert "measuring the model: prefill of 4 x 16 tokens" in text and text.count("done") >= 2, text


def test_no_prefill_chunk_smaller_than_the_measured_one_is_chosen() -> None:
    """A chunk on a cache priced cheaper per token than a whole prompt would make the smallest
    chunk look fastest; but each chunk is a pass through every layer whose cost outside the
    layers the profile does not see, so the planner searches only the chunk it measured
    (a quarter of the prompt) and larger."""
    p = _profile(prefill=Fit(0.0, 5e-3), prefill_chunked=Fit(0.0, 1e-3))
    w = Generate(prompts=64, prompt_len=64, new_tokens=4)
    assert smallest_chunk(64) == 16
    plan = choose(p, w, 8 * GiB)
    assert plan.choice.prefill_chunk == 16, plan.describe()
    assert all((e.choice.prefill_chunk or 64) >= 16 for e, _ in plan.alternatives), plan.alternatives
