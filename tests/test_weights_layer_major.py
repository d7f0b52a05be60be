"""Layer-major generation (gds_offload.weights.run.generation, .schedule, .kv): several micro-batches
share each weight load, in the prefill and at every decode step, and every micro-batch's tokens
and scores equal the resident model generating the same micro-batches one after another
(greedy and sampled with a seed; the KV cache in memory and on the drive; every engine)."""
from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.gates import ENGINES  # noqa: E402
from helpers.llama import assert_same_generation  # noqa: E402

from gds_offload.errors import ConfigError, SpillSpaceError  # noqa: E402
from gds_offload.weights import as_reference, convert, load_streamed  # noqa: E402
from gds_offload.weights.run.generation import micro_batches  # noqa: E402
from gds_offload.weights.streaming.team import Team, TeamCancelled  # noqa: E402

LAYERS = 4


def _llama() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip


def _gpt2() -> transformers.GPT2Config:
    return transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=128)


@pytest.fixture(scope="module")
def stores() -> Iterator[dict[str, tuple[Path, Path]]]:
    base = real_disk_base() / f"gds_offload-layer-major-{os.getpid()}"
    out = {}
    for name, cfg in (("llama", _llama()), ("gpt2", _gpt2())):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(base / f"ckpt-{name}")
        convert(base / f"ckpt-{name}", base / f"store-{name}")
        out[name] = (base / f"ckpt-{name}", base / f"store-{name}")
    yield out
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def kv_dir(tmp_path: Path) -> Path:
    d = real_disk_base() / f"gds_offload-kv-{os.getpid()}-{id(tmp_path)}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _prompts(n: int = 11, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g) for _ in range(n)]


def _skeleton(store: Path) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(store)).eval()


def _reference(ckpt: Path, mbs: list[Any], *, seed: int, **kw: Any) -> list[Any]:
    """The resident model generating the micro-batches one after another, micro-batch j seeded seed + j."""
    ref = as_reference(transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval())
    out = []
    for j, mb in enumerate(mbs):
        torch.manual_seed(seed + j)
        out.append(ref.generate(mb.input_ids, attention_mask=mb.attention_mask, pad_token_id=0, **kw))
    return out


def _assert_same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want), f"{len(got)} micro-batches' outputs, the reference has {len(want)}"
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_generation(g, w, f"micro-batch {j}: ")


SCORES = dict(output_scores=True, return_dict_in_generate=True)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("kv", ["device", "host", "drive"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generate_many_equals_the_resident_model_per_micro_batch(stores: dict[str, tuple[Path, Path]], kv_dir: Path, arch: str, kv: str, sample: bool) -> None:
    ckpt, store = stores[arch]
    prompts = _prompts()
    kw = dict(max_new_tokens=5, do_sample=sample, top_k=20 if sample else None, **SCORES)
    with load_streamed(_skeleton(store), store, slots=2) as lm:
        out = lm.generate_many(prompts, micro_batch=3, per_load=2, kv=kv, kv_path=kv_dir, seed=7, pad_token_id=0, **kw)
        s = lm.stats()
    assert [mb.indices for mb in out.micro_batches] == [mb.indices for mb in micro_batches(prompts, 3, pad_token_id=0)]
    _assert_same(out.outputs, _reference(ckpt, out.micro_batches, seed=7, **kw))
    # 4 micro-batches in 2 waves of 2: each layer read once per step of a wave, not once per micro-batch.
    assert s.loads == [2 * 5] * LAYERS and s.teams == 2 and s.team_micro_batches == 4
    assert (s.kv_bytes_read > 0 and s.kv_bytes_written > 0) == (kv == "drive")
    for i, p in enumerate(prompts):  # the tokens are each prompt's own, in the caller's order
        mb = next(m for m in out.micro_batches if i in m.indices)
        row = mb.indices.index(i)
        assert torch.equal(mb.input_ids[row, -len(p) :], p) and out.tokens[i].shape == (5,)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("slots", [1, 3])
def test_every_engine_and_ring_size(stores: dict[str, tuple[Path, Path]], kv_dir: Path, engine: str, slots: int) -> None:
    ckpt, store = stores["llama"]
    prompts = _prompts(7, seed=5)
    kw = dict(max_new_tokens=4, **SCORES)
    with load_streamed(_skeleton(store), store, slots=slots, engine=engine, verify=True) as lm:
        out = lm.generate_many(prompts, micro_batch=2, per_load=4, kv="drive", kv_path=kv_dir, seed=1, pad_token_id=0, **kw)
        assert lm.stats().misses == 0
    _assert_same(out.outputs, _reference(ckpt, out.micro_batches, seed=1, **kw))


def test_a_micro_batch_that_stops_early_leaves_the_rotation(stores: dict[str, tuple[Path, Path]]) -> None:
    """An end token stops one micro-batch's generate before the others'; the rest go on, exact."""
    ckpt, store = stores["llama"]
    prompts = _prompts(6, seed=9)
    kw = dict(max_new_tokens=8, **SCORES)
    first = micro_batches(prompts, 1, pad_token_id=0)
    probe = _reference(ckpt, first, seed=0, **kw)
    eos = int(probe[1].sequences[0, first[1].input_ids.shape[1] + 2])  # micro-batch 1 emits it 3rd: it stops there
    with load_streamed(_skeleton(store), store) as lm:
        out = lm.generate_many(prompts, micro_batch=1, per_load=3, seed=0, pad_token_id=0, eos_token_id=eos, **kw)
    want = _reference(ckpt, out.micro_batches, seed=0, eos_token_id=eos, **kw)
    assert len({len(w.scores) for w in want}) > 1, "the micro-batches stop at different steps"
    _assert_same(out.outputs, want)


def test_bad_arguments_are_refused_before_anything_runs(stores: dict[str, tuple[Path, Path]]) -> None:
    _, store = stores["llama"]
    with load_streamed(_skeleton(store), store) as lm:
        cases = [
            (dict(prompts=[], max_new_tokens=2), "prompts=\\[\\]"),
            (dict(prompts=[[1, 2]], max_new_tokens=0), "max_new_tokens=0"),
            (dict(prompts=[[1, 2]], max_new_tokens=2, micro_batch=0), "micro_batch=0"),
            (dict(prompts=[[1, 2]], max_new_tokens=2, per_load=1.5), "per_load=1.5"),
            (dict(prompts=[[]], max_new_tokens=2), "prompts\\[0\\] must be a non-empty"),
            (dict(prompts=[[1, 2]], max_new_tokens=2, kv="ssd"), "kv='ssd'"),
            (dict(prompts=[[1, 2]], max_new_tokens=2, kv="drive", num_beams=2), "beam search"),
            (dict(prompts=[[1, 2]], max_new_tokens=2, attention_mask=None), "sets attention_mask itself"),
        ]
        for kw, match in cases:
            with pytest.raises(ConfigError, match=match):
                lm.generate_many(**kw)
        assert sum(lm.stats().loads) == 0


def test_a_kv_cache_the_drive_cannot_hold_names_max_new_tokens(stores: dict[str, tuple[Path, Path]], kv_dir: Path) -> None:
    """kv='drive' reserves prompt + max_new_tokens positions per micro-batch and layer up front: a
    max_new_tokens far past what the drive holds is refused before anything is reserved, naming the
    argument, the bytes per position (4 layers x one 4 KiB record) and the fix; the next call runs."""
    ckpt, store = stores["llama"]
    prompts = [torch.arange(1, 10)]
    with load_streamed(_skeleton(store), store) as lm:
        need = 4 * 4096 * (9 + 10**10)
        with pytest.raises(SpillSpaceError, match=rf"reserves each micro-batch's KV cache on the drive up front, for its prompt \+ "
                                                  rf"max_new_tokens positions at 16384 bytes per position \(4 layers x 4096-byte records .*\): "
                                                  rf"max_new_tokens=10000000000 with prompts of up to 9 tokens asks for more than the drive "
                                                  rf"holds: {need} bytes of KV caches .* do not fit in .*: \d+ bytes free there\. Give max_new_tokens "
                                                  rf"what you will generate, or run fewer or smaller micro-batches .*kv='device'"):  # fmt: skip
            lm.generate_many(prompts, max_new_tokens=10**10, kv="drive", kv_path=kv_dir, pad_token_id=0)
        out = lm.generate_many(prompts, max_new_tokens=3, kv="drive", kv_path=kv_dir, pad_token_id=0, **SCORES)
    _assert_same(out.outputs, _reference(ckpt, out.micro_batches, seed=0, max_new_tokens=3, **SCORES))


def test_team_runs_members_layer_major_and_cancels_on_failure() -> None:
    """The schedule alone: members hand over at arrive(); one that raises cancels the rest."""
    order: list[tuple[int, int]] = []
    team: Team[int] = Team([lambda i=i: _member(team, i, order) for i in range(3)])
    assert team.run() == [0, 1, 2]
    assert order == [(i, k) for k in range(3) for i in range(3)], "every member passes step k before any passes k + 1"

    def boom() -> int:
        team2.arrive()
        raise RuntimeError("boom")

    team2: Team[int] = Team([lambda: _member(team2, 0, []), boom, lambda: _member(team2, 2, [])])
    with pytest.raises(RuntimeError, match="boom"):
        team2.run()


def _member(team: Team[int], i: int, order: list[tuple[int, int]]) -> int:
    for k in range(3):
        team.arrive()
        order.append((i, k))
    return i


def test_team_members_draw_their_own_random_numbers() -> None:
    want = []
    for seed in (11, 12):
        torch.manual_seed(seed)
        want.append([torch.rand(()) for _ in range(3)])
    team: Team[list[torch.Tensor]] = Team([lambda: _draws(team), lambda: _draws(team)], seeds=[11, 12])
    before = torch.get_rng_state()
    got = team.run()
    assert torch.equal(torch.get_rng_state(), before), "the caller's state is left as it was"
    assert len(got) == len(want) and all(torch.equal(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))


def _draws(team: Team[list[torch.Tensor]]) -> list[torch.Tensor]:
    out = []
    for _ in range(3):
        team.arrive()
        out.append(torch.rand(()))
    return out


def test_a_member_cancelled_by_another_raises_team_cancelled() -> None:
    seen: list[BaseException] = []
    started = threading.Event()

    def waits() -> int:
        started.set()
        try:
            team.arrive()
            team.arrive()
        except TeamCancelled as exc:
            seen.append(exc)
            raise
        return 0

    def fails() -> int:
        raise ValueError("bad input")

    team: Team[int] = Team([waits, fails])
    with pytest.raises(ValueError, match="bad input"):
        team.run()
    assert started.is_set() and seen and "ValueError" in str(seen[0])


def test_ctrl_c_during_generate_many_leaves_the_next_call_exact(stores: dict[str, tuple[Path, Path]], kv_dir: Path) -> None:
    import signal

    ckpt, store = stores["llama"]
    prompts = _prompts(6, seed=2)
    kw = dict(max_new_tokens=4, **SCORES)
    calls = [0]
    handled = threading.Event()

    def on_sigint(signum: int, frame: Any) -> None:  # Python's own behaviour, and a flag the member waits for
        handled.set()
        raise KeyboardInterrupt

    def interrupt(*args: Any) -> None:  # on a member's thread; the caller's thread gets the KeyboardInterrupt
        calls[0] += 1
        if calls[0] == 7:
            os.kill(os.getpid(), signal.SIGINT)
            assert handled.wait(30), "the caller's thread handled the signal"  # so the team cannot finish first

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with load_streamed(_skeleton(store), store, slots=2) as lm:
            handle = lm.model.model.layers[2].register_forward_pre_hook(interrupt)
            with pytest.raises(KeyboardInterrupt):
                lm.generate_many(prompts, micro_batch=2, per_load=3, kv="drive", kv_path=kv_dir, seed=4, pad_token_id=0, **kw)
            handle.remove()
            out = lm.generate_many(prompts, micro_batch=2, per_load=3, kv="drive", kv_path=kv_dir, seed=4, pad_token_id=0, **kw)
    finally:
        signal.signal(signal.SIGINT, previous)
    _assert_same(out.outputs, _reference(ckpt, out.micro_batches, seed=4, **kw))
