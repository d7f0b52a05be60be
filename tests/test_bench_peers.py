"""The peers of the weight benchmarks (:mod:`gds_offload.bench.weights.peers`,
:mod:`gds_offload.bench.weights.peers_run`) on a tiny Llama checkpoint: each peer generates in a
child process (under a cgroup v1 memory cap where one can be made; uncapped otherwise) and its
tokens are compared with the reference's: the same child, the model resident in memory, the
same batches.

What is true here (CPU, fp32): Accelerate's disk offload, AirLLM and DeepSpeed ZeRO-Inference
all run the transformers model's own forward with the checkpoint's weights, only placed
elsewhere between uses, so their greedy tokens equal the resident model's exactly.
"""
from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from gds_offload.bench import procs  # noqa: E402
from gds_offload.bench.cgroup import cap_available  # noqa: E402
from gds_offload.bench.weights.bench import BenchModel  # noqa: E402
from gds_offload.bench.weights.peer_loaders import airllm_dir, airllm_ready, peer_support  # noqa: E402
from gds_offload.bench.weights.peers import MODULE, PEERS, left_pad  # noqa: E402
from gds_offload.bench.weights.peers_run import PeerResult, best_batch, peer_env, run_peer, tokens_digest, workload_tokens_per_s  # noqa: E402
from gds_offload.errors import ConfigError  # noqa: E402

#: A cap a tiny model's child fits in with room to spare (torch alone needs ~300 MB).
CAP = 1 << 30
NEW = 4


def _cap() -> int | None:
    return CAP if cap_available()[0] else None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    import transformers

    path = tmp_path_factory.mktemp("peers") / "checkpoint"
    # The MLP weights, embeddings and lm_head are 1 MiB each: the smallest tensor DeepSpeed swaps to NVMe.
    cfg = BenchModel(hidden=128, intermediate=2048, layers=2, heads=4, kv_heads=2, vocab=2048).config()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    out = [[rng.randrange(3, 2048) for _ in range(8)] for _ in range(3)]
    out[1] = out[1][:5]  # a shorter prompt: its batch is left-padded
    return out


@pytest.fixture(scope="module")
def reference(checkpoint: Path, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> PeerResult:
    r = run_peer("resident", checkpoint=checkpoint, workdir=tmp_path_factory.mktemp("ref"), prompts=prompts, max_new_tokens=NEW, batch=2,
                 memory_limit=_cap(), timeout_s=300)  # fmt: skip
    assert r.status == "ok", r
    return r


def _check_shape(r: PeerResult, prompts: list[list[int]], *, cap: int | None) -> None:
    """``cap``: the memory limit the run was given (``None``: uncapped), which the result must report."""
    assert r.status == "ok" and r.error is None, r
    assert r.batch == 2 and r.forwards == (NEW, NEW)  # two batches (2 + 1 prompts): one prefill, NEW - 1 decodes each
    assert r.prompts == len(prompts) and len(r.tokens) == len(prompts) and all(len(t) == NEW for t in r.tokens)
    assert r.generated_tokens == NEW * len(prompts) and r.tokens_sha256 == tokens_digest(r.tokens)
    assert r.prefill_s is not None and r.decode_s is not None and r.prefill_s > 0 and r.decode_s > 0
    assert r.tokens_per_s == pytest.approx(r.generated_tokens / (r.prefill_s + r.decode_s))
    assert r.setup_s is not None and r.setup_s > 0 and r.peak_rss_bytes is not None and r.peak_rss_bytes > 0 and r.bytes_read is not None
    if cap is None:
        assert r.cgroup_limit_bytes is None and r.cgroup_peak_bytes is None
    else:
        assert r.cgroup_limit_bytes == cap and r.cgroup_peak_bytes is not None and 0 < r.cgroup_peak_bytes <= cap


def test_reference_is_the_resident_model_in_process(checkpoint: Path, prompts: list[list[int]], reference: PeerResult) -> None:
    """The reference child's tokens are those of ``from_pretrained`` + ``generate`` in this process:
    the child batches, pads and cuts as a plain call would."""
    import torch
    import transformers

    _check_shape(reference, prompts, cap=_cap())
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    want = []
    with torch.no_grad():
        for chunk in (prompts[:2], prompts[2:]):
            ids, mask = left_pad(chunk, 2)  # pad: the config's eos_token_id (2), as the child does without a pad_token_id
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=2)
            want += [tuple(row[: row.index(2) + 1] if 2 in row else row) for row in out[:, ids.shape[1] :].tolist()]  # cut after eos
    assert reference.tokens == tuple(want)


def _skip_unless_supported(peer: str) -> None:
    ok, why = peer_support(peer)
    if not ok:
        pytest.skip(why)  # names the missing package or op


def test_accelerate_disk_equals_the_resident_model(checkpoint: Path, prompts: list[list[int]], reference: PeerResult, tmp_path: Path) -> None:
    _skip_unless_supported("accelerate-disk")
    r = run_peer("accelerate-disk", checkpoint=checkpoint, workdir=tmp_path, prompts=prompts, max_new_tokens=NEW, batch=2, memory_limit=_cap(),
                 timeout_s=300)  # fmt: skip
    _check_shape(r, prompts, cap=_cap())
    assert r.tokens == reference.tokens and r.tokens_sha256 == reference.tokens_sha256
    assert not list(tmp_path.glob("accelerate-offload-*"))  # its offload folder is removed


def test_airllm_prepares_its_shards_once_and_equals_the_resident_model(checkpoint: Path, prompts: list[list[int]], reference: PeerResult,
                                                                       tmp_path: Path) -> None:  # fmt: skip
    """The first run splits the checkpoint into AirLLM's per-layer shards (uncapped, outside every
    measured figure: ``prepare_s``); the second finds them and splits nothing."""
    _skip_unless_supported("airllm")
    assert not airllm_ready(checkpoint, tmp_path)
    first = run_peer("airllm", checkpoint=checkpoint, workdir=tmp_path, prompts=prompts, max_new_tokens=NEW, batch=2, memory_limit=_cap(), timeout_s=300)
    _check_shape(first, prompts, cap=_cap())
    assert first.tokens == reference.tokens
    assert first.prepare_s is not None and first.prepare_s > 0 and airllm_ready(checkpoint, tmp_path)
    assert sorted(p.name for p in (airllm_dir(tmp_path) / "splitted_model").glob("*.safetensors")) == sorted(
        ["model.embed_tokens.safetensors", "model.layers.0.safetensors", "model.layers.1.safetensors", "model.norm.safetensors", "lm_head.safetensors"])
    again = run_peer("airllm", checkpoint=checkpoint, workdir=tmp_path, prompts=prompts[:1], max_new_tokens=NEW, batch=1, memory_limit=_cap(), timeout_s=300)
    assert again.status == "ok" and again.prepare_s is None and again.tokens == reference.tokens[:1]


def test_deepspeed_zero_inference_equals_the_resident_model(checkpoint: Path, prompts: list[list[int]], reference: PeerResult, tmp_path: Path) -> None:
    """ZeRO-3 with ``offload_param`` to NVMe on DeepSpeed's CPU accelerator: the MLP weights, embeddings
    and lm_head (2 x 3 + 2 tensors) live in swap files; the attention weights (under 1 MiB) and the
    norms (under the persistence threshold) stay in memory. Uncapped: on a fresh machine DeepSpeed
    builds its async_io op in the child at first use, and the compiler alone can pass a 1 GiB cap
    (the cap itself is tested with the other peers); ``scripts/setup.sh`` builds it beforehand."""
    _skip_unless_supported("deepspeed-zero-inference")  # scripts/setup.sh builds the op
    r = run_peer("deepspeed-zero-inference", checkpoint=checkpoint, workdir=tmp_path, prompts=prompts, max_new_tokens=NEW, batch=2,
                 memory_limit=None, timeout_s=600)  # fmt: skip
    _check_shape(r, prompts, cap=None)
    assert r.settings["params_on_nvme"] == 8 and r.settings["param_bytes_on_nvme"] == 8 << 20
    assert r.settings["nvme_file_bytes"] >= 8 << 20
    assert r.tokens == reference.tokens
    assert not (tmp_path / "deepspeed-nvme").exists()  # its swap files are removed when it closes


def test_left_pad_pads_on_the_left_with_a_mask() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def _needs_cap() -> None:
    ok, why = cap_available()
    if not ok:
        pytest.skip(f"needs a cgroup v1 memory cap: {why}")


def test_out_of_memory_under_the_cap_is_reported_as_such(checkpoint: Path, prompts: list[list[int]], tmp_path: Path) -> None:
    _needs_cap()
    # 64 MiB: the child is killed while it imports torch.
    r = run_peer("resident", checkpoint=checkpoint, workdir=tmp_path, prompts=prompts, max_new_tokens=2, batch=2, memory_limit=64 << 20, timeout_s=120)
    assert r.status == "oom" and r.returncode == -9 and r.error is not None and r.error.startswith("out of memory at batch 2")
    assert r.tokens == () and r.tokens_per_s is None and not list(tmp_path.glob("peer-prompts-*"))


def test_best_batch_stops_at_the_first_real_out_of_memory(checkpoint: Path, prompts: list[list[int]], tmp_path: Path) -> None:
    """Batches 1 and 2 run under a cap they fit in; batch 3 under one the child cannot start in:
    the kernel kills it, the search stops there and keeps the best of the two before. (A
    tolerance of 99%: real probes of a tiny model on a shared machine may come out in any order
    of speed, and only the stop at the kill is under test here.)"""
    _needs_cap()
    calls = []

    def run(peer: str, **kw: Any) -> PeerResult:
        calls.append(kw["batch"])
        return run_peer(peer, **(kw | {"memory_limit": CAP if kw["batch"] < 3 else 64 << 20}))

    search = best_batch("resident", checkpoint=checkpoint, workdir=tmp_path, prompts=prompts, max_new_tokens=32, memory_limit=CAP,
                        batches=(1, 2, 3), probe_new_tokens=2, tolerance=0.99, timeout_s=300, run=run)  # fmt: skip
    assert calls == [1, 2, 3] and [p.result.status for p in search.points] == ["ok", "ok", "oom"]
    assert search.points[-1].est_tokens_per_s is None and search.stopped.startswith("batch 3: oom")
    assert search.best is not None and search.best.batch in (1, 2) and search.best.est_tokens_per_s is not None


def test_bad_arguments_are_refused_before_any_child(checkpoint: Path, tmp_path: Path) -> None:
    kw: dict[str, Any] = {"checkpoint": checkpoint, "workdir": tmp_path, "prompts": [[1]], "max_new_tokens": 2, "batch": 1, "memory_limit": None}
    with pytest.raises(ConfigError, match="unknown peer; expected one of accelerate-disk, airllm"):
        run_peer("vllm", **kw)
    with pytest.raises(ConfigError, match="no config.json there; pass a Hugging Face checkpoint directory"):
        run_peer(PEERS[0], **(kw | {"checkpoint": tmp_path}))
    with pytest.raises(ConfigError, match="batch=0 must be an int >= 1"):
        run_peer(PEERS[0], **(kw | {"batch": 0}))
    with pytest.raises(ConfigError, match=r"prompts\[1\]: a prompt must be a non-empty list of token ids"):
        run_peer(PEERS[0], **(kw | {"prompts": [[1], []]}))
    with pytest.raises(ConfigError, match="0 is not 'no cap'"):
        run_peer(PEERS[0], **(kw | {"memory_limit": 0}))
    with pytest.raises(ConfigError, match="timeout_s=0"):
        run_peer(PEERS[0], **(kw | {"timeout_s": 0}))
    search_kw = {k: v for k, v in kw.items() if k != "batch"}
    with pytest.raises(ConfigError, match="give the batch sizes growing"):
        best_batch(PEERS[0], **search_kw, batches=(4, 2))
    with pytest.raises(ConfigError, match="probe_new_tokens=1 must be an int >= 2"):
        best_batch(PEERS[0], **search_kw, probe_new_tokens=1)
    assert not list(tmp_path.iterdir())  # nothing was started or written


def test_child_refuses_a_bad_spec_with_one_line(checkpoint: Path, tmp_path: Path) -> None:
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps([[1], []]))
    spec = {"peer": PEERS[0], "checkpoint": str(checkpoint), "workdir": str(tmp_path), "prompts_file": str(prompts_file), "max_new_tokens": 2, "batch": 1}
    p = subprocess.run(procs.child_command(MODULE, json.dumps(spec)), capture_output=True, text=True, env=peer_env(), timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["bad spec: prompts[1]: a prompt must be a non-empty list of token ids (ints >= 0); got []"]


def _scripted(rates: dict[int, float | str]):  # noqa: ANN202 - a run_peer stand-in
    """``run_peer`` giving, at batch ``b``, a probe whose workload estimate is ``rates[b]`` tokens/s (or the status ``rates[b]``)."""
    calls = []

    def run(peer: str, *, prompts: list, batch: int, max_new_tokens: int, **_kw: object) -> PeerResult:
        calls.append(batch)
        rate = rates[batch]
        if isinstance(rate, str):
            return PeerResult(peer, batch, status=rate, error=f"{rate} at batch {batch}", prompts=len(prompts))
        # prefill 0, decode of (max_new_tokens - 1) steps taking what the rate says for a 32-token workload
        t = len(prompts) * 32 / rate
        return PeerResult(peer, batch, prompts=len(prompts), prefill_s=0.0, decode_s=t * (max_new_tokens - 1) / 31, forwards=(max_new_tokens,))

    return run, calls


def _search(tmp_path: Path, n: int, batches: tuple[int, ...], run: Any, **kw: Any) -> Any:
    (tmp_path / "config.json").write_text("{}")  # a checkpoint as far as the argument checks go: the scripted run reads nothing
    return best_batch("airllm", checkpoint=tmp_path, workdir=tmp_path, prompts=[[1]] * n, max_new_tokens=32, memory_limit=None, batches=batches,
                      run=run, **kw)  # fmt: skip


def test_best_batch_stops_at_the_first_slower_probe(tmp_path: Path) -> None:
    run, calls = _scripted({1: 1.0, 2: 3.0, 4: 2.0, 8: 9.0})
    search = _search(tmp_path, 8, (1, 2, 4, 8), run)
    assert calls == [1, 2, 4] and search.best is not None and search.best.batch == 2
    assert [p.est_tokens_per_s for p in search.points] == pytest.approx([1.0, 3.0, 2.0])
    assert search.stopped == "batch 4 is slower than batch 2 by more than 5%"


def test_best_batch_goes_on_over_a_plateau(tmp_path: Path) -> None:
    """A probe within ``tolerance`` of the best is a plateau, not a slowdown: the search goes on."""
    run, calls = _scripted({1: 1.0, 2: 3.0, 4: 2.9, 8: 4.0, 16: 3.7})
    search = _search(tmp_path, 16, (1, 2, 4, 8, 16), run)
    assert calls == [1, 2, 4, 8, 16] and search.best is not None and search.best.batch == 8
    run, calls = _scripted({1: 1.0, 2: 3.0, 4: 2.9, 8: 4.0})
    search = _search(tmp_path, 8, (1, 2, 4, 8), run, tolerance=0.0)
    assert calls == [1, 2, 4] and search.best is not None and search.best.batch == 2  # no tolerance: any slower probe ends the search
    with pytest.raises(ConfigError, match="tolerance=1"):
        _search(tmp_path, 1, (1,), run, tolerance=1)


def test_best_batch_stops_at_out_of_memory_and_at_the_prompts(tmp_path: Path) -> None:
    run, calls = _scripted({1: 1.0, 2: 3.0, 4: "oom", 8: 9.0})
    search = _search(tmp_path, 8, (1, 2, 4, 8), run)
    assert calls == [1, 2, 4] and search.best is not None and search.best.batch == 2 and search.points[-1].est_tokens_per_s is None
    assert search.stopped == "batch 4: oom (oom at batch 4)"
    run, calls = _scripted({1: 1.0, 2: 3.0, 4: 5.0})
    search = _search(tmp_path, 3, (1, 2, 4), run)
    assert calls == [1, 2] and search.best is not None and search.best.batch == 2  # 4 prompts are not there
    assert search.stopped == "batch 4 is more than the 3 prompts"


def test_workload_estimate_scales_the_decode_steps() -> None:
    probe = PeerResult("airllm", 2, prompts=2, prefill_s=1.0, decode_s=3.0, forwards=(4,))  # 3 decode steps of 1 s
    assert workload_tokens_per_s(probe, max_new_tokens=32) == pytest.approx(2 * 32 / (1.0 + 31.0))
    assert workload_tokens_per_s(PeerResult("airllm", 2, status="error", error="x"), max_new_tokens=32) is None
    assert workload_tokens_per_s(PeerResult("airllm", 2, prompts=2, prefill_s=1.0, decode_s=0.0, forwards=(1,)), max_new_tokens=32) is None


def test_a_missing_package_is_unsupported_without_a_child(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer whose package is not installed is ``unsupported``, naming the package, and starts no child."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "airllm" else real(name, *a))
    r = run_peer("airllm", checkpoint=checkpoint, workdir=tmp_path, prompts=[[1]], max_new_tokens=2, batch=1, memory_limit=None)
    assert r.status == "unsupported" and r.error is not None and "'airllm'" in r.error and "not installed" in r.error
    assert r.returncode is None and not list(tmp_path.iterdir())


def test_a_workload_past_one_arguments_limit_reaches_the_child(checkpoint: Path, tmp_path: Path) -> None:
    """Prompts whose JSON is over Linux's 128 KiB for one command-line argument (``MAX_ARG_STRLEN``)
    travel in a file the spec names: the child gets them all, and the file is removed after."""
    rng = random.Random(1)
    many = [[rng.randrange(1000, 2048) for _ in range(400)] for _ in range(64)]
    assert len(json.dumps(many)) > 128 << 10
    r = run_peer("resident", checkpoint=checkpoint, workdir=tmp_path, prompts=many, max_new_tokens=1, batch=64, memory_limit=None, timeout_s=300)
    assert r.status == "ok" and r.prompts == 64 and len(r.tokens) == 64 and r.forwards == (1,)
    assert not list(tmp_path.glob("peer-prompts-*"))
