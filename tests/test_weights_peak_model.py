"""The planner's peak model (gds_offload.weights.planning.cost.peak_nbytes) counts what a layer-major run
was measured to hold beyond the first model: each suspended member's libraries' caches, a
chunk's memory on the longest cache, the logits every suspended member keeps. Synthetic
profiles: each term is checked against a profile without it."""
from __future__ import annotations

from dataclasses import replace

from gds_offload.weights.planning.cost import peak_nbytes
from gds_offload.weights.planning.options import KVPlacement
from gds_offload.weights.planning.planner import Choice, Fit, Generate, Profile

MiB = 1 << 20
W = Generate(prompts=256, prompt_len=32, new_tokens=8)


def _profile(**kw: object) -> Profile:
    base = dict(device="cpu", layers=16, layer_nbytes=43 * MiB, resident_nbytes=250 * MiB, hidden_nbytes=4096, kv_nbytes=2048,
                kv_record_nbytes=2048, logits_nbytes=128000, read_Bps=1e9, base_nbytes=516 * MiB, prefill=Fit(0.0, 1e-3),
                decode=Fit(0.01, 1e-4), head=Fit(0.001, 1e-5), prefill_transient_nbytes=60000, decode_transient_nbytes=40000)  # fmt: skip
    return Profile(**(base | kw))  # type: ignore[arg-type]


def test_each_member_of_a_team_counts_its_threads_caches() -> None:
    """A team runs every member on a thread of its own, a team of one too (measured on a 10-layer
    Llama plan of 2 members: each member's first layer raised the process by 14 MiB, the profile's
    member_nbytes); the thread that measured the base keeps its caches in the base."""
    p, q = _profile(), _profile(member_nbytes=12 * MiB)
    team = Choice(8, 32, 0, 2, KVPlacement.DRIVE, 2)
    alone = Choice(8, 1, 0, 2, KVPlacement.DRIVE, 2)
    assert peak_nbytes(q, W, team) - peak_nbytes(p, W, team) == 32 * 12 * MiB
    assert peak_nbytes(q, W, alone) - peak_nbytes(p, W, alone) == 12 * MiB


def test_a_chunked_prefill_is_priced_on_the_last_chunks_cache() -> None:
    c = Choice(64, 1, 0, 2, KVPlacement.DRIVE, 8)
    p = _profile(prefill_transient_nbytes=1000.0, decode_transient_nbytes=0.0)
    heavy = replace(p, prefill_chunked_transient_nbytes=500_000.0)
    assert peak_nbytes(heavy, W, c) - peak_nbytes(p, W, c) == (500_000 - 1000) * 64 * 8
    whole = Choice(64, 1, 0, 2, KVPlacement.DRIVE, None)  # a whole prompt at once: no chunk on a cache
    assert peak_nbytes(heavy, W, whole) == peak_nbytes(p, W, whole)


def test_every_suspended_member_keeps_two_copies_of_its_logits_and_the_computing_one_four() -> None:
    """Suspended: generate's fp32 copy and the processed scores. Computing, inside min_new_tokens'
    processor: the model's logits, the fp32 copy, the processor's clone and its masked output."""
    p = _profile()
    one, four = Choice(16, 1, 0, 2, KVPlacement.DRIVE, 2), Choice(16, 4, 0, 2, KVPlacement.DRIVE, 2)
    zero = replace(p, logits_nbytes=0)
    assert peak_nbytes(p, W, four) - peak_nbytes(zero, W, four) == (2 * 64 + 2 * 16) * 128000
    assert peak_nbytes(p, W, one) - peak_nbytes(zero, W, one) == (2 * 16 + 2 * 16) * 128000
