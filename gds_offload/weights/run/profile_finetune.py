"""Measuring a streamed model for a fine-tuning plan, in this process: LoRA on every linear layer,
one layer's forward with grad and its backward (:mod:`gds_offload.weights.run.profile` measures the rest)."""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gds_offload.weights.planning.workload import Fit
from gds_offload.weights.run.profile import StopWith, check_floor_loaded, loaded, medians, rss, stop_with, time_head
from gds_offload.weights.streaming.adapters import unwrap

__all__ = ["head_train_peak", "profile_finetune"]

def profile_finetune(spec: dict[str, Any], skeleton: Any, cfg: Any, store: Path, device: torch.device, say: Callable[[str], None],
                     stack: contextlib.ExitStack) -> dict[str, Any]:  # fmt: skip
    """The fine-tuning profile: LoRA of rank ``lora_r`` on every linear layer of the decoder; one
    layer's forward with grad and its backward, at one and two sequences of ``seq`` tokens, each
    the median of three runs (one run's times vary by a quarter on a shared machine)."""
    import peft

    seq = spec["seq"]
    model = peft.get_peft_model(skeleton, peft.LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], target_modules="all-linear"))
    lm, stats, reset, peak, base, (nbytes, seconds) = loaded(model, store, device, spec["engine"], "loading the resident group and the adapters", say,
                                                              stack, functools.partial(check_floor_loaded, spec, cfg))  # fmt: skip
    text = cfg.get_text_config(decoder=True)
    vocab = text.vocab_size
    dtype = next(p.dtype for p in lm.model.parameters() if p.dtype.is_floating_point)
    stop = lm.layer_modules()[2].register_forward_pre_hook(stop_with, with_kwargs=True)
    forward, backward, saved_per, transient = [], [], [], []
    lm.model.train()
    for b in (1, 1, 1, 1, 2, 2, 2):  # the first run warms up
        say(f"forward and backward of {b} x {seq} tokens")
        ids = torch.randint(0, vocab, (b, seq), device=device)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            if t.layout == torch.strided and not t.is_meta:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        before = lm.stats().compute_s
        rss0 = peak() if device.type == "cuda" else rss("VmRSS")
        reset()
        hidden = None
        call: Any = lm.model
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            try:
                call(input_ids=ids)
            except StopWith as exc:
                hidden = exc.hidden
        assert hidden is not None, "the profile's stop did not run"
        after = lm.stats().compute_s
        stalled = lm.stats().stall_s
        start = time.perf_counter()
        hidden.float().square().mean().backward()
        # The compute: this stop leaves no layer in the ring for backward, which waits for its reads
        # (in a whole pass they overlap the layer above's backward, as the planner models).
        bwd = time.perf_counter() - start - (lm.stats().stall_s - stalled)
        mem = max(peak() - rss0, 0)
        tokens = b * seq
        forward.append((tokens, (after[0] - before[0] + after[1] - before[1]) / 2))
        backward.append((tokens, bwd / 2))
        saved_per.append(sum(saved.values()) / (2 * tokens))
        transient.append(max(mem - sum(saved.values()), 0) / tokens)
        lm.model.zero_grad(set_to_none=True)
    stop.remove()
    assert hidden is not None
    say(f"the head and loss of 1 x {seq} tokens, forward and backward")
    # Measured in this process, small allocations may come from heap memory freed earlier and add
    # nothing to its resident set; the head holds at least its logits and their gradient.
    head_train = max(head_train_peak(lm.model, hidden[:1], vocab, device, reset, peak), 2.0 * vocab * 4)
    forward, backward = medians(forward[1:]), medians(backward[1:])
    head = time_head(call, cfg, dtype, device, sizes=[64, 256])
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = 2 * (getattr(text, "num_key_value_heads", None) or heads) * head_dim * dtype.itemsize
    trainable = sum(p.numel() * p.element_size() for p in lm.model.parameters() if p.requires_grad)
    lm.close()
    zero = {"fixed": 0.0, "per_row": 0.0}
    return {
        "device": str(device), "layers": text.num_hidden_layers, "layer_nbytes": stats.slot_nbytes, "resident_nbytes": stats.resident_nbytes,
        "hidden_nbytes": text.hidden_size * dtype.itemsize, "kv_nbytes": kv, "kv_record_nbytes": kv, "logits_nbytes": vocab * 4,
        "read_Bps": nbytes / seconds, "base_nbytes": base, "prefill": zero, "decode": zero, "head": vars(Fit.through(head)),
        "prefill_transient_nbytes": 0.0, "decode_transient_nbytes": 0.0,
        "train_forward": vars(Fit.through(forward)), "train_backward": vars(Fit.through(backward)),
        "saved_nbytes": max(saved_per[1:]), "train_transient_nbytes": max(transient[1:]), "trainable_nbytes": trainable,
        "head_train_nbytes": head_train, "measured": {"forward": forward, "backward": backward, "saved_per_token": saved_per, "transient_per_token": transient,
                     "head": head, "read": [nbytes, seconds]},
    }  # fmt: skip


def head_train_peak(model: Any, hidden: torch.Tensor, vocab: int, device: torch.device, reset: Callable[[], None],
                     peak: Callable[[], int]) -> float:  # fmt: skip
    """The peak of one micro-batch's head and loss (the model's own ``loss_function``) over their
    forward and backward, per token: what each micro-batch of a wave holds there at once."""
    base, _ = unwrap(model)
    x = hidden.detach().clone().requires_grad_(True)
    labels = torch.randint(0, vocab, x.shape[:2], device=device)
    before = rss("VmRSS") if device.type == "cpu" else torch.cuda.memory_allocated(device)
    reset()
    logits = model.get_output_embeddings()(x)
    loss_function = getattr(base, "loss_function", None)
    if callable(loss_function):
        loss = loss_function(logits=logits, labels=labels, vocab_size=vocab)
    else:  # older transformers: the causal LM loss as it computed it
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten())
    loss.backward()
    return max(peak() - before, 0) / x.shape[1]
