"""Measuring a streamed model for the planner, in this process: what :mod:`gds_offload.weights.run.measure`
runs (here, or in its child). Generation here; fine-tuning in :mod:`gds_offload.weights.run.profile_finetune`.

* the read rate: streamed layers read from the store through the ring's engine, outside the ring;
* one layer's forward time, prefill (1, 4 and 16 prompts of ``prompt_len`` tokens; and 1, 4 and 8
  prompts' tokens in chunks of a quarter prompt on a cache of a chunked prefill's mean length: a
  chunk after the first) and decode (8, 32 and 128 sequences at the workload's mean context), each
  the median of three runs, and the head's: a forward that stops after the first two streamed
  layers (the others are not computed), timed per layer by the streamed model's own counters
  (``stats().compute_s``), reads in flight as in a real run; the head on a decode step's input and
  on a prefill's (the last position of a longer hidden state, :func:`time_head`); what a decode
  step's cache on the drive adds to a layer (:mod:`~gds_offload.weights.run.profile_kv`);
* memory: the process's resident set after loading (the base), and its peak (``VmHWM``, reset
  before each forward) above that during each one, per token (prefill) or sequence (decode).

Under a memory limit the measurement fits where its plan does: the floor is checked from the
store's manifest before anything is loaded (and again after, never lower), the ring gets one slot
when two would pass the limit, and a size after the two smallest of each kind is measured only
if its memory, priced from the smaller ones, fits what the limit leaves (a larger micro-batch
would not fit the plan either; the fit extrapolates to it).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gds_offload.errors import ConfigError
from gds_offload.weights.planning.planner import check_floor, least_peak
from gds_offload.weights.planning.workload import HEADROOM, Finetune, Fit, Generate, Workload, smallest_chunk
from gds_offload.weights.run.generation import cache_argument
from gds_offload.weights.run.model import load_streamed
from gds_offload.weights.run.profile_kv import time_kv_on_drive
from gds_offload.weights.store.manifest import read_manifest

__all__ = ["LOAD_NBYTES", "SETTLED", "StopWith", "check_floor_loaded", "loaded", "medians", "profile_generate", "rss", "settled", "stop_with", "time_head", "trust"]

#: Timed runs per size, after a warm-up: the median (one run's time varies by a tenth or more on a
#: shared machine, enough to flip a choice between plans predicted within a few percent).
_RUNS = 3


#: The fastest runs of a size agree within this factor, or more are taken (:func:`settled`), up to :data:`_MAX_RUNS`.
SETTLED = 1.25


_MAX_RUNS = 9


_JITTER_S = 1e-3


#: What loading a streamed model adds to a process beyond its resident group and its ring (the
#: engines' threads, the skeleton's computed buffers, the allocator's first arenas): 8-12 MiB
#: measured on the CPU here, from a 4-layer Llama to a 40-layer Granite. The floor said before the
#: load counts it, so that the one said after the load, with what it measured, is rarely higher.
LOAD_NBYTES = 16 << 20


class _Stop(Exception):
    """Raised in the third streamed layer's pre-hook: the profile needs two layers' times only."""


def rss(field: str) -> int:
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
    return _reset_peak, (lambda: rss("VmHWM"))


def profile_generate(spec: dict[str, Any], skeleton: Any, cfg: Any, store: Path, device: torch.device, say: Callable[[str], None],
                     stack: contextlib.ExitStack) -> dict[str, Any]:  # fmt: skip
    """The generation profile of ``spec``'s model (see the module doc), as a dict
    (:func:`~gds_offload.weights.planning.workload.profile_from`); ``say`` reports progress; the
    streamed model is closed when ``stack`` closes (also after an exception)."""
    prompt_len, new_tokens = spec["prompt_len"], spec["new_tokens"]
    lm, stats, reset, peak, base, (read_nbytes, read_s) = loaded(skeleton, store, device, spec["engine"], "loading the resident group", say, stack,
                                                              functools.partial(check_floor_loaded, spec, cfg))  # fmt: skip
    model = lm.model
    layers = lm.layer_modules()
    stop = layers[2].register_forward_pre_hook(lambda *a: _raise_stop())
    fills_before = lm.stats()
    dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    vocab = cfg.get_text_config(decoder=True).vocab_size

    def layer_times(call: Callable[[], Any]) -> list[float]:
        """Each streamed layer's compute seconds in ``call`` (a forward the stop ends after two)."""
        before = lm.stats().compute_s
        try:
            with torch.no_grad():
                call()
        except _Stop:
            pass
        return [a - b for a, b in zip(lm.stats().compute_s, before)]

    def two_layers(call: Callable[[], Any]) -> tuple[float, int]:
        base_now = peak() if device.type == "cuda" else rss("VmRSS")
        reset()
        times = layer_times(call)
        return (times[0] + times[1]) / 2, max(peak() - base_now, 0)

    prefill: list[tuple[int, float, int]] = []
    decode: list[tuple[int, float, int]] = []
    unsettled: list[str] = []
    load_before = _load()
    cap = spec["prompts"]
    text = cfg.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = 2 * (getattr(text, "num_key_value_heads", None) or heads) * head_dim * dtype.itemsize
    room = _room(spec, device)

    def fits(b: int, per_row: float, rows: int, cached: int = 0) -> bool:
        """A size after the two smallest is measured only if its memory, priced from the sizes measured
        before it (``per_row`` bytes a row, ``rows`` rows) and ``cached`` positions of a random cache
        of two layers (and its copy as a forward extends it), fits what the plan's memory leaves:
        the measurement must fit where its plan does, and a larger size would not fit the plan either."""
        return rows * per_row + 2 * 2 * b * cached * kv <= room

    for i, b in enumerate(sorted({min(1, cap), min(4, cap), min(16, cap)})):
        if i >= 2 and not fits(b, max(m / r for r, _, m in prefill), b * prompt_len):
            break
        say(f"prefill of {b} x {prompt_len} tokens")
        ids = torch.randint(0, vocab, (b, prompt_len), device=device)
        two_layers(functools.partial(model, ids))  # warm-up: first-touch costs
        seconds, mem = settled(functools.partial(two_layers, functools.partial(model, ids)), f"prefill of {b}", unsettled)
        prefill.append((b * prompt_len, seconds, mem))

    def on_cache(b: int, width: int, past: int) -> tuple[float, int]:
        """``width`` new positions of ``b`` sequences on ``past`` cached: the median seconds and the
        largest peak of the measured runs, after a warm-up (each run on a cache of its own)."""
        ids = torch.randint(0, vocab, (b, width), device=device)
        mask = torch.ones(b, past + width, dtype=torch.long, device=device)

        def run() -> tuple[float, int]:
            cache = {cache_argument(): _random_cache(cfg, b, past, dtype, device)}
            return two_layers(functools.partial(model, ids, attention_mask=mask, use_cache=True, **cache))

        run()  # warm-up
        return settled(run, f"{width} positions of {b} on {past} cached", unsettled)

    def peak_on_cache(b: int, width: int, past: int) -> int:
        """The peak of one forward of ``width`` new positions of ``b`` sequences on ``past`` cached (memory only)."""
        ids = torch.randint(0, vocab, (b, width), device=device)
        mask = torch.ones(b, past + width, dtype=torch.long, device=device)
        cache = {cache_argument(): _random_cache(cfg, b, past, dtype, device)}
        return two_layers(functools.partial(model, ids, attention_mask=mask, use_cache=True, **cache))[1]

    chunked = []
    chunked_peak = 0.0
    if prompt_len >= 2:  # a chunk after the first: positions on a cache of the prompt's earlier ones
        chunk = smallest_chunk(prompt_len)  # the smallest the planner chooses
        past = max((prompt_len - chunk) // 2, 1)  # a chunked prefill's mean cache
        sizes = sorted({min(s * prompt_len // chunk, cap) for s in (1, 4, 8)})  # up to half the largest whole prompts' tokens
        per_token = max(m / r for r, _, m in prefill)
        sizes = sizes[:2] + [b for b in sizes[2:] if fits(b, per_token, b * chunk, prompt_len)]
        for b in sizes:
            say(f"prefill chunks of {b} x {chunk} tokens on {past} cached")
            chunked.append((b * chunk, on_cache(b, chunk, past)[0]))
        # A chunk's memory grows with the cache it attends to (GQA's keys and values expanded per
        # head, the scores): the peak is the last chunk's, on the longest cache.
        say(f"the last prefill chunk's memory: {sizes[-1]} x {chunk} tokens on {prompt_len - chunk} cached")
        chunked_peak = peak_on_cache(sizes[-1], chunk, prompt_len - chunk) / (sizes[-1] * chunk)
    ctx = prompt_len + new_tokens // 2
    for i, b in enumerate(sorted({min(8, cap), min(32, cap), min(128, cap)})):
        if i >= 2 and not fits(b, max(m / r for r, _, m in decode), b, prompt_len + new_tokens):
            break
        say(f"decode of {b} sequences at {ctx} positions")
        decode.append((b, *on_cache(b, 1, ctx)))
    last = prompt_len + new_tokens - 1  # the last decode step's cache: its memory is the decode's peak
    say(f"the last decode step's memory: {decode[-1][0]} sequences at {last + 1} positions")
    decode_peak = peak_on_cache(decode[-1][0], 1, last) / decode[-1][0]
    say("the memory a suspended micro-batch's thread keeps")
    # Each member's step ends in the head: its logits (4 bytes a vocabulary entry) beside the decode's memory.
    per_seq = max(m / r for r, _, m in decode) + vocab * 4
    member_b = max([b for b, _, _ in decode if fits(b, per_seq, b, ctx)] or [decode[0][0]])
    member = _member_overhead(model, cfg, dtype, device, member_b, ctx, vocab, reset, peak)
    # The drive's rate as a run sees it: the fills of the forwards timed above, each read while a
    # layer computed (O_DIRECT's copies and the engine's threads share the cores with it). Read
    # alone it was 2.3 GB/s on a Granite shape whose runs filled layers at 1.6 GB/s.
    fills = lm.stats()
    beside = (fills.bytes_read - fills_before.bytes_read, fills.read_s - fills_before.read_s)
    say("decode steps with the KV cache on the drive")
    kv_drive = time_kv_on_drive(lm, cfg, dtype, sizes=[b for b, _, _ in decode][:2], ctx=ctx, vocab=vocab, layer_times=layer_times,
                                random_cache=lambda b, n: _random_cache(cfg, b, n, dtype, device),
                                settle=lambda run, what: settled(run, what, unsettled), max_runs=_MAX_RUNS)  # fmt: skip
    stop.remove()
    head_sizes = sorted({min(8, cap), *([min(64, cap)] if fits(64, vocab * 4, min(64, cap)) else [])})
    head = time_head(model, cfg, dtype, device, sizes=head_sizes)
    prefill_head = time_head(model, cfg, dtype, device, sizes=head_sizes, positions=max(smallest_chunk(prompt_len), 2)) if prompt_len > 1 else head
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
        "read_Bps": beside[0] / beside[1] if beside[0] >= 2 * stats.slot_nbytes and beside[1] > 0 else read_nbytes / read_s,
        "base_nbytes": base,
        "prefill": vars(Fit.through([(r, s) for r, s, _ in prefill])),
        "prefill_chunked": vars(Fit.through(chunked)) if chunked else None,
        "decode": vars(Fit.through([(r, s) for r, s, _ in decode])),
        "head": vars(Fit.through(head)),
        "prefill_head": vars(Fit.through(prefill_head)),
        "kv_drive": vars(Fit.through(kv_drive)) if kv_drive else None,
        "prefill_transient_nbytes": max(m / r for r, _, m in prefill),
        "prefill_chunked_transient_nbytes": chunked_peak,
        "member_nbytes": member,
        "decode_transient_nbytes": max(max(m / r for r, _, m in decode), decode_peak),
        "measured": {"prefill": prefill, "prefill_chunked": chunked, "decode": decode, "head": head, "prefill_head": prefill_head, "kv_drive": kv_drive, "read": [read_nbytes, read_s], "read_beside_compute": list(beside),
                     "unsettled": unsettled, "load": [load_before, _load(), os.cpu_count() or 1]},
    }


def check_floor_loaded(spec: dict[str, Any], cfg: Any, layer_nbytes: int, resident_nbytes: int, base: int) -> int:
    """:func:`~gds_offload.weights.planning.planner.check_floor` for ``spec``'s memory, if it has one; the
    ring's slots to measure with: two (a read beside compute, as the runs it plans for), or one
    where the smallest plan of two slots would pass the memory (the measurement must fit where
    the plan it makes does)."""
    if spec.get("memory") is None:
        return 2
    w = spec["workload"]
    workload: Workload = Finetune(**w) if w.get("kind") == "finetune" else Generate(**w)
    text = cfg.get_text_config(decoder=True)
    sizes = {"layers": text.num_hidden_layers, "layer_nbytes": layer_nbytes, "resident_nbytes": resident_nbytes, "base_nbytes": base}
    check_floor(text.to_dict(), workload, spec["memory"], **sizes)
    return 2 if least_peak(text.to_dict(), workload, slots=2, **sizes) <= spec["memory"] * HEADROOM else 1


def _held(device: torch.device) -> int:
    """What this process holds where the plan's memory is counted: anonymous and shared memory on
    the CPU (the libraries' file pages are what a memory limit reclaims first), allocated memory on a GPU."""
    return rss("RssAnon") + rss("RssShmem") if device.type == "cpu" else torch.cuda.memory_allocated(device)


def _room(spec: dict[str, Any], device: torch.device) -> float:
    """What the measurement may add to what this process holds now and stay inside the plan's
    memory (its usable share, :data:`~gds_offload.weights.planning.workload.HEADROOM`); unbounded without one."""
    return math.inf if spec.get("memory") is None else spec["memory"] * HEADROOM - _held(device)


def settled(run: Callable[[], tuple[float, int]], what: str, unsettled: list[str]) -> tuple[float, int]:
    """Time ``run`` (``(seconds, peak bytes)``) until its :data:`_RUNS` fastest runs lie within
    :data:`SETTLED` of each other (or a millisecond), at most :data:`_MAX_RUNS` runs: the median of those fastest, and
    the largest peak seen. Other work on the machine slows some runs and not others (it moved the
    median of three by 4x here, and with it the plan); a size whose runs never settle is named in
    ``unsettled`` (the profile says so: :func:`trust`)."""
    runs = [run() for _ in range(_RUNS)]
    while True:
        fastest = sorted(s for s, _ in runs)[:_RUNS]
        if _agree(fastest) or len(runs) >= _MAX_RUNS:
            break
        runs.append(run())
    if not _agree(fastest):
        unsettled.append(f"{what}: {len(runs)} runs from {min(s for s, _ in runs):.3g} s to {max(s for s, _ in runs):.3g} s")
    return statistics.median(fastest), max(m for _, m in runs)


def _agree(fastest: list[float]) -> bool:
    # Within SETTLED of each other, or within a millisecond (a thread's wake-up: below it, the
    # layer's cost is too small for a plan to depend on)
    return fastest[-1] <= SETTLED * fastest[0] + _JITTER_S


def trust(measured: dict[str, Any]) -> str | None:
    """Why a profile's timings may not be the machine's own (other work ran while it was measured),
    or ``None``: sizes whose runs never settled (:func:`settled`), a load average above the cores
    before measuring began."""
    why = []
    unsettled = measured.get("unsettled") or []
    if unsettled:
        why.append(f"the repeated runs of {len(unsettled)} sizes never agreed within {SETTLED - 1:.0%} ({unsettled[0]})")
    load = measured.get("load")
    if load and load[0] > load[2]:
        why.append(f"the load average was {load[0]:.1f} on {load[2]} cores before measuring")
    if not why:
        return None
    return "measured while other work ran: " + "; ".join(why) + ": predictions may be off; measure again on a quiet machine"


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _member_overhead(model: Any, cfg: Any, dtype: torch.dtype, device: torch.device, b: int, ctx: int, vocab: int,
                     reset: Callable[[], None], peak: Callable[[], int]) -> int:  # fmt: skip
    """What each micro-batch of a layer-major team (a thread of its own) keeps while it waits at a hand-over,
    beyond its tensors: per-thread caches of the math libraries (MKL's fast memory manager keeps
    about 10 MiB of packing buffers per thread that ran a GEMM, until the thread ends). Measured
    as a team holds them: ``k`` threads alive at once, each having run a decode step of two
    layers and the head of ``b`` sequences; ``(peak(4) - peak(1)) / 3``. 0 on a GPU."""
    if device.type != "cpu":
        return 0
    head = model.get_output_embeddings()
    hidden = cfg.get_text_config(decoder=True).hidden_size

    def step() -> None:
        ids = torch.randint(0, vocab, (b, 1), device=device)
        mask = torch.ones(b, ctx + 1, dtype=torch.long, device=device)
        with torch.no_grad():
            try:
                model(ids, attention_mask=mask, use_cache=True, **{cache_argument(): _random_cache(cfg, b, ctx, dtype, device)})
            except _Stop:
                pass
            head(torch.randn(b, 1, hidden, dtype=dtype, device=device))

    def held_by(k: int) -> int:
        done, release = threading.Semaphore(0), threading.Event()

        def member() -> None:
            try:
                step()
            finally:
                done.release()
            release.wait()

        gc.collect()
        before = rss("VmRSS")
        reset()
        threads = [threading.Thread(target=member, daemon=True) for _ in range(k)]
        try:
            for t in threads:  # one at a time, as a team computes; each stays alive, as a suspended member does
                t.start()
                done.acquire()
            return peak() - before
        finally:
            release.set()
            for t in threads:
                t.join()

    one = held_by(1)
    return max(held_by(4) - one, 0) // 3


def _raise_stop() -> None:
    raise _Stop


class StopWith(Exception):
    """Raised in the third streamed layer's pre-hook with the hidden states it was given."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("stop")
        self.hidden = hidden


def loaded(model: Any, store: Path, device: torch.device, engine: str, what: str, say: Callable[[str], None],
            stack: contextlib.ExitStack, check: Callable[[int, int, int], int]) -> tuple[Any, Any, Any, Any, int, tuple[int, float]]:  # fmt: skip
    """``model`` streamed from ``store`` with the slots ``check`` returns (it refuses a memory below
    the floor, before the load and again after it, with what the load measured), checked to stream at least 3 layers, settled,
    and its ``stats()`` then; the device's peak reset and read back (``reset``, ``peak``), the memory held before any forward
    less the ring (``base``), and three layers' reads timed: ``(nbytes, seconds)``."""
    say(what)
    # The floor is known before anything is loaded (the manifest's resident group and largest layer,
    # this process as it is): a limit below it would kill the load before the check after it.
    manifest = read_manifest(store)
    resident = manifest.resident.nbytes if manifest.resident else 0
    before = _held(device) + resident + LOAD_NBYTES
    slots = check(max((g.padded_nbytes for g in manifest.layers), default=0), resident, before)
    lm = load_streamed(model, store, device=device, slots=slots, engine=engine)
    stack.callback(lm.close)
    stats = lm.stats()
    if len(stats.streamed_layers) < 3:
        raise ConfigError(f"{store} streams {len(stats.streamed_layers)} layers; the profile needs at least 3")
    lm.settle()
    reset, peak = _device_peak(device)
    # On the CPU, the anonymous memory: the libraries' file pages (about 0.1 GiB with torch) are
    # what a memory limit reclaims first, and counting them put every predicted peak a tenth high.
    base = _held(device) - stats.slots * stats.slot_nbytes
    # Before anything is read or timed; never a lower floor than the one said before the load (one number).
    check(stats.slot_nbytes, stats.resident_nbytes, max(base, before))
    say("reading layers from the drive")
    return lm, stats, reset, peak, base, lm.read_layers(3)


def medians(runs: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``(tokens, seconds)`` runs: the median seconds at each size, by size."""
    sizes = sorted({t for t, _ in runs})
    return [(t, statistics.median(s for u, s in runs if u == t)) for t in sizes]


def stop_with(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    raise StopWith(args[0] if args else kwargs["hidden_states"])


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


def time_head(model: Any, cfg: Any, dtype: torch.dtype, device: torch.device, *, sizes: list[int], positions: int = 1) -> list[tuple[float, float]]:
    """The head's forward on ``b`` sequences' last position, for each ``b`` in ``sizes``: ``(b, seconds)``.

    With ``positions > 1`` its input is the last position of a ``positions``-long hidden state, a
    strided view, as a prefill (or a chunk of one) hands it over under ``logits_to_keep=1``. On the
    CPU a linear layer on such a view runs as one product per sequence, each reading the whole
    head: several times the decode step's time on a large vocabulary (a Granite head of 100352 x 640,
    32 sequences: 0.38 s strided, 0.08 s contiguous). The timing is of what runs, untouched."""
    head = model.get_output_embeddings()
    hidden = cfg.get_text_config(decoder=True).hidden_size
    out = []
    with torch.no_grad():
        for b in sizes:
            x = torch.randn(b, positions, hidden, dtype=dtype, device=device)[:, -1:, :]
            head(x)
            start = time.perf_counter()
            for _ in range(3):
                head(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out.append((float(b), (time.perf_counter() - start) / 3))
    return out
