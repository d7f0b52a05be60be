"""attach() on real Hugging Face models (built from small configs, random weights, nothing
downloaded) and the Trainer callback: layers found automatically, training bit-identical."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

import gds_offload  # noqa: E402
from gds_offload.errors import ConfigError  # noqa: E402

VOCAB, SEQ, BATCH = 128, 32, 2


def _llama(attn: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg)


def _gpt2(attn: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return GPT2LMHeadModel(cfg)


MODELS = {"llama": (_llama, ["model.layers.0", "model.layers.1"]), "gpt2": (_gpt2, ["transformer.h.0", "transformer.h.1"])}


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _train(model: torch.nn.Module, steps: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Losses of each step and the last step's gradients (dropout seeded per step)."""
    model.train()
    losses, grads = [], []
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(10 + i)
        loss = model(input_ids=_ids(i), labels=_ids(i)).loss
        loss.backward()
        losses.append(loss.detach().clone())
        grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    return losses, grads


def _assert_same(ref, got) -> None:
    assert len(ref[0]) == len(got[0]), f"{len(got[0])} losses, the reference has {len(ref[0])}"
    for a, b in zip(ref[0], got[0], strict=True):
        assert torch.equal(a, b), (a.item(), b.item())
    assert len(ref[1]) == len(got[1])
    for i, (a, b) in enumerate(zip(ref[1], got[1], strict=True)):
        assert (a is None) == (b is None), f"gradient {i}: one is None"
        assert a is None or torch.equal(a, b), f"gradient {i} differs"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_model_bit_identical(name: str, attn: str, tmp_path) -> None:
    build, layer_names = MODELS[name]
    ref = _train(build(attn))
    model = build(attn)
    with gds_offload.attach(model, path=tmp_path, mode="posix", min_bytes=0, keep_last=0) as off:
        got = _train(model)
        off.synchronize()  # bytes_offloaded counts the writes that completed: all of them, whatever the drive's pace
        st = off.stats()
    assert off.layer_names == layer_names
    _assert_same(ref, got)
    assert st.bytes_offloaded > 0 and st.bytes_read + st.bytes_forwarded > 0, st


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_gradient_checkpointing_bit_identical(name: str, tmp_path) -> None:
    build, layer_names = MODELS[name]

    def make() -> torch.nn.Module:
        m = build("sdpa")
        if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.x's name
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    ref = _train(make())
    model = make()
    with gds_offload.attach(model, path=tmp_path, mode="posix", min_bytes=0, keep_last=0) as off:
        got = _train(model)
        off.synchronize()  # bytes_offloaded counts the writes that completed: all of them, whatever the drive's pace
        st = off.stats()
    assert off.layer_names == layer_names
    _assert_same(ref, got)
    assert st.bytes_packed > 0


# ---------------------------------------------------------------------- Trainer
class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(100 + i))
        return {"input_ids": ids, "labels": ids}


def _trainer_run(tmp_path, callbacks):
    from transformers import Trainer, TrainingArguments

    model = _gpt2("sdpa")
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks)
    out = trainer.train()
    return model, trainer, out


class _Settle(transformers.TrainerCallback):
    """Lets every write of a step land before the step's figures are logged: bytes_offloaded
    counts completed writes, and a slow drive may still hold some at log time."""

    def __init__(self, cb) -> None:  # noqa: ANN001
        self.cb = cb

    def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001, ANN003
        if self.cb.offloader is not None:
            self.cb.offloader.synchronize()


def test_trainer_callback_is_exact_and_logs(tmp_path) -> None:
    from gds_offload.integrations.transformers import LOG_PREFIX, OffloadCallback

    ref_model, ref_trainer, ref_out = _trainer_run(tmp_path / "ref", None)
    cb = OffloadCallback(path=str(tmp_path), mode="posix", min_bytes=0, keep_last=0)
    model, trainer, out = _trainer_run(tmp_path / "off", [cb, _Settle(cb)])
    assert out.training_loss == ref_out.training_loss
    ref_losses = [e["loss"] for e in ref_trainer.state.log_history if "loss" in e]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses == ref_losses and len(losses) == 2
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), f"parameter {n} differs"
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert all(e[LOG_PREFIX + "offloaded_mib"] > 0 for e in logged)
    assert logged[-1][LOG_PREFIX + "steps"] == 2
    # a handful of named figures, not the raw counters
    figures = sorted(k.removeprefix(LOG_PREFIX) for k in logged[-1] if k.startswith(LOG_PREFIX))
    assert figures == ["fallback_mib", "io_hidden", "io_wait_s", "kept_mib", "offloaded_mib", "peak_resident_mib", "steps"]
    assert 0.0 <= logged[-1][LOG_PREFIX + "io_hidden"] <= 1.0
    # detached at the end: nothing left on the model, final stats kept
    assert cb.offloader is None and gds_offload.offloader_of(model) is None
    assert cb.final_stats is not None and cb.final_stats.bytes_read + cb.final_stats.bytes_forwarded > 0


def test_trainer_callback_install_goes_first(tmp_path) -> None:
    from transformers import Trainer, TrainingArguments

    from gds_offload.integrations.transformers import OffloadCallback

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1)
    trainer = Trainer(model=_gpt2("sdpa"), args=args, train_dataset=_Tokens())
    cb = OffloadCallback.install(trainer, mode="host")
    assert trainer.callback_handler.callbacks[0] is cb


def test_callback_refuses_unknown_arguments() -> None:
    from gds_offload.integrations.transformers import OffloadCallback

    with pytest.raises(ConfigError, match="min_byte"):
        OffloadCallback(min_byte=0)
