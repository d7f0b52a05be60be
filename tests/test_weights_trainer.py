"""Full fine-tuning of streamed layers (StreamedTrainer): losses, every weight and the optimizer
state after 3 steps are torch.equal to resident training of the same transformers model with
the same torch.optim class on the same micro-batches; resuming from the drive; every refusal,
before anything is written."""
from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.gates import ENGINES, cuda_test  # noqa: E402
from helpers.llama import VOCAB, llama_config, meta_skeleton, resident_model, save_checkpoint  # noqa: E402

from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.weights import StoreFormatError, convert, export, from_pretrained, load_streamed  # noqa: E402
from gds_offload.weights.train.trainer import StreamedTrainer  # noqa: E402

STEPS = 3
OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw-foreach": functools.partial(torch.optim.AdamW, lr=1e-2, foreach=True),
    "adamw-fused": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
}


@pytest.fixture(scope="module")
def base() -> Path:
    d = real_disk_base() / f"gds_offload-trainer-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ckpt(base: Path) -> Path:
    return save_checkpoint(llama_config(), base / "ckpt")


@pytest.fixture()
def store(base: Path, ckpt: Path, tmp_path: Path) -> Path:
    out = real_disk_base() / f"gds_offload-trainer-store-{os.getpid()}-{tmp_path.name}"
    convert(ckpt, out)
    yield out
    shutil.rmtree(out, ignore_errors=True)


def _batches(micro: int) -> list[list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(micro):
            ids = torch.randint(0, VOCAB, (2, 10), generator=g)
            step.append({"input_ids": ids, "labels": ids})
        out.append(step)
    return out


def _resident(ckpt: Path, optimizer, steps, max_norm, upto: int = STEPS, device: str = "cpu", autocast: torch.dtype | None = None):
    """The reference: every parameter trained, one optimizer, ordinary accumulation; with
    ``autocast``, forward and backward under ``torch.autocast`` (clipping and the step outside)."""
    model = resident_model(ckpt).to(device)
    for p in model.parameters():
        p.requires_grad_(True)
    opt = optimizer(list(model.parameters()))
    losses = []
    for s in steps[:upto]:
        for b in s:
            with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = model(**{k: v.to(device) for k, v in b.items()}).loss
                loss.backward()
            losses.append(loss.detach())
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return model, opt, losses


def _exported(store: Path, out: Path) -> dict[str, torch.Tensor]:
    export(store, out)
    return safetensors_torch.load_file(out / "model.safetensors")


CASES = [
    pytest.param(engine, "adamw", 2, per_load, clip, id=f"{engine}-adamw-accumulate2-per_load{per_load}-clip{clip}")
    for engine in ENGINES for per_load, clip in ((1, None), (2, 0.5))
] + [
    pytest.param("posix", "adamw-foreach", 1, None, None, id="posix-adamw-foreach-no-accumulation"),
    pytest.param("posix", "adamw-fused", 2, 2, None, id="posix-adamw-fused-accumulate2"),
    pytest.param("posix", "adamw-fused", 2, 1, 0.5, id="posix-adamw-fused-accumulate2-per_load1-clip"),
    pytest.param("posix", "sgd-momentum", 2, 2, 0.5, id="posix-sgd-momentum-accumulate2-clip"),
]


@pytest.mark.parametrize(("engine", "opt", "micro", "per_load", "max_norm"), CASES)
def test_full_finetuning_equals_resident_training(ckpt: Path, store: Path, tmp_path: Path, engine: str, opt: str, micro: int,
                                                  per_load: int | None, max_norm: float | None) -> None:  # fmt: skip
    steps = _batches(micro)
    ref, ref_opt, ref_losses = _resident(ckpt, OPTIMIZERS[opt], steps, max_norm)
    with load_streamed(meta_skeleton(store), store, engine=engine, resident_layers=1) as lm:
        trainer = StreamedTrainer(lm, OPTIMIZERS[opt])
        losses = [loss for s in steps for loss in trainer.step(s, per_load=per_load, max_norm=max_norm)]
        assert trainer.step_count == STEPS
        names = dict(ref.named_parameters())
        for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.3.self_attn.q_proj.weight", "model.embed_tokens.weight"):
            want, got = ref_opt.state[names[name]], trainer.state_of(name)  # resident layer 0, streamed layer 3, the resident group
            assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want), name
        trainer.close()
    assert len(losses) == len(ref_losses) and all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert not torch.equal(losses[0], losses[-micro]), "the weights changed between steps"
    weights = _exported(store, tmp_path / "out")
    state = ref.state_dict()
    assert sorted(weights) == sorted(state) and all(torch.equal(weights[k], state[k]) for k in state)


class MatmulSGD(torch.optim.Optimizer):
    """SGD whose step multiplies matrices (as Shampoo's or Muon's do), which autocast would run in bf16."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad @ torch.eye(p.shape[-1], dtype=p.dtype) if p.dim() == 2 else p.grad
                    p.add_(g, alpha=-group["lr"])


@pytest.mark.parametrize(("opt", "per_load", "max_norm"), [("adamw", 1, None), ("adamw", 2, 0.5), ("matmul-sgd", 1, None)],
                         ids=["adamw-per_load1", "adamw-per_load2-clip", "matmul-sgd-updated-in-backward"])  # fmt: skip
def test_mixed_precision_bf16_compute_over_fp32_masters_equals_resident_amp(ckpt: Path, store: Path, tmp_path: Path, opt: str,
                                                                            per_load: int, max_norm: float | None) -> None:  # fmt: skip
    """The second mode: the step inside ``torch.autocast(dtype=torch.bfloat16)``, as resident AMP
    training: bf16 matmuls over the fp32 masters on the drive, fp32 gradients, clipping and updates
    in fp32 (the trainer leaves autocast for them, even when its update runs inside backward: the
    matmul optimizer would otherwise step in bf16)."""
    optimizer = functools.partial(MatmulSGD, lr=0.05) if opt == "matmul-sgd" else OPTIMIZERS[opt]
    steps = _batches(2)
    ref, ref_opt, ref_losses = _resident(ckpt, optimizer, steps, max_norm, autocast=torch.bfloat16)
    _, _, fp32_losses = _resident(ckpt, optimizer, steps, max_norm, upto=1)
    assert ref_losses[0].dtype == torch.float32 and not torch.equal(ref_losses[0], fp32_losses[0]), "autocast computed in bf16"
    with load_streamed(meta_skeleton(store), store, engine="posix", resident_layers=1) as lm:
        trainer = StreamedTrainer(lm, optimizer)
        losses = []
        for s in steps:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses += trainer.step(s, per_load=per_load, max_norm=max_norm)
        name = "model.layers.3.mlp.down_proj.weight"  # a streamed layer's optimizer state, fp32
        want, got = ref_opt.state[dict(ref.named_parameters())[name]], trainer.state_of(name)
        assert set(want) == set(got) and all(got[k].dtype == torch.float32 and torch.equal(want[k], got[k]) for k in want if k != "step")
        trainer.close()
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    weights, state = _exported(store, tmp_path / "out"), ref.state_dict()
    assert all(weights[k].dtype == torch.float32 and torch.equal(weights[k], state[k]) for k in state)


def test_training_resumes_from_the_drive_where_it_stopped(ckpt: Path, store: Path, tmp_path: Path) -> None:
    steps = _batches(2)
    ref, _, ref_losses = _resident(ckpt, OPTIMIZERS["adamw"], steps, None)
    losses = []
    for first, last in ((0, 2), (2, 3)):  # two runs: the second finds step 2 on the drive
        with load_streamed(meta_skeleton(store), store) as lm, StreamedTrainer(lm, OPTIMIZERS["adamw"]) as trainer:
            assert trainer.step_count == first
            losses += [loss for s in steps[first:last] for loss in trainer.step(s)]
    assert len(losses) == len(ref_losses) and all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    weights = _exported(store, tmp_path / "out")
    assert all(torch.equal(weights[k], v) for k, v in ref.state_dict().items())
    assert export(store, tmp_path / "converted", converted=True).step == 0  # the converted store is never written
    original = safetensors_torch.load_file(ckpt / "model.safetensors")
    back = safetensors_torch.load_file(tmp_path / "converted" / "model.safetensors")
    assert all(torch.equal(original[k], back[k]) for k in original)


def test_refusals_come_before_anything_is_written(ckpt: Path, store: Path) -> None:
    adamw = OPTIMIZERS["adamw"]
    with load_streamed(meta_skeleton(store), store, verify=True) as lm:
        with pytest.raises(ConfigError, match="verify=True checks the checksums of the weights load_streamed read"):
            StreamedTrainer(lm, adamw)
    with load_streamed(meta_skeleton(store), store, tier="host") as lm:
        with pytest.raises(ConfigError, match="needs layers streamed from the drive"):
            StreamedTrainer(lm, adamw)
    with load_streamed(meta_skeleton(store), store) as lm:
        with pytest.raises(ConfigError, match="give a callable building a torch.optim.Optimizer"):
            StreamedTrainer(lm, "adamw")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="returned a list, not a torch.optim.Optimizer"):
            StreamedTrainer(lm, lambda params: list(params))  # type: ignore[arg-type,return-value]
        with pytest.raises(ConfigError, match="made 2 parameter groups"):
            StreamedTrainer(lm, lambda ps: torch.optim.SGD([{"params": ps[:1]}, {"params": ps[1:]}], lr=0.1))
        with pytest.raises(ConfigError, match="is LBFGS, whose step needs the whole model's loss"):
            StreamedTrainer(lm, lambda ps: torch.optim.LBFGS(ps))
        with StreamedTrainer(lm, adamw) as trainer:
            with pytest.raises(ConfigError, match="max_norm=-1: give a positive number"):
                trainer.step(_batches(1)[0], max_norm=-1)
    assert not (store / "train").exists()
    peft = pytest.importorskip("peft", reason="peft is not installed")
    lora = peft.get_peft_model(meta_skeleton(store), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with load_streamed(lora, store) as lm:
        with pytest.raises(ConfigError, match="for LoRA adapters use lm.accumulate"):
            StreamedTrainer(lm, adamw)


def test_a_damaged_step_file_is_refused_with_the_fix(ckpt: Path, store: Path) -> None:
    with load_streamed(meta_skeleton(store), store) as lm, StreamedTrainer(lm, OPTIMIZERS["adamw"]) as trainer:
        trainer.step(_batches(1)[0])
    step = store / "train" / "step.json"
    d = json.loads(step.read_text())
    d["groups"].pop("model.layers.2")
    step.write_text(json.dumps(d))
    with pytest.raises(StoreFormatError, match=r"is not a training step of this store .* remove .*train to start again from the store; "
                                               r"or stream the converted weights: load_streamed\(\.\.\., converted=True\)"):
        load_streamed(meta_skeleton(store), store)
    with load_streamed(meta_skeleton(store), store, converted=True) as lm:
        with pytest.raises(StoreFormatError, match=r"is not a training step of this store .* remove .*train to start again"):
            StreamedTrainer(lm, OPTIMIZERS["adamw"])


def test_a_trained_store_streams_its_last_complete_step(ckpt: Path, store: Path, tmp_path: Path) -> None:
    """After StreamedTrainer's steps, load_streamed and from_pretrained stream the last complete step
    (what export writes and transformers' from_pretrained loads; verify=True checks that step's
    checksums), converted=True the converted weights; a trainer in a new directory starts from those."""
    steps = _batches(1)
    with load_streamed(meta_skeleton(store), store) as lm, StreamedTrainer(lm, OPTIMIZERS["adamw"]) as trainer:
        for s in steps[:2]:
            trainer.step(s)
        assert lm.step == 2
    export(store, tmp_path / "trained")
    ids = steps[2][0]["input_ids"]
    with torch.no_grad():
        trained, converted = resident_model(tmp_path / "trained")(ids).logits, resident_model(ckpt)(ids).logits
    assert not torch.equal(trained, converted)
    for kw in ({}, {"verify": True}, {"train_dir": store / "train"}, {"resident_layers": 1}, {"tier": "host"}):
        with load_streamed(meta_skeleton(store), store, **kw) as lm, torch.no_grad():
            assert lm.step == 2 and torch.equal(lm(ids).logits, trained), kw
    with from_pretrained(ckpt, store=store, memory="8GiB") as lm, torch.no_grad():
        assert lm.step == 2 and torch.equal(lm(ids).logits, trained)
    with from_pretrained(ckpt, store=store, memory="8GiB", converted=True) as lm, torch.no_grad():
        assert lm.step == 0 and torch.equal(lm(ids).logits, converted)
    with load_streamed(meta_skeleton(store), store, converted=True, verify=True) as lm, torch.no_grad():
        assert lm.step == 0 and torch.equal(lm(ids).logits, converted)
    with load_streamed(meta_skeleton(store), store) as lm, StreamedTrainer(lm, OPTIMIZERS["adamw"], state_dir=tmp_path / "new"), \
            torch.no_grad():  # fmt: skip
        assert lm.step == 0 and torch.equal(lm(ids).logits, converted)
    with pytest.raises(ConfigError, match=r"train_dir=.*none holds no training step \(no step.json\); pass the directory StreamedTrainer"):
        load_streamed(meta_skeleton(store), store, train_dir=tmp_path / "none")
    with pytest.raises(ConfigError, match="converted=True with train_dir=.*: .*pass one of them"):
        load_streamed(meta_skeleton(store), store, converted=True, train_dir=store / "train")


@cuda_test
def test_full_finetuning_on_cuda_equals_resident_training_on_the_same_gpu(ckpt: Path, store: Path, tmp_path: Path) -> None:
    steps = [[{k: v.cuda() for k, v in b.items()} for b in s] for s in _batches(2)]
    ref, ref_opt, ref_losses = _resident(ckpt, OPTIMIZERS["adamw"], steps, 0.5, device="cuda")
    with load_streamed(meta_skeleton(store), store, device="cuda") as lm, StreamedTrainer(lm, OPTIMIZERS["adamw"]) as trainer:
        losses = [loss for s in steps for loss in trainer.step(s, max_norm=0.5)]
        name = "model.layers.3.self_attn.q_proj.weight"
        want, got = ref_opt.state[dict(ref.named_parameters())[name]], trainer.state_of(name)
        assert all(torch.equal(want[k].cpu(), got[k].cpu()) for k in want)
    assert len(losses) == len(ref_losses) and all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    weights = _exported(store, tmp_path / "out")
    assert all(torch.equal(weights[k], v.cpu()) for k, v in ref.state_dict().items())


def test_convert_check_validates_a_trained_store(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gds_offload.cli import main as cli_main

    with load_streamed(meta_skeleton(store), store) as lm, StreamedTrainer(lm, OPTIMIZERS["adamw"]) as trainer:
        trainer.step(_batches(1)[0])
    assert cli_main(["convert", "--check", str(store)]) == 0
    assert "training step 1: every group and 5 optimizer state files match step.json" in capsys.readouterr().out  # 4 layers, the resident group
    state = store / "train" / "state-0.model.layers.3.bin"
    data = bytearray(state.read_bytes())
    data[10] ^= 0xFF
    state.write_bytes(bytes(data))
    assert cli_main(["convert", "--check", str(store)]) == 1
    assert "state-0.model.layers.3.bin is corrupt" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["backward", "resident update"])
def test_ctrl_c_inside_a_step_leaves_the_last_complete_step(ckpt: Path, store: Path, tmp_path: Path, where: str) -> None:
    """A KeyboardInterrupt in the second step (in a micro-batch's loss, or after the resident
    optimizer changed its tensors) rolls memory back to step 1: steps 1 and 3 then equal
    resident training on those two steps alone."""
    steps = _batches(2)
    ref, _, ref_losses = _resident(ckpt, OPTIMIZERS["adamw"], [steps[0], steps[2]], None, upto=2)
    with load_streamed(meta_skeleton(store), store) as lm, StreamedTrainer(lm, OPTIMIZERS["adamw"]) as trainer:
        losses = trainer.step(steps[0])
        if where == "backward":
            calls = iter(range(10))

            def loss(out, batch):  # the second micro-batch is interrupted
                if next(calls) == 1:
                    raise KeyboardInterrupt
                return out.loss

            with pytest.raises(KeyboardInterrupt):
                trainer.step(steps[1], loss=loss)
        else:
            original = trainer.optimizer.step

            def interrupted(*a, **kw):
                original(*a, **kw)
                raise KeyboardInterrupt

            trainer.optimizer.step = interrupted  # type: ignore[method-assign]
            with pytest.raises(KeyboardInterrupt):
                trainer.step(steps[1])
            trainer.optimizer.step = original  # type: ignore[method-assign]
        assert trainer.step_count == 1
        losses += trainer.step(steps[2])
    assert len(losses) == len(ref_losses) and all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    weights = _exported(store, tmp_path / "out")
    assert all(torch.equal(weights[k], v) for k, v in ref.state_dict().items())
