"""The layer-major team's protocol (gds_offload.weights.streaming.team): its state table, and Ctrl-C at
every wait of the calling thread, on every path that runs a team (``StreamedTrainer.step``,
``accumulate``, ``generate_many``), each followed by a call ``torch.equal`` to the reference.

The interrupts are real ``SIGINT``s handled by Python's own handler. The calling thread waits for
its members with stop signals held and delivers them only between its waits (the members' moves
and hand-overs wake it, so it delivers once per hand-over at least); the tests raise the signal
at the ``n``-th delivery, for every ``n`` an uninterrupted call reaches: before the members start,
at the gate, and at each hand-over. After each interrupt every member must already have left
(no member computes after the call returned), and the next call must equal the reference.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.llama import VOCAB, converted, meta_skeleton, resident_model  # noqa: E402

from gds_offload.errors import OffloadError  # noqa: E402
from gds_offload.weights import as_reference, export, load_streamed  # noqa: E402
from gds_offload.weights.streaming import team as schedule  # noqa: E402
from gds_offload.weights.streaming.team import MOVES, MemberState, Team  # noqa: E402
from gds_offload.weights.train.trainer import StreamedTrainer  # noqa: E402

TRAIN = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
pytestmark = pytest.mark.usefixtures("one_thread")


# -- the state table ---------------------------------------------------------------------------
def test_every_move_of_the_table_and_no_other() -> None:
    legal = {(a, b) for a, nexts in MOVES.items() for b in nexts}
    assert legal == {(MemberState.NEW, MemberState.READY), (MemberState.READY, MemberState.RUNNING),
                     (MemberState.READY, MemberState.LEFT), (MemberState.RUNNING, MemberState.LEFT)}  # fmt: skip
    for a in MemberState:
        for b in MemberState:
            if (a, b) in legal:
                assert schedule.check_move(0, a, b) is b
            else:
                with pytest.raises(OffloadError, match=f"cannot go from {a.value} to {b.value}"):
                    schedule.check_move(0, a, b)


def test_members_go_through_the_table_and_all_leave() -> None:
    seen: list[list[MemberState]] = []
    team: Team[int] = Team([lambda: 1, lambda: 2, lambda: 3])
    team.run(started=lambda idents: seen.append(team.states))
    assert seen == [[MemberState.READY] * 3]  # every thread registered, none computing before the gate
    assert team.states == [MemberState.LEFT] * 3


def test_a_member_cancelled_at_the_gate_never_runs() -> None:
    ran: list[int] = []
    team: Team[None] = Team([lambda: ran.append(0), lambda: ran.append(1)])

    def refuse(idents: list[int]) -> None:
        raise RuntimeError("admission refused")

    with pytest.raises(RuntimeError, match="admission refused"):
        team.run(started=refuse)
    assert ran == [] and team.states == [MemberState.LEFT] * 2


@pytest.fixture
def interrupt_at(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], list[int]]:
    """``interrupt_at(n)``: a real SIGINT at the calling thread's ``n``-th delivery point of a
    team (0: none); returns a one-item list counting the delivery points reached."""
    real = schedule.deliver
    state = {"at": 0}
    count = [0]

    def deliver() -> None:
        if threading.current_thread() is threading.main_thread():
            count[0] += 1
            if count[0] == state["at"]:
                signal.raise_signal(signal.SIGINT)  # held: recorded, then handed to Python's handler below
        real()

    monkeypatch.setattr(schedule, "deliver", deliver)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def arm(n: int) -> list[int]:
        state["at"], count[0] = n, 0
        return count

    return arm


@pytest.fixture
def teams(monkeypatch: pytest.MonkeyPatch) -> list[Team[Any]]:
    """Every team run during the test."""
    made: list[Team[Any]] = []
    original = Team.run

    def run(self: Team[Any], **kw: Any) -> Any:
        made.append(self)
        return original(self, **kw)

    monkeypatch.setattr(Team, "run", run)
    return made


def test_an_interrupted_caller_returns_only_once_a_computing_member_left(interrupt_at: Callable[[int], list[int]]) -> None:
    """Member 0 is inside its call (not at a hand-over) when the caller is interrupted: ``run``
    raises only after that member's call has returned."""
    inside, release = threading.Event(), threading.Event()
    finished: list[str] = []

    def slow() -> None:
        inside.set()
        release.wait()
        finished.append("member 0")

    team: Team[None] = Team([slow, lambda: None])
    count = interrupt_at(1)

    def release_once_interrupted() -> None:
        while count[0] < 1 or team.states[0] is not MemberState.RUNNING:
            inside.wait(0.01)
        release.set()

    helper = threading.Thread(target=release_once_interrupted, daemon=True)
    helper.start()
    with pytest.raises(KeyboardInterrupt):
        team.run()
    assert finished == ["member 0"] and team.states == [MemberState.LEFT] * 2
    helper.join()


# -- every path that runs a team -----------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt_store() -> Iterator[tuple[Path, Path]]:
    with converted("team") as paths:
        yield paths


def _batches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _sweep(interrupt_at: Callable[[int], list[int]], teams: list[Team[Any]], interrupted: Callable[[], Any], clean: Callable[[int], None]) -> int:
    """Count the delivery points of ``interrupted()``; then for each ``n`` run it with Ctrl-C at the
    ``n``-th, check that every member had left when it raised, and run ``clean(n)`` (which checks
    the next call against the reference). Returns how many interrupts landed."""
    points = interrupt_at(0)
    interrupted()
    total = points[0]
    assert total >= 3, "the team's caller delivers at its waits"
    landed = 0
    for n in range(1, total + 1):
        teams.clear()
        reached = interrupt_at(n)
        try:
            interrupted()
        except KeyboardInterrupt:
            landed += 1
            assert teams and all(s is MemberState.LEFT for t in teams for s in t.states), f"a member still ran after Ctrl-C at delivery {n}"
        else:  # the waits vary with the machine's speed: this run may have ended before its n-th
            assert reached[0] < n, f"Ctrl-C at delivery {n} of {reached[0]} did not stop the call"
        interrupt_at(0)
        clean(n)
    assert landed >= 1
    return landed


def test_ctrl_c_at_every_wait_of_a_training_step(ckpt_store: tuple[Path, Path], interrupt_at: Callable[[int], list[int]], teams: list[Team[Any]]) -> None:
    """``StreamedTrainer.step`` over 2 micro-batches sharing each load; after each interrupted step,
    a step on the same micro-batches: the successful steps equal resident AdamW on them, in order."""
    ckpt, store = ckpt_store
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2, foreach=False)
    steps: list[list[dict[str, torch.Tensor]]] = []
    losses: list[torch.Tensor] = []
    d = real_disk_base() / f"gds_offload-team-train-{os.getpid()}"
    shutil.copytree(store, d)
    try:
        with load_streamed(meta_skeleton(d), d) as lm, StreamedTrainer(lm, optimizer) as trainer:

            def step(batch: list[dict[str, torch.Tensor]]) -> None:
                losses.extend(trainer.step(batch, per_load=2))
                steps.append(batch)  # only a step that returned is on the drive

            def clean(n: int) -> None:
                assert trainer.step_count == len(steps), "an interrupted step left the drive at the step before it"
                step(_batches(2, seed=100 + n))

            _sweep(interrupt_at, teams, lambda: step(_batches(2, seed=1)), clean)
        ref = resident_model(ckpt)
        for p in ref.parameters():
            p.requires_grad_(True)
        opt = optimizer(list(ref.parameters()))
        want = []
        for batch in steps:
            for b in batch:
                loss = ref(**b).loss
                loss.backward()
                want.append(loss.detach())
            opt.step()
            opt.zero_grad()
        assert len(losses) == len(want) and all(torch.equal(a, b) for a, b in zip(losses, want))
        export(d, d.with_name(d.name + "-out"))
        weights = safetensors_torch.load_file(d.with_name(d.name + "-out") / "model.safetensors")
        assert all(torch.equal(weights[k], v) for k, v in ref.state_dict().items())
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(d.with_name(d.name + "-out"), ignore_errors=True)


def test_ctrl_c_at_every_wait_of_accumulate(ckpt_store: tuple[Path, Path], interrupt_at: Callable[[int], list[int]], teams: list[Team[Any]]) -> None:
    """``accumulate`` of 3 micro-batches sharing each load, the resident tensors trained: after each
    interrupt, a clean call's losses and gradients equal the resident model's accumulation."""
    ckpt, store = ckpt_store
    batches = _batches(3, seed=2)
    ref = as_reference(resident_model(ckpt))
    for n, p in ref.named_parameters():
        p.requires_grad_(n in TRAIN)
    want_losses = []
    for b in batches:
        loss = ref(**b).loss
        loss.backward()
        want_losses.append(loss.detach())
    want = {n: p.grad for n, p in ref.named_parameters() if n in TRAIN}
    with load_streamed(meta_skeleton(store), store) as lm:
        params = dict(lm.model.named_parameters())
        for n, p in params.items():
            p.requires_grad_(n in TRAIN)

        def call() -> list[torch.Tensor]:
            for n in TRAIN:
                params[n].grad = None
            return lm.accumulate(batches, per_load=3)

        def clean(n: int) -> None:
            got = call()
            assert len(got) == len(want_losses) and all(torch.equal(a, b) for a, b in zip(got, want_losses)), f"losses after Ctrl-C at {n}"
            assert all(torch.equal(params[k].grad, v) for k, v in want.items()), f"gradients after Ctrl-C at {n}"

        _sweep(interrupt_at, teams, call, clean)


def test_ctrl_c_at_every_wait_of_generate_many(ckpt_store: tuple[Path, Path], interrupt_at: Callable[[int], list[int]], teams: list[Team[Any]]) -> None:
    ckpt, store = ckpt_store
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g) for _ in range(4)]
    kw: dict[str, Any] = dict(max_new_tokens=3, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    ref = as_reference(resident_model(ckpt))
    with load_streamed(meta_skeleton(store), store) as lm:

        def call() -> Any:
            return lm.generate_many(prompts, micro_batch=2, per_load=2, seed=4, **kw)

        def clean(n: int) -> None:
            out = call()
            assert len(out.outputs) == len(out.micro_batches) == 2
            for j, (got, mb) in enumerate(zip(out.outputs, out.micro_batches)):
                torch.manual_seed(4 + j)
                want = ref.generate(mb.input_ids, attention_mask=mb.attention_mask, **kw)
                assert torch.equal(got.sequences, want.sequences), f"tokens of micro-batch {j} after Ctrl-C at {n}"
                assert len(got.scores) == len(want.scores) and all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))

        _sweep(interrupt_at, teams, call, clean)
