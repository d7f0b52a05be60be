"""``gds-offload bench-weights``: inference with the weights resident, streamed from the drive,
streamed from host memory, and under Accelerate's disk offload, each mode in its own process.

The parent (:func:`run_bench`) saves a Llama-shaped model with random weights
(``save_pretrained``, safetensors) and converts it to a store, or uses a checkpoint
given to it, then runs each mode in a child (``python -m gds_offload.weights.bench
--child SPEC``), optionally under a cgroup v1 memory cap (:mod:`gds_offload.weights.cgroup`).

Each child loads the model its way, warms up (one short prefill and two decode steps,
not measured), then for each batch size: a prefill of ``prompt_len`` tokens with the KV
cache on, and ``new_tokens - 1`` greedy decode steps, one token per sequence each. It
reports tokens/s for both phases, the bytes this process read from storage per token
(``/proc/self/io`` ``read_bytes``: what reached the drive, page-cache hits excluded) and,
for the streamed modes, the store bytes read per token (:meth:`StreamedModel.stats`), its
peak resident set, and the generated tokens and a hash of the prefill logits, which the
parent compares with the resident mode's.

Modes:

* ``resident``: ``from_pretrained`` (everything in memory).
* ``drive``: a meta skeleton + :func:`~gds_offload.weights.load_streamed` (``tier="drive"``): layers
  read with ``O_DIRECT`` into a ring of ``slots`` buffers for every forward.
* ``host``: ``load_streamed(tier="host")``: every layer read once into host memory.
* ``accelerate-disk``: ``from_pretrained(device_map={layers: "disk", rest: "cpu"}, offload_folder=...)``.
  With a safetensors checkpoint, Accelerate reads the offloaded layers from the checkpoint
  itself (memory-mapped, through the page cache) for every forward.

Before each child the parent evicts the checkpoint's and the store's pages from the page
cache (``posix_fadvise(DONTNEED)`` on those files only), so no mode starts with the
weights cached by another.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gds_offload.bench.children import die_with_parent, reap, spawn

__all__ = ["BenchModel", "BenchSpec", "ModeResult", "MODES", "TINY", "DEFAULT_MODEL", "run_bench", "run_child", "summarize"]

MODES = ("resident", "drive", "host", "accelerate-disk")
_PREFIX = "@@gds_offload.bench-weights "


@dataclass(frozen=True)
class BenchModel:
    """A Llama shape (random weights)."""

    hidden: int = 1024
    intermediate: int = 2816
    layers: int = 16
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 32000
    dtype: str = "float32"

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.intermediate, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
                           max_position_embeddings=4096, tie_word_embeddings=False, dtype=self.dtype)  # fmt: skip


TINY = BenchModel(hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, vocab=256)
DEFAULT_MODEL = BenchModel()


@dataclass(frozen=True)
class BenchSpec:
    """One child's work: ``mode`` over ``batch_sizes`` on the checkpoint and its store."""

    mode: str
    checkpoint: str
    store: str
    workdir: str
    batch_sizes: tuple[int, ...] = (1, 4)
    prompt_len: int = 128
    new_tokens: int = 16
    slots: int = 2
    num_threads: int = 4
    #: Measurements per batch size in the child (medians are reported): the load is paid once.
    repeats: int = 2
    seed: int = 0


@dataclass
class ModeResult:
    """One mode at one batch size (``status``: ``ok`` or ``error`` with ``error`` set)."""

    mode: str
    batch: int
    round: int = 0
    status: str = "ok"
    error: str | None = None
    load_s: float | None = None
    prefill_s: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_s: float | None = None
    decode_tokens_per_s: float | None = None
    #: Bytes this process read from storage (``/proc/self/io``) per decoded token.
    drive_bytes_per_token: float | None = None
    #: Store bytes read per decoded token (streamed modes' own count).
    store_bytes_per_token: float | None = None
    stall_s: float | None = None
    peak_rss_bytes: int | None = None
    cgroup_peak_bytes: int | None = None
    cgroup_limit_bytes: int | None = None
    matches_resident: bool | None = None
    tokens: list[list[int]] = field(default_factory=list)
    logits_xxh3: str | None = None


# -- the child ------------------------------------------------------------------------------
def _proc_read_bytes() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("read_bytes:"))


def _peak_rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def _load(spec: BenchSpec) -> tuple[Any, Any]:
    """``(model, StreamedModel or None)`` for ``spec.mode``."""
    import torch
    import transformers

    from gds_offload.weights import load_streamed

    if spec.mode == "resident":
        return transformers.AutoModelForCausalLM.from_pretrained(spec.checkpoint), None
    if spec.mode in ("drive", "host"):
        cfg = transformers.AutoConfig.from_pretrained(spec.store)
        dtype = cfg.dtype if isinstance(cfg.dtype, torch.dtype) else getattr(torch, cfg.dtype or "float32")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        handle = load_streamed(model, spec.store, tier=spec.mode, slots=spec.slots, num_threads=spec.num_threads)  # type: ignore[arg-type]
        return model, handle
    if spec.mode == "accelerate-disk":
        cfg = transformers.AutoConfig.from_pretrained(spec.checkpoint)
        device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        device_map |= {f"model.layers.{i}": "disk" for i in range(cfg.num_hidden_layers)}
        folder = Path(spec.workdir) / f"accelerate-offload-{os.getpid()}"
        return transformers.AutoModelForCausalLM.from_pretrained(spec.checkpoint, device_map=device_map, offload_folder=str(folder)), None
    raise ValueError(f"mode {spec.mode!r} unknown; expected one of {', '.join(MODES)}")


def _generate(model: Any, ids: Any, new_tokens: int) -> tuple[float, float, list[list[int]], str]:
    """Prefill then greedy decode with the KV cache: ``(prefill_s, decode_s, tokens, prefill logits hash)``."""
    import inspect

    import torch
    import xxhash

    # transformers 5 renamed past_key_values to cache (the old name warns).
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    t1 = time.perf_counter()
    h = xxhash.xxh3_64_hexdigest(out.logits[:, -1].float().contiguous().numpy().tobytes())
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [tok]
    t2 = time.perf_counter()
    for _ in range(new_tokens - 1):
        past = getattr(out, name, None) if name == "cache" else out.past_key_values
        out = model(input_ids=tok, use_cache=True, **{name: past})
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(tok)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, torch.cat(tokens, 1).tolist(), h


def run_child(spec: BenchSpec) -> list[ModeResult]:
    """Measure ``spec.mode`` in this process (see the module doc)."""
    import torch

    torch.manual_seed(spec.seed)
    t = time.perf_counter()
    model, handle = _load(spec)
    model.train(False)
    load_s = time.perf_counter() - t
    vocab = model.config.vocab_size
    results = []
    with torch.no_grad():
        _generate(model, torch.zeros(1, 8, dtype=torch.long), 3)  # warm-up: one-time costs
        for batch in spec.batch_sizes:
            ids = torch.randint(0, vocab, (batch, spec.prompt_len), generator=torch.Generator().manual_seed(spec.seed + batch))
            io0, st0 = _proc_read_bytes(), handle.stats() if handle else None
            runs = [_generate(model, ids, spec.new_tokens) for _ in range(spec.repeats)]
            io1, st1 = _proc_read_bytes(), handle.stats() if handle else None
            prefill_s = statistics.median(r[0] for r in runs)
            decode_s = statistics.median(r[1] for r in runs)
            decoded = batch * (spec.new_tokens - 1)
            r = ModeResult(spec.mode, batch, load_s=load_s, prefill_s=prefill_s, prefill_tokens_per_s=batch * spec.prompt_len / prefill_s,
                           decode_s=decode_s, decode_tokens_per_s=decoded / decode_s if decoded else None, tokens=runs[0][2], logits_xxh3=runs[0][3])  # fmt: skip
            if any(x[2] != runs[0][2] or x[3] != runs[0][3] for x in runs):
                r.status, r.error = "error", "outputs differ between repeats in one process"
            # Per token of the whole run (prefill included), so modes that read per forward compare.
            tokens = spec.repeats * batch * (spec.prompt_len + spec.new_tokens - 1)
            r.drive_bytes_per_token = (io1 - io0) / tokens
            if st0 is not None and st1 is not None:
                r.store_bytes_per_token = (st1.bytes_read - st0.bytes_read) / tokens
                r.stall_s = (st1.stall_s - st0.stall_s) / spec.repeats
            r.peak_rss_bytes = _peak_rss()
            results.append(r)
    if handle is not None:
        handle.close()
    return results


# -- the parent -----------------------------------------------------------------------------
def _evict(paths: list[Path]) -> None:
    """Drop these files' clean pages from the page cache (no effect on other files)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prepare(model: BenchModel, workdir: Path, checkpoint: Path | None = None) -> tuple[Path, Path]:
    """``(checkpoint, store)`` in ``workdir``: a random-weight checkpoint (unless given) and its store."""
    import torch
    import transformers

    from gds_offload.weights import convert
    from gds_offload.weights.errors import StoreFormatError
    from gds_offload.weights.manifest import config_fingerprint, read_manifest

    workdir.mkdir(parents=True, exist_ok=True)
    created = False
    if checkpoint is None:
        checkpoint = workdir / "checkpoint"
        cfg = model.config()
        saved = checkpoint / "config.json"
        if not saved.is_file() or config_fingerprint(saved) != config_fingerprint(cfg):
            torch.manual_seed(0)
            m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, model.dtype))
            m.save_pretrained(checkpoint)
            del m
            created = True
    store = workdir / "store"
    try:
        current = read_manifest(store).source.get("checkpoint") == str(checkpoint.resolve()) and not created
    except StoreFormatError:
        current = False
    if not current:
        convert(checkpoint, store, overwrite=True)
    return checkpoint, store


def run_mode(spec: BenchSpec, *, memory_limit: int | None = None, timeout_s: float = 3600) -> list[ModeResult]:
    """Run one mode in a child process (under a memory cap if given); errors become ``status="error"`` rows."""
    from gds_offload.weights.cgroup import MemoryCap

    _evict([*Path(spec.checkpoint).glob("*.safetensors"), Path(spec.store) / "weights.bin"])
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env.setdefault("MKL_CBWR", "AUTO,STRICT")  # bit-identical kernels across processes (see bench/runner.py)
    cap = MemoryCap(memory_limit) if memory_limit else None
    cmd = [sys.executable, "-m", "gds_offload.weights.bench", "--child", json.dumps(asdict(spec))]
    try:
        proc = spawn(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    except BaseException:
        if cap is not None:
            cap.close()
        raise
    try:
        if cap is not None:
            cap.add(proc.pid)  # the child's pid; the child waits for "go" so nothing ran uncapped
        out, err = proc.communicate("go\n", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err = f"timed out after {timeout_s} s\n" + err
    finally:
        reap(proc)  # a no-op once it has exited; on a stop signal it stops the child first
        rep = cap.close() if cap is not None else None
    rows = [json.loads(line[len(_PREFIX):]) for line in out.splitlines() if line.startswith(_PREFIX)]
    if proc.returncode != 0 or not rows:
        why = f"child exited {proc.returncode}" + (" (killed: out of memory under the cap?)" if proc.returncode == -9 else "")
        tail = " | ".join(err.strip().splitlines()[-3:])
        return [ModeResult(spec.mode, b, status="error", error=f"{why}: {tail}", cgroup_limit_bytes=memory_limit,
                           cgroup_peak_bytes=rep.peak_bytes if rep else None) for b in spec.batch_sizes]  # fmt: skip
    results = [ModeResult(**r) for r in rows]
    for r in results:
        if rep is not None:
            r.cgroup_limit_bytes, r.cgroup_peak_bytes = rep.limit_bytes, rep.peak_bytes
    return results


def run_bench(
    base: BenchSpec,
    modes: list[str],
    *,
    model: BenchModel,
    rounds: int = 1,
    memory_limit: int | None = None,
    checkpoint: Path | None = None,
) -> dict[str, Any]:
    """Prepare the checkpoint and store, run every mode ``rounds`` times (round ``k`` starts ``k``
    modes later, so a slow spell of a shared machine does not always hit the same mode), compare
    outputs with ``resident``'s; a JSON-ready dict with every row and the per-mode medians.

    ``memory_limit`` caps every mode but ``resident``: that one provides the reference outputs,
    and its uncapped peak shows what keeping the model in memory needs.
    """
    from gds_offload.weights.manifest import read_manifest

    ckpt, store = prepare(model, Path(base.workdir), checkpoint)
    m = read_manifest(store)
    rows: list[ModeResult] = []
    for k in range(rounds):
        for mode in modes[k % len(modes) :] + modes[: k % len(modes)]:
            # resident is the reference outputs, so it runs without the cap (its peak shows what it would need).
            limit = None if mode == "resident" else memory_limit
            for r in run_mode(replace(base, mode=mode, checkpoint=str(ckpt), store=str(store)), memory_limit=limit):
                r.round = k
                rows.append(r)
    ref = {r.batch: r for r in rows if r.mode == "resident" and r.status == "ok"}
    for r in rows:
        if r.status == "ok" and r.batch in ref:
            r.matches_resident = r.tokens == ref[r.batch].tokens and r.logits_xxh3 == ref[r.batch].logits_xxh3
    layer_bytes = [g.nbytes for g in m.layers]
    return {
        "model": asdict(model) | {"checkpoint": str(ckpt), "store": str(store), "layers_nbytes": sum(layer_bytes),
                                  "resident_nbytes": m.resident.nbytes if m.resident else 0, "largest_layer_nbytes": max(layer_bytes, default=0)},  # fmt: skip
        "spec": {k: v for k, v in asdict(base).items() if k not in ("mode", "checkpoint", "store")} | {"memory_limit_bytes": memory_limit, "memory_limit_applies_to": [m for m in modes if m != "resident"] if memory_limit else [], "rounds": rounds},
        "summary": summarize(rows),
        "results": [asdict(r) for r in rows],
    }


def summarize(rows: list[ModeResult]) -> list[dict[str, Any]]:
    """Per (mode, batch): medians over rounds of the figures; ``matches_resident`` only if every round matched."""
    keys = ("prefill_tokens_per_s", "decode_tokens_per_s", "drive_bytes_per_token", "store_bytes_per_token", "stall_s", "peak_rss_bytes", "cgroup_peak_bytes")
    out = []
    for mode, batch in dict.fromkeys((r.mode, r.batch) for r in rows):
        group = [r for r in rows if (r.mode, r.batch) == (mode, batch)]
        ok = [r for r in group if r.status == "ok"]
        row: dict[str, Any] = {"mode": mode, "batch": batch, "rounds_ok": len(ok), "rounds": len(group), "errors": [r.error for r in group if r.error]}
        for k in keys:
            vals = [getattr(r, k) for r in ok if getattr(r, k) is not None]
            row[k] = statistics.median(vals) if vals else None
        flags = [r.matches_resident for r in ok]
        row["matches_resident"] = None if not flags or None in flags else all(flags)
        out.append(row)
    return out


def _child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m gds_offload.weights.bench")
    p.add_argument("--child", required=True, help="a BenchSpec as JSON")
    args = p.parse_args(argv)
    die_with_parent()
    spec_d = json.loads(args.child)
    spec = BenchSpec(**(spec_d | {"batch_sizes": tuple(spec_d["batch_sizes"])}))
    sys.stdin.readline()  # wait until the parent has put this process in its memory group
    for r in run_child(spec):
        print(_PREFIX + json.dumps(asdict(r)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
