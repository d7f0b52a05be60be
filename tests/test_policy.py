"""Placement policies: adaptive offloading, memory budgets, the plan, and the simulation behind them.

Timing-dependent assertions use what the scheduler measures about waiting (``io_wait``),
with generous margins; speed targets live in ``gds-offload rok`` / ``bench``.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch

import gds_offload
from gds_offload.activations.planning.planners import make_planner
from gds_offload.activations.planning.policy import Adaptive, Budget, BudgetError
from gds_offload.activations.planning.profile import StepProfile, UnitProfile, simulate
from gds_offload.errors import ConfigError
from gds_offload.io.limits import TokenBucket
from gds_offload.io.posix import PosixEngine
from gds_offload.models.gpt import GPTConfig, lm_loss, make_gpt, synthetic_batch

MiB = 1 << 20


def _profile(n: int, *, fwd: float, bwd: float, nbytes: int, fixed: int = 0) -> StepProfile:
    units = tuple(UnitProfile(f"u{k}", fwd, bwd, nbytes if k else 0, 0) for k in range(n))
    return StepProfile(units, write_bps=0, read_bps=0, io_wait_s=0, peak_resident_bytes=0, fixed_bytes=fixed)


def _step(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    loss = lm_loss(model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


# --------------------------------------------------------------------------- simulation
def test_simulate_fast_drive_hides_everything() -> None:
    p = _profile(5, fwd=0.1, bwd=0.2, nbytes=10 * MiB)
    sim = simulate(p, {1, 2, 3}, write_bps=10e9, read_bps=10e9)
    assert sim.stall_s == pytest.approx(0.0, abs=1e-3)
    assert sim.io_bytes == 30 * MiB


def test_simulate_slow_reads_stall_and_keeping_removes_the_stall() -> None:
    p = _profile(5, fwd=0.1, bwd=0.2, nbytes=100 * MiB)
    slow = simulate(p, {1, 2, 3}, write_bps=10e9, read_bps=100e6)
    assert slow.stall_s > 0.5
    assert simulate(p, set(), write_bps=10e9, read_bps=100e6).stall_s == 0.0


def test_simulate_writes_too_slow_to_finish_are_forwarded() -> None:
    p = _profile(5, fwd=0.01, bwd=0.02, nbytes=100 * MiB)
    sim = simulate(p, {1, 2, 3}, write_bps=100e6, read_bps=100e6)
    assert sim.stall_s == 0.0 and sim.forwarded == {1, 2, 3}
    keep = simulate(p, set(), write_bps=100e6, read_bps=100e6)
    assert sim.peak_bytes >= keep.peak_bytes, "forwarded units never left memory"


def test_simulate_peak_counts_kept_units_and_writes_in_flight() -> None:
    p = _profile(4, fwd=0.1, bwd=0.1, nbytes=100 * MiB, fixed=5 * MiB)
    keep_all = simulate(p, set(), write_bps=1e12, read_bps=1e12)
    assert keep_all.peak_bytes == 5 * MiB + 3 * 100 * MiB
    offload = simulate(p, {1, 2}, write_bps=1e12, read_bps=1e12)
    assert offload.peak_bytes < keep_all.peak_bytes


def test_adaptive_plan_keeps_from_the_end_until_io_hides() -> None:
    pol = make_planner(Adaptive(keep_last=1, warmup_steps=0))
    pol.begin_forward(6)
    p = _profile(7, fwd=0.05, bwd=0.1, nbytes=50 * MiB)
    slow = StepProfile(p.units, write_bps=300e6, read_bps=300e6, io_wait_s=0, peak_resident_bytes=0, fixed_bytes=0)
    pol.observe(slow)
    plan = pol.plan()
    offloaded = plan.offloaded_units()
    assert offloaded and offloaded != set(range(1, 6)), plan
    assert offloaded == set(range(1, max(offloaded) + 1)), "keeps a suffix, offloads a prefix"
    assert plan.predicted is not None and plan.predicted.stall_s <= 0.02 * plan.predicted.step_s


def test_adaptive_replans_when_bandwidth_drops() -> None:
    pol = make_planner(Adaptive(keep_last=1, warmup_steps=0))
    pol.begin_forward(6)
    p = _profile(7, fwd=0.05, bwd=0.1, nbytes=50 * MiB)
    fast = StepProfile(p.units, write_bps=5e9, read_bps=5e9, io_wait_s=0, peak_resident_bytes=0, fixed_bytes=0)
    pol.observe(fast)
    assert pol.plan().offloaded_units() == set(range(1, 6))
    slow = StepProfile(p.units, write_bps=100e6, read_bps=100e6, io_wait_s=0.5, peak_resident_bytes=0, fixed_bytes=0)
    pol.observe(slow)
    pol.observe(slow)
    plan = pol.plan()
    assert len(plan.offloaded_units()) < 5
    assert any("bandwidth" in e or "stalled" in e for e in plan.events), plan.events


def test_adaptive_does_not_plan_from_its_warm_up_step() -> None:
    """A slow first step (buffers mapped, files grown) must not become the plan: with it, the
    plan would keep every unit and never measure the drive again."""
    pol = make_planner(Adaptive(keep_last=1))
    pol.begin_forward(6)
    p = _profile(7, fwd=0.05, bwd=0.1, nbytes=50 * MiB)
    cold = StepProfile(p.units, write_bps=1e6, read_bps=1e6, io_wait_s=2.0, peak_resident_bytes=0, fixed_bytes=0)
    warm = StepProfile(p.units, write_bps=5e9, read_bps=5e9, io_wait_s=0, peak_resident_bytes=0, fixed_bytes=0)
    pol.observe(cold)
    assert "profiling" in pol.plan().reason and pol.offload(1), "still offloading everything while it profiles"
    pol.observe(warm)
    assert pol.plan().offloaded_units() == set(range(1, 6)), pol.plan()


def test_adaptive_rejects_negative_warmup() -> None:
    with pytest.raises(ConfigError, match=r"warmup_steps=-1.*use 0 or more"):
        Adaptive(warmup_steps=-1)


def test_budget_rejects_nonsense() -> None:
    with pytest.raises(ConfigError, match="40 gigs"):
        Budget("40 gigs")
    with pytest.raises(ConfigError, match="positive"):
        Budget(0)


# --------------------------------------------------------------------------- real training
@pytest.fixture
def gpt() -> tuple[torch.nn.Module, torch.Tensor]:
    cfg = GPTConfig(layers=6, hidden=256, heads=4, seq=256, vocab=512)
    return make_gpt(cfg, seed=0), synthetic_batch(cfg, batch=8, seed=1)


@pytest.mark.parametrize("policy", ["adaptive", "budget"])
def test_every_policy_is_exact(gpt, spill_dir, policy) -> None:
    model, batch = gpt
    ref = [_step(model, batch) for _ in range(3)]
    twin = copy.deepcopy(model)
    kw = {"budget": "150MiB"} if policy == "budget" else {"policy": "adaptive"}
    with gds_offload.attach(twin, path=spill_dir, mode="posix", min_bytes=0, **kw) as off:
        got = [_step(twin, batch) for _ in range(3)]
        assert off.stats().bytes_offloaded > 0
    for (l1, g1), (l2, g2) in zip(ref, got, strict=True):
        assert torch.equal(l1, l2)
        assert len(g1) == len(g2) and all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


def test_adaptive_uncapped_offloads_all_but_the_last(spill_dir) -> None:
    # Compute-heavy layers (wide, short sequence: compute per saved byte grows with the width),
    # so this CPU's drive hides their I/O with a wide margin even on a busy machine.
    cfg = GPTConfig(layers=4, hidden=768, heads=12, seq=64, vocab=512)
    model, batch = make_gpt(cfg, seed=0), synthetic_batch(cfg, batch=8, seed=1)
    with gds_offload.attach(model, path=spill_dir, mode="posix", policy="adaptive") as off:
        for _ in range(3):
            _step(model, batch)
        plan = off.plan()
    offloaded = plan.offloaded_units()
    eligible = {d.unit for d in plan.decisions if d.bytes}
    last = max(d.unit for d in plan.decisions)
    assert offloaded == eligible - {last}, plan


class _Timed(torch.autograd.Function):
    """``x * x`` whose forward and backward each take a fixed wall-clock time (a sleep)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:  # noqa: ANN001
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        time.sleep(ctx.backward_s)
        (x,) = ctx.saved_tensors
        return 2 * x * grad, None, None


class _TimedBlock(torch.nn.Module):
    """Saves two 64 KiB storages; computes 10 ms forward and 20 ms backward, asleep but for
    about a millisecond, so its step time hardly changes on a busy machine."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Timed.apply(x * self.scale, 0.010, 0.020)


def _timed_step(model: torch.nn.Module, x: torch.Tensor, off: gds_offload.Offloader) -> None:
    model.zero_grad(set_to_none=True)
    loss = model(x).sum()
    off.synchronize()  # every write done before backward: no tensor is served from memory by luck
    loss.backward()


def _on_a_capped_drive(off: gds_offload.Offloader, bytes_per_s: float) -> gds_offload.Offloader:
    """``off`` moving its bytes at ``bytes_per_s`` with no burst: every transfer of ``n`` bytes
    takes at least ``n / bytes_per_s`` (``max_bandwidth`` allows a 1 MiB burst, which would
    let these small transfers through free)."""
    old = off.engine
    off.use_engine(PosixEngine(num_threads=1, limiter=TokenBucket(bytes_per_s, burst_bytes=0)))
    old.close()
    return off


def test_adaptive_under_a_bandwidth_cap_stops_stalling(spill_dir) -> None:
    """Capped at 400 kB/s, a unit's 128 KiB read takes about 330 ms against 20 ms of backward
    compute: offloading every unit stalls, and adaptive, having measured both, keeps units
    until it does not. Compute is sleeps, transfers are paced by the cap, and every write
    ends before backward, so the outcome does not depend on how busy the machine is."""
    model, x = torch.nn.Sequential(*(_TimedBlock() for _ in range(4))), torch.randn(16, 1024)
    cap = 400e3
    with _on_a_capped_drive(gds_offload.attach(model, path=spill_dir, mode="posix", min_bytes=0), cap) as off:
        for _ in range(2):
            _timed_step(model, x, off)
        stalled = off.stats(reset=True)
        _timed_step(model, x, off)
        all_wait = off.stats().io_wait_s
    assert stalled.stalls > 0 and all_wait > 0.1, "the cap must make offload-all wait, or this test shows nothing"
    with _on_a_capped_drive(gds_offload.attach(model, path=spill_dir, mode="posix", policy="adaptive", min_bytes=0), cap) as off:
        for _ in range(4):  # warm up, profile, plan, settle
            _timed_step(model, x, off)
        off.stats(reset=True)
        _timed_step(model, x, off)
        s = off.stats()
        plan = off.plan()
    assert s.io_wait_s < 0.5 * all_wait, (s.io_wait_s, all_wait)
    assert len(plan.offloaded_units()) < len([d for d in plan.decisions if d.bytes]) - 1, "kept more than the last layer"


@pytest.mark.parametrize("budget_mib", [150, 250])
def test_budget_is_met(gpt, spill_dir, budget_mib) -> None:
    model, batch = gpt
    with gds_offload.attach(model, path=spill_dir, mode="posix", budget=f"{budget_mib}MiB") as off:
        _step(model, batch)  # profile: offloads everything
        _step(model, batch)  # planned
        off.stats(reset=True)
        for _ in range(2):
            _step(model, batch)
        peak = off.stats().peak_resident_bytes
        plan = off.plan()
    assert peak <= budget_mib * MiB, (peak / MiB, plan)


def test_budget_keeps_more_when_the_budget_is_larger(gpt, spill_dir) -> None:
    model, batch = gpt
    kept = {}
    for budget in ("150MiB", "1GiB"):
        with gds_offload.attach(model, path=spill_dir, mode="posix", budget=budget) as off:
            for _ in range(3):
                _step(model, batch)
            kept[budget] = sum(d.bytes for d in off.plan().decisions if d.action == "keep")
    assert kept["1GiB"] > kept["150MiB"]


def test_impossible_budget_says_by_how_much(gpt, spill_dir) -> None:
    model, batch = gpt
    with gds_offload.attach(model, path=spill_dir, mode="posix", budget="1MiB"):
        _step(model, batch)
        with pytest.raises(BudgetError, match=r"cannot be met.*over"):
            _step(model, batch)


def test_plan_renders_as_a_table(gpt, spill_dir) -> None:
    from rich.console import Console

    model, batch = gpt
    with gds_offload.attach(model, path=spill_dir, mode="posix", policy="adaptive") as off:
        assert "profiling" in off.plan().reason
        _step(model, batch)  # warm-up: not measured
        assert "profiling" in off.plan().reason
        _step(model, batch)
        console = Console(record=True, width=160)
        console.print(off.plan())
    text = console.export_text()
    assert "blocks.0" in text and "offload" in text and "GB/s" in text


def test_budget_and_policy_together_is_an_error(gpt, spill_dir) -> None:
    model, _ = gpt
    with pytest.raises(ConfigError, match="either budget"):
        gds_offload.attach(model, path=spill_dir, policy="adaptive", budget="1GiB")


def test_one_budget_given_to_two_offloaders_shares_no_measurement(spill_dir) -> None:
    """A ``Budget`` is configuration: each ``attach()`` plans with state of its own, so a step of
    one model is no measurement of the other, and the ``Budget`` itself is left as it was."""
    cfg = GPTConfig(layers=2, hidden=64, heads=2, seq=32, vocab=128)
    a, b = make_gpt(cfg, seed=0), make_gpt(cfg, seed=1)
    batch = synthetic_batch(cfg, batch=2, seed=1)
    budget = Budget("1GiB")
    with gds_offload.attach(a, path=spill_dir, mode="posix", policy=budget, min_bytes=0) as off_a, \
         gds_offload.attach(b, path=spill_dir, mode="posix", policy=budget, min_bytes=0) as off_b:  # fmt: skip
        _step(a, batch)
        assert "measured" in off_a.plan().reason, off_a.plan().reason
        assert off_b.plan().reason.startswith("profiling"), "b ran no step: it has measured nothing"
    assert budget == Budget("1GiB")
    with pytest.raises(AttributeError):
        budget.bytes = "2GiB"  # type: ignore[misc]  # frozen: configuration, not state
