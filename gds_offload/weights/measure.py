"""Measuring a streamed model on this machine for the planner (:mod:`gds_offload.weights.planner`):
:func:`measure` returns a :class:`~gds_offload.weights.planner.Profile`.

The measurements run in a child process (``python -m gds_offload.weights.measure``), so that
the memory it reports is the model's own, not whatever the caller's process holds:

* the read rate: streamed layers read from the store through the ring's engine, outside the ring;
* one layer's forward time, prefill (1, 4 and 16 prompts of ``prompt_len`` tokens; and 1, 4 and 8
  prompts' tokens in chunks of a quarter prompt on a cache of a chunked prefill's mean length: a
  chunk after the first) and decode (8, 32 and 128 sequences at the workload's mean context), each
  the median of three runs, and the head's: a forward that stops after the first two streamed
  layers (the others are not computed), timed per layer by the streamed model's own counters
  (``stats().compute_s``), reads in flight as in a real run;
* memory: the process's resident set after loading (the base), and its peak (``VmHWM``, reset
  before each forward) above that during each one, per token (prefill) or sequence (decode).

The child prints one JSON object per line: ``{"event": "progress", ...}`` while it works, then
``{"event": "profile", ...}``.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gds_offload.errors import ConfigError
from gds_offload.units import parse_bytes
from gds_offload.weights.adapters import unwrap
from gds_offload.weights.generation import cache_argument
from gds_offload.weights.malloc import predictable_malloc
from gds_offload.weights.planner import Plan, check_feasible, choose
from gds_offload.weights.skeleton import empty_model
from gds_offload.weights.stream import load_streamed
from gds_offload.weights.workload import Finetune, Fit, Profile, Workload, profile_from

__all__ = ["measure", "main", "plan"]

_TIMEOUT_S = 600
#: Timed runs per size, after a warm-up: the median (one run's time varies by a tenth or more on a
#: shared machine, enough to flip a choice between plans predicted within a few percent).
_RUNS = 3


def measure(
    store: str | os.PathLike[str],
    workload: Workload,
    *,
    device: str = "cpu",
    engine: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """Profile the model in ``store`` for ``workload`` on ``device`` (see the module doc).

    Raises:
        ConfigError: the child failed (its last line of output is in the message).
    """
    spec: dict[str, Any] = {"store": os.fspath(store), "device": device, "engine": engine}
    if isinstance(workload, Finetune):
        spec |= {"kind": "finetune", "seq": workload.seq, "global_batch": workload.global_batch, "lora_r": workload.lora_r}
    else:
        spec |= {"kind": "generate", "prompt_len": workload.prompt_len, "new_tokens": workload.new_tokens, "prompts": workload.prompts}
    cmd = [sys.executable, "-m", "gds_offload.weights.measure", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    result: dict[str, Any] | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "progress" and progress is not None:
                progress(event["what"])
            elif event.get("event") == "profile":
                result = event["profile"]
        _, err = proc.communicate(timeout=_TIMEOUT_S)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0 or result is None:
        last = (err or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise ConfigError(f"measuring {store} failed: {last[0]}")
    return profile_from(result)


# -- the child -------------------------------------------------------------------------------------
class _Stop(Exception):
    """Raised in the third streamed layer's pre-hook: the profile needs two layers' times only."""


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        pass


def _device_peak(device: torch.device) -> tuple[Callable[[], None], Callable[[], int]]:
    if device.type == "cuda":
        return (lambda: torch.cuda.reset_peak_memory_stats(device)), (lambda: torch.cuda.max_memory_allocated(device))
    return _reset_peak, (lambda: _rss("VmHWM"))


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import transformers


    predictable_malloc()  # as generate_many runs: the memory measured is the memory held
    store = Path(spec["store"])
    device = torch.device(spec["device"])
    cfg = transformers.AutoConfig.from_pretrained(store)
    skeleton = empty_model(cfg)  # every architecture load_streamed streams (computed buffers real)
    if spec.get("kind") == "finetune":
        return _finetune_child(spec, skeleton, cfg, store, device)
    prompt_len, new_tokens = spec["prompt_len"], spec["new_tokens"]
    lm, stats, reset, peak, base, (nbytes, seconds) = _loaded(skeleton, store, device, spec["engine"], "loading the resident group")
    model = lm.model
    layers = lm.layer_modules()
    stop = layers[2].register_forward_pre_hook(lambda *a: _raise_stop())
    dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    vocab = cfg.get_text_config(decoder=True).vocab_size

    def two_layers(call: Callable[[], Any]) -> tuple[float, int]:
        before = lm.stats().compute_s
        base_now = peak() if device.type == "cuda" else _rss("VmRSS")
        reset()
        try:
            with torch.no_grad():
                call()
        except _Stop:
            pass
        after = lm.stats().compute_s
        return (after[0] - before[0] + after[1] - before[1]) / 2, max(peak() - base_now, 0)

    prefill, decode = [], []
    cap = spec["prompts"]
    for b in sorted({min(1, cap), min(4, cap), min(16, cap)}):
        _emit("progress", what=f"prefill of {b} x {prompt_len} tokens")
        ids = torch.randint(0, vocab, (b, prompt_len), device=device)
        two_layers(functools.partial(model, ids))  # warm-up: first-touch costs
        runs = [two_layers(functools.partial(model, ids)) for _ in range(_RUNS)]
        prefill.append((b * prompt_len, statistics.median(s for s, _ in runs), max(m for _, m in runs)))

    def on_cache(b: int, width: int, past: int) -> tuple[float, int]:
        """``width`` new positions of ``b`` sequences on ``past`` cached: the median seconds and the
        largest peak of the measured runs, after a warm-up (each run on a cache of its own)."""
        ids = torch.randint(0, vocab, (b, width), device=device)
        mask = torch.ones(b, past + width, dtype=torch.long, device=device)
        runs = [two_layers(functools.partial(model, ids, attention_mask=mask, use_cache=True,
                                             **{cache_argument(): _random_cache(cfg, b, past, dtype, device)}))
                for _ in range(1 + _RUNS)]  # fmt: skip
        return statistics.median(s for s, _ in runs[1:]), max(m for _, m in runs[1:])

    chunked = []
    if prompt_len >= 2:  # a chunk after the first: positions on a cache of the prompt's earlier ones
        chunk = max(prompt_len // 4, 1)
        past = max((prompt_len - chunk) // 2, 1)  # a chunked prefill's mean cache
        for b in sorted({min(s * prompt_len // chunk, cap) for s in (1, 4, 8)}):  # up to half the largest whole prompts' tokens
            _emit("progress", what=f"prefill chunks of {b} x {chunk} tokens on {past} cached")
            chunked.append((b * chunk, on_cache(b, chunk, past)[0]))
    ctx = prompt_len + new_tokens // 2
    for b in sorted({min(8, cap), min(32, cap), min(128, cap)}):
        _emit("progress", what=f"decode of {b} sequences at {ctx} positions")
        decode.append((b, *on_cache(b, 1, ctx)))
    stop.remove()
    head = _time_head(model, cfg, dtype, device, sizes=sorted({min(8, cap), min(64, cap)}))
    text = cfg.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = 2 * (getattr(text, "num_key_value_heads", None) or heads) * head_dim * dtype.itemsize
    lm.close()
    return {
        "device": str(device),
        "layers": text.num_hidden_layers,
        "layer_nbytes": stats.slot_nbytes,
        "resident_nbytes": stats.resident_nbytes,
        "hidden_nbytes": text.hidden_size * dtype.itemsize,
        "kv_nbytes": kv,
        "kv_record_nbytes": kv,
        "logits_nbytes": vocab * 4,
        "read_Bps": nbytes / seconds,
        "base_nbytes": base,
        "prefill": vars(Fit.through([(r, s) for r, s, _ in prefill])),
        "prefill_chunked": vars(Fit.through(chunked)) if chunked else None,
        "decode": vars(Fit.through([(r, s) for r, s, _ in decode])),
        "head": vars(Fit.through(head)),
        "prefill_transient_nbytes": max(m / r for r, _, m in prefill),
        "decode_transient_nbytes": max(m / r for r, _, m in decode),
        "measured": {"prefill": prefill, "prefill_chunked": chunked, "decode": decode, "head": head, "read": [nbytes, seconds]},
    }


def _raise_stop() -> None:
    raise _Stop


class _StopWith(Exception):
    """Raised in the third streamed layer's pre-hook with the hidden states it was given."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("stop")
        self.hidden = hidden


def _loaded(model: Any, store: Path, device: torch.device, engine: str, what: str) -> tuple[Any, Any, Any, Any, int, tuple[int, float]]:
    """``model`` streamed from ``store`` with two slots, checked to stream at least 3 layers, settled,
    and its ``stats()`` then; the device's peak reset and read back (``reset``, ``peak``), the memory held before any forward
    less the ring (``base``), and three layers' reads timed: ``(nbytes, seconds)``."""
    _emit("progress", what=what)
    lm = load_streamed(model, store, device=device, slots=2, engine=engine)
    stats = lm.stats()
    if len(stats.streamed_layers) < 3:
        raise ConfigError(f"{store} streams {len(stats.streamed_layers)} layers; the profile needs at least 3")
    lm.settle()
    reset, peak = _device_peak(device)
    ring = stats.slots * stats.slot_nbytes
    # On the CPU, the anonymous memory: the libraries' file pages (about 0.1 GiB with torch) are
    # what a memory limit reclaims first, and counting them put every predicted peak a tenth high.
    base = (_rss("RssAnon") + _rss("RssShmem") - ring) if device.type == "cpu" else torch.cuda.memory_allocated(device) - ring
    _emit("progress", what="reading layers from the drive")
    return lm, stats, reset, peak, base, lm.read_layers(3)


def _finetune_child(spec: dict[str, Any], skeleton: Any, cfg: Any, store: Path, device: torch.device) -> dict[str, Any]:
    """The fine-tuning profile: LoRA of rank ``lora_r`` on every linear layer of the decoder; one
    layer's forward with grad and its backward, at one and two sequences of ``seq`` tokens, each
    the median of three runs (one run's times vary by a quarter on a shared machine)."""
    import peft

    seq = spec["seq"]
    model = peft.get_peft_model(skeleton, peft.LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], target_modules="all-linear"))
    lm, stats, reset, peak, base, (nbytes, seconds) = _loaded(model, store, device, spec["engine"], "loading the resident group and the adapters")
    text = cfg.get_text_config(decoder=True)
    vocab = text.vocab_size
    dtype = next(p.dtype for p in lm.model.parameters() if p.dtype.is_floating_point)
    stop = lm.layer_modules()[2].register_forward_pre_hook(_stop_with, with_kwargs=True)
    forward, backward, saved_per, transient = [], [], [], []
    lm.model.train()
    for b in (1, 1, 1, 1, 2, 2, 2):  # the first run warms up
        _emit("progress", what=f"forward and backward of {b} x {seq} tokens")
        ids = torch.randint(0, vocab, (b, seq), device=device)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            if t.layout == torch.strided and not t.is_meta:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        before = lm.stats().compute_s
        rss0 = peak() if device.type == "cuda" else _rss("VmRSS")
        reset()
        hidden = None
        call: Any = lm.model
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            try:
                call(input_ids=ids)
            except _StopWith as exc:
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
    _emit("progress", what=f"the head and loss of 1 x {seq} tokens, forward and backward")
    head_train = _head_train_peak(lm.model, hidden[:1], vocab, device, reset, peak)
    forward, backward = _medians(forward[1:]), _medians(backward[1:])
    head = _time_head(call, cfg, dtype, device, sizes=[64, 256])
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


def _medians(runs: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``(tokens, seconds)`` runs: the median seconds at each size, by size."""
    sizes = sorted({t for t, _ in runs})
    return [(t, statistics.median(s for u, s in runs if u == t)) for t in sizes]


def _head_train_peak(model: Any, hidden: torch.Tensor, vocab: int, device: torch.device, reset: Callable[[], None],
                     peak: Callable[[], int]) -> float:  # fmt: skip
    """The peak of one micro-batch's head and loss (the model's own ``loss_function``) over their
    forward and backward, per token: what each micro-batch of a wave holds there at once."""
    base, _ = unwrap(model)
    x = hidden.detach().clone().requires_grad_(True)
    labels = torch.randint(0, vocab, x.shape[:2], device=device)
    before = _rss("VmRSS") if device.type == "cpu" else torch.cuda.memory_allocated(device)
    reset()
    logits = model.get_output_embeddings()(x)
    loss_function = getattr(base, "loss_function", None)
    if callable(loss_function):
        loss = loss_function(logits=logits, labels=labels, vocab_size=vocab)
    else:  # older transformers: the causal LM loss as it computed it
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten())
    loss.backward()
    return max(peak() - before, 0) / x.shape[1]


def _stop_with(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    raise _StopWith(args[0] if args else kwargs["hidden_states"])


def _random_cache(cfg: Any, batch: int, positions: int, dtype: torch.dtype, device: torch.device) -> Any:
    """A ``DynamicCache`` of ``positions`` random keys and values in the first two layers (timing only)."""
    from transformers import DynamicCache

    text = cfg.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    cache = DynamicCache()
    for layer in range(2):
        k = torch.randn(batch, kv_heads, positions, head_dim, dtype=dtype, device=device)
        cache.update(k, torch.randn_like(k), layer)
    return cache


def _time_head(model: Any, cfg: Any, dtype: torch.dtype, device: torch.device, *, sizes: list[int]) -> list[tuple[float, float]]:
    head = model.get_output_embeddings()
    hidden = cfg.get_text_config(decoder=True).hidden_size
    out = []
    with torch.no_grad():
        for b in sizes:
            x = torch.randn(b, 1, hidden, dtype=dtype, device=device)
            head(x)
            start = time.perf_counter()
            for _ in range(3):
                head(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out.append((float(b), (time.perf_counter() - start) / 3))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        profile = _child(json.loads(args[0]))
    except ConfigError as exc:
        print(f"gds_offload.weights.measure: {exc}", file=sys.stderr)
        return 2
    _emit("profile", profile=profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def plan(
    store: str | os.PathLike[str],
    workload: Workload,
    *,
    memory: int | str,
    device: str = "cpu",
    engine: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Measure the model in ``store`` on this machine (:func:`measure`,
    in a child process) and choose the fastest shape for ``workload`` under ``memory`` bytes
    (``"1.2GiB"``): :func:`~gds_offload.weights.planner.choose`. Checks what it can before measuring.

    Raises:
        ConfigError: ``memory`` below what any plan needs (before measuring when the store alone
            shows it), a workload longer than the model's positions, or no plan that fits.
    """
    limit = parse_bytes(memory, name="memory")
    check_feasible(store, workload, limit)
    return choose(measure(store, workload, device=device, engine=engine, progress=progress), workload, limit)
