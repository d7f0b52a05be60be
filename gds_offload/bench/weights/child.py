"""One ``gds-offload bench-weights`` mode, measured in its own process:
``python -m gds_offload.bench.weights.child SPEC_JSON`` (the parent, :mod:`gds_offload.bench.weights.bench`,
starts it, puts it in its memory group, then writes one line to its stdin to let it go).

The child loads the model its mode's way, warms up (one short prefill and one decode step,
not measured), then for each batch size, ``repeats`` times: a prefill of ``prompt_len``
tokens with the KV cache on, and ``new_tokens - 1`` greedy decode steps (one token per
sequence each). It prints one JSON line per batch size (:class:`~gds_offload.bench.weights.bench.ModeResult`):
tokens/s of both phases (medians), the bytes this process read from storage in each phase
(``/proc/self/io`` ``read_bytes``: what reached the drive, page-cache hits excluded), the
streamed modes' own counters, its peak RSS, and its outputs (tokens and a hash of the
prefill logits) for the parent to compare with the resident mode's.

Loading, per mode:

* ``resident``: ``from_pretrained``; CPU tensors copied into the process's own memory
  (transformers 5 leaves fp32 tensors as views of the memory-mapped safetensors file, which
  the page cache could evict and re-read).
* ``drive`` / ``host``: a meta skeleton + :func:`~gds_offload.weights.load_streamed`.
* ``accelerate-disk``: ``from_pretrained(device_map={layers: "disk", rest: device}, offload_folder=...)``;
  Accelerate then reads each layer from the checkpoint itself (its index points there) for
  every forward; the resident parts are copied into own memory as for ``resident``.
"""
from __future__ import annotations

import inspect
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gds_offload.bench.weights.bench import BenchSpec, ModeResult, serve_rows, weight_files
from gds_offload.bench.weights.drive import raw_read_bandwidth
from gds_offload.weights import load_streamed
from gds_offload.weights.run.model import DEFAULT_THREADS
from gds_offload.weights.store.manifest import read_manifest

__all__ = ["run_child", "load_mode", "own_memory", "peak_rss", "read_bytes"]


def read_bytes() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("read_bytes:"))


def peak_rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def own_memory(model: Any) -> None:
    """Copy every real CPU parameter and buffer into ordinary (anonymous) memory, in place."""
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None and p.device.type == "cpu" and not p.is_meta:
                p.data = p.data.clone()
        for leaf, b in mod._buffers.items():
            if b is not None and b.device.type == "cpu" and not b.is_meta:
                mod._buffers[leaf] = b.clone()


def load_mode(spec: BenchSpec) -> tuple[Any, Any]:
    """``(model, StreamedModel or None)`` for ``spec.mode``, on ``spec.device``."""
    import torch
    import transformers

    if spec.mode == "resident":
        model = transformers.AutoModelForCausalLM.from_pretrained(spec.checkpoint)
        if spec.device == "cpu":
            own_memory(model)
        # transformers declares PreTrainedModel.to with @wraps(nn.Module.to), which types it as the unbound function.
        return model.to(spec.device), None  # type: ignore[arg-type]
    if spec.mode in ("drive", "host"):
        cfg = transformers.AutoConfig.from_pretrained(spec.store)
        dtype = cfg.dtype if isinstance(cfg.dtype, torch.dtype) else getattr(torch, cfg.dtype or "float32")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        handle = load_streamed(model, spec.store, device=spec.device, tier=spec.mode, slots=spec.slots,  # type: ignore[arg-type]
                               num_threads=spec.num_threads, engine=spec.engine)  # fmt: skip
        return model, handle
    if spec.mode == "accelerate-disk":
        cfg = transformers.AutoConfig.from_pretrained(spec.checkpoint)
        here: Any = 0 if spec.device.startswith("cuda") else "cpu"
        device_map = {"model.embed_tokens": here, "model.norm": here, "model.rotary_emb": here, "lm_head": here}
        device_map |= {f"model.layers.{i}": "disk" for i in range(cfg.num_hidden_layers)}
        folder = Path(spec.workdir) / f"accelerate-offload-{os.getpid()}"
        model = transformers.AutoModelForCausalLM.from_pretrained(spec.checkpoint, device_map=device_map, offload_folder=str(folder))
        own_memory(model)
        return model, None
    raise ValueError(f"mode {spec.mode!r} unknown; expected resident, drive, host or accelerate-disk")


def _generate(model: Any, ids: Any, new_tokens: int, sync: Any) -> dict[str, Any]:
    """Prefill then greedy decode with the KV cache; times, drive bytes per phase, tokens, logits hash."""
    import torch
    import xxhash

    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5 renamed it
    # All positions' logits (no logits_to_keep=1): the lm_head of a strided last-position slice
    # goes through an MKL path whose low bits depend on buffer addresses, so no mode could match another.
    keep: dict[str, Any] = {}
    r0, t0 = read_bytes(), time.perf_counter()
    out = model(input_ids=ids, use_cache=True, **keep)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    sync()
    r1, t1 = read_bytes(), time.perf_counter()
    h = xxhash.xxh3_64_hexdigest(out.logits[:, -1].float().contiguous().cpu().numpy().tobytes())
    tokens = [tok]
    r2, t2 = read_bytes(), time.perf_counter()
    for _ in range(new_tokens - 1):
        past = getattr(out, cache_kw, None) if cache_kw == "cache" else out.past_key_values
        out = model(input_ids=tok, use_cache=True, **{cache_kw: past}, **keep)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(tok)
    sync()
    r3, t3 = read_bytes(), time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t3 - t2, "prefill_read": r1 - r0, "decode_read": r3 - r2,
            "tokens": torch.cat(tokens, 1).tolist(), "hash": h}  # fmt: skip


#: The modes whose decodes read the drive, and are paired with raw passes (:attr:`BenchSpec.paired_raw`).
PAIRED_MODES = ("drive", "accelerate-disk")


def run_child(spec: BenchSpec) -> Iterator[ModeResult]:
    """Measure ``spec.mode`` in this process (see the module doc); yields each batch size's
    result as soon as it is measured (a child killed by its memory cap keeps the smaller ones),
    then, for the modes that read the drive (``drive``, ``accelerate-disk``) with
    ``spec.paired_raw``, each batch's result again with its pairs."""
    import torch

    torch.manual_seed(spec.seed)
    cuda = spec.device.startswith("cuda")
    sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
    t = time.perf_counter()
    model, handle = load_mode(spec)
    model.train(False)
    sync()
    load_s = time.perf_counter() - t
    vocab = model.config.vocab_size
    with torch.no_grad():
        _generate(model, torch.zeros(1, 8, dtype=torch.long, device=spec.device), 2, sync)  # warm-up: one-time costs
        measured: list[tuple[ModeResult, Any]] = []  # each batch's result and its inputs
        for batch in spec.batch_sizes:
            ids = torch.randint(0, vocab, (batch, spec.prompt_len), generator=torch.Generator().manual_seed(spec.seed + batch)).to(spec.device)
            st0 = handle.stats() if handle else None
            runs = [_generate(model, ids, spec.new_tokens, sync) for _ in range(spec.repeats)]
            st1 = handle.stats() if handle else None
            r = _result(spec, batch, runs, load_s, st0, st1)
            measured.append((r, ids))
            yield r
        if spec.mode in PAIRED_MODES and spec.paired_raw:
            # After every measured run, so that none starts with a prefetch these left settled.
            for r, ids in measured:
                if r.status == "ok" and spec.new_tokens > 1:
                    _pair_with_raw(r, model, handle, spec, ids, sync)
                    yield r  # again, with the pairs: the parent keeps a batch's last line
    if handle is not None:
        handle.close()


def _pair_with_raw(r: ModeResult, model: Any, handle: Any, spec: BenchSpec, ids: Any, sync: Any) -> None:
    """Set ``r.raw_paired_bytes_per_s`` and ``r.decode_read_vs_raw``: ``spec.paired_raw`` more
    generations, each one's decode bracketed by raw ``O_DIRECT`` passes over as many bytes of
    the file the mode reads its layers from as a forward reads (the store's data for ``drive``,
    the checkpoint for ``accelerate-disk``; as many reads in flight as the streamer keeps, the
    same chunks), the drive idle otherwise (:meth:`StreamedModel.settle`). A drive whose rate
    drifts over minutes is then compared with itself seconds apart, not with a pass made before
    every mode. These runs come after the measured ones: a prefetch they left settled would favour a prefill."""

    files = weight_files(Path(spec.checkpoint), Path(spec.store))
    if handle is not None:
        data, streamed = files[-1], set(handle.stats().streamed_layers)
        nbytes = sum(g.nbytes for g in handle.manifest.layers if g.name in streamed)
    else:  # Accelerate reads every layer from the checkpoint (its first shard stands for the drive)
        data, nbytes = files[0], sum(g.nbytes for g in read_manifest(Path(spec.store)).layers)
    # As deep as the engine reads (KvikIO on a GPU: 16 threads; posix: its threads).
    depth = handle.engine.depth if handle is not None and handle.engine is not None else spec.num_threads or DEFAULT_THREADS

    def raw() -> float:
        if handle is not None:
            handle.settle()
        return raw_read_bandwidth(data, depths=(depth,), max_bytes=nbytes)[0].bytes_per_s

    before, ratios, raws = raw(), [], []
    for _ in range(spec.paired_raw):
        run = _generate(model, ids, spec.new_tokens, sync)
        after = raw()
        rate, bracket = run["decode_read"] / run["decode_s"], (before + after) / 2
        ratios.append(rate / bracket)
        raws.append(bracket)
        before = after
    r.raw_paired_bytes_per_s, r.decode_read_vs_raw = statistics.median(raws), statistics.median(ratios)


def _result(spec: BenchSpec, batch: int, runs: list[dict[str, Any]], load_s: float, st0: Any, st1: Any) -> ModeResult:
    import torch

    med = {k: statistics.median(r[k] for r in runs) for k in ("prefill_s", "decode_s", "prefill_read", "decode_read")}
    steps = spec.new_tokens - 1
    decoded = batch * steps
    r = ModeResult(spec.mode, batch, load_s=load_s, prefill_s=med["prefill_s"], decode_s=med["decode_s"],
                   prefill_tokens_per_s=batch * spec.prompt_len / med["prefill_s"],
                   decode_tokens_per_s=decoded / med["decode_s"] if decoded else None,
                   prefill_read_bytes=int(med["prefill_read"]), decode_read_bytes=int(med["decode_read"]),
                   decode_read_bytes_per_s=med["decode_read"] / med["decode_s"] if steps else None,
                   drive_bytes_per_token=med["decode_read"] / decoded if decoded else None,
                   tokens=runs[0]["tokens"], logits_xxh3=runs[0]["hash"], torch_threads=torch.get_num_threads())  # fmt: skip
    if any(x["tokens"] != runs[0]["tokens"] or x["hash"] != runs[0]["hash"] for x in runs):
        r.status, r.error = "error", "outputs differ between repeats in one process"
    if st0 is not None and st1 is not None:
        forwards = spec.repeats * (1 + steps)
        r.store_bytes_per_forward = (st1.bytes_read - st0.bytes_read) / forwards
        r.stall_s = (st1.stall_s - st0.stall_s) / spec.repeats
        r.engine = st1.engine
    r.peak_rss_bytes = peak_rss()
    return r


def main(argv: list[str] | None = None) -> int:
    return serve_rows(argv, "gds_offload.bench.weights.child", BenchSpec, run_child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
