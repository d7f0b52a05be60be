"""Backward through streamed layers (gds_offload.weights.streaming.backward): the weights autograd saves
are read again from the store (or copied out of the slots still holding the forward's last
layers), so losses and gradients equal the resident model's bit for bit. With ``slots=1`` every
layer's slot but the last one's is refilled before backward, and that one as soon as backward
has copied it, so a saved view of a slot would hold another layer's bytes: these tests fail if
the saved weights are not read again or copied."""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

import peft  # noqa: E402  # in the test extra: a plain import, so a missing peft fails the file rather than skipping it
from helpers.disks import real_disk_base  # noqa: E402

import gds_offload  # noqa: E402
from gds_offload.errors import ConfigError, OffloadError  # noqa: E402
from gds_offload.weights import StoreCorruptError, convert, load_streamed, read_manifest  # noqa: E402
from gds_offload.weights.streaming.stats import StreamStats  # noqa: E402

LAYERS = 4
#: The tensors trained in these tests: resident ones (the streamed layers' parameters are frozen).
LLAMA_TRAIN = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
GPT2_TRAIN = ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias")


def _llama() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip


def _gpt2() -> transformers.GPT2Config:
    return transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64)  # tied head, Conv1D


@pytest.fixture(scope="module")
def stores() -> dict[str, tuple[Path, Path]]:
    base = real_disk_base() / f"gds_offload-weights-backward-{os.getpid()}"
    out = {}
    for name, cfg in (("llama", _llama()), ("gpt2", _gpt2())):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(base / f"ckpt-{name}")
        convert(base / f"ckpt-{name}", base / f"store-{name}")
        out[name] = (base / f"ckpt-{name}", base / f"store-{name}")
    yield out
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))


def _trainable(model: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Module:
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    return model


def _resident(ckpt: Path, names: tuple[str, ...], **kw: str) -> torch.nn.Module:
    return _trainable(transformers.AutoModelForCausalLM.from_pretrained(ckpt, **kw).eval(), names)


def _skeleton(store: Path, **kw: str) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(store), **kw).eval()


def _step(model: torch.nn.Module, ids: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    params = dict(model.named_parameters())
    return loss.detach(), {n: params[n].grad.clone() for n in names}


def _again(streamed: int, slots: int, steps: int = 1) -> tuple[list[int], list[int], list[int], int]:
    """``(backward_reads, backward_held, backward_copies, renewed_slots)`` after ``steps`` forward-backward steps:
    each layer once per step, computed from its slot for the last ``slots`` layers (still in the ring at the turn),
    read again into a slot for the rest; nothing copied, no slot still viewed when the ring wrote it."""
    held = min(slots, streamed)
    return [steps] * (streamed - held) + [0] * held, [0] * (streamed - held) + [steps] * held, [0] * streamed, 0


def _backward(s: StreamStats) -> tuple[list[int], list[int], list[int], int]:
    return s.backward_reads, s.backward_held, s.backward_copies, s.renewed_slots


def _assert_equal(got: tuple[torch.Tensor, dict[str, torch.Tensor]], want: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n


@pytest.mark.parametrize("arch, names", [("llama", LLAMA_TRAIN), ("gpt2", GPT2_TRAIN)])
@pytest.mark.parametrize("slots", [1, 2])
def test_gradients_equal_resident(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor, arch: str, names: tuple[str, ...], slots: int) -> None:
    ckpt, store = stores[arch]
    want = _step(_resident(ckpt, names), ids, names)
    with load_streamed(_skeleton(store), store, slots=slots) as h:
        _assert_equal(_step(_trainable(h.model, names), ids, names), want)
        s = h.stats()
        assert _backward(s) == _again(LAYERS, slots)  # each layer's weights once more, for backward
        with torch.no_grad():
            h(ids)
        s = h.stats()
        assert _backward(s) == _again(LAYERS, slots)  # nothing is saved without grad


def test_input_gradients_and_double_backward(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor) -> None:
    ckpt, store = stores["llama"]

    def grads(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        loss = model(inputs_embeds=emb).logits.square().mean()
        (g,) = torch.autograd.grad(loss, emb, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), emb)  # backward through the backward
        return g.detach(), gg

    eager = {"attn_implementation": "eager"}  # SDPA on the CPU has no double backward
    want = grads(_resident(ckpt, (), **eager))
    with load_streamed(_skeleton(store, **eager), store, slots=1) as h:
        got = grads(_trainable(h.model, ()))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_backward_waits_for_a_slow_drive(monkeypatch: pytest.MonkeyPatch, stores: dict[str, tuple[Path, Path]], ids: torch.Tensor) -> None:
    import gds_offload.io.posix as posix_mod

    ckpt, store = stores["llama"]
    want = _step(_resident(ckpt, LLAMA_TRAIN), ids, LLAMA_TRAIN)
    real, reads = os.preadv, [0]

    def slow_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        reads[0] += 1
        time.sleep(0.05)  # each backward read is still in flight when the gradient needs it
        return real(fd, buffers, offset)

    with load_streamed(_skeleton(store), store, slots=1) as h:
        loss = _trainable(h.model, LLAMA_TRAIN)(input_ids=ids, labels=ids).loss
        monkeypatch.setattr(posix_mod.os, "preadv", slow_preadv)
        loss.backward()
        params = dict(h.model.named_parameters())
        _assert_equal((loss.detach(), {n: params[n].grad for n in LLAMA_TRAIN}), want)
        assert reads[0] >= LAYERS - 1  # every layer but the last, which backward finds in its slot


def _settle_before_attention_backward(model: torch.nn.Module, settle: object) -> None:
    """Call ``settle()`` when backward reaches each layer's attention, after its MLP: by then the
    MLP's backward has taken the layer's weights, and the reads that followed have landed."""

    def hook(_mod: torch.nn.Module, _args: object, out: tuple[torch.Tensor, ...]) -> None:
        if out[0].requires_grad:
            out[0].register_hook(lambda g: settle())  # type: ignore[operator]

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)


@pytest.mark.parametrize("slots", [1, 2])
def test_backward_copies_the_layers_left_in_the_ring(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor, slots: int) -> None:
    """The forward's last ``slots`` layers are still in the ring at backward: backward computes
    from them where they lie, and reads the layers below into the slots as it frees them. Each
    layer's attention backward waits until those fills have landed (``settle``), so a view of a
    slot written too early would compute with another layer's bytes. Two steps: the second
    forward finds its first layers where the first backward left them."""
    ckpt, store = stores["llama"]
    ref = _resident(ckpt, LLAMA_TRAIN)
    _settle_before_attention_backward(ref, lambda: None)
    want = _step(ref, ids, LLAMA_TRAIN)
    with load_streamed(_skeleton(store), store, slots=slots) as h:
        model = _trainable(h.model, LLAMA_TRAIN)
        _settle_before_attention_backward(model, h.settle)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            _assert_equal(_step(model, ids, LLAMA_TRAIN), want)
        s = h.stats()
    assert _backward(s) == _again(LAYERS, slots, steps=2)
    assert s.misses == 0 and s.wasted_reads == 0
    # Every layer once per forward, but the first `slots` of the second (the first backward left them in the ring),
    # and once per backward below the last `slots`.
    assert s.reads == [2 - (p < slots) + 2 * (p < LAYERS - slots) for p in range(LAYERS)]


class _Keep(torch.autograd.Function):
    """``x`` unchanged; its backward keeps the weight it saved (``kept``): a tensor autograd
    unpacked that outlives its layer's backward, as a custom ``autograd.Function`` may make."""

    kept: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _Keep.kept.append(ctx.saved_tensors[0])
        return grad, None


@pytest.mark.parametrize("slots", [1, 2])
def test_a_weight_kept_past_its_layers_backward_keeps_its_bytes(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor, slots: int) -> None:
    """Backward computes from the ring's slots; a tensor made from a slot and kept after its layer's
    backward (here by a custom Function) keeps that layer's bytes: the slot gets a new buffer
    before anything is written into it. Gradients stay equal to resident, and so does the kept tensor."""
    ckpt, store = stores["llama"]

    def keeping(model: torch.nn.Module) -> torch.nn.Module:
        for layer in model.model.layers:
            mlp = layer.mlp
            mlp.down_proj.register_forward_hook(lambda m, _a, out: _Keep.apply(out, m.weight))
        return model

    ref = keeping(_resident(ckpt, LLAMA_TRAIN))
    want = _step(ref, ids, LLAMA_TRAIN)
    want_kept = [layer.mlp.down_proj.weight.detach().clone() for layer in ref.model.layers][::-1]
    _Keep.kept.clear()
    with load_streamed(_skeleton(store), store, slots=slots) as h:
        model = keeping(_trainable(h.model, LLAMA_TRAIN))
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            _assert_equal(_step(model, ids, LLAMA_TRAIN), want)
        s = h.stats()
    assert len(_Keep.kept) == 2 * LAYERS
    assert all(torch.equal(k, w) for k, w in zip(_Keep.kept, 2 * want_kept, strict=True)), "a kept weight changed under it"
    assert s.renewed_slots > 0 and s.backward_copies == [0] * LAYERS
    _Keep.kept.clear()


def test_a_ring_holding_every_layer_lends_each_to_backward(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor) -> None:
    ckpt, store = stores["llama"]
    want = _step(_resident(ckpt, LLAMA_TRAIN), ids, LLAMA_TRAIN)
    with load_streamed(_skeleton(store), store, slots=LAYERS) as h:
        model = _trainable(h.model, LLAMA_TRAIN)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            _assert_equal(_step(model, ids, LLAMA_TRAIN), want)
        s = h.stats()
    assert s.reads == [1] * LAYERS and s.backward_reads == s.backward_copies == [0] * LAYERS and s.backward_held == [2] * LAYERS
    assert s.misses == 0 and s.reused == LAYERS  # the second forward reads nothing


def test_a_forward_with_grad_and_no_backward_then_inference(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor) -> None:
    """The layers kept for a backward that never comes: the next forward is a miss, not wrong."""
    ckpt, store = stores["llama"]
    ref = _resident(ckpt, LLAMA_TRAIN)
    want_loss = ref(input_ids=ids, labels=ids).loss.detach()
    with torch.no_grad():
        want = ref(ids).logits
    with load_streamed(_skeleton(store), store, slots=2) as h:
        model = _trainable(h.model, LLAMA_TRAIN)
        assert torch.equal(model(input_ids=ids, labels=ids).loss.detach(), want_loss)  # no backward
        with torch.no_grad():
            assert torch.equal(model(ids).logits, want)
            assert torch.equal(model(ids).logits, want)
        s = h.stats()
    assert s.misses == 1 and s.wasted_reads == 0 and s.backward_reads == s.backward_copies == [0] * LAYERS


def test_composes_with_activation_offloading(tmp_path: Path, stores: dict[str, tuple[Path, Path]], ids: torch.Tensor) -> None:
    ckpt, store = stores["llama"]
    want = _step(_resident(ckpt, LLAMA_TRAIN), ids, LLAMA_TRAIN)
    with load_streamed(_skeleton(store), store, slots=1) as h:
        model = _trainable(h.model, LLAMA_TRAIN)
        with gds_offload.attach(model, path=tmp_path, min_bytes=0, keep_last=0) as off:
            got = _step(model, ids, LLAMA_TRAIN)
        # The activations went to the offloader's hooks (below the streamed layers' own), the weights to the store.
        s = h.stats()
        assert off.stats().bytes_offloaded > 0 and _backward(s) == _again(LAYERS, 1)
    _assert_equal(got, want)


def test_a_forward_that_raises_pops_the_hooks(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor) -> None:
    ckpt, store = stores["llama"]
    want = _step(_resident(ckpt, LLAMA_TRAIN), ids, LLAMA_TRAIN)
    with load_streamed(_skeleton(store), store, slots=1) as h:
        model = _trainable(h.model, LLAMA_TRAIN)

        def boom(module: torch.nn.Module, args: object) -> None:
            raise RuntimeError("boom")

        handle = model.model.layers[2].mlp.register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            model(input_ids=ids)
        handle.remove()
        # PyTorch's own stack of saved-tensor hooks is empty again: nothing of ours is left pushed.
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        model.zero_grad(set_to_none=True)
        _assert_equal(_step(model, ids, LLAMA_TRAIN), want)


def test_backward_after_close_and_a_corrupt_store_are_named(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor, tmp_path: Path) -> None:
    _, store = stores["llama"]
    with load_streamed(_skeleton(store), store, slots=1) as h:
        loss = _trainable(h.model, LLAMA_TRAIN)(input_ids=ids, labels=ids).loss
    with pytest.raises(OffloadError, match=r"layer 3 .*closed; run backward before close\(\)"):
        loss.backward()

    bad = tmp_path / "store"
    shutil.copytree(store, bad)
    m = read_manifest(bad)
    g = m.layers[1]
    with load_streamed(_skeleton(bad), bad, slots=1, verify=True) as h:
        loss = _trainable(h.model, LLAMA_TRAIN)(input_ids=ids, labels=ids).loss
        with open(bad / m.files[g.file].path, "r+b") as fh:  # the drive changes between forward and backward
            fh.seek(g.offset + 100)
            fh.write(b"\xff" * 8)
            os.fsync(fh.fileno())
        with pytest.raises(StoreCorruptError, match=r"layer 1 .*xxh3-64"):
            loss.backward()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("slots", [1, 2])
def test_hf_gradient_checkpointing_recomputes_with_the_streamed_weights(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor,
                                                                       reentrant: bool, slots: int) -> None:  # fmt: skip
    """Backward recomputes each checkpointed layer without its module hooks; the layer's wrapped
    checkpointing function binds it for that (:mod:`gds_offload.weights.streaming.recompute`)."""
    ckpt, store = stores["llama"]
    kw = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}

    def checkpointed(model: torch.nn.Module) -> torch.nn.Module:
        model.gradient_checkpointing_enable(**kw)
        if reentrant:
            model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
        return model.train()

    plain = _step(_resident(ckpt, LLAMA_TRAIN), ids, LLAMA_TRAIN)
    want = _step(checkpointed(_resident(ckpt, LLAMA_TRAIN)), ids, LLAMA_TRAIN)
    _assert_equal(want, plain)  # checkpointing itself changes nothing here
    with load_streamed(_skeleton(store), store, slots=slots) as h:
        model = checkpointed(_trainable(h.model, LLAMA_TRAIN))
        for _ in range(2):  # the second step starts after a backward that recomputed every layer
            model.zero_grad(set_to_none=True)
            _assert_equal(_step(model, ids, LLAMA_TRAIN), want)
        s = h.stats()
        assert s.loads == [4] * LAYERS and s.backward_reads == [0] * LAYERS  # each layer: a forward and a recompute per step
        # At each turn (forward -> recompute -> next forward) the last `slots` layers are used
        # again from their slots: each step reads every layer twice less `slots` twice.
        assert s.misses == 0 and s.reused == 3 * slots and sum(s.reads) == slots + 2 * 2 * (LAYERS - slots)
    import functools

    # close() put Hugging Face's own checkpointing functions back (partials of torch's checkpoint).
    funcs = [m._gradient_checkpointing_func for m in h.model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert len(funcs) >= LAYERS and all(isinstance(f, functools.partial) for f in funcs)


def _checkpointed(model: torch.nn.Module) -> torch.nn.Module:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_gradient_checkpointing_with_a_slow_drive(monkeypatch: pytest.MonkeyPatch, stores: dict[str, tuple[Path, Path]],
                                                 ids: torch.Tensor, slots: int) -> None:  # fmt: skip
    """Every read is still in flight when its layer is called (forward and recompute), while the
    layers kept in their slots at each turn are used at once: both kinds of fill in one step."""
    import gds_offload.io.posix as posix_mod

    ckpt, store = stores["llama"]
    want = _step(_checkpointed(_resident(ckpt, LLAMA_TRAIN)), ids, LLAMA_TRAIN)
    real = os.preadv

    def slow_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        time.sleep(0.03)
        return real(fd, buffers, offset)

    with load_streamed(_skeleton(store), store, slots=slots) as h:
        model = _checkpointed(_trainable(h.model, LLAMA_TRAIN))
        monkeypatch.setattr(posix_mod.os, "preadv", slow_preadv)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            _assert_equal(_step(model, ids, LLAMA_TRAIN), want)
        assert h.stats().misses == 0 and h.stats().reused == 3 * slots


def test_a_checkpointed_forward_without_backward_then_inference(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor) -> None:
    """The layers kept for a recompute that never comes: the next forward is a miss, not wrong."""
    ckpt, store = stores["llama"]
    ref = _checkpointed(_resident(ckpt, LLAMA_TRAIN))
    want_loss = ref(input_ids=ids, labels=ids).loss.detach()
    with torch.no_grad():
        want = ref.eval()(ids).logits
    with load_streamed(_skeleton(store), store, slots=2) as h:
        model = _checkpointed(_trainable(h.model, LLAMA_TRAIN))
        assert torch.equal(model(input_ids=ids, labels=ids).loss.detach(), want_loss)  # no backward
        with torch.no_grad():
            assert torch.equal(model.eval()(ids).logits, want)
            assert torch.equal(model(ids).logits, want)
        s = h.stats()
    assert s.misses == 1 and s.wasted_reads == 0  # the kept layers were no reads


@pytest.mark.parametrize("slots", [1, 2])
def test_two_checkpointed_forwards_then_one_backward(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor, slots: int) -> None:
    """Accumulating two losses before backward: the recomputes of both forwards follow the
    second forward, in whatever order autograd runs them; the predictions miss, nothing is wrong."""
    ckpt, store = stores["llama"]
    other = torch.roll(ids, 1, dims=1)

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = model(input_ids=ids, labels=ids).loss + model(input_ids=other, labels=other).loss
        loss.backward()
        params = dict(model.named_parameters())
        return loss.detach(), {n: params[n].grad.clone() for n in LLAMA_TRAIN}

    want = step(_checkpointed(_resident(ckpt, LLAMA_TRAIN)))
    with load_streamed(_skeleton(store), store, slots=slots) as h:
        model = _checkpointed(_trainable(h.model, LLAMA_TRAIN))
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            _assert_equal(step(model), want)
        assert h.stats().loads == [8] * LAYERS  # two forwards and two recomputes per step


def test_lora_with_gradient_checkpointing_equals_resident(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor) -> None:
    ckpt, store = stores["llama"]
    runs = []
    for streamed in (False, True):
        if streamed:
            h = load_streamed(_peft_skeleton(store, _lora(init_lora_weights="gaussian")), store, slots=1)
            model = h.model
        else:
            model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(ckpt), _lora(init_lora_weights="gaussian"))
        torch.manual_seed(4)
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                if p.requires_grad:
                    p.normal_(std=0.05)
        model.gradient_checkpointing_enable()
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append(([loss.detach()], {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        if streamed:
            h.close()
    assert torch.equal(runs[0][0][0], runs[1][0][0]) and runs[0][1].keys() == runs[1][1].keys()
    for n in runs[0][1]:
        assert torch.equal(runs[0][1][n], runs[1][1][n]), n


def test_saved_tensor_hooks_disabled_is_a_clear_error(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor) -> None:
    _, store = stores["llama"]
    with load_streamed(_skeleton(store), store) as h:
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"), pytest.raises(ConfigError, match="no hooks here"):
            h(ids)
        with torch.no_grad():
            h(ids)  # and the model still works


def test_backward_on_another_thread(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor) -> None:
    ckpt, store = stores["llama"]
    want = _step(_resident(ckpt, LLAMA_TRAIN), ids, LLAMA_TRAIN)
    with load_streamed(_skeleton(store), store, slots=1) as h:
        model = _trainable(h.model, LLAMA_TRAIN)
        loss = model(input_ids=ids, labels=ids).loss
        t = threading.Thread(target=loss.backward)
        t.start()
        t.join()
        params = dict(model.named_parameters())
        _assert_equal((loss.detach(), {n: params[n].grad for n in LLAMA_TRAIN}), want)


# ---- LoRA adapters (PEFT) on streamed layers: gds_offload.weights.streaming.adapters -------------------

LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


def _lora(**kw: object) -> peft.LoraConfig:
    return peft.LoraConfig(**({"r": 4, "target_modules": LORA_TARGETS, "lora_dropout": 0.0} | kw))


def _peft_skeleton(store: Path, cfg: peft.PeftConfig) -> peft.PeftModel:
    return peft.get_peft_model(_skeleton(store), cfg)


@pytest.mark.parametrize("slots, resident_layers", [(1, 0), (2, 1)])
def test_lora_fine_tuning_equals_resident(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor, tmp_path: Path,
                                          slots: int, resident_layers: int) -> None:  # fmt: skip
    ckpt, store = stores["llama"]
    ref = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(ckpt), _lora())
    with load_streamed(_peft_skeleton(store, _lora()), store, slots=slots, resident_layers=resident_layers) as h:
        pm = h.model
        # lora_B starts at zero; give both the same non-zero adapters so every gradient is exercised.
        torch.manual_seed(3)
        start = {k: torch.randn_like(v) * 0.1 for k, v in peft.get_peft_model_state_dict(ref).items()}
        for m in (ref, pm):
            peft.set_peft_model_state_dict(m, start)
        runs = []
        for m in (ref, pm):
            m.train()
            opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            losses = []
            for _ in range(3):
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            runs.append((losses, peft.get_peft_model_state_dict(m)))
        s = h.stats()
        assert _backward(s) == _again(LAYERS - resident_layers, slots, steps=3)
        assert len(runs[0][0]) == len(runs[1][0]) == 3
        for a, b in zip(runs[0][0], runs[1][0], strict=True):
            assert torch.equal(a, b)
        assert runs[0][1].keys() == runs[1][1].keys() and len(runs[0][1]) == 2 * len(LORA_TARGETS) * LAYERS
        for k in runs[0][1]:
            assert torch.equal(runs[0][1][k], runs[1][1][k]), k
        # The trained adapters save with PEFT and load onto the resident model: the same logits.
        pm.save_pretrained(tmp_path / "adapters")
        pm.eval()
        with torch.no_grad():
            got = pm(input_ids=ids).logits
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()(input_ids=ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("init", [True, "gaussian", False])
def test_lora_adapters_are_made_real_and_initialised(stores: dict[str, tuple[Path, Path]], init: object) -> None:
    _, store = stores["llama"]
    with load_streamed(_peft_skeleton(store, _lora(init_lora_weights=init)), store) as h:
        adapters = {n: p for n, p in h.model.named_parameters() if "lora_" in n}
        assert len(adapters) == 2 * len(LORA_TARGETS) * LAYERS
        for n, p in adapters.items():
            assert p.device.type == "cpu" and p.requires_grad and torch.isfinite(p).all(), n
            # PEFT's own initialisations: B at zero unless init_lora_weights=False; A random.
            assert bool((p == 0).all()) == ("lora_B" in n and init is not False), n
        # Only the adapters train.
        assert all(("lora_" in n) == p.requires_grad for n, p in h.model.named_parameters() if not p.is_meta)


def test_lora_setups_that_need_base_weights_are_refused(stores: dict[str, tuple[Path, Path]]) -> None:
    _, store = stores["llama"]
    cases = [
        (_lora(init_lora_weights="eva", eva_config=peft.EvaConfig()), r"init_lora_weights='eva' derives the adapter from"),
        (_lora(use_dora=True), r"uses DoRA"),
        (peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]), r"only LoRA adapters"),
    ]
    for cfg, match in cases:
        with pytest.raises(ConfigError, match=match):
            load_streamed(_peft_skeleton(store, cfg), store)
    with pytest.raises(ConfigError, match="pass that to load_streamed"):
        load_streamed(_peft_skeleton(store, _lora()).get_base_model(), store)


def test_lora_example_runs_and_matches_resident(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "examples" / "lora_streamed.py"), "--steps", "2", "--path", str(tmp_path), "--check"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=root)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "losses equal to the resident model's: True" in proc.stdout and "step 1: loss" in proc.stdout


@pytest.mark.parametrize(("slots", "checkpointed"), [(1, False), (LAYERS, False), (LAYERS, True)])
def test_an_in_place_change_to_streamed_weights_is_refused(stores: dict[str, tuple[Path, Path]], ids: torch.Tensor,
                                                           slots: int, checkpointed: bool) -> None:  # fmt: skip
    """The resident model would keep a change its forward makes to a weight (BatchNorm's running
    statistics are the common case); the store would not, so a streamed layer refuses it. The
    changed slot is never used again, even by a ring that keeps layers in their slots (every
    layer fits; a checkpointed forward keeps its last layers for the recompute)."""
    ckpt, store = stores["llama"]
    with torch.no_grad():
        want = _resident(ckpt, ())(ids).logits
    with load_streamed(_skeleton(store), store, slots=slots) as h:
        model = _checkpointed(_trainable(h.model, LLAMA_TRAIN)) if checkpointed else h.model
        norm = h.model.model.layers[1].post_attention_layernorm
        handle = norm.register_forward_pre_hook(lambda m, a: m.weight.add_(1.0))
        with pytest.raises(OffloadError, match=r"layer 1 .*changed its streamed parameters or buffers in place"), torch.set_grad_enabled(checkpointed):
            model(input_ids=ids, labels=ids)
        handle.remove()
        with torch.no_grad():  # the model goes on, with the store's bytes
            assert torch.equal(model.eval()(ids).logits, want) and torch.equal(model(ids).logits, want)


# ---- more Hugging Face architectures, built from configs ------------------------------------
_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)
ARCHS = {
    "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, **_SMALL),  # q/k/v biases
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, sliding_window=4, **_SMALL),
    "gemma": lambda: transformers.GemmaConfig(num_key_value_heads=2, head_dim=16, **_SMALL),  # scaled embeddings (a buffer)
    "phi3": lambda: transformers.Phi3Config(num_key_value_heads=2, pad_token_id=0, **_SMALL),  # fused qkv and gate/up
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**_SMALL),  # checkpoint names renamed at load (embed_out -> lm_head)
    "opt": lambda: transformers.OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
                                          max_position_embeddings=64, word_embed_proj_dim=64),  # model.decoder.layers
    "falcon": lambda: transformers.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_architectures_stream_and_backward_exactly(arch: str, ids: torch.Tensor, tmp_path: Path) -> None:
    import accelerate

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(ARCHS[arch]()).save_pretrained(tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "store")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    embed = next(n for n, _ in ref.named_parameters())  # the input embedding: its gradient crosses every layer
    with torch.no_grad():
        want_logits = ref(ids).logits
    want = _step(_trainable(ref, (embed,)), ids, (embed,))
    with accelerate.init_empty_weights():  # keeps computed buffers (Gemma's embedding scale) real
        skeleton = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "store")).eval()
    with load_streamed(skeleton, tmp_path / "store", slots=1) as h:
        with torch.no_grad():
            assert torch.equal(h(ids).logits, want_logits)
        _assert_equal(_step(_trainable(h.model, (embed,)), ids, (embed,)), want)
        s = h.stats()
        assert _backward(s) == _again(3, 1)
