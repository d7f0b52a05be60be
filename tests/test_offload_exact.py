"""attach() is exact: losses and gradients are bit-identical (torch.equal) to a run without it.

Each test runs the same model (same init, same inputs, RNG reset before each step) once
without the offloader and once with it, on each storage engine that runs here, with
``min_bytes=0`` and ``keep_last=0`` so that every saved activation really goes to storage.
Tests that take ``timing`` run once in each of two timings (``between`` in helpers.models):
``drive`` synchronizes between forward and backward, so every write has landed and backward
reads every offloaded byte back from the drive (asserted: ``bytes_read`` is what was offloaded,
once per backward, and nothing is served from memory), so a read path that loses or changes
bytes fails them; ``natural`` forces nothing, as in real training (a tensor whose write is
still in flight is served from memory).
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint as cp
from helpers.exact import assert_io
from helpers.models import MLP, TinyGPT, assert_same, between, grads_of, make, offload_everything, settled, train_step
from torch import nn


@pytest.mark.parametrize("name", ["mlp", "gpt", "conv", "qkv"])
def test_models_bit_identical(name: str, engine: str, timing: str, tmp_path) -> None:
    model, inputs = make(name)
    ref = [train_step(model, inputs, seed=s) for s in (1, 2)]
    model, inputs = make(name)
    with offload_everything(model, tmp_path, engine) as off:
        got = [train_step(model, inputs, seed=s, sync=between(off, timing)) for s in (1, 2)]
        st = settled(off)
    for r, g in zip(ref, got, strict=True):
        assert_same(r, g)
    assert_io(st, timing, backwards=1)


def test_gpt_dropout_really_random(tmp_path) -> None:
    """Guard for the test above: dropout is on, so only an identical RNG state gives identical grads."""
    model, inputs = make("gpt")
    assert not torch.equal(train_step(model, inputs, seed=1).loss, train_step(model, inputs, seed=2).loss)


class Checkpointed(nn.Module):
    """An MLP whose blocks run under non-reentrant activation checkpointing (every other block)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(depth=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.mlp.blocks):
            x = cp.checkpoint(b, x, use_reentrant=False) if i % 2 == 0 else b(x)
        return self.mlp.head(x)


def test_checkpoint_regions(engine: str, timing: str, tmp_path) -> None:
    torch.manual_seed(0)
    model, x = Checkpointed(), torch.randn(64, 128)
    ref = train_step(model, x)
    with offload_everything(model, tmp_path, engine) as off:
        assert_same(ref, train_step(model, x, sync=between(off, timing)))
        assert_io(settled(off), timing, backwards=1)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_bf16_autocast(name: str, engine: str, timing: str, tmp_path) -> None:
    model, inputs = make(name)

    def step(sync: Callable[[], None] = lambda: None) -> object:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(*inputs)
            loss = out if out.dim() == 0 else out.float().pow(2).mean()
        sync()
        loss.backward()
        return grads_of(model, loss)

    ref = step()
    with offload_everything(model, tmp_path, engine) as off:
        assert_same(ref, step(between(off, timing)))
        assert_same(ref, step(between(off, timing)))
        assert_io(settled(off), timing, backwards=1)


def test_grad_accumulation_backward_out_of_order(engine: str, timing: str, tmp_path) -> None:
    """Four micro-batches: all forwards first, then backwards in another order (3, 0, 2, 1)."""
    torch.manual_seed(0)
    model = MLP(depth=3)
    xs = [torch.randn(32, 128) for _ in range(4)]

    def step(sync: Callable[[], None] = lambda: None) -> object:
        model.zero_grad(set_to_none=True)
        losses = [model(x).pow(2).mean() for x in xs]
        sync()
        for i in (3, 0, 2, 1):
            losses[i].backward()
        return grads_of(model, sum(ls.detach() for ls in losses))

    ref = step()
    with offload_everything(model, tmp_path, engine) as off:
        assert_same(ref, step(between(off, timing)))
        assert_same(ref, step(between(off, timing)))
        assert_io(settled(off), timing, backwards=1)
        assert off.store.allocated_bytes() == 0


def test_forward_twice_in_one_step(engine: str, timing: str, tmp_path) -> None:
    model, (idx,) = make("gpt")
    other = torch.randint(0, 256, idx.shape)

    def step(sync: Callable[[], None] = lambda: None) -> object:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = model(idx) + 0.5 * model(other)
        sync()
        loss.backward()
        return grads_of(model, loss)

    ref = step()
    with offload_everything(model, tmp_path, engine) as off:
        assert_same(ref, step(between(off, timing)))
        st = settled(off)
    assert st.steps == 2  # two forwards
    assert_io(st, timing, backwards=1)


def test_retain_graph_second_backward(engine: str, timing: str, tmp_path) -> None:
    """Each backward through the retained graph reads its tensors back again (``drive``: twice)."""
    model, inputs = make("gpt")

    def step(sync: Callable[[], None] = lambda: None) -> object:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        loss = model(*inputs)
        sync()
        loss.backward(retain_graph=True)
        loss.backward()
        return grads_of(model, loss)

    ref = step()
    with offload_everything(model, tmp_path, engine) as off:
        assert_same(ref, step(between(off, timing)))
        assert_io(settled(off), timing, backwards=2)
    assert off.store.allocated_bytes() == 0


def test_no_grad_saves_and_writes_nothing(engine: str, tmp_path) -> None:
    model, inputs = make("gpt")
    with offload_everything(model, tmp_path, engine) as off:
        with torch.no_grad():
            model(*inputs)
        st = settled(off)
        assert (st.bytes_packed, st.bytes_offloaded, off.engine.stats().bytes_written) == (0, 0, 0)
        assert off.store.allocated_bytes() == 0


def test_paused_steps_are_plain_and_exact(engine: str, tmp_path) -> None:
    """Steps inside ``paused()`` save nothing through the offloader; steps around them still
    offload; every step's loss and gradients equal a run without the offloader."""
    model, inputs = make("gpt")
    ref = [train_step(model, inputs, seed=s) for s in (1, 2, 3)]
    model, inputs = make("gpt")
    with offload_everything(model, tmp_path, engine) as off:
        assert_same(ref[0], train_step(model, inputs, seed=1))
        before = settled(off)
        written = off.engine.stats().bytes_written
        with off.paused():
            with off.paused():  # nests
                pass
            assert_same(ref[1], train_step(model, inputs, seed=2))
        paused = settled(off)
        assert (paused.steps, paused.bytes_packed, off.engine.stats().bytes_written) == (before.steps, before.bytes_packed, written)
        assert_same(ref[2], train_step(model, inputs, seed=3))
        after = settled(off)
        assert after.steps == before.steps + 1 and after.bytes_offloaded > before.bytes_offloaded
        assert off.store.allocated_bytes() == 0


def test_eval_mode(engine: str, timing: str, tmp_path) -> None:
    model, inputs = make("gpt")
    model.eval()
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path, engine) as off:
        assert_same(ref, train_step(model, inputs, sync=between(off, timing)))
        assert_io(settled(off), timing, backwards=1)


def test_detach_then_attach_again(engine: str, tmp_path) -> None:
    model, inputs = make("conv")
    refs = [train_step(make("conv")[0], inputs, seed=s) for s in (1,)]
    model, _ = make("conv")
    off = offload_everything(model, tmp_path, engine)
    assert_same(refs[0], train_step(model, inputs, seed=1))
    off.detach()
    assert not off.attached
    model2, _ = make("conv")
    with offload_everything(model2, tmp_path, engine) as off2:
        assert_same(refs[0], train_step(model2, inputs, seed=1))
        assert settled(off2).bytes_offloaded > 0
    # and the first model again, after its offloader was detached
    model3, _ = make("conv")
    off3 = offload_everything(model3, tmp_path, engine)
    off3.detach()
    with offload_everything(model3, tmp_path, engine):
        assert_same(refs[0], train_step(model3, inputs, seed=1))


def test_detach_while_graph_alive(engine: str, tmp_path) -> None:
    """detach() between forward and backward: bytes only on disk are read back; backward is exact."""
    model, inputs = make("gpt")
    ref = train_step(model, inputs, seed=9)
    model.zero_grad(set_to_none=True)
    off = offload_everything(model, tmp_path, engine)
    torch.manual_seed(9)
    loss = model(*inputs)
    off.synchronize()
    assert settled(off).bytes_offloaded > 0
    off.detach()
    loss.backward()
    assert_same(ref, grads_of(model, loss))


def test_detach_between_two_backwards_of_a_retained_graph(engine: str, tmp_path) -> None:
    """After the first backward the forward's bookkeeping is finished; detach must still read back
    every tensor the retained graph holds on disk."""
    model, inputs = make("gpt")

    def run(off_factory=None) -> object:
        model.zero_grad(set_to_none=True)
        off = off_factory() if off_factory else None
        torch.manual_seed(11)
        loss = model(*inputs)
        loss.backward(retain_graph=True)
        if off is not None:
            off.synchronize()
            off.detach()
        loss.backward()
        return grads_of(model, loss)

    ref = run()
    assert_same(ref, run(lambda: offload_everything(model, tmp_path, engine)))


def test_hf_gpt2_bit_identical(engine: str, timing: str, tmp_path, monkeypatch) -> None:
    """A real Hugging Face model class built from a config (nothing downloaded)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (4, 32))

    def step(sync: Callable[[], None] = lambda: None) -> object:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = model(input_ids=ids, labels=ids).loss
        sync()
        loss.backward()
        return grads_of(model, loss)

    ref = step()
    with offload_everything(model, tmp_path, engine) as off:
        assert off.layer_names == ["transformer.h.0", "transformer.h.1"]
        assert_same(ref, step(between(off, timing)))
        assert_io(settled(off), timing, backwards=1)


def test_tinygpt_tied_head_shares_grad(tmp_path) -> None:
    """Tied embedding/LM head: one parameter, one gradient (the model under test really ties them)."""
    model = TinyGPT()
    assert model.lm_head.weight is model.tok.weight
