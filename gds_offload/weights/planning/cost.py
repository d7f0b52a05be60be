"""The planner's cost model (:mod:`gds_offload.weights.planning.planner`): a choice's predicted time, drive
traffic and peak memory for a workload, from a measured :class:`~gds_offload.weights.planning.workload.Profile`.
The model is the planner's module doc."""
from __future__ import annotations

import math
import operator

from gds_offload.errors import ConfigError
from gds_offload.weights.planning.options import KVPlacement
from gds_offload.weights.planning.workload import HEADROOM, Bound, Choice, Estimate, Finetune, Generate, Profile

__all__ = ["estimate", "estimate_finetune", "peak_finetune", "peak_nbytes"]

_WRITE_WINDOW_MIN = 64 << 20  # attach()'s default write window is at least this


def estimate(profile: Profile, workload: Generate, choice: Choice, memory_nbytes: int) -> Estimate:
    """``choice``'s predicted time, peak memory and bound for ``workload`` (see the module doc).

    Raises :class:`ConfigError` for ``kv=host``: the model has no host<->device copy term, so it
    would price the host cache like the device's at the drive's memory cost."""
    p, w, c = profile, workload, choice
    if c.kv is KVPlacement.HOST:
        raise ConfigError("kv=host: the cost model prices the cache on the device or the drive only; "
                          "estimate kv='device' or kv='drive'")
    streamed = p.layers - c.resident_layers
    write_Bps = p.write_Bps or p.read_Bps
    drive_kv = c.kv is KVPlacement.DRIVE
    chunk = min(c.prefill_chunk or w.prompt_len, w.prompt_len)
    prefill_head = p.prefill_head or p.head  # each chunk ends in the head, on a strided last position

    def kv_cost(n: int, kv_r: float, kv_w: float) -> float:
        """What ``n`` micro-batches' caches on the drive add to a layer's compute (measured, not hidden)."""
        return n * p.kv_drive((kv_r + kv_w) / n) if drive_kv and p.kv_drive is not None else 0.0

    acc = _Cost()
    full, last = divmod(w.prompts, c.in_flight)
    for seqs, times in ((c.in_flight, full), (last, 1)):
        if seqs == 0 or times == 0:
            continue
        wave = _Cost()
        n = math.ceil(seqs / c.micro_batch)
        b = seqs / n  # the wave's micro-batches, evenly filled
        done = 0
        while done < w.prompt_len:  # the prefill, a chunk of positions per forward
            step = min(chunk, w.prompt_len - done)
            kv_r = seqs * done * p.kv_record_nbytes if drive_kv else 0
            kv_w = seqs * step * p.kv_record_nbytes if drive_kv else 0
            fit = p.prefill if done == 0 or p.prefill_chunked is None else p.prefill_chunked  # the first chunk has no cache
            wave.step(p, streamed, c, compute=n * fit(b * step) + kv_cost(n, kv_r, kv_w), head=n * prefill_head(b), kv_r=kv_r, kv_w=kv_w, write_Bps=write_Bps, phase="prefill")
            done += step
        for step in range(1, w.new_tokens):
            ctx = w.prompt_len + step
            kv_r = seqs * ctx * p.kv_record_nbytes if drive_kv else 0
            kv_w = seqs * p.kv_record_nbytes if drive_kv else 0
            wave.step(p, streamed, c, compute=n * p.decode(b) + kv_cost(n, kv_r, kv_w), head=n * p.head(b), kv_r=kv_r, kv_w=kv_w, write_Bps=write_Bps, phase="decode")
        acc.add(wave, times)
    peak = peak_nbytes(p, w, c)
    bound: Bound = "compute" if acc.compute >= acc.drive else "drive"
    total = acc.prefill_s + acc.decode_s
    return Estimate(c, w.prompts * w.new_tokens / total if total else 0.0, acc.prefill_s, acc.decode_s, peak, bound,
                    peak <= HEADROOM * memory_nbytes, acc.read, acc.written, acc.compute * streamed / p.layers)  # fmt: skip


class _Cost:
    """Time and traffic summed over the steps of a workload (:func:`estimate`)."""

    def __init__(self) -> None:
        self.prefill_s = self.decode_s = self.compute = self.drive = 0.0
        self.read = self.written = 0

    def add(self, other: _Cost, times: int) -> None:
        for name in ("prefill_s", "decode_s", "compute", "drive", "read", "written"):
            setattr(self, name, getattr(self, name) + times * getattr(other, name))

    def step(self, p: Profile, streamed: int, c: Choice, *, compute: float, head: float, kv_r: float, kv_w: float,
             write_Bps: float, phase: str) -> None:  # fmt: skip
        """One pass of a wave through every layer: ``compute`` seconds per layer, ``kv_r``/``kv_w``
        bytes of KV per layer moved, the layer's weights read for each streamed one."""
        kv_s = kv_r / p.read_Bps + kv_w / write_Bps
        drive = p.layer_nbytes / p.read_Bps + kv_s
        t = _layers(streamed, c.resident_layers, compute, drive, kv_s, c.slots) + head
        if phase == "prefill":
            self.prefill_s += t
        else:
            self.decode_s += t
        self.read += int(streamed * p.layer_nbytes + p.layers * kv_r)
        self.written += int(p.layers * kv_w)
        self.compute += p.layers * compute
        self.drive += streamed * drive


def _layers(streamed: int, resident: int, compute: float, drive: float, kv_s: float, slots: int) -> float:
    """One step through every layer: streamed layers overlap their reads with compute when the ring
    has a slot to read into while a layer computes; resident layers still move their KV."""
    per_streamed = max(compute, drive) if slots >= 2 else compute + drive
    return streamed * per_streamed + resident * max(compute, kv_s)


def peak_nbytes(p: Profile, w: Generate, c: Choice) -> int:
    """The predicted peak memory of ``c``: the larger of the prefill's (the caches at the prompt's
    length, a chunk's activations) and the decode's (the caches at full length, one position's)."""
    b = c.micro_batch
    seqs = min(w.prompts, c.in_flight)
    chunk = min(c.prefill_chunk or w.prompt_len, w.prompt_len)
    weights = p.base_nbytes + c.resident_layers * p.layer_nbytes + min(c.slots, p.layers - c.resident_layers) * p.layer_nbytes
    # Every sequence in flight holds two hidden states between layers: the one a layer takes, and
    # the embeddings the decoder's forward keeps to its end (Hugging Face decoders keep ``inputs_embeds``).
    per_token = p.prefill_transient_nbytes if chunk >= w.prompt_len else max(p.prefill_transient_nbytes, p.prefill_chunked_transient_nbytes)
    prefill = _kv_nbytes(p, c, seqs, w.prompt_len, chunk) + 2 * seqs * chunk * p.hidden_nbytes + per_token * b * chunk
    decode = _kv_nbytes(p, c, seqs, w.prompt_len + w.new_tokens, 1) + 2 * seqs * p.hidden_nbytes + p.decode_transient_nbytes * b
    # Each member suspended at a hand-over keeps generate's fp32 copy of its last logits and the
    # processed scores (a new tensor whenever a logits processor runs: min_new_tokens, temperature,
    # top-k, ...); the member computing its head holds its logits as the model returns them too,
    # and a processor's input beside its output (min_new_tokens clones the scores, then masks them
    # into a new tensor: four vocabulary-sized rows a sequence at that moment).
    # Every member runs on a thread of its own (a team of one too: Team starts a thread per call),
    # each keeping its libraries' caches; the thread that measured the base holds its own already.
    members = math.ceil(seqs / b)
    return int(weights + max(prefill, decode) + (2 * seqs + 2 * b) * p.logits_nbytes + members * p.member_nbytes)


def _kv_nbytes(p: Profile, c: Choice, seqs: int, positions: int, new: int) -> int:
    """The KV caches' memory once they hold ``positions`` positions, the last ``new`` just computed."""
    b = c.micro_batch
    if c.kv is KVPlacement.DEVICE:
        # Every sequence's cache, plus the copy torch.cat makes of one micro-batch-layer's as it grows.
        return seqs * positions * p.layers * p.kv_nbytes + b * positions * p.kv_nbytes
    # The micro-batch-layer read back, its cat with the new positions, the next one read ahead,
    # and the new positions' write in flight (finished writes are let go: KVPool).
    return (3 * positions + new) * b * p.kv_record_nbytes


def estimate_finetune(profile: Profile, workload: Finetune, choice: Choice, memory_nbytes: int) -> Estimate:
    """``choice``'s predicted time, traffic and peak for LoRA fine-tuning (:func:`~gds_offload.weights.run.accumulate.accumulate`):
    per wave of ``per_load`` micro-batches, each streamed layer is read once in forward and once in
    backward (but the last ``slots``, still in the ring) while the wave computes it; with
    ``offload_activations`` what autograd saves goes to the drive and back on the same drive. On the
    CPU backward reads into the ring's slots (:meth:`~gds_offload.weights.streaming.prefetch.Prefetch.lend`),
    so with one slot its reads wait for compute as the forward's do; a GPU's backward reads into
    buffers of its own."""
    p, w, c = profile, workload, choice
    streamed = p.layers - c.resident_layers
    write_Bps = p.write_Bps or p.read_Bps
    forward_s = backward_s = compute = drive = 0.0
    read = written = 0
    for _ in range(w.steps):
        left = w.global_batch
        while left > 0:
            seqs = min(left, c.in_flight)
            left -= seqs
            n = math.ceil(seqs / c.micro_batch)
            tokens = seqs / n * w.seq
            saved = seqs * w.seq * p.saved_nbytes if c.offload_activations else 0.0
            f = n * p.train_forward(tokens)
            bwd = n * p.train_backward(tokens)
            reread = max(streamed - c.slots, 0)  # backward finds the last slots in the ring
            d_f = p.layer_nbytes / p.read_Bps + saved / write_Bps
            d_b = saved / p.read_Bps
            forward_s += _layers(streamed, c.resident_layers, f, d_f, saved / write_Bps, c.slots) + n * p.head(tokens)
            overlap = max if c.slots >= 2 or p.device != "cpu" else operator.add
            backward_s += reread * overlap(bwd, p.layer_nbytes / p.read_Bps + d_b) + (p.layers - reread) * max(bwd, d_b) + 2 * n * p.head(tokens)
            compute += p.layers * (f + bwd)
            drive += streamed * d_f + reread * p.layer_nbytes / p.read_Bps + p.layers * d_b
            read += int((streamed + reread) * p.layer_nbytes + p.layers * saved)
            written += int(p.layers * saved)
    peak = peak_finetune(p, w, c)
    bound: Bound = "compute" if compute >= drive else "drive"
    total = forward_s + backward_s
    return Estimate(c, w.steps * w.global_batch * w.seq / total if total else 0.0, forward_s, backward_s, peak, bound,
                    peak <= HEADROOM * memory_nbytes, read, written, compute * streamed / p.layers)  # fmt: skip


def peak_finetune(p: Profile, w: Finetune, c: Choice) -> int:
    """The predicted peak of ``c`` for fine-tuning: the weights as for generation, the adapters with
    their gradients and AdamW state, and what autograd saves: every layer's, for every micro-batch
    of the wave, kept in memory; or, offloaded, the offloader's bound (:func:`gds_offload.attach`);
    plus one micro-batch's transient in a layer and every micro-batch's head and loss."""
    seqs = min(w.global_batch, c.in_flight)
    weights = p.base_nbytes + c.resident_layers * p.layer_nbytes + min(c.slots, p.layers - c.resident_layers) * p.layer_nbytes
    layer_saved = c.micro_batch * w.seq * p.saved_nbytes
    if c.offload_activations:
        # attach()'s documented bound, K + max(W, L) + 2L: the last layer of each micro-batch kept,
        # the write window (at least 64 MiB), and for each micro-batch's backward the layer read and the one read ahead.
        saved = c.per_load * layer_saved + max(_WRITE_WINDOW_MIN, 2 * layer_saved) + c.per_load * 2 * layer_saved
    else:
        saved = seqs * w.seq * p.saved_nbytes * p.layers
    # Every micro-batch of a wave reaches the head before the first one's backward leaves it (they run as a team),
    # so each holds the head's and the loss's memory at once.
    head = p.head_train_nbytes or 3 * p.logits_nbytes  # measured; or logits, their float copy in the loss, and its gradient
    logits = c.per_load * c.micro_batch * w.seq * head
    return int(weights + 4 * p.trainable_nbytes + saved + p.train_transient_nbytes * c.micro_batch * w.seq + logits)
