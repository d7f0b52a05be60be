"""Running the peers (:mod:`gds_offload.bench.weights.peers`) each in a capped child, and
finding each one's best batch: the seam a benchmark driver calls.

* :func:`run_peer`: one child under ``memory_limit`` (a cgroup v1 memory group,
  :func:`gds_offload.bench.procs.run_child`, page cache included), after dropping the peer's
  weight files from the page cache, so that no run starts with weights another left cached.
  Returns a :class:`PeerResult`; a failure is a ``status``, never an exception (bad arguments
  raise ``ConfigError`` before any child starts). A peer whose package (or DeepSpeed's
  ``async_io`` op) is missing here is ``"unsupported"`` without a child; a child killed by
  ``SIGKILL`` under the cap (the kernel's OOM killer) is ``"oom"``.
* :func:`prepare_peer`: a peer's one-time preparation, uncapped and not measured (for
  ``airllm``: splitting the checkpoint into per-layer shards, AirLLM's counterpart of
  converting to a store; it loads the whole, memory-mapped, checkpoint once per module).
  :func:`run_peer` calls it when AirLLM's shards are not all there; for
  ``deepspeed-zero-inference``: loading its ``async_io`` op once outside the cap
  (:func:`~gds_offload.bench.weights.peer_loaders.build_deepspeed_ops`), before every run, so that
  no compiler runs under the cap. DeepSpeed writes its NVMe swap files at every load, in ``setup_s``.
* :func:`best_batch`: short probes (the first ``b`` prompts as one batch, a few new tokens) at
  growing batch sizes until one fails (out of memory, timeout) or is clearly slower than the
  best so far; each probe's throughput is extrapolated to the full workload
  (:func:`workload_tokens_per_s`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gds_offload.bench import procs
from gds_offload.bench.cgroup import check_limit
from gds_offload.bench.weights.bench import child_env, remove_offload_folders
from gds_offload.bench.weights.drive import evict
from gds_offload.bench.weights.peer_loaders import airllm_dir, airllm_ready, build_deepspeed_ops, deepspeed_nvme_dir, peer_support
from gds_offload.bench.weights.peers import MODULE, PEERS, REFERENCE, PeerSpec, check_peer, check_prompts
from gds_offload.errors import ConfigError
from gds_offload.units import checked_int, format_bytes

__all__ = ["BATCHES", "STATUSES", "BatchPoint", "BatchSearch", "PeerResult", "best_batch", "peer_env", "prepare_peer", "run_peer",
           "tokens_digest", "weight_files", "workload_tokens_per_s", "PEERS", "REFERENCE"]  # fmt: skip

#: The batch sizes :func:`best_batch` tries, in order.
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STATUSES = ("ok", "oom", "error", "unsupported")


def tokens_digest(tokens: Sequence[Sequence[int]]) -> str:
    """SHA-256 of the token ids (JSON, no spaces): equal digests, equal tokens."""
    return hashlib.sha256(json.dumps([list(map(int, t)) for t in tokens], separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class PeerResult:
    """One run of a peer (or of the reference, ``"resident"``) over its prompts.

    Attributes:
        status: ``"ok"``; ``"oom"`` (killed under its memory cap, or an allocation refused);
            ``"error"`` (``error`` says what and where); ``"unsupported"`` (its package or op is
            missing here: ``error`` names it).
        prompts, max_new_tokens: the workload.
        generated_tokens: new tokens made, every prompt's cut after its first end token.
        tokens_per_s: ``generated_tokens / (prefill_s + decode_s)``: over every batch of the run,
            generation only (``setup_s``, the load, is apart).
        prefill_s, decode_s: summed over batches (the child's module doc says where each ends).
        setup_s: the peer's load in the child; ``prepare_s``: its one-time preparation, if this
            call ran one (AirLLM's split), uncapped and not in any other figure.
        wall_s: the child's life, start to exit.
        peak_rss_bytes: the child's peak resident set; ``cgroup_peak_bytes``: its memory group's
            peak, page cache included (capped runs).
        bytes_read: bytes the child read from storage while generating (page-cache hits excluded).
        forwards: forwards of the model per batch.
        tokens: each prompt's new tokens, input order; ``tokens_sha256``: :func:`tokens_digest` of them.
    """

    peer: str
    batch: int
    status: str = "ok"
    error: str | None = None
    prompts: int = 0
    max_new_tokens: int = 0
    generated_tokens: int = 0
    tokens_per_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    setup_s: float | None = None
    prepare_s: float | None = None
    wall_s: float | None = None
    peak_rss_bytes: int | None = None
    cgroup_peak_bytes: int | None = None
    cgroup_limit_bytes: int | None = None
    bytes_read: int | None = None
    forwards: tuple[int, ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()
    tokens_sha256: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    returncode: int | None = None
    #: The machine's 1-minute load average when the child started and when it ended.
    load_avg: tuple[float, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def peer_env() -> dict[str, str]:
    """A peer child's environment: the weight benchmarks' (:func:`~gds_offload.bench.weights.bench.child_env`)
    and DeepSpeed's CPU accelerator."""
    return child_env() | {"DS_ACCELERATOR": "cpu"}


def weight_files(peer: str, checkpoint: str | Path, workdir: str | Path) -> list[Path]:
    """The files ``peer`` reads its weights from: the checkpoint's shards (AirLLM: its own shards too)."""
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if peer == "airllm":
        files += sorted((airllm_dir(workdir) / "splitted_model").glob("*.safetensors"))
    return files


def _check_run(peer: str, checkpoint: str | Path, timeout_s: float, memory_limit: int | None) -> str:
    peer = check_peer(peer)
    if not Path(checkpoint, "config.json").is_file():
        raise ConfigError(f"checkpoint={checkpoint}: no config.json there; pass a Hugging Face checkpoint directory (safetensors and config.json)")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ConfigError(f"timeout_s={timeout_s!r}: give the seconds a child may run, a number > 0")
    if memory_limit is not None:
        check_limit(memory_limit, name=f"memory_limit={memory_limit}")
    return peer


def _spawn(spec: PeerSpec, prompts: list[list[int]], *, memory_limit: int | None, timeout_s: float) -> PeerResult:
    """Run ``spec`` in a child; its ``result`` event, or why it ended without one, as a :class:`PeerResult`."""
    work = Path(spec.workdir)
    prompts_file = Path(spec.prompts_file)
    prompts_file.write_text(json.dumps(prompts))
    evict(weight_files(spec.peer, spec.checkpoint, work))
    load_before = os.getloadavg()[0]
    try:
        run = procs.run_child(procs.child_command(MODULE, json.dumps(asdict(spec))), env=peer_env(), memory_limit=memory_limit,
                              timeout_s=timeout_s)  # fmt: skip
    finally:
        prompts_file.unlink(missing_ok=True)
        remove_offload_folders(work)  # Accelerate's offload folder, left by a child that was killed
        if spec.peer == "deepspeed-zero-inference":
            shutil.rmtree(deepspeed_nvme_dir(work), ignore_errors=True)  # its swap files, likewise
    got = run.last("result")
    base = PeerResult(spec.peer, spec.batch, prompts=len(prompts), max_new_tokens=spec.max_new_tokens, wall_s=run.wall_s,
                      returncode=run.returncode, load_avg=(load_before, os.getloadavg()[0]),
                      cgroup_peak_bytes=run.cap.peak_bytes if run.cap else None, cgroup_limit_bytes=run.cap.limit_bytes if run.cap else None)  # fmt: skip
    if got is None:
        oom = run.returncode == -9 and not run.timed_out and run.cap is not None
        why = f"out of memory at batch {spec.batch} under a {format_bytes(run.cap.limit_bytes)} cap ({run.failure()})" if oom and run.cap else run.failure()
        return replace(base, status="oom" if oom else "error", error=why)
    tokens = tuple(tuple(t) for t in got["tokens"])
    total = (got["prefill_s"] or 0.0) + (got["decode_s"] or 0.0)
    n = sum(len(t) for t in tokens)
    return replace(base, status=got["status"], error=got["error"], generated_tokens=n, tokens_per_s=n / total if tokens and total > 0 else None,
                   prefill_s=got["prefill_s"], decode_s=got["decode_s"], setup_s=got["setup_s"], peak_rss_bytes=got["peak_rss_bytes"],
                   bytes_read=got["bytes_read"], forwards=tuple(got["forwards"]), tokens=tokens,
                   tokens_sha256=tokens_digest(tokens) if tokens else None, settings=got["settings"])  # fmt: skip


def _spec(peer: str, checkpoint: str | Path, work: Path, max_new_tokens: int, batch: int, prepare_only: bool = False) -> PeerSpec:
    work.mkdir(parents=True, exist_ok=True)
    return PeerSpec(peer, str(checkpoint), str(work), str(work / f"peer-prompts-{os.getpid()}.json"), max_new_tokens, batch, prepare_only)


def prepare_peer(peer: str, *, checkpoint: str | Path, workdir: str | Path, timeout_s: float = 3600) -> PeerResult | None:
    """``peer``'s one-time preparation (uncapped; see the module doc). ``None`` for the peers that
    need none; else the preparing child's result (``setup_s``: how long it took)."""
    peer = _check_run(peer, checkpoint, timeout_s, None)
    if peer not in ("airllm", "deepspeed-zero-inference"):
        return None
    ok, why = peer_support(peer)
    if not ok:
        return PeerResult(peer, 1, status="unsupported", error=why)
    if peer == "deepspeed-zero-inference":
        t = time.perf_counter()
        built, why = build_deepspeed_ops(timeout_s=timeout_s)
        return PeerResult(peer, 1, status="ok" if built else "error", error=why or None, setup_s=time.perf_counter() - t)
    return _spawn(_spec(peer, checkpoint, Path(workdir), 1, 1, prepare_only=True), [], memory_limit=None, timeout_s=timeout_s)


def run_peer(peer: str, *, checkpoint: str | Path, workdir: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch: int,
             memory_limit: int | None, timeout_s: float = 3600) -> PeerResult:  # fmt: skip
    """Run ``peer`` (one of :data:`PEERS`, or ``"resident"``, the reference) over ``prompts``,
    ``batch`` at a time, ``max_new_tokens`` greedy tokens each, in a child under ``memory_limit``
    bytes (``None``: uncapped) killed after ``timeout_s``. ``workdir`` holds the peer's files
    (AirLLM's shards, kept for later runs; DeepSpeed's swap files and Accelerate's offload folder,
    removed after the run).

    Raises:
        ConfigError: an unknown peer, no checkpoint, bad prompts, ``batch`` or ``max_new_tokens``,
            or a memory cap that cannot be had; before any child starts.
    """
    peer = _check_run(peer, checkpoint, timeout_s, memory_limit)
    checked_int("batch", batch, low=1, what="prompts per generate call")
    checked_int("max_new_tokens", max_new_tokens, low=1, what="tokens to generate per prompt")
    todo = check_prompts(prompts)
    ok, why = peer_support(peer)
    if not ok:
        return PeerResult(peer, batch, status="unsupported", error=why, prompts=len(todo), max_new_tokens=max_new_tokens)
    prepare_s = None
    if (peer == "airllm" and not airllm_ready(checkpoint, workdir)) or peer == "deepspeed-zero-inference":
        prep = prepare_peer(peer, checkpoint=checkpoint, workdir=workdir, timeout_s=timeout_s)
        assert prep is not None, f"{peer} has a preparation"
        if prep.status != "ok":
            what = "AirLLM's shards" if peer == "airllm" else "DeepSpeed's async_io op, uncapped"
            return replace(prep, batch=batch, prompts=len(todo), max_new_tokens=max_new_tokens, error=f"preparing {what}: {prep.error}")
        prepare_s = prep.setup_s
    r = _spawn(_spec(peer, checkpoint, Path(workdir), max_new_tokens, batch), todo, memory_limit=memory_limit, timeout_s=timeout_s)
    return replace(r, prepare_s=prepare_s)


def workload_tokens_per_s(result: PeerResult, *, max_new_tokens: int) -> float | None:
    """A probe's throughput carried over to a workload of ``max_new_tokens`` per prompt: its
    batches' prefill time plus its decode time scaled from the probe's ``k - 1`` decode steps to
    ``max_new_tokens - 1``, for its ``prompts * max_new_tokens`` new tokens. ``None`` for a failed
    probe, or one with no decode step to scale."""
    if result.status != "ok" or result.prefill_s is None or result.decode_s is None:
        return None
    steps = max(result.forwards, default=0) - 1  # decode forwards in the probe's batches
    if steps < 1:
        return None
    t = result.prefill_s + result.decode_s * (max_new_tokens - 1) / steps
    return result.prompts * max_new_tokens / t if t > 0 else None


@dataclass(frozen=True)
class BatchPoint:
    """One probe of :func:`best_batch`: its result and its :func:`workload_tokens_per_s` (``None``: it failed)."""

    batch: int
    result: PeerResult
    est_tokens_per_s: float | None


@dataclass(frozen=True)
class BatchSearch:
    """What :func:`best_batch` tried (``points``, in order), the fastest (``best``; ``None`` if no
    probe succeeded) and why it stopped (``stopped``)."""

    peer: str
    points: tuple[BatchPoint, ...]
    best: BatchPoint | None
    stopped: str


def _check_search(batches: Sequence[int], probe_new_tokens: int, tolerance: float) -> None:
    checked_int("probe_new_tokens", probe_new_tokens, low=2, what="new tokens per probe (one prefill and at least one decode step)")
    if not 0 <= tolerance < 1:
        raise ConfigError(f"tolerance={tolerance!r}: a fraction in [0, 1) of the best throughput a probe may fall short by before the search stops")
    if not batches:
        raise ConfigError("batches=(): give the batch sizes to try, growing, e.g. (1, 2, 4, 8)")
    for b in batches:
        checked_int("batches", b, low=1, what="a batch size to try")
    if list(batches) != sorted(set(batches)):
        raise ConfigError(f"batches={tuple(batches)}: the search goes upward; give the batch sizes growing, each once, e.g. (1, 2, 4, 8)")


def best_batch(peer: str, *, checkpoint: str | Path, workdir: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               memory_limit: int | None, batches: Sequence[int] = BATCHES, probe_new_tokens: int = 4, tolerance: float = 0.05,
               timeout_s: float = 1800, say: Callable[[str], None] | None = None, run: Callable[..., PeerResult] | None = None,
               ) -> BatchSearch:  # fmt: skip
    """Probe ``peer`` at each of ``batches`` in turn (one batch: the first ``b`` prompts,
    ``probe_new_tokens`` new tokens each) until a probe fails (out of memory, timeout, error) or
    its :func:`workload_tokens_per_s` (for ``max_new_tokens`` per prompt) is more than
    ``tolerance`` (a fraction) below the best so far: on a shared machine two probes of one
    speed differ by a few percent, and a plateau is not a slowdown. Batches larger than the
    prompts are not tried. ``say(text)`` is told each probe's outcome; ``run`` replaces
    :func:`run_peer` (same arguments).

    Raises:
        ConfigError: bad ``batches`` (not growing), ``probe_new_tokens`` < 2, ``tolerance``
            outside [0, 1); and :func:`run_peer`'s, before any child starts.
    """
    _check_search(batches, probe_new_tokens, tolerance)
    peer = _check_run(peer, checkpoint, timeout_s, memory_limit)
    checked_int("max_new_tokens", max_new_tokens, low=1, what="tokens to generate per prompt in the workload")
    todo = check_prompts(prompts)
    run = run_peer if run is None else run
    points: list[BatchPoint] = []
    best: BatchPoint | None = None
    stopped = f"tried every batch size up to {batches[-1]}"
    for b in batches:
        if b > len(todo):
            stopped = f"batch {b} is more than the {len(todo)} prompts"
            break
        r = run(peer, checkpoint=checkpoint, workdir=workdir, prompts=todo[:b], max_new_tokens=probe_new_tokens, batch=b,
                memory_limit=memory_limit, timeout_s=timeout_s)  # fmt: skip
        p = BatchPoint(b, r, workload_tokens_per_s(r, max_new_tokens=max_new_tokens))
        points.append(p)
        if say is not None:
            say(f"{peer} batch {b}: " + (f"{r.status}: {r.error}" if p.est_tokens_per_s is None else f"{p.est_tokens_per_s:.2f} tokens/s (workload estimate)"))
        if p.est_tokens_per_s is None:
            stopped = f"batch {b}: {r.status}" + (f" ({r.error})" if r.error else "")
            break
        if best is None or best.est_tokens_per_s is None or p.est_tokens_per_s > best.est_tokens_per_s:
            best = p
        elif p.est_tokens_per_s < (1 - tolerance) * best.est_tokens_per_s:
            stopped = f"batch {b} is slower than batch {best.batch} by more than {tolerance:.0%}"
            break
    return BatchSearch(peer, tuple(points), best, stopped)
