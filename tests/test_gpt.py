"""The built-in GPT (gds_offload.models.gpt): shapes, determinism, and exact training under the offloader."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

import gds_offload
from gds_offload.activations.layers import find_layers
from gds_offload.errors import ConfigError
from gds_offload.io.host import HostEngine
from gds_offload.io.kvikio.engine import kvikio_status
from gds_offload.models.gpt import GPTConfig, lm_loss, make_gpt, synthetic_batch

TINY = GPTConfig(layers=3, hidden=64, heads=4, seq=32, vocab=128, dropout=0.1)
ENGINES = ["posix", "host"] + (["compat"] if kvikio_status()[0] else [])


def _train(model: torch.nn.Module, steps: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Losses and the last step's gradients; RNG and batch a function of the step only."""
    losses, grads = [], []
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + i)
        loss = lm_loss(model, synthetic_batch(TINY, 2, seed=i))
        loss.backward()
        losses.append(loss.detach().clone())
        grads = [p.grad.clone() for p in model.parameters()]
    return losses, grads


def _assert_equal(ref: tuple[list[torch.Tensor], list[torch.Tensor]], got: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
    assert len(ref[0]) == len(got[0]), f"{len(got[0])} losses, the reference has {len(ref[0])}"
    for a, b in zip(ref[0], got[0], strict=True):
        assert torch.equal(a, b), (a, b)
    assert len(ref[1]) == len(got[1])
    for i, (a, b) in enumerate(zip(ref[1], got[1], strict=True)):
        assert torch.equal(a, b), f"gradient {i} differs"


def test_shapes_params_and_tied_head() -> None:
    model = make_gpt(TINY)
    batch = synthetic_batch(TINY, 2, seed=0)
    assert batch.shape == (2, TINY.seq + 1) and batch.dtype == torch.long
    assert model(batch[:, :-1]).shape == (2, TINY.seq, TINY.vocab)
    assert model.head.weight is model.tok.weight
    assert sum(p.numel() for p in model.parameters()) == TINY.params()
    assert [n for n, _ in find_layers(model)] == ["blocks.0", "blocks.1", "blocks.2"]


def test_same_seed_same_weights_and_batches() -> None:
    a, b = make_gpt(TINY, seed=3), make_gpt(TINY, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(make_gpt(TINY, seed=4).tok.weight, a.tok.weight)
    assert torch.equal(synthetic_batch(TINY, 2, seed=5), synthetic_batch(TINY, 2, seed=5))
    assert not torch.equal(synthetic_batch(TINY, 2, seed=5), synthetic_batch(TINY, 2, seed=6))


def test_dropout_is_random_but_seeded() -> None:
    model = make_gpt(TINY)
    batch = synthetic_batch(TINY, 2, seed=0)
    torch.manual_seed(1)
    a = lm_loss(model, batch)
    torch.manual_seed(1)
    b = lm_loss(model, batch)
    torch.manual_seed(2)
    c = lm_loss(model, batch)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"hidden": 65}, "divisible by heads"), ({"layers": 0}, "layers=0"), ({"dropout": 1.0}, "dropout")],
)
def test_config_errors_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        GPTConfig(**(dict(layers=2, hidden=64, heads=4) | kwargs))


def test_sequence_longer_than_positions_is_refused() -> None:
    with pytest.raises(ConfigError, match="longer than GPTConfig.seq"):
        make_gpt(TINY)(torch.zeros(1, TINY.seq + 1, dtype=torch.long))


@pytest.mark.parametrize("engine", ENGINES)
def test_training_bit_identical_under_offload(engine: str, tmp_path) -> None:
    ref = _train(make_gpt(TINY))
    model = make_gpt(TINY)
    with gds_offload.attach(model, path=tmp_path, mode=engine, min_bytes=0, keep_last=0) as off:
        got = _train(model)
        off.synchronize()  # bytes_offloaded counts the writes that completed: all of them, whatever the drive's pace
        st = off.stats()
    _assert_equal(ref, got)
    assert off.layer_names == ["blocks.0", "blocks.1", "blocks.2"]
    assert st.bytes_offloaded > 0 and st.bytes_read + st.bytes_forwarded > 0
    # q, k and v are three views of one fused-projection storage: saved once.
    assert st.bytes_deduplicated > 0


class _InlineHostEngine(HostEngine):
    """A host engine whose writes complete before ``write()`` returns, as a fast engine's
    small transfers can (KvikIO compat did, intermittently, on 4 KiB tensors)."""

    def _submit_write(self, src, slot, ready) -> Future[int]:
        future = super()._submit_write(src, slot, ready)
        future.result()
        return future


def test_write_that_completes_at_once_keeps_its_slot(monkeypatch, tmp_path) -> None:
    """Regression: a write already done when the scheduler added its done-callback ran the
    callback inside ``pack`` before the handle was counted, so the entry looked released:
    slot freed, source dropped, and backward failed with an AssertionError."""
    import gds_offload.activations.offloader as hooks_mod

    monkeypatch.setattr(hooks_mod, "make_engine", lambda *a, **k: _InlineHostEngine())
    ref = _train(make_gpt(TINY))
    model = make_gpt(TINY)
    with gds_offload.attach(model, path=tmp_path, mode="host", min_bytes=0, keep_last=0) as off:
        got = _train(model)
        st = off.stats()
    _assert_equal(ref, got)
    assert st.bytes_read > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_buffers_are_freed_without_the_cyclic_gc(engine: str, tmp_path) -> None:
    """Regression: ``IOFuture.add_done_callback`` captured the IOFuture in a callback stored
    on its own inner future (a reference cycle), and the read check closure held the read
    buffer, so read buffers (and write sources) lived on after backward until the cyclic
    GC ran: on the demo GPT, +0.25 GiB of peak RSS in forward and backward."""
    import gc

    model = make_gpt(TINY)
    with gds_offload.attach(model, path=tmp_path, mode=engine, min_bytes=0, keep_last=0) as off:
        gc.collect()
        gc.disable()
        try:
            _train(model)
            off.synchronize()  # a write still in flight holds its source: let every one land first
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            leaked = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert off.stats().resident_bytes == 0
    assert not leaked, f"{len(leaked)} tensors ({sum(t.untyped_storage().nbytes() for t in leaked)} bytes) only reachable through reference cycles"
