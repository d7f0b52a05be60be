"""One ``gds-offload bench-finetune --full`` mode, measured in its own process:
``python -m gds_offload.bench.weights.full_child SPEC_JSON`` (started by
:mod:`gds_offload.bench.weights.full`, which puts it in its memory group first).

Every weight trains, with AdamW (torch's ``fused=True`` kernel, the same hyperparameters in every mode).
For each micro-batch size: one optimizer step not measured, then ``steps`` measured ones, each
over ``micro_batches`` micro-batches of ``batch`` sequences (seeded random tokens, the same in
every mode). One JSON line per micro-batch size
(:class:`~gds_offload.bench.weights.full.FullResult`): the median step time, the bytes this
process read from and wrote to storage per step (``/proc/self/io``), its peak RSS, the losses
(exact, ``float.hex``) and an xxh3 of every weight after the steps.

Per mode:

* ``resident``: ``from_pretrained``, tensors copied into the process's own memory; per
  micro-batch ``loss.backward()``, then ``optimizer.step()``, ``zero_grad()``. The weights'
  hash is taken over ``save_pretrained``'s safetensors files.
* ``drive``: a meta skeleton, :func:`~gds_offload.weights.load_streamed` (``verify=False``), and
  :class:`~gds_offload.weights.train.trainer.StreamedTrainer` with a training directory of its own
  (removed afterwards); ``trainer.step(micro_batches, per_load=...)``. The hash is taken over
  :func:`~gds_offload.weights.export`'s files of the last step.
* ``deepspeed-infinity``: ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on NVMe
  (ZeRO-Infinity) on DeepSpeed's CPU accelerator, one process with gloo, its AdamW
  (``DeepSpeedCPUAdam``), ``gradient_accumulation_steps = micro_batches``; per micro-batch
  ``engine.backward(loss)`` and ``engine.step()``. DeepSpeed scales each micro-batch's loss by
  ``1 / micro_batches`` for backward and updates with its own fused Adam, so its losses are
  compared with resident's (the largest difference), not its weights.
"""
from __future__ import annotations

import functools
import os
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gds_offload.bench.weights.bench import serve_rows
from gds_offload.bench.weights.child import own_memory, peak_rss, read_bytes
from gds_offload.bench.weights.full import FullResult, FullSpec
from gds_offload.bench.weights.peer_loaders import deepspeed_config, deepspeed_nvme_dir
from gds_offload.weights import export, load_streamed
from gds_offload.weights.train.trainer import StreamedTrainer

__all__ = ["run_child", "safetensors_xxh3", "written_bytes"]

_Step = Callable[[list[Any]], list[float]]


def written_bytes() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("write_bytes:"))


def safetensors_xxh3(folder: Path) -> str:
    """xxh3-64 over every tensor of the safetensors files in ``folder``: name, dtype, shape and
    bytes, in name order (one tensor in memory at a time)."""
    import torch
    import xxhash
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            where |= {k: f for k in fh.keys()}  # noqa: SIM118 - safe_open has keys(), no iteration
    h = xxhash.xxh3_64()
    for name in sorted(where):
        with safe_open(str(where[name]), framework="pt") as fh:
            t = fh.get_tensor(name)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _adamw(spec: FullSpec) -> Callable[[list[Any]], Any]:
    import torch

    # torch's fused CPU kernel, its fastest AdamW (DeepSpeed steps with its own vectorised one); per tensor, so per layer alike.
    return functools.partial(torch.optim.AdamW, lr=spec.lr, weight_decay=spec.weight_decay, fused=True)


def _resident(spec: FullSpec) -> tuple[_Step, Callable[[], str], Callable[[], None], dict[str, Any]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(spec.checkpoint)
    own_memory(model)
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    opt = _adamw(spec)(list(model.parameters()))

    def step(batches: list[Any]) -> list[float]:
        losses = []
        for b in batches:
            loss = model(**b).loss
            loss.backward()
            losses.append(float(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return losses

    def weights() -> str:
        out = Path(spec.workdir) / f"full-resident-{os.getpid()}"
        try:
            model.save_pretrained(out)
            return safetensors_xxh3(out)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    return step, weights, lambda: None, {}


def _drive(spec: FullSpec) -> tuple[_Step, Callable[[], str], Callable[[], None], dict[str, Any]]:
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(spec.store)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(cfg)
    lm = load_streamed(skeleton, spec.store, tier="drive", slots=spec.slots, verify=False)
    train_dir = Path(spec.workdir) / f"full-train-{os.getpid()}"
    trainer = StreamedTrainer(lm, _adamw(spec), state_dir=train_dir)
    lm.model.train()

    def step(batches: list[Any]) -> list[float]:
        return [float(x) for x in trainer.step(batches, per_load=spec.per_load)]

    def weights() -> str:
        out = Path(spec.workdir) / f"full-export-{os.getpid()}"
        try:
            export(spec.store, out, train_dir=train_dir)
            return safetensors_xxh3(out)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def close() -> None:
        trainer.close()
        lm.close()
        shutil.rmtree(train_dir, ignore_errors=True)

    s = lm.stats()
    return step, weights, close, {"slots": s.slots, "per_load": spec.per_load, "streamed_layers": len(s.streamed_layers)}


def layer_numel(model_config: Any) -> int:
    """The elements of one Llama-shaped decoder layer (attention, MLP, two norms)."""
    h, inter = model_config.hidden_size, model_config.intermediate_size
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or h // heads
    kv = (getattr(model_config, "num_key_value_heads", None) or heads) * head_dim
    return h * heads * head_dim * 2 + 2 * h * kv + 3 * h * inter + 2 * h


def deepspeed_infinity_config(model_config: Any, nvme: Path, spec: FullSpec, batch: int) -> dict[str, Any]:
    """ZeRO-Infinity: :func:`~gds_offload.bench.weights.peer_loaders.deepspeed_config`'s stage 3 with
    parameters on NVMe, plus the optimizer state on NVMe and DeepSpeed's AdamW with the same
    hyperparameters as the other modes."""
    ds = deepspeed_config(model_config, nvme)
    ds["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True, "buffer_count": 4}
    # DeepSpeed's default sub-group (1e9 elements) holds this whole model: the optimizer's NVMe swapper
    # then pins buffer_count buffers and a gradient buffer of every parameter (about 5 x the fp32
    # weights, over 20 GiB here). Sub-groups of one decoder layer's elements, as DeepSpeed's docs
    # advise for NVMe offload, swap a layer at a time, as the streamed trainer does.
    ds["zero_optimization"]["sub_group_size"] = layer_numel(model_config)
    ds |= {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": spec.micro_batches,
           "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "weight_decay": spec.weight_decay, "betas": [0.9, 0.999], "eps": 1e-8}}}  # fmt: skip
    return ds


def _deepspeed(spec: FullSpec, batch: int) -> tuple[_Step, Callable[[], str], Callable[[], None], dict[str, Any]]:
    for k, v in {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cfg = transformers.AutoConfig.from_pretrained(spec.checkpoint)
    nvme = deepspeed_nvme_dir(spec.workdir)
    nvme.mkdir(parents=True, exist_ok=True)
    ds = deepspeed_infinity_config(cfg, nvme, spec, batch)
    keep = HfDeepSpeedConfig(ds)  # must live while the model is built: from_pretrained then uses zero.Init
    model = transformers.AutoModelForCausalLM.from_pretrained(spec.checkpoint, dtype=cfg.dtype)
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)[0]
    engine.train()

    def step(batches: list[Any]) -> list[float]:
        losses = []
        for b in batches:
            loss = engine(**b).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        return losses

    def close() -> None:
        del keep.config
        engine.destroy()
        shutil.rmtree(nvme, ignore_errors=True)

    return step, lambda: "", close, {"ds_config": ds, "optimizer": type(engine.optimizer.optimizer).__name__}


def run_child(spec: FullSpec) -> Iterator[FullResult]:
    """Measure ``spec.mode`` in this process (see the module doc); yields each micro-batch size's
    result as soon as it is measured."""
    import torch
    import transformers

    vocab = int(transformers.AutoConfig.from_pretrained(spec.checkpoint).vocab_size)
    for batch in spec.batch_sizes:
        r = FullResult(spec.mode, batch, torch_threads=torch.get_num_threads(), micro_batches=spec.micro_batches)
        t = time.perf_counter()
        try:
            if spec.mode == "resident":
                step, weights, close, r.settings = _resident(spec)
            elif spec.mode == "drive":
                step, weights, close, r.settings = _drive(spec)
            elif spec.mode == "deepspeed-infinity":
                step, weights, close, r.settings = _deepspeed(spec, batch)
            else:
                raise ValueError(f"mode {spec.mode!r} unknown; expected resident, drive or deepspeed-infinity")
            r.load_s = time.perf_counter() - t
            g = torch.Generator().manual_seed(spec.seed + batch)
            times: list[float] = []
            reads: list[int] = []
            writes: list[int] = []
            for _ in range(1 + spec.steps):  # the first is a warm-up
                batches = []
                for _ in range(spec.micro_batches):
                    ids = torch.randint(0, vocab, (batch, spec.seq_len), generator=g)
                    batches.append({"input_ids": ids, "labels": ids})
                r0, w0, t0 = read_bytes(), written_bytes(), time.perf_counter()
                losses = step(batches)
                times.append(time.perf_counter() - t0)
                reads.append(read_bytes() - r0)
                writes.append(written_bytes() - w0)
                r.losses += [x.hex() for x in losses]
            step_s = statistics.median(times[1:])
            r.step_s, r.tokens_per_s = step_s, spec.micro_batches * batch * spec.seq_len / step_s
            r.read_bytes_per_step = int(statistics.median(reads[1:]))
            r.written_bytes_per_step = int(statistics.median(writes[1:]))
            r.weights_xxh3 = weights() or None
            r.peak_rss_bytes = peak_rss()
            close()
        except Exception as exc:  # noqa: BLE001 - reported as this mode's result (e.g. a peer that cannot run here)
            r.status, r.error = "error", f"{type(exc).__name__}: {exc}"[:500]
            yield r
            return
        yield r


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return serve_rows(argv, "gds_offload.bench.weights.full_child", FullSpec, run_child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
