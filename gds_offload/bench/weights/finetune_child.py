"""One ``gds-offload bench-finetune`` mode, measured in its own process:
``python -m gds_offload.bench.weights.finetune_child SPEC_JSON`` (started by
:mod:`gds_offload.bench.weights.finetune`, which puts it in its memory group, then writes one
line to its stdin to let it go).

The child loads the model its mode's way with LoRA adapters from PEFT on the attention
projections (with Hugging Face gradient checkpointing if the spec asks), gives every adapter the same values (a seeded normal draw in name order, so
``lora_B`` is not zero and every gradient is exercised), then for each batch size: one AdamW
step not measured, then ``steps`` measured ones on the same sequences. It prints one JSON line
per batch size (:class:`~gds_offload.bench.weights.finetune.StepResult`): the median step time,
the bytes this process read from storage per step (``/proc/self/io``), the streamed modes'
counters, its peak RSS, and the losses (exact, as ``float.hex``) and an xxh3 of the adapters
after the batch, for the parent to compare with the resident mode's.

Loading, per mode (as :mod:`gds_offload.bench.weights.child`, then ``peft.get_peft_model``):

* ``resident``: ``from_pretrained``, tensors copied into the process's own memory;
* ``drive`` / ``host``: the PEFT model of a meta skeleton, then :func:`~gds_offload.weights.load_streamed`;
* ``accelerate-disk``: ``from_pretrained(device_map={layers: "disk", ...}, offload_folder=...)``,
  then PEFT, as Accelerate's and PEFT's documentation describe for a model larger than memory.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gds_offload.bench.weights.bench import serve_rows
from gds_offload.bench.weights.child import own_memory, peak_rss, read_bytes
from gds_offload.bench.weights.finetune import FinetuneSpec, StepResult
from gds_offload.weights import load_streamed

__all__ = ["run_child"]


def _lora(spec: FinetuneSpec) -> Any:
    import peft

    return peft.LoraConfig(r=spec.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)


def _load(spec: FinetuneSpec) -> tuple[Any, Any]:
    """``(PEFT model, StreamedModel or None)`` for ``spec.mode``."""
    import peft
    import torch
    import transformers

    if spec.mode == "resident":
        model = transformers.AutoModelForCausalLM.from_pretrained(spec.checkpoint)
        own_memory(model)
        return peft.get_peft_model(model, _lora(spec)), None
    if spec.mode in ("drive", "host"):
        cfg = transformers.AutoConfig.from_pretrained(spec.store)
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(cfg)
        pm = peft.get_peft_model(skeleton, _lora(spec))
        return pm, load_streamed(pm, spec.store, tier=spec.mode, slots=spec.slots)  # type: ignore[arg-type]
    if spec.mode == "accelerate-disk":
        cfg = transformers.AutoConfig.from_pretrained(spec.checkpoint)
        device_map: dict[str, Any] = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        device_map |= {f"model.layers.{i}": "disk" for i in range(cfg.num_hidden_layers)}
        folder = Path(spec.workdir) / f"accelerate-offload-{os.getpid()}"
        model = transformers.AutoModelForCausalLM.from_pretrained(spec.checkpoint, device_map=device_map, offload_folder=str(folder))
        own_memory(model)
        return peft.get_peft_model(model, _lora(spec)), None
    raise ValueError(f"mode {spec.mode!r} unknown; expected resident, drive, host or accelerate-disk")


def _adapters(model: Any) -> list[tuple[str, Any]]:
    return sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)


def _adapter_hash(model: Any) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    for _, p in _adapters(model):
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_child(spec: FinetuneSpec) -> Iterator[StepResult]:
    """Measure ``spec.mode`` in this process (see the module doc); yields each batch size's result
    as soon as it is measured (a child killed by its memory cap keeps the smaller ones)."""
    import torch

    t = time.perf_counter()
    model, handle = _load(spec)
    if spec.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    load_s = time.perf_counter() - t
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        for _, p in _adapters(model):
            p.normal_(std=0.02)
    opt = torch.optim.AdamW([p for _, p in _adapters(model)], lr=1e-3)
    model.train()
    vocab = model.config.vocab_size
    for batch in spec.batch_sizes:
        ids = torch.randint(0, vocab, (batch, spec.seq_len), generator=torch.Generator().manual_seed(spec.seed + batch))
        r = StepResult(spec.mode, batch, load_s=load_s, torch_threads=torch.get_num_threads())
        st0 = handle.stats() if handle else None
        try:
            steps = [_step(model, opt, ids) for _ in range(1 + spec.steps)][1:]  # the first is a warm-up
        except Exception as exc:  # noqa: BLE001 - reported as this mode's result, e.g. Accelerate's meta adapters
            r.status, r.error = "error", f"{type(exc).__name__}: {exc}"[:500]
            yield r
            return
        st1 = handle.stats() if handle else None
        r.step_s = statistics.median(s["s"] for s in steps)
        r.tokens_per_s = batch * spec.seq_len / r.step_s
        r.read_bytes_per_step = int(statistics.median(s["read"] for s in steps))
        r.losses = [s["loss"] for s in steps]
        r.adapters_xxh3 = _adapter_hash(model)
        if st0 is not None and st1 is not None:
            n = 1 + spec.steps
            r.store_bytes_per_step = (st1.bytes_read - st0.bytes_read) / n
            r.backward_reads_per_step = (sum(st1.backward_reads) - sum(st0.backward_reads)) / n
            r.stall_s = (st1.stall_s - st0.stall_s) / n
        r.peak_rss_bytes = peak_rss()
        yield r
    if handle is not None:
        handle.close()


def _step(model: Any, opt: Any, ids: Any) -> dict[str, Any]:
    r0, t0 = read_bytes(), time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"s": time.perf_counter() - t0, "read": read_bytes() - r0, "loss": float(loss).hex()}


def main(argv: list[str] | None = None) -> int:
    return serve_rows(argv, "gds_offload.bench.weights.finetune_child", FinetuneSpec, run_child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
