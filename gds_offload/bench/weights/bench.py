"""``gds-offload bench-weights``: inference with the weights resident, streamed from the drive,
streamed from host memory, and under Accelerate's disk offload, each mode in its own process.

The parent (:func:`run_bench`) saves a Llama-shaped model with random weights
(``save_pretrained``, safetensors) and converts it to a store, or uses a checkpoint given
to it; measures the drive's raw ``O_DIRECT`` read rate on the store's file
(:func:`~gds_offload.bench.weights.drive.raw_read_bandwidth`, several requests in flight), before
and after the modes; then runs each mode in a child (:mod:`gds_offload.bench.weights.child`,
which says what is measured). Modes in :data:`CAPPED` run in a cgroup v1 memory group of
their own below the weights' size (:mod:`gds_offload.bench.cgroup`; page cache included).
Every child runs with ``MALLOC_MMAP_THRESHOLD_=1048576``: under a cap, freed activations and
layers must go back to the kernel rather than stay in glibc's heap; and since each allocation
of 1 MiB or more then costs fresh page faults, the uncapped modes get it too, so no mode's
compute is measured with a cheaper allocator than another's.

Modes:

* ``resident``: everything in memory, uncapped: the reference outputs, and what keeping the
  model in memory needs.
* ``drive``: :func:`~gds_offload.weights.load_streamed` ``tier="drive"``: layers read with
  ``O_DIRECT`` into a ring of ``slots`` buffers for every forward. Capped.
* ``host``: ``tier="host"``: every layer in host memory. Uncapped: holding all layers in RAM
  is what this tier is (on a GPU it is the pinned host tier; on a CPU it is resident with
  the store's layout).
* ``accelerate-disk``: ``from_pretrained(device_map={layers: "disk", rest: "cpu"}, offload_folder=...)``.
  With a safetensors checkpoint Accelerate's offload folder stays empty and it reads the
  offloaded layers from the checkpoint itself (memory-mapped, through the page cache) for
  every forward; under the cap those pages are evicted and read again. Capped.

Accelerate's CPU offload (``cpu_offload``, or ``device_map`` entries ``"cpu"`` with a GPU
execution device) is left out on a CPU-only machine: its execution device would be the CPU
itself, so it is the resident mode (nothing moves). With ``device="cuda"`` it is the
counterpart of ``host``.

Before each child the parent drops the checkpoint's and the store's pages from the page
cache (:func:`~gds_offload.bench.weights.drive.evict`) and records how much was still cached
(``mincore``), so no mode starts with the weights cached by another.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gds_offload.bench import procs
from gds_offload.bench.cgroup import check_limit, remove_stale_groups
from gds_offload.bench.weights.drive import cached_bytes, evict, raw_read_bandwidth, read_interference
from gds_offload.io.kvikio.engine import DEFAULT_THREADS as KVIKIO_THREADS
from gds_offload.weights import convert
from gds_offload.weights.errors import StoreFormatError
from gds_offload.weights.store.manifest import config_fingerprint, read_manifest

__all__ = ["BenchModel", "BenchSpec", "ChildSpec", "ChildResult", "ModeResult", "MODES", "CAPPED", "TINY", "DEFAULT_MODEL", "child_env", "child_rows", "serve_rows", "prepare", "remove_offload_folders", "run_bench",
           "run_inference_mode", "run_rounds", "summarize", "weight_files"]

MODES = ("resident", "drive", "host", "accelerate-disk")
#: Modes run under ``memory_limit``; the others hold every weight in memory by design.
CAPPED = ("drive", "accelerate-disk")


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
#: 12 layers of 180 MB and 262 MB resident (2.42 GB fp32): twice a 1.2 GiB cap, yet small
#: enough that every mode runs in minutes on a CPU.
DEFAULT_MODEL = BenchModel(hidden=2048, intermediate=5632, layers=12, heads=16, kv_heads=4, vocab=16000)


@dataclass(frozen=True)
class ChildSpec:
    """What every benchmark child is given: its mode, the checkpoint and store it reads, its working directory."""

    mode: str
    checkpoint: str
    store: str
    workdir: str


@dataclass(frozen=True)
class BenchSpec(ChildSpec):
    """One child's work: ``mode`` over ``batch_sizes`` on the checkpoint and its store."""

    batch_sizes: tuple[int, ...] = (1, 8, 64)
    prompt_len: int = 16
    new_tokens: int = 3
    slots: int = 2
    num_threads: int | None = None
    engine: str = "auto"
    device: str = "cpu"
    #: Measurements per batch size in the child (medians are reported): the load is paid once.
    repeats: int = 2
    #: ``drive`` and ``accelerate-disk``, every batch size: this many extra generations after the
    #: measured runs, each decode bracketed by raw ``O_DIRECT`` passes over the file the mode reads
    #: (:func:`~gds_offload.bench.weights.child.run_child`); 0: none.
    paired_raw: int = 2
    seed: int = 0


@dataclass
class ChildResult:
    """What every benchmark child reports for one mode at one batch size (``status``: ``ok``, or
    ``error`` with ``error`` set), and what its parent adds (round, memory group, comparison)."""

    mode: str
    batch: int
    round: int = 0
    status: str = "ok"
    error: str | None = None
    load_s: float | None = None
    #: Time the model's thread waited for reads (streamed modes).
    stall_s: float | None = None
    torch_threads: int | None = None
    peak_rss_bytes: int | None = None
    cgroup_peak_bytes: int | None = None
    cgroup_limit_bytes: int | None = None
    matches_resident: bool | None = None


@dataclass
class ModeResult(ChildResult):
    """Inference of one mode at one batch size. Times and bytes are medians over the child's
    repeats; ``stall_s`` is per prefill + decode."""

    prefill_s: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_s: float | None = None
    decode_tokens_per_s: float | None = None
    #: Bytes this process read from storage (``/proc/self/io``) in the prefill and in the decode steps.
    prefill_read_bytes: int | None = None
    decode_read_bytes: int | None = None
    #: ``decode_read_bytes / decode_s``: the drive rate the decode steps drew.
    decode_read_bytes_per_s: float | None = None
    #: Bytes read from storage per decoded token.
    drive_bytes_per_token: float | None = None
    #: ``drive`` and ``accelerate-disk``: the raw O_DIRECT rate measured around extra decodes, and the
    #: decodes' read rate over it (medians of the pairs; see :attr:`BenchSpec.paired_raw`).
    raw_paired_bytes_per_s: float | None = None
    decode_read_vs_raw: float | None = None
    #: Store bytes the streamed modes filled per forward (their own count).
    store_bytes_per_forward: float | None = None
    engine: str | None = None
    #: Fraction of the checkpoint's and the store's bytes in the page cache when the child started.
    cached_fraction_before: float | None = None
    #: The machine's 1-minute load average when the child started and when it ended (other jobs show here).
    load_avg: tuple[float, float] | None = None
    tokens: list[list[int]] = field(default_factory=list)
    logits_xxh3: str | None = None


# -- the parent -----------------------------------------------------------------------------
class ModelShape(Protocol):
    """What :func:`prepare` builds a checkpoint from: a transformers config and the weights' dtype."""

    @property
    def dtype(self) -> str: ...

    def config(self) -> Any: ...


def prepare(model: ModelShape, workdir: Path, checkpoint: Path | None = None) -> tuple[Path, Path]:
    """``(checkpoint, store)`` in ``workdir``: a random-weight checkpoint (unless given) and its store."""
    import torch
    import transformers

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


_Row = TypeVar("_Row", bound=Any)


def run_rounds(modes: list[str], rounds: int, *, memory_limit: int | None, workdir: Path, say: Callable[[str], None],
               run: Callable[[str, int | None], list[_Row]], capped: Sequence[str] = CAPPED) -> list[_Row]:  # fmt: skip
    """``run(mode, cap)`` for every mode, ``rounds`` times: round ``k`` starts ``k`` modes later, so a
    slow spell of a shared machine does not always hit the same mode; modes in ``capped`` get
    ``memory_limit``. Each row's ``round`` is set. Accelerate's offload folders are removed after.
    With a ``memory_limit``, before the first child: the limit is checked
    (:func:`~gds_offload.bench.cgroup.check_limit`: a bad one raises ``ConfigError`` here, not
    when the first capped child starts), and the memory groups left by benchmark parents that
    were killed are removed (:func:`~gds_offload.bench.cgroup.remove_stale_groups`), each one ``say``-ed."""

    rows: list[_Row] = []
    if memory_limit is not None:
        check_limit(memory_limit, name=f"memory_limit={memory_limit}")
        for line in remove_stale_groups():
            say(line)
    try:
        for k in range(rounds):
            for mode in modes[k % len(modes) :] + modes[: k % len(modes)]:
                limit = memory_limit if mode in capped else None
                say(f"round {k + 1}/{rounds}: {mode}" + (f" (cap {limit} bytes)" if limit is not None else ""))
                for r in run(mode, limit):
                    r.round = k
                    rows.append(r)
    finally:
        remove_offload_folders(workdir)
    return rows


def remove_offload_folders(workdir: Path) -> None:
    """Remove the ``offload_folder`` each ``accelerate-disk`` child made (empty with a safetensors checkpoint)."""
    for d in workdir.glob("accelerate-offload-*"):
        shutil.rmtree(d, ignore_errors=True)


def weight_files(checkpoint: Path, store: Path) -> list[Path]:
    """The files holding the weights: the checkpoint's safetensors shards and the store's data files."""

    m = read_manifest(store)
    dirs = [store] + [Path(d) for d in m.dirs[1:]]  # a striped store's other directories, as converted
    return sorted(checkpoint.glob("*.safetensors")) + [dirs[f.dir] / f.path for f in m.files]


def child_env() -> dict[str, str]:
    """A benchmark child's environment (:func:`gds_offload.bench.procs.child_env`), offline, and
    large frees back to the kernel in every mode (see the module doc)."""
    return procs.child_env({"HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"})


def child_rows(module: str, spec: ChildSpec, *, memory_limit: int | None, timeout_s: float) -> tuple[list[dict[str, Any]], procs.ChildRun]:
    """Run ``spec`` in ``python -m module`` (under a memory cap if given): the ``row`` events it
    emitted (one per batch size; a batch's last row wins), and how it ended."""
    run = procs.run_child(procs.child_command(module, json.dumps(asdict(spec))), env=child_env(), memory_limit=memory_limit,
                          timeout_s=timeout_s)  # fmt: skip
    rows = {e["batch"]: {k: v for k, v in e.items() if k != "event"} for e in run.events if e.get("event") == "row"}
    return list(rows.values()), run


def serve_rows(argv: list[str] | None, module: str, spec_type: Callable[..., Any], run: Callable[[Any], Iterable[Any]]) -> int:
    """A child's side of :func:`child_rows`: read its ``--spec`` (``batch_sizes`` a list in JSON),
    then emit each dataclass ``run(spec)`` yields as a ``row`` event."""
    spec_d = json.loads(procs.read_spec(argv, module, f"one mode of a weight benchmark ({module})"))
    spec = spec_type(**(spec_d | {"batch_sizes": tuple(spec_d["batch_sizes"])}))
    for r in run(spec):
        procs.emit({"event": "row", **asdict(r)})
    return 0


def run_inference_mode(spec: BenchSpec, *, memory_limit: int | None = None, timeout_s: float = 3600) -> list[ModeResult]:
    """Run one mode in a child process (under a memory cap if given) after dropping the weights'
    page cache; errors become ``status="error"`` rows."""

    files = weight_files(Path(spec.checkpoint), Path(spec.store))
    evict(files)
    cached = cached_bytes(files)
    fraction = sum(c for c, _ in cached.values()) / max(1, sum(n for _, n in cached.values()))
    load_before = os.getloadavg()[0]
    # A batch's last row wins: the drive-reading children repeat each batch's row with the raw pairs.
    rows, run = child_rows("gds_offload.bench.weights.child", spec, memory_limit=memory_limit, timeout_s=timeout_s)
    rep = run.cap
    if run.returncode != 0:  # the batch sizes it did not report failed
        done = {r["batch"] for r in rows}
        rows += [asdict(ModeResult(spec.mode, b, status="error", error=run.failure())) for b in spec.batch_sizes if b not in done]
    results = [ModeResult(**r) for r in rows]
    for r in results:
        r.cached_fraction_before, r.load_avg = fraction, (load_before, os.getloadavg()[0])
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
    raw_depths: tuple[int, ...] = (1, 4, 8),
    interference_s: float = 2.0,
    progress: Any = None,
) -> dict[str, Any]:
    """Prepare the checkpoint and store, measure the drive, run every mode ``rounds`` times (round
    ``k`` starts ``k`` modes later, so a slow spell of a shared machine does not always hit the
    same mode), measure the drive again, compare outputs with ``resident``'s.

    ``memory_limit`` caps the modes in :data:`CAPPED`; ``interference_s`` is how long each timing of
    :func:`~gds_offload.bench.weights.drive.read_interference` computes. ``progress(text)`` is called before each step.
    Returns a JSON-ready dict: ``model``, ``spec``, ``raw_read`` (every pass), ``interference``
    (:func:`~gds_offload.bench.weights.drive.read_interference` at the best depth), ``summary``
    (per mode and batch, medians over rounds) and ``results`` (every row).
    """

    say = progress or (lambda text: None)
    say("preparing the checkpoint and the store")
    ckpt, store = prepare(model, Path(base.workdir), checkpoint)
    m = read_manifest(store)
    data = weight_files(ckpt, store)[-1]
    say(f"raw O_DIRECT reads of {data}")
    if base.device.startswith("cuda"):  # the GPU engine reads as deep as its threads: compare at that depth too
        raw_depths = tuple(sorted({*raw_depths, base.num_threads or KVIKIO_THREADS}))
    raw = [dict(r.as_dict(), when="before") for r in raw_read_bandwidth(data, depths=raw_depths)]
    rows = run_rounds(modes, rounds, memory_limit=memory_limit, workdir=Path(base.workdir), say=say,
                      run=lambda mode, limit: run_inference_mode(replace(base, mode=mode, checkpoint=str(ckpt), store=str(store)), memory_limit=limit))  # fmt: skip
    best = max(raw, key=lambda r: r["bytes_per_s"])["depth"]
    say("raw O_DIRECT reads again")
    raw += [dict(r.as_dict(), when="after") for r in raw_read_bandwidth(data, depths=(best,))]
    interference: dict[str, Any]
    if base.device.startswith("cuda"):
        # The probe times CPU matmuls: on a GPU it would not say what reading costs the model's compute.
        interference = {"skipped": f"the model computes on {base.device}; the probe times matmuls on the CPU"}
    else:
        say("compute alone and beside O_DIRECT reads")
        # Shaped like the model's MLP at the largest batch: what the streamed modes compute while reading.
        interference = read_interference(data, rows=max(base.batch_sizes), hidden=model.hidden, intermediate=model.intermediate, depth=best,
                                         seconds=interference_s).as_dict()
    ref = {(r.round, r.batch): r for r in rows if r.mode == "resident" and r.status == "ok"}
    for r in rows:
        want = ref.get((r.round, r.batch)) or next((x for x in ref.values() if x.batch == r.batch), None)
        if r.status == "ok" and want is not None:
            r.matches_resident = r.tokens == want.tokens and r.logits_xxh3 == want.logits_xxh3
    layer_bytes = [g.nbytes for g in m.layers]
    return {
        "model": asdict(model) | {"checkpoint": str(ckpt), "store": str(store), "layers_nbytes": sum(layer_bytes),
                                  "resident_nbytes": m.resident.nbytes if m.resident else 0, "largest_layer_nbytes": max(layer_bytes, default=0)},  # fmt: skip
        "spec": {k: v for k, v in asdict(base).items() if k not in ("mode", "checkpoint", "store")}
        | {"memory_limit_bytes": memory_limit, "memory_limit_applies_to": [x for x in modes if x in CAPPED] if memory_limit else [], "rounds": rounds},
        "raw_read": raw,
        "interference": interference,
        "summary": summarize(rows),
        "results": [asdict(r) for r in rows],
    }


#: The figures :func:`summarize` takes the median of, for inference.
SUMMARY_KEYS = ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_read_bytes_per_s", "drive_bytes_per_token", "prefill_read_bytes",
                "store_bytes_per_forward", "raw_paired_bytes_per_s", "decode_read_vs_raw", "stall_s", "peak_rss_bytes", "cgroup_peak_bytes",
                "cgroup_limit_bytes", "cached_fraction_before")  # fmt: skip


def summarize(rows: list[Any], keys: tuple[str, ...] = SUMMARY_KEYS) -> list[dict[str, Any]]:
    r"""Per (mode, batch) of ``rows`` (:class:`ChildResult`\ s): medians over rounds of ``keys``, the
    errors, and ``matches_resident`` only if every round matched."""
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
