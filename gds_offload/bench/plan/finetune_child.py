"""One fine-tuning mode of ``gds-offload bench-plan --workload finetune`` in a child process (the
protocol: :mod:`gds_offload.bench.procs`; the parent: :mod:`gds_offload.bench.plan.finetune`).

Every mode trains the same LoRA adapters (rank ``lora_r``, ``lora_alpha = 2 r``, every linear layer
of the decoder, no dropout: what the planner's profile measured) with AdamW (``foreach=False``) on
the same sequences: ``steps`` optimizer steps of ``global_batch`` sequences of ``seq`` tokens, each
step accumulated over micro-batches of ``micro_batch`` sequences, every micro-batch's loss divided
by their number (the mean). The adapters start from the same seeded normal draw (so ``lora_B`` is
not zero and every gradient is exercised). Modes:

* ``resident``: the model in memory (``from_pretrained``, :func:`~gds_offload.weights.as_reference`),
  ordinary accumulation (forward and backward of one micro-batch after another): the reference and
  the ceiling;
* ``naive``: ``load_streamed(slots=2)``, ordinary accumulation: every micro-batch reads every layer
  in forward and again in backward;
* ``planned``: ``load_streamed(plan=)`` and :func:`~gds_offload.weights.run.accumulate.accumulate` with
  the plan's ``per_load`` micro-batches per weight load.

``naive`` and ``planned`` offload what autograd saves through :func:`gds_offload.attach` when the
plan says so (``offload_activations``), so the two differ only in the weight loads. The result:
time per step, tokens trained on per second, the store's bytes per step, the peak, and the losses
(``float.hex``) and an xxh3 of the adapters after the last step, which the parent compares with
the resident mode's.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import gds_offload
from gds_offload.bench import procs
from gds_offload.bench.weights.child import peak_rss
from gds_offload.weights import Plan, as_reference, load_streamed

__all__ = ["FinetuneChildSpec", "run"]

MODES = ("resident", "naive", "planned")


@dataclass(frozen=True)
class FinetuneChildSpec:
    """One child's work (see the module doc)."""

    mode: str
    store: str
    checkpoint: str
    workdir: str
    seq: int
    global_batch: int
    micro_batch: int
    steps: int
    lora_r: int = 8
    per_load: int = 1
    slots: int = 2
    offload_activations: bool = False
    plan: dict[str, Any] | None = None
    seed: int = 0
    #: Keyword arguments of :func:`gds_offload.attach` beyond ``path`` (the defaults if empty).
    attach: dict[str, Any] = field(default_factory=dict)


def step_batches(vocab: int, spec: FinetuneChildSpec, step: int) -> list[dict[str, torch.Tensor]]:
    """Step ``step``'s micro-batches: random tokens (seeded by the step), labels equal to the inputs."""
    g = torch.Generator().manual_seed(spec.seed * 100_003 + step)
    ids = torch.randint(0, vocab, (spec.global_batch, spec.seq), generator=g)
    return [{"input_ids": m, "labels": m} for m in ids.split(spec.micro_batch)]


def _load(spec: FinetuneChildSpec) -> tuple[Any, Any]:
    """``(PEFT model, StreamedModel or None)`` for ``spec.mode``."""
    import peft
    import transformers

    lora = peft.LoraConfig(r=spec.lora_r, lora_alpha=2 * spec.lora_r, target_modules="all-linear", lora_dropout=0.0)
    if spec.mode == "resident":
        return peft.get_peft_model(as_reference(transformers.AutoModelForCausalLM.from_pretrained(spec.checkpoint)), lora), None
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(spec.store))
    model = peft.get_peft_model(skeleton, lora)
    if spec.mode == "planned":
        assert spec.plan is not None, "the planned mode runs the plan made before it (uncapped, as gds-offload plan is run)"
        return model, load_streamed(model, spec.store, plan=Plan.from_dict(spec.plan))
    return model, load_streamed(model, spec.store, slots=spec.slots)


def _adapters(model: Any) -> list[tuple[str, torch.Tensor]]:
    return sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)


def _adapter_hash(model: Any) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    for _, p in _adapters(model):
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def run(spec: FinetuneChildSpec) -> dict[str, Any]:
    """Train ``spec.steps`` optimizer steps in this process (see the module doc); the result row."""
    if spec.mode not in MODES:
        raise ValueError(f"mode {spec.mode!r} unknown; expected one of {MODES}")
    t_load = time.perf_counter()
    model, lm = _load(spec)
    load_s = time.perf_counter() - t_load
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        for _, p in _adapters(model):
            p.normal_(std=0.02)
    opt = torch.optim.AdamW([p for _, p in _adapters(model)], lr=1e-3, foreach=False)
    model.train()
    vocab = model.config.vocab_size
    k = -(-spec.global_batch // spec.micro_batch)

    def loss(out: Any, _batch: Any) -> torch.Tensor:
        return out.loss / k

    off = None
    if spec.offload_activations and lm is not None:
        spill = Path(spec.workdir) / f"spill-{os.getpid()}"
        off = gds_offload.attach(lm.model, path=spill, **spec.attach)
    losses: list[str] = []
    step_s: list[float] = []
    read0 = lm.stats().bytes_read if lm is not None else 0
    try:
        for step in range(spec.steps):
            batches = step_batches(vocab, spec, step)
            t0 = time.perf_counter()
            if spec.mode == "planned":
                got = lm.accumulate(batches, per_load=spec.per_load, loss=loss, seed=spec.seed)
            else:
                got = []
                for b in batches:
                    value = loss(model(**b), b)
                    value.backward()
                    got.append(value.detach())
            if off is not None:
                off.synchronize()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step_s.append(time.perf_counter() - t0)
            losses.extend(float(x).hex() for x in got)
        spilled = off.stats().bytes_offloaded if off is not None else 0
    finally:
        if off is not None:
            off.detach()  # deletes the spill files; the directory attach() made for them goes too
            with contextlib.suppress(OSError):
                spill.rmdir()
    trained = spec.steps * spec.global_batch * spec.seq
    out: dict[str, Any] = {"mode": spec.mode, "load_s": load_s, "step_s": step_s, "total_s": sum(step_s), "tokens": trained,
                           "tokens_per_s": trained / sum(step_s), "micro_batch": spec.micro_batch, "per_load": spec.per_load,
                           "micro_batches_per_step": k, "offload_activations": spec.offload_activations, "losses": losses,
                           "adapters_xxh3": _adapter_hash(model), "peak_rss_bytes": peak_rss(), "steps": spec.steps}  # fmt: skip
    if lm is not None:
        s = lm.stats()
        out |= {"bytes_read_per_step": (s.bytes_read - read0) / spec.steps, "activation_bytes_written_per_step": spilled / spec.steps, "slots": s.slots, "resident_layers": len(s.resident_layers)}
        lm.close()
    if spec.plan is not None:
        pred = spec.plan["predicted"]
        out["predicted"] = {"tokens_per_s": pred["tokens_per_s"], "peak_bytes": pred["peak_nbytes"], "bound": pred["bound"],
                            "bytes_read_per_step": pred["bytes_read"] / max(-(-spec.plan["workload"]["sequences"] // spec.global_batch), 1)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    spec = FinetuneChildSpec(**json.loads(procs.read_spec(argv, "gds_offload.bench.plan.finetune_child", "one fine-tuning mode of gds-offload bench-plan")))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    procs.emit({"event": "result", "result": run(spec)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
