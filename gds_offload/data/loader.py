"""``TokenLoader``: batches of token windows from a shard directory, read by a DALI pipeline.

With a CUDA device the pipeline's reader is ``fn.readers.numpy(device="gpu")``: each shard
file goes from the drive into GPU memory through cuFile (GPUDirect Storage where the node
has it, see :mod:`gds_offload.data.check`). Without one it is the same pipeline on the CPU
(``device_id=None``, the CPU reader). Either way the pipeline is wrapped by
``nvidia.dali.plugin.pytorch.DALIGenericIterator`` and yields torch tensors.

One DALI batch is one *pool*: ``pool_files`` files, each one whole read into one buffer
(with the default file size, a whole number of 4 KiB pages, so each file starts aligned
in GPU memory too). The loader gathers each training batch's windows from the pool in the
pool's permuted order (see :mod:`gds_offload.data.order` for the order and why a position
can be resumed exactly); while it serves one pool, DALI reads the next
(``prefetch_queue_depth``).

Example::

    from gds_offload.data import TokenLoader

    loader = TokenLoader("data/shards", batch_size=8, seed=0, shard_id=rank, num_shards=world)
    loader.load_state_dict(ckpt["loader"])             # resume where the checkpoint was taken
    for batch in loader:                               # the rest of this epoch, on the GPU if any
        loss = model(batch["input_ids"], labels=batch["labels"])
        ...
        ckpt["loader"] = loader.state_dict()           # position after this batch
"""
from __future__ import annotations

import os
import shlex
import warnings
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from gds_offload.data.format import ShardError, ShardSet, scan_shards
from gds_offload.data.order import EpochPlan, plan_epoch, pool_permutation
from gds_offload.errors import ConfigError
from gds_offload.node.system import probe_libcufile

__all__ = ["TokenLoader", "STATE_FORMAT", "DEFAULT_POOL_FILES"]

#: ``format`` of :meth:`TokenLoader.state_dict` (``/1`` identified the shards by names and counts only).
STATE_FORMAT = "gds_offload.data.TokenLoader/2"
#: Files whose windows are shuffled together (the pool): 8 files of ~2 MB hold ~16k windows of 512 tokens.
DEFAULT_POOL_FILES = 8
#: Unsigned token dtypes and the signed DALI type of the same width they are handed over as.
_SIGNED_VIEW = {"uint16": "INT16", "uint32": "INT32"}
_MUST_MATCH = ("seed", "num_shards", "shard_id", "batch_size", "pool_files", "shuffle", "drop_last", "dataset")


def _dali_missing(exc: BaseException) -> str:
    return (f"the token loader needs NVIDIA DALI ({type(exc).__name__}: {exc}); "
            f"install it with pip install 'gds_offload[data]' (nvidia-dali-cuda120)")


class _PoolReader:
    """A DALI pipeline that reads ``paths`` in order, ``pool_files`` files per iteration.

    Each iteration is one tensor ``[files, rows, seq + 1]`` on the reader's device: the
    pool's files, with ``pad`` the shorter ones padded with zero rows to ``rows``
    (``fn.pad``), so that the batch is dense and ``DALIGenericIterator`` hands it over in
    one piece (zero-copy, through DLPack). ``uint16``/``uint32`` tokens come reinterpreted
    as ``int16``/``int32`` (no copy; torch has no unsigned types there): see :meth:`_Pool.take`.
    """

    def __init__(self, paths: list[str], *, pool_files: int, rows: int, pad: bool, dtype: str, reader: Literal["gpu", "cpu"],
                 device_id: int | None, num_threads: int, prefetch: int) -> None:
        try:
            from nvidia.dali import fn, pipeline_def, types
            from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
        except ImportError as exc:
            raise ConfigError(_dali_missing(exc)) from exc

        @pipeline_def(batch_size=pool_files, num_threads=num_threads, device_id=device_id,  # type: ignore[arg-type]
                      prefetch_queue_depth=prefetch)
        def pipeline() -> Any:
            tokens = fn.readers.numpy(device=reader, files=paths, name="reader", random_shuffle=False)
            if dtype in _SIGNED_VIEW:
                tokens = fn.reinterpret(tokens, dtype=getattr(types, _SIGNED_VIEW[dtype]))
            return fn.pad(tokens, axes=(0,), shape=(rows,), fill_value=0) if pad else tokens

        self.paths = paths
        self._pipe: Any = pipeline()
        self._pipe.build()
        self._it: Any = DALIGenericIterator([self._pipe], ["tokens"], reader_name="reader",
                                            last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=False)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            try:
                out = next(self._it)
            except StopIteration:
                return
            except RuntimeError as exc:
                raise ShardError(f"DALI failed reading one of {self.paths[0]} ... {self.paths[-1]}: {exc}") from exc
            yield out[0]["tokens"]

    def close(self) -> None:
        self._it = None
        self._pipe = None


class _Pool:
    """One pool's rows (``stage``, padding included) and the order its windows are served in.

    :meth:`take` copies windows ``order[lo:hi]`` out as ``int64``. On the CPU it gathers
    with numpy: torch would split a batch of 64 windows (32k tokens, just above its grain
    size) over its intra-op threads, whose parallel region costs far more than the copy when
    the training's threads hold the cores.
    """

    def __init__(self, stage: torch.Tensor, order: np.ndarray, mask: int | None) -> None:
        self.stage, self.mask = stage, mask
        self.stage_np = stage.numpy() if stage.device.type == "cpu" else None
        self.order: Any = order if self.stage_np is not None else torch.from_numpy(order).to(stage.device, non_blocking=True)

    @classmethod
    def empty(cls) -> _Pool:
        return cls(torch.empty((0, 0), dtype=torch.int32), np.empty(0, dtype=np.int64), None)

    def __len__(self) -> int:
        return int(self.order.shape[0])

    def take(self, lo: int, hi: int) -> torch.Tensor:
        """Windows ``lo:hi`` of the order, as a fresh ``int64`` tensor on the pool's device (unsigned tokens unmasked)."""
        if self.stage_np is not None:
            rows = self.stage_np[self.order[lo:hi]].astype(np.int64)
            if self.mask is not None:
                rows &= self.mask
            return torch.from_numpy(rows)
        out = self.stage.index_select(0, self.order[lo:hi]).long()
        if self.mask is not None:
            out &= self.mask
        return out


class TokenLoader:
    """Batches ``{"input_ids": [b, seq], "labels": [b, seq]}`` (int64) from a shard directory.

    ``labels[i, t]`` is the token after ``input_ids[i, t]`` (already shifted; Hugging Face
    models shift ``labels`` themselves, so pass them ``labels=input_ids``).

    Iterating serves the rest of the current epoch, then moves to the next: ``for batch in
    loader`` once per epoch, or :meth:`batches` for an endless stream. :meth:`state_dict` is
    the position after the last batch handed out; :meth:`load_state_dict` or ``start_step``
    resume there exactly.

    Every rank serves the same number of batches per epoch, of the same sizes (DDP steps
    all ranks together; see :mod:`gds_offload.data.order`). With ``drop_last=False`` every
    window of the directory is served once per epoch, and ranks holding fewer windows than
    the rank with the most serve the first windows of their epoch's stream again to match
    it (``plan().repeated`` says how many; one rank repeats nothing); the last batch may be
    short. With ``drop_last=True`` every batch is whole and each rank serves the whole
    batches the rank with the fewest windows fills; the rest is left out, with a warning.

    Args:
        directory: a directory ``gds-offload shards`` wrote.
        batch_size: windows per batch.
        seq: the sequence length expected (None: the shards').
        seed: seed of the file and window orders.
        shard_id: this rank (0-based).
        num_shards: ranks reading the directory together.
        device: ``"auto"`` (CUDA if torch sees a GPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``: where batches are.
        reader: ``"auto"`` (GPU reader on a CUDA device where cuFile is found, else CPU), ``"gpu"`` or ``"cpu"``.
        shuffle: permute files and windows (False: file order, then row order).
        drop_last: only whole batches (as many on every rank), leaving the remainder out;
            False: every window, ranks with fewer repeating some (as many batches on every rank).
        pool_files: files whose windows are shuffled together.
        num_threads: DALI worker threads.
        prefetch: DALI's prefetch queue depth (pools read ahead).
        start_step: resume at this global step (batches served over all epochs).

    Raises:
        ShardError: a bad directory or file (named).
        ConfigError: a bad argument, or DALI not installed.
    """

    def __init__(self, directory: str | os.PathLike[str], *, batch_size: int, seq: int | None = None, seed: int = 0,
                 shard_id: int = 0, num_shards: int = 1, device: str | torch.device = "auto",
                 reader: Literal["auto", "gpu", "cpu"] = "auto", shuffle: bool = True, drop_last: bool = False,
                 pool_files: int = DEFAULT_POOL_FILES, num_threads: int = 2, prefetch: int = 2, start_step: int = 0) -> None:
        for name, value, low in (("batch_size", batch_size, 1), ("num_shards", num_shards, 1), ("pool_files", pool_files, 1),
                                 ("num_threads", num_threads, 1), ("prefetch", prefetch, 1), ("start_step", start_step, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"TokenLoader {name}={value!r} must be an int >= {low}")
        if not isinstance(shard_id, int) or not 0 <= shard_id < num_shards:
            raise ConfigError(f"TokenLoader shard_id={shard_id!r} must be in [0, num_shards={num_shards})")
        self.device = _resolve_device(device)
        self.reader = _resolve_reader(reader, self.device, Path(directory))
        self.shards: ShardSet = scan_shards(directory, seq=seq)
        if self.shards.windows < num_shards:
            raise ShardError(f"{self.shards.directory}: {self.shards.windows} windows of {self.shards.seq + 1} tokens cannot "
                             f"feed num_shards={num_shards} ranks (each rank reads whole files, one window at least); write "
                             f"more text into the set, or train on fewer ranks")
        if len(self.shards.files) < num_shards:
            d, per_file = shlex.quote(str(self.shards.directory)), max(1, self.shards.windows // num_shards)
            raise ShardError(f"{self.shards.directory}: {len(self.shards.files)} file(s) cannot feed num_shards={num_shards} "
                             f"ranks (each rank reads whole files); write smaller files: `gds-offload shards {d} --text FILE... "
                             f"--seq {self.shards.seq} --windows-per-file {per_file} --overwrite`")
        self.batch_size, self.seed, self.shard_id, self.num_shards = batch_size, seed, shard_id, num_shards
        self.shuffle, self.drop_last, self.pool_files = shuffle, drop_last, pool_files
        self.num_threads, self.prefetch = num_threads, prefetch
        self._fingerprint = self.shards.fingerprint()
        bits = {"uint16": 15, "uint32": 31}.get(self.shards.dtype)
        vocab = self.shards.vocab
        # A uint16 token >= 2**15 reads as a negative int16: mask it back, unless the vocabulary is below that.
        self._mask = (1 << (bits + 1)) - 1 if bits is not None and (vocab is None or vocab > 1 << bits) else None
        self._plans: dict[int, EpochPlan] = {}
        self._warned_left_out = False
        self.epoch, self.window, self.step = 0, 0, 0
        if start_step:
            self.seek(start_step)

    # ------------------------------------------------------------------ position
    @property
    def seq(self) -> int:
        return self.shards.seq

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """This rank's plan of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        plan = self._plans.get(epoch)
        if plan is None:
            plan = plan_epoch(tuple(f.windows for f in self.shards.files), epoch=epoch, seed=self.seed,
                              shard_id=self.shard_id, num_shards=self.num_shards, batch=self.batch_size,
                              pool_files=self.pool_files, shuffle=self.shuffle, drop_last=self.drop_last)
            if plan.steps == 0:
                raise ShardError(f"{self.shards.directory}: rank {self.shard_id} gets no batch in epoch {epoch} "
                                 f"({plan.rank_windows} windows, batch_size={self.batch_size}, drop_last={self.drop_last}); "
                                 f"use a smaller batch or fewer ranks")
            if plan.left_out and not self._warned_left_out:
                self._warned_left_out = True
                warnings.warn(f"TokenLoader(drop_last=True) leaves out {plan.left_out} of rank {self.shard_id}'s "
                              f"{plan.rank_windows} windows in epoch {epoch} (equal whole batches on every rank)", stacklevel=3)
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[epoch] = plan
        return plan

    def __len__(self) -> int:
        """Batches in the current epoch."""
        return self.plan().steps

    def seek(self, step: int) -> None:
        """Move to global step ``step``: the next batch is the one a run from the start serves ``step``-th (0-based)."""
        if step < 0:
            raise ConfigError(f"TokenLoader.seek(step={step}) needs step >= 0")
        epoch, left = 0, step
        while left >= self.plan(epoch).steps:
            left -= self.plan(epoch).steps
            epoch += 1
        self.epoch, self.window, self.step = epoch, left * self.batch_size, step

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch served, and what the order depends on (for :meth:`load_state_dict`).

        ``dataset`` is the shards' fingerprint (names, window counts, hashes) and ``files``
        each shard's xxh3, so that a state resumed on other shards names the one that differs.
        """
        return {"format": STATE_FORMAT, "epoch": self.epoch, "window": self.window, "step": self.step,
                "seed": self.seed, "num_shards": self.num_shards, "shard_id": self.shard_id, "batch_size": self.batch_size,
                "pool_files": self.pool_files, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "dataset": self._fingerprint, "windows": self.shards.windows, "files": self.shards.file_hashes()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`).

        The state must come from a loader of the same order over the same data set: the
        shards' names, window counts and bytes (their hashes in ``shards.json``), wherever
        the directory now is.

        Raises:
            ConfigError: a state from another loader format; one whose order differs from this
                loader's (seed, ranks, batch size, pool, shuffling); one taken on other shards
                (the first differing shard named); or a position that is not an int >= 0, or
                not one a loader reaches (the field and value named).
        """
        where = "TokenLoader.load_state_dict"
        if isinstance(state, dict) and state.get("format") == "gds_offload.data.TokenLoader/1":
            raise ConfigError(f"{where}: a gds_offload.data.TokenLoader/1 state identifies its shards by names and counts "
                              f"only, so it cannot show it was taken on these; if it was, resume with "
                              f"TokenLoader(..., start_step={state.get('step')!r})")
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ConfigError(f"{where}: not a {STATE_FORMAT} state ({type(state).__name__})")
        mine = self.state_dict()
        for key in _MUST_MATCH:
            if key == "dataset" and state.get(key) != mine[key]:
                raise ConfigError(f"{where}: the state was taken on other shards ({self.shards.difference(state.get('files'))}); "
                                  f"resume on the data set it was taken on, or start without it")
            if state.get(key) != mine[key]:
                raise ConfigError(f"{where}: the state was taken with another order ({key}={state.get(key)!r} there, "
                                  f"{mine[key]!r} here); build the loader as it was when the state was saved")
        epoch, window, step = (_position(where, state, key) for key in ("epoch", "window", "step"))
        plan = self.plan(epoch)
        if window > plan.windows or (window % self.batch_size and window != plan.windows):
            raise ConfigError(f"{where}: window={window} is no position in epoch {epoch} ({plan.windows} windows in batches "
                              f"of {self.batch_size}: a multiple of {self.batch_size}, or {plan.windows} at its end)")
        expected = -(-window // self.batch_size)
        for e in range(epoch):  # stops early on a damaged epoch: every epoch has a batch
            if expected > step:
                break
            expected += self.plan(e).steps
        if step != expected:
            raise ConfigError(f"{where}: step={step} does not match epoch={epoch}, window={window} (a loader there has "
                              f"served {'more than ' if expected > step else ''}{expected} batches); the state was edited or mixed from two states")
        self.epoch, self.window, self.step = epoch, window, step

    # ------------------------------------------------------------------ batches
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """The rest of the current epoch's batches; afterwards the loader is at the next epoch's start.

        Each batch is a fresh ``int64`` tensor ``[b, seq + 1]`` gathered from its pool;
        ``input_ids`` and ``labels`` are views of it.
        """
        plan = self.plan()
        pools = self._pools(plan, self.window) if self.window < plan.windows else None
        pool = _Pool.empty()
        at = 0  # windows of ``pool`` already served
        try:
            while self.window < plan.windows:
                want = min(self.batch_size, plan.windows - self.window)
                if len(pool) - at >= want:
                    tokens = pool.take(at, at + want)
                    at += want
                else:  # the batch spans pools
                    assert pools is not None, "windows left in the epoch, so its pools are open"
                    have = len(pool) - at
                    pieces = [pool.take(at, len(pool))] if have else []
                    while have < want:
                        pool = next(pools)
                        at = min(want - have, len(pool))
                        pieces.append(pool.take(0, at))
                        have += at
                    tokens = torch.cat(pieces)
                self.window += want
                self.step += 1
                yield {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        finally:
            if pools is not None:
                pools.close()
        if self.window >= plan.windows:
            self.epoch, self.window = self.epoch + 1, 0

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Batches without end, epoch after epoch."""
        while True:
            yield from self

    def _pools(self, plan: EpochPlan, window: int) -> Generator[_Pool, None, None]:
        """The pools of ``plan``'s stream from window ``window`` on, and the stream again from its start, endlessly.

        Window ``w`` of the epoch is window ``w % plan.rank_windows`` of the stream: past
        the rank's own windows, a rank with fewer than others serves its stream again.
        """
        start = window % plan.rank_windows
        while True:
            yield from self._pass(plan, start)
            start = 0

    def _pass(self, plan: EpochPlan, window: int) -> Generator[_Pool, None, None]:
        """Each pool from the one holding ``window`` (cut to start there), on the batches' device."""
        first = plan.pool_of(window)
        skip = window - plan.pool_start(first)
        positions = list(range(plan.pool_range(first)[0], len(plan.files)))
        paths = [str(self.shards.files[plan.files[i]].path) for i in positions]
        counts = [plan.file_windows[i] for i in positions]
        rows = max(counts)
        # Files shorter than the longest come last (see order.py): only the pools holding them are padded.
        tail = next((j for j, c in enumerate(counts) if c < rows), len(counts)) // self.pool_files * self.pool_files
        batches = self._read([(paths[:tail], False), (paths[tail:], True)], rows)
        try:
            for pool in range(first, plan.pools):
                lo, hi = plan.pool_range(pool)
                tokens = next(batches, None)
                if tokens is None or tokens.shape[0] != hi - lo or tokens.shape[1] != rows:
                    got = "nothing" if tokens is None else f"a batch of shape {tuple(tokens.shape)}"
                    raise ShardError(f"DALI returned {got} for the {hi - lo} files from {paths[lo - positions[0]]}; "
                                     f"expected [{hi - lo}, {rows}, {self.seq + 1}]")
                # The pool's real rows (padding left out), as positions in the flattened stage.
                real = np.concatenate([j * rows + np.arange(plan.file_windows[k]) for j, k in enumerate(range(lo, hi))])
                if self.shuffle:
                    real = real[pool_permutation(real.size, seed=self.seed, epoch=plan.epoch, shard_id=self.shard_id, pool=pool)]
                if pool == first:
                    real = real[skip:]
                yield _Pool(tokens.reshape(-1, tokens.shape[2]).to(self.device, non_blocking=True), real, self._mask)
        finally:
            batches.close()

    def _read(self, parts: list[tuple[list[str], bool]], rows: int) -> Generator[torch.Tensor, None, None]:
        """The DALI batches of each ``(paths, pad)`` part in turn, one pipeline at a time."""
        for paths, pad in parts:
            if not paths:
                continue
            reader = _PoolReader(paths, pool_files=self.pool_files, rows=rows, pad=pad, dtype=self.shards.dtype,
                                 reader=self.reader, device_id=self._device_id(), num_threads=self.num_threads,
                                 prefetch=self.prefetch)
            try:
                yield from reader
            finally:
                reader.close()

    def _device_id(self) -> int | None:
        if self.reader != "gpu":
            return None
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def describe(self) -> str:
        """One line: the directory, its size, this rank and the read path."""
        s = self.shards
        return (f"{s.directory}: {len(s.files)} files, {s.windows} windows of {s.seq + 1} {s.dtype} tokens; "
                f"rank {self.shard_id}/{self.num_shards}, {self.reader} reader -> {self.device}")


def _position(where: str, state: dict[str, Any], key: str) -> int:
    """``state[key]``, an int >= 0 (numpy's too; not a bool)."""
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"{where}: {key}={value!r} must be an int >= 0 (the state is damaged, or not from state_dict())")
    return int(value)


def _resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"TokenLoader device={device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"TokenLoader device={device!r}: batches go to cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"TokenLoader device={device!r} but torch sees no CUDA GPU; use device='cpu'")
    return dev


def _resolve_reader(reader: str, device: torch.device, directory: Path) -> Literal["gpu", "cpu"]:
    if reader not in ("auto", "gpu", "cpu"):
        raise ConfigError(f"TokenLoader reader={reader!r}; expected auto, gpu or cpu")
    if reader == "gpu" and device.type != "cuda":
        raise ConfigError(f"TokenLoader reader='gpu' reads into GPU memory; it needs a CUDA device, not {device}")
    if reader == "auto":
        if device.type != "cuda":
            return "cpu"

        if not probe_libcufile().found:
            warnings.warn(f"TokenLoader: libcufile not found, so DALI's GPU reader cannot run; reading on the CPU "
                          f"(see `gds-offload shards --check {shlex.quote(str(directory))}`)", stacklevel=3)
            return "cpu"
        return "gpu"
    return reader  # type: ignore[return-value]

