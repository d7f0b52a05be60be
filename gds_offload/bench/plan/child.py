"""One mode of ``gds-offload bench-plan`` in a child process (the protocol: :mod:`gds_offload.bench.procs`).

Modes, each on the benchmark's workload (``prompts`` prompts of ``prompt_len`` tokens, ``new_tokens``
new tokens each, greedy), over the first ``measure_prompts`` of them (slow modes measure a subset:
every batch of a mode has the same shape, so its rate is the workload's):

* ``resident``: the model in memory (``from_pretrained``, frozen and aligned as the stream's
  reference is), Hugging Face ``generate`` in batches of ``batch``;
* ``naive``: today's API without a plan: ``load_streamed(slots=2)``, ``generate`` in batches of ``batch``;
* ``planned``: the plan ``gds_offload.weights.plan`` made under the cap (in the parent, before: as
  ``gds-offload plan`` would), applied with ``load_streamed(plan=)`` and ``generate_many``; the
  plan's prediction is reported beside the measurement;
* ``pretrained``: what a user runs under the cap: ``from_pretrained(memory=the cap, workload=...)``
  measures, plans and loads inside this capped process, then ``generate_many`` with its plan;
* ``sweep``: ``generate_many`` at a given choice (micro-batch, per load, resident layers, slots, KV);
* ``reference``: the resident model generating given micro-batches, for the exactness check.

Time is split into prefill and decode by the layer that runs: hooks on every decoder layer stamp
each layer call; the time from one stamp to the next goes to the phase of the micro-batch that
made the first: a decoder forward is a prefill's while the positions it ends at (those cached before
and its own) are within the prompt.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from gds_offload.bench import procs
from gds_offload.weights import Generate, Plan, as_reference, from_pretrained, load_streamed
from gds_offload.weights.planning.options import KVPlacement
from gds_offload.weights.planning.workload import Choice

MODES = ("resident", "naive", "planned", "pretrained", "sweep", "reference")


@dataclass(frozen=True)
class PlanChildSpec:
    """One child's work: ``mode`` (see the module doc) on the store and checkpoint, the workload's
    shape, and what the mode needs (a batch, a choice, the plan, the micro-batches to re-run)."""

    mode: str
    store: str
    checkpoint: str
    workdir: str
    prompts: int
    prompt_len: int
    new_tokens: int
    measure_prompts: int
    memory_limit: int | None = None
    batch: int = 8
    choice: dict[str, Any] | None = None
    reference: list[Any] | None = None
    plan: dict[str, Any] | None = None
    check_batches: int = 2
    seed: int = 0


def workload_prompts(vocab: int, prompts: int, prompt_len: int, seed: int = 0) -> list[torch.Tensor]:
    """The workload's prompts: random tokens in ``[1, vocab)`` (seeded), ``prompt_len`` each; every
    mode and peer gets the same ones."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (prompt_len,), generator=g) for _ in range(prompts)]


def make_prompts(vocab: int, spec: PlanChildSpec) -> list[Any]:
    """:func:`workload_prompts` for ``spec``."""
    return list(workload_prompts(vocab, spec.prompts, spec.prompt_len, spec.seed))


class PhaseClock:
    """Wall time of a run split into prefill and decode (see the module doc)."""

    def __init__(self, decoder: Any, layers: list[Any], prompt_len: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.prompt_len = prompt_len
        self._clock = clock
        self._prefill: dict[int, bool] = {}  # each thread's last decoder pass: a prefill's
        self._last: tuple[float, bool] | None = None
        self.prefill_s = self.decode_s = 0.0
        self._lock = threading.Lock()
        self._handles = [decoder.register_forward_pre_hook(self._pass, with_kwargs=True)]
        self._handles += [layer.register_forward_pre_hook(self._stamp) for layer in layers]

    def start(self) -> None:
        self._prefill.clear()
        self._last = None

    def _pass(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # By position, not by count of passes: layer-major teams run on threads whose idents repeat.
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs["inputs_embeds"]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        with self._lock:
            self._prefill[threading.get_ident()] = past + x.shape[1] <= self.prompt_len
        self._stamp()

    def _stamp(self, *args: Any) -> None:
        now = self._clock()
        prefill = self._prefill.get(threading.get_ident(), True)
        with self._lock:
            if self._last is not None:
                t, was_prefill = self._last
                if was_prefill:
                    self.prefill_s += now - t
                else:
                    self.decode_s += now - t
            self._last = (now, prefill)

    def stop(self) -> None:
        self._stamp()
        self._last = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _peak_rss() -> int:
    """This process's peak resident memory (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class AnonPeak:
    """This process's largest anonymous and shared memory (``RssAnon + RssShmem``: what a plan's
    predicted peak counts; the libraries' file pages are left out, as the planner leaves them), sampled
    every ``interval_s`` on a daemon thread from :meth:`start` to :meth:`stop`. A spike shorter than
    the interval can be missed: the sampled peak is a lower bound of the true one."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s, self.peak = interval_s, 0
        self._done = threading.Event()
        self._lock = threading.Lock()  # split() resets the peak the sampler raises
        self._thread = threading.Thread(target=self._run, name="anon-peak", daemon=True)

    @staticmethod
    def now() -> int:
        held = 0
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("RssAnon:", "RssShmem:")):
                held += int(line.split()[1]) * 1024
        return held

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            held = self.now()
            with self._lock:
                self.peak = max(self.peak, held)

    def start(self) -> AnonPeak:
        self.peak = self.now()
        self._thread.start()
        return self

    def split(self) -> int:
        """The peak so far; from now the peak counts afresh (a phase's own peak)."""
        held = self.now()
        with self._lock:
            peak, self.peak = max(self.peak, held), held
        return peak

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())
        return self.peak


def _skeleton(store: Path) -> Any:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(store)).eval()


def _batched(model: Any, prompts: list[Any], batch: int, new_tokens: int, clock: PhaseClock) -> list[list[int]]:
    out: list[list[int]] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch):
            ids = torch.stack(prompts[start : start + batch])
            seqs = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)  # fmt: skip
            out.extend(seqs[:, ids.shape[1] :].tolist())
    return out


def run(spec: PlanChildSpec) -> dict[str, Any]:
    store, ckpt = Path(spec.store), Path(spec.checkpoint)
    cfg = transformers.AutoConfig.from_pretrained(store)
    prompts = make_prompts(cfg.vocab_size, spec)[: spec.measure_prompts]
    result: dict[str, Any] = {"mode": spec.mode, "prompts_measured": len(prompts), "new_tokens": spec.new_tokens}
    t_load = time.perf_counter()
    anon = AnonPeak().start()
    lm = None
    predicted = None
    model: Any
    if spec.mode in ("resident", "reference"):
        model = as_reference(transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval())
    elif spec.mode == "naive":
        lm = load_streamed(_skeleton(store), store, slots=2)
        model = lm.model
    else:
        if spec.mode == "planned":
            assert spec.plan is not None, "the planned mode runs the plan gds-offload plan made (uncapped, before)"
            chosen = Plan.from_dict(spec.plan)
            lm = load_streamed(_skeleton(store), store, plan=chosen)
        elif spec.mode == "pretrained":
            assert spec.memory_limit is not None, "the pretrained mode plans under the cap it runs in"
            workload = Generate(spec.prompts, spec.prompt_len, spec.new_tokens)
            lm = from_pretrained(ckpt, store=store, memory=spec.memory_limit, workload=workload, progress=False)
            chosen = lm.plan
        if spec.mode in ("planned", "pretrained"):
            choice = chosen.choice
            predicted = chosen.predicted
            result["plan"] = chosen.as_dict() | {"describe": chosen.describe()}
        else:
            c = dict(spec.choice or {})
            c["kv"] = KVPlacement(c.get("kv", "device"))
            choice = Choice(**c)
            lm = load_streamed(_skeleton(store), store, slots=choice.slots, resident_layers=choice.resident_layers)
        assert lm is not None
        model = lm.model
    result["load_s"] = time.perf_counter() - t_load
    result["load_peak_anon_bytes"] = anon.split()  # converting, measuring and loading; the run's peak is peak_anon_bytes
    if spec.mode == "reference":
        ref_out: list[Any] = []
        with torch.no_grad():
            for ids, mask, chunk in spec.reference or []:
                seqs = model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=spec.new_tokens,
                                      min_new_tokens=spec.new_tokens, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk)  # fmt: skip
                ref_out.append(seqs[:, len(ids[0]) :].tolist())
        return result | {"reference_tokens": ref_out, "peak_anon_bytes": anon.stop()}
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    clock = PhaseClock(decoder, list(decoder.layers), spec.prompt_len)
    clock.start()
    start = time.perf_counter()
    if spec.mode in ("resident", "naive"):
        tokens = _batched(model, prompts, spec.batch, spec.new_tokens, clock)
        result["batch"] = spec.batch
    else:
        assert lm is not None
        out = lm.generate_many(prompts, max_new_tokens=spec.new_tokens, plan=None if spec.mode == "sweep" else lm.plan,
                               micro_batch=choice.micro_batch, per_load=choice.per_load, kv=choice.kv, prefill_chunk=choice.prefill_chunk,
                               kv_path=Path(spec.workdir) / "kv", seed=0, pad_token_id=0, min_new_tokens=spec.new_tokens, do_sample=False)  # fmt: skip
        tokens = [t.tolist() for t in out.tokens]
        result["choice"] = asdict(choice) | {"kv": choice.kv.value}
        result["check"] = [
            {"ids": mb.input_ids.tolist(), "mask": mb.attention_mask.tolist(), "chunk": ch, "tokens": [tokens[i] for i in mb.indices]}
            for mb, ch in list(zip(out.micro_batches, out.prefill_chunks))[: spec.check_batches]
        ]
    total = time.perf_counter() - start
    clock.stop()
    clock.remove()
    generated = sum(len(t) for t in tokens)
    result |= {"total_s": total, "prefill_s": clock.prefill_s, "decode_s": clock.decode_s, "generated": generated,
               "tokens_per_s": generated / total, "prefill_tokens_per_s": len(prompts) * spec.prompt_len / clock.prefill_s if clock.prefill_s else None,
               "decode_tokens_per_s": (generated - len(prompts)) / clock.decode_s if clock.decode_s else None,
               "peak_rss_bytes": _peak_rss(), "peak_anon_bytes": anon.stop(), "peak_anon_interval_s": anon.interval_s}  # fmt: skip
    if lm is not None:
        s = lm.stats()
        result |= {"bytes_read": s.bytes_read + s.kv_bytes_read, "bytes_written": s.kv_bytes_written, "weight_bytes_read": s.bytes_read,
                   "kv_bytes_read": s.kv_bytes_read, "replans": s.replans}  # fmt: skip
        lm.close()
    if predicted is not None:
        result["predicted"] = {"tokens_per_s": predicted.tokens_per_s, "peak_bytes": predicted.peak_nbytes, "total_s": predicted.total_s,
                               "bound": predicted.bound}  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    spec = PlanChildSpec(**json.loads(procs.read_spec(argv, "gds_offload.bench.plan.child", "one mode of gds-offload bench-plan")))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    procs.emit({"event": "result", "result": run(spec)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
