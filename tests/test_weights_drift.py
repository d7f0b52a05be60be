"""generate_many's re-planning after a drift (gds_offload.weights.run.generation.Drift), on a synthetic
profile and given compute times, so the outcome depends on nothing the machine does: the scale is
applied once (a wave that runs as the scaled profile predicts triggers nothing), and a re-plan
keeps what the caller set by hand."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

from gds_offload.weights.planning.options import KVPlacement  # noqa: E402
from gds_offload.weights.planning.planner import Fit, Generate, Plan, Profile, choose, estimate  # noqa: E402
from gds_offload.weights.run.generation import Drift, Fixed, micro_batches  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
PROMPTS = [torch.arange(1, 65) for _ in range(4096)]  # twice what the plan was made for: waves are left after the first


def _profile() -> Profile:
    """A 12-layer model: 100 MiB layers read at 1 GB/s; a layer's decode step 40 ms + 0.1 ms per sequence."""
    return Profile(device="cpu", layers=12, layer_nbytes=100 * MiB, resident_nbytes=200 * MiB, hidden_nbytes=8192, kv_nbytes=4096,
                   kv_record_nbytes=4096, logits_nbytes=64000, read_Bps=1e9, base_nbytes=500 * MiB, prefill=Fit(0.0, 1e-3),
                   decode=Fit(0.04, 1e-4), head=Fit(0.01, 1e-4), prefill_transient_nbytes=100_000, decode_transient_nbytes=1000)  # fmt: skip


class _Notes:
    """The StreamedModel's side that Drift uses: where re-plans are noted."""

    def __init__(self) -> None:
        self.replans: list[str] = []

    def note_replan(self, what: str) -> None:
        self.replans.append(what)


def _first_wave(plan: Plan) -> tuple[list, list[int]]:
    mbs = micro_batches(PROMPTS, plan.choice.micro_batch, pad_token_id=0)
    n = plan.choice.per_load
    return mbs[:n], [i for mb in mbs[n:] for i in mb.indices]


def _predicted(profile: Profile, plan: Plan, wave: list) -> float:
    w = Generate(sum(mb.input_ids.shape[0] for mb in wave), max(mb.input_ids.shape[1] for mb in wave), 32)
    return estimate(profile, w, plan.choice, plan.memory_nbytes).streamed_compute_s


def test_a_machine_1_4x_slower_re_plans_once_and_then_runs_as_predicted() -> None:
    p = _profile()
    plan = choose(p, Generate(2048, 64, 32), int(1.5 * GiB))
    notes = _Notes()
    drift = Drift(notes, plan, 32)
    wave, rest = _first_wave(plan)
    new = drift.check(wave, 1.4 * _predicted(p, plan, wave), rest, PROMPTS)
    assert new is not None and drift.scale == pytest.approx(1.4)
    # The next wave, under the new plan, takes what the measured profile x 1.4 predicts: no drift.
    wave, rest = _first_wave(new)
    rest = rest[: len(rest) // 2]
    assert drift.check(wave, _predicted(p.scaled(1.4), new, wave), rest, PROMPTS) is None
    assert len(notes.replans) == 1 and "(1.40x)" in notes.replans[0]


def test_a_re_plan_keeps_the_kv_placement_the_caller_gave() -> None:
    p = _profile()
    plan = choose(p, Generate(2048, 64, 32), int(1.5 * GiB))
    assert plan.choice.kv is KVPlacement.DRIVE
    wave, rest = _first_wave(plan)
    free = Drift(_Notes(), plan, 32).check(wave, 3 * _predicted(p, plan, wave), rest, PROMPTS)
    assert free is not None and free.choice.kv is KVPlacement.DRIVE  # what the planner alone would pick
    notes = _Notes()
    kept = Drift(notes, plan, 32, Fixed(kv=KVPlacement.DEVICE)).check(wave, 3 * _predicted(p, plan, wave), rest, PROMPTS)
    assert kept is None or kept.choice.kv is KVPlacement.DEVICE, notes.replans


def test_a_re_plan_keeps_a_shape_the_caller_gave() -> None:
    p = _profile()
    plan = choose(p, Generate(2048, 64, 32), int(1.5 * GiB))
    wave, rest = _first_wave(plan)
    notes = _Notes()
    assert Drift(notes, plan, 32, Fixed(shape=True)).check(wave, 3 * _predicted(p, plan, wave), rest, PROMPTS) is None
    assert notes.replans == ["compute measured {:.2f} s against {:.2f} s planned (3.00x); kept the shape given to generate_many".format(
        3 * _predicted(p, plan, wave), _predicted(p, plan, wave))]  # fmt: skip
