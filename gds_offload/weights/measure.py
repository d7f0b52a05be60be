"""Measuring a streamed model on this machine for the planner (:mod:`gds_offload.weights.planner`):
:func:`measure` returns a :class:`~gds_offload.weights.planner.Profile`.

The measurements run in the calling process (or, with ``isolate=True``, in a child process,
``python -m gds_offload.weights.measure``): its base memory is then everything the process holds,
as the run it plans for will hold it, and nothing beside it needs room under a memory limit:

* the read rate: streamed layers read from the store through the ring's engine, outside the ring;
* one layer's forward time, prefill (1, 4 and 16 prompts of ``prompt_len`` tokens; and 1, 4 and 8
  prompts' tokens in chunks of a quarter prompt on a cache of a chunked prefill's mean length: a
  chunk after the first) and decode (8, 32 and 128 sequences at the workload's mean context), each
  the median of three runs, and the head's: a forward that stops after the first two streamed
  layers (the others are not computed), timed per layer by the streamed model's own counters
  (``stats().compute_s``), reads in flight as in a real run;
* memory: the process's resident set after loading (the base), and its peak (``VmHWM``, reset
  before each forward) above that during each one, per token (prefill) or sequence (decode).

Under a memory limit the measurement fits where its plan does: the floor is checked from the
store's manifest before anything is loaded (and again after, never lower), the ring gets one slot
when two would pass the limit, and a size after the two smallest of each kind is measured only
if its memory, priced from the smaller ones, fits what the limit leaves (a larger micro-batch
would not fit the plan either; the fit extrapolates to it).

The child prints one JSON object per line: ``{"event": "progress", ...}`` while it works, then
``{"event": "profile", ...}``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gds_offload.errors import ConfigError
from gds_offload.units import format_bytes, parse_bytes
from gds_offload.weights.adapters import unwrap
from gds_offload.weights.generation import cache_argument
from gds_offload.weights.malloc import predictable_malloc, release_free
from gds_offload.weights.manifest import read_manifest
from gds_offload.weights.planner import Plan, check_feasible, check_floor, choose, least_peak
from gds_offload.weights.skeleton import empty_model
from gds_offload.weights.stream import load_streamed
from gds_offload.weights.workload import HEADROOM, Finetune, Fit, Generate, Profile, Workload, profile_from

__all__ = ["SETTLED", "measure", "main", "memory_limit", "plan", "settled", "trust"]

_TIMEOUT_S = 600
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


def measure(
    store: str | os.PathLike[str],
    workload: Workload,
    *,
    device: str = "cpu",
    engine: str = "auto",
    progress: Callable[[str], None] | None = None,
    isolate: bool = False,
    memory: int | None = None,
) -> Profile:
    """Profile the model in ``store`` for ``workload`` on ``device`` (see the module doc).

    Args:
        isolate: measure in a child process (``python -m gds_offload.weights.measure``), whose base
            memory is the model's and a fresh interpreter's. Default: in this process, whose base is
            everything it holds, as the run it plans for will hold it; nothing beside it needs room
            (a child and its parent together pass a memory limit that the run alone fits), and this
            process's random-number state is left as it was.
        memory: the plan's memory limit: refused once the resident group is loaded, before anything
            is timed, if below what the smallest plan needs (:func:`~gds_offload.weights.planner.check_floor`).

    Raises:
        ConfigError: the measurement failed: the child's error, or how it ended (a kill by the
            kernel's out-of-memory killer names the memory limit it ran under); ``memory`` too small.
    """
    spec: dict[str, Any] = {"store": os.fspath(store), "device": device, "engine": engine, "memory": memory,
                            "workload": dataclasses.asdict(workload)}  # fmt: skip
    if isinstance(workload, Finetune):
        spec |= {"kind": "finetune", "seq": workload.seq, "global_batch": workload.global_batch, "lora_r": workload.lora_r}
    else:
        spec |= {"kind": "generate", "prompt_len": workload.prompt_len, "new_tokens": workload.new_tokens, "prompts": workload.prompts}
    if isolate:
        return profile_from(_in_child(spec, progress))
    dev = torch.device(device)
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as stack:
            return profile_from(_child(spec, progress or (lambda what: None), stack))
    finally:
        # The measured model and its hooks reference each other: only the cycle collector frees
        # them, and the run this plan is for loads the model again (a second resident group). The
        # heap's free memory goes back too: the run's base is what the plan counted, not its leftovers.
        release_free()


def _in_child(spec: dict[str, Any], progress: Callable[[str], None] | None) -> dict[str, Any]:
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
    if proc.returncode == 0 and result is not None:
        return result
    raise ConfigError(f"measuring {spec['store']} failed: {_how_it_ended(proc.returncode, err or '')}")


def _how_it_ended(returncode: int, err: str) -> str:
    """A failed measuring child's end, in words: its own error line, or the signal that ended it."""
    if returncode < 0:
        import signal

        name = signal.Signals(-returncode).name if -returncode in signal.Signals._value2member_map_ else f"signal {-returncode}"
        if -returncode == signal.SIGKILL:
            limit = memory_limit()
            where = f" of {format_bytes(limit)}" if limit is not None else ""
            return (f"the measuring process was killed ({name}), most likely by the kernel's out-of-memory killer at this "
                    f"process group's memory limit{where}; measure in this process (isolate=False), or give more memory")  # fmt: skip
        return f"the measuring process was ended by {name}"
    ours = [line for line in err.strip().splitlines() if line.startswith("gds_offload.weights.measure:")]
    last = ours[-1:] or [line for line in err.strip().splitlines() if line.strip() and "Warning" not in line][-1:]
    return last[0] if last else f"exit {returncode}"


def memory_limit() -> int | None:
    """The memory limit of this process's memory cgroup (v1 ``memory.limit_in_bytes`` or v2
    ``memory.max``), or ``None`` when there is none or it cannot be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            f = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes"
        elif controllers == "":
            f = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max"
        else:
            continue
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None


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


def _child(spec: dict[str, Any], say: Callable[[str], None], stack: contextlib.ExitStack) -> dict[str, Any]:
    """The profile of ``spec``'s model, as a dict (:func:`~gds_offload.weights.workload.profile_from`); ``say`` reports
    progress; the streamed model is closed when ``stack`` closes (also after an exception)."""
    import transformers


    predictable_malloc()  # as generate_many runs: the memory measured is the memory held
    store = Path(spec["store"])
    device = torch.device(spec["device"])
    cfg = transformers.AutoConfig.from_pretrained(store)
    skeleton = empty_model(cfg)  # every architecture load_streamed streams (computed buffers real)
    if spec.get("kind") == "finetune":
        return _finetune_child(spec, skeleton, cfg, store, device, say, stack)
    prompt_len, new_tokens = spec["prompt_len"], spec["new_tokens"]
    lm, stats, reset, peak, base, (nbytes, seconds) = _loaded(skeleton, store, device, spec["engine"], "loading the resident group", say, stack,
                                                              functools.partial(_check_floor, spec, cfg))  # fmt: skip
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
        chunk = max(prompt_len // 4, 1)
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
    stop.remove()
    head = _time_head(model, cfg, dtype, device, sizes=sorted({min(8, cap), *([min(64, cap)] if fits(64, vocab * 4, min(64, cap)) else [])}))
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
        "prefill_chunked_transient_nbytes": chunked_peak,
        "member_nbytes": member,
        "decode_transient_nbytes": max(max(m / r for r, _, m in decode), decode_peak),
        "measured": {"prefill": prefill, "prefill_chunked": chunked, "decode": decode, "head": head, "read": [nbytes, seconds],
                     "unsettled": unsettled, "load": [load_before, _load(), os.cpu_count() or 1]},
    }


def _check_floor(spec: dict[str, Any], cfg: Any, layer_nbytes: int, resident_nbytes: int, base: int) -> int:
    """:func:`~gds_offload.weights.planner.check_floor` for ``spec``'s memory, if it has one; the
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
    return _rss("RssAnon") + _rss("RssShmem") if device.type == "cpu" else torch.cuda.memory_allocated(device)


def _room(spec: dict[str, Any], device: torch.device) -> float:
    """What the measurement may add to what this process holds now and stay inside the plan's
    memory (its usable share, :data:`~gds_offload.weights.workload.HEADROOM`); unbounded without one."""
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
    """What each further micro-batch of a layer-major team keeps while it waits at a hand-over,
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
        before = _rss("VmRSS")
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


class _StopWith(Exception):
    """Raised in the third streamed layer's pre-hook with the hidden states it was given."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("stop")
        self.hidden = hidden


def _loaded(model: Any, store: Path, device: torch.device, engine: str, what: str, say: Callable[[str], None],
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


def _finetune_child(spec: dict[str, Any], skeleton: Any, cfg: Any, store: Path, device: torch.device, say: Callable[[str], None],
                    stack: contextlib.ExitStack) -> dict[str, Any]:  # fmt: skip
    """The fine-tuning profile: LoRA of rank ``lora_r`` on every linear layer of the decoder; one
    layer's forward with grad and its backward, at one and two sequences of ``seq`` tokens, each
    the median of three runs (one run's times vary by a quarter on a shared machine)."""
    import peft

    seq = spec["seq"]
    model = peft.get_peft_model(skeleton, peft.LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], target_modules="all-linear"))
    lm, stats, reset, peak, base, (nbytes, seconds) = _loaded(model, store, device, spec["engine"], "loading the resident group and the adapters", say,
                                                              stack, functools.partial(_check_floor, spec, cfg))  # fmt: skip
    text = cfg.get_text_config(decoder=True)
    vocab = text.vocab_size
    dtype = next(p.dtype for p in lm.model.parameters() if p.dtype.is_floating_point)
    stop = lm.layer_modules()[2].register_forward_pre_hook(_stop_with, with_kwargs=True)
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
    say(f"the head and loss of 1 x {seq} tokens, forward and backward")
    # Measured in this process, small allocations may come from heap memory freed earlier and add
    # nothing to its resident set; the head holds at least its logits and their gradient.
    head_train = max(_head_train_peak(lm.model, hidden[:1], vocab, device, reset, peak), 2.0 * vocab * 4)
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
        with contextlib.ExitStack() as stack:
            profile = _child(json.loads(args[0]), lambda what: _emit("progress", what=what), stack)
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
    profile = measure(store, workload, device=device, engine=engine, progress=progress, memory=limit)
    doubt = trust(profile.measured)
    if doubt is not None:
        warnings.warn(f"the profile of {store} was {doubt}", stacklevel=2)
    return choose(profile, workload, limit)
