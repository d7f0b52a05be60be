"""The peers of the weight benchmarks: what users would pick instead of streaming with this
library for a model larger than memory, each run in a child process of its own:
``python -m gds_offload.bench.weights.peers --spec JSON`` (the one child protocol,
:mod:`gds_offload.bench.procs`; started by :func:`gds_offload.bench.weights.peers_run.run_peer`,
which puts it in its memory group before letting it go).

The spec (:class:`PeerSpec`) names the peer, the checkpoint, a working directory, a file
holding the prompts (token ids as JSON: a workload's prompts outgrow one command-line
argument's 128 KiB), ``max_new_tokens`` and ``batch``. The child loads the peer's way
(:mod:`gds_offload.bench.weights.peer_loaders`), then generates greedily for the prompts
``batch`` at a time in input order (the last batch may be smaller), each batch left-padded to
its longest prompt with an attention mask, by Hugging Face's ``generate(input_ids,
attention_mask=..., max_new_tokens=..., do_sample=False, pad_token_id=pad)`` on the peer's
model: the pad id is the model's ``generation_config.pad_token_id``, else its
``eos_token_id``, else 0. It emits one ``result`` event (:class:`ChildReport`'s fields).

What is measured, with ``time.perf_counter`` in the child:

* ``setup_s``: loading, from before the loader to the model ready (not counted in ``total_s``).
* ``prefill_s``: per batch, from the call of ``generate`` to the end of its first forward of
  the model (a forward hook on the top-level ``*ForCausalLM`` module: ``generate`` calls it once
  per step, the first time with the whole prompt), summed over batches. It includes
  ``generate``'s own preparation before the first forward (inputs, cache), which is small.
* ``decode_s``: per batch, from the end of that first forward to the return of ``generate``
  (the choice of each token and ``max_new_tokens - 1`` forwards of one position), summed.
* ``total_s = prefill_s + decode_s``: generation only; no warm-up is run, so the first batch
  pays any one-time costs (first touches, lazily built kernels) as a user's first call would.
* ``bytes_read``: what the child read from storage while generating (``/proc/self/io``
  ``read_bytes``: page-cache hits excluded).
* ``peak_rss_bytes``: the child's ``VmHWM`` (resident set, not the page cache; the parent adds
  its memory group's peak, page cache included).

``tokens`` holds each prompt's new tokens in input order, cut after its first end token
(``eos_token_id``) if it made one: ``generate`` goes on padding a finished row while others
in its batch run, so what follows depends on the batch, not the prompt.

A failure while loading or generating is reported, not raised: ``status`` ``"unsupported"``
for a missing package (``ImportError``), ``"oom"`` for an allocation the cap refused
(``MemoryError``, torch's "can't allocate memory"), ``"error"`` otherwise. A spec the child
cannot use is refused with one line on stderr and exit status 2.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gds_offload.bench import procs
from gds_offload.bench.weights.child import peak_rss, read_bytes
from gds_offload.bench.weights.peer_loaders import LOADERS, Loaded
from gds_offload.errors import ConfigError
from gds_offload.units import checked_int

__all__ = ["PEERS", "REFERENCE", "MODULE", "ChildReport", "PeerSpec", "check_peer", "check_prompts", "end_token", "generate_batches", "left_pad",
           "pad_token", "read_prompts", "run_spec"]  # fmt: skip

PEERS = ("accelerate-disk", "airllm", "deepspeed-zero-inference")
#: Not a peer: the model resident in memory, run by the same child the same way; the tokens each peer should give.
REFERENCE = "resident"
MODULE = "gds_offload.bench.weights.peers"


def check_peer(peer: object) -> str:
    """``peer`` if it names a peer or the reference; else :class:`ConfigError` listing them."""
    if peer not in (*PEERS, REFERENCE):
        raise ConfigError(f"peer={peer!r}: unknown peer; expected one of {', '.join(PEERS)} (or {REFERENCE!r}, the reference)")
    return str(peer)


def check_prompts(prompts: object) -> list[list[int]]:
    """``prompts`` as a list of lists of token ids; else :class:`ConfigError` naming the bad one."""
    if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not prompts:
        raise ConfigError("prompts: give a non-empty list of prompts, each a non-empty list of token ids")
    for i, p in enumerate(prompts):
        if not isinstance(p, Sequence) or isinstance(p, str) or not p or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            raise ConfigError(f"prompts[{i}]: a prompt must be a non-empty list of token ids (ints >= 0); got {str(p)[:60]}")
    return [list(p) for p in prompts]


@dataclass(frozen=True)
class PeerSpec:
    """One peer child's work. ``prompts_file``: JSON, a list of prompts (lists of token ids).
    ``prepare_only``: load (AirLLM: split the checkpoint into its shards), generate nothing."""

    peer: str
    checkpoint: str
    workdir: str
    prompts_file: str
    max_new_tokens: int
    batch: int
    prepare_only: bool = False

    def __post_init__(self) -> None:
        check_peer(self.peer)
        checked_int("max_new_tokens", self.max_new_tokens, low=1, what="tokens to generate per prompt")
        checked_int("batch", self.batch, low=1, what="prompts per generate call")


def read_prompts(path: str | Path) -> list[list[int]]:
    """The prompts in ``path`` (JSON), checked by :func:`check_prompts`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"prompts_file={path}: cannot read a JSON list of prompts ({exc}); write one with json.dump(prompts)") from None
    return check_prompts(data)


@dataclass
class ChildReport:
    """What a peer child reports (see the module doc for what each time covers)."""

    peer: str
    batch: int
    status: str = "ok"
    error: str | None = None
    tokens: list[list[int]] = field(default_factory=list)
    prefill_s: float | None = None
    decode_s: float | None = None
    total_s: float | None = None
    setup_s: float | None = None
    peak_rss_bytes: int | None = None
    bytes_read: int | None = None
    #: Forwards of the model per batch (1 prefill + ``max_new_tokens - 1`` decodes when no batch stopped early).
    forwards: list[int] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)


def _first_int(value: object) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def pad_token(model: Any) -> int:
    """The id left padding uses: ``generation_config.pad_token_id``, else ``eos_token_id``, else 0."""
    cfg = getattr(model, "generation_config", None)
    for name in ("pad_token_id", "eos_token_id"):
        v = _first_int(getattr(cfg, name, None))
        if v is not None:
            return v
    return 0


def end_token(model: Any) -> set[int]:
    """The ids that end a sequence (``generation_config.eos_token_id``; none: empty)."""
    v = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    vals = v if isinstance(v, list) else [v]
    return {t for t in vals if isinstance(t, int)}


def left_pad(prompts: Sequence[Sequence[int]], pad: int) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)``: ``prompts`` left-padded with ``pad`` to the longest."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[r, width - len(p) :] = 1
    return ids, mask


class _FirstForward:
    """A forward hook on the model: the time its first forward since :meth:`reset` ended, and the count."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.first_end: float | None = None
        self.calls = 0

    def __call__(self, _module: Any, _args: Any, _output: Any) -> None:
        self.calls += 1
        if self.first_end is None:
            self.first_end = time.perf_counter()


def _cut(row: list[int], ends: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in ends:
            return row[: i + 1]
    return row


def generate_batches(model: Any, prompts: Sequence[Sequence[int]], *, batch: int, max_new_tokens: int) -> dict[str, Any]:
    """Greedy generation for ``prompts``, ``batch`` at a time (see the module doc): tokens and times."""
    import torch

    pad, ends = pad_token(model), end_token(model)
    hook = _FirstForward()
    handle = model.register_forward_hook(hook)
    tokens: list[list[int]] = []
    prefill = decode = 0.0
    forwards = []
    try:
        with torch.no_grad():
            for start in range(0, len(prompts), batch):
                chunk = prompts[start : start + batch]
                ids, mask = left_pad(chunk, pad)
                hook.reset()
                t0 = time.perf_counter()
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
                t1 = time.perf_counter()
                first = hook.first_end if hook.first_end is not None else t1
                prefill += first - t0
                decode += t1 - first
                forwards.append(hook.calls)
                seqs = out if isinstance(out, torch.Tensor) else out.sequences
                tokens += [_cut(row, ends) for row in seqs[:, ids.shape[1] :].tolist()]
    finally:
        handle.remove()
    return {"tokens": tokens, "prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode, "forwards": forwards}


def _status(exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return "unsupported"
    if isinstance(exc, MemoryError) or "can't allocate memory" in str(exc) or "out of memory" in str(exc).lower():
        return "oom"
    return "error"


def _describe(exc: BaseException) -> str:
    tb = traceback.format_exc().strip().splitlines()
    where = tb[-3].strip() if len(tb) >= 3 else ""
    return f"{type(exc).__name__}: {exc}" + (f" ({where})" if where else "")


def run_spec(spec: PeerSpec, prompts: Sequence[Sequence[int]]) -> ChildReport:
    """Load ``spec.peer`` in this process and generate for ``prompts`` (see the module doc). An
    exception while loading or generating becomes ``status``/``error``, not a crash."""
    r = ChildReport(spec.peer, spec.batch)
    loaded: Loaded | None = None
    try:
        t = time.perf_counter()
        loaded = LOADERS[spec.peer](spec.checkpoint, spec.workdir)
        loaded.model.train(False)
        r.setup_s, r.settings = time.perf_counter() - t, loaded.settings
        if not spec.prepare_only:
            r0 = read_bytes()
            got = generate_batches(loaded.model, prompts, batch=spec.batch, max_new_tokens=spec.max_new_tokens)
            r.bytes_read = read_bytes() - r0
            r.tokens, r.prefill_s, r.decode_s, r.total_s, r.forwards = got["tokens"], got["prefill_s"], got["decode_s"], got["total_s"], got["forwards"]
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
        r.status, r.error = _status(exc), _describe(exc)
    finally:
        if loaded is not None:
            try:
                loaded.close()
            except Exception as exc:  # noqa: BLE001 - a failed cleanup is reported, the result kept
                if r.error is None:
                    r.status, r.error = "error", f"cleanup failed: {type(exc).__name__}: {exc}"
    r.peak_rss_bytes = peak_rss()
    return r


def main(argv: list[str] | None = None) -> int:
    """The child: ``--spec JSON`` (:class:`PeerSpec`); emits one ``result`` event."""
    text = procs.read_spec(argv, MODULE, "one peer of the weight benchmarks: load it, generate, report")
    try:
        spec = PeerSpec(**json.loads(text))
        prompts = [] if spec.prepare_only else read_prompts(spec.prompts_file)
    except (ConfigError, TypeError, ValueError) as exc:
        print(f"bad spec: {exc}", file=sys.stderr)
        return 2
    procs.emit({"event": "result", **asdict(run_spec(spec, prompts))})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
