"""The order in which a rank serves windows: a pure function of the seed, the epoch and the rank.

For epoch ``e`` the files are permuted by ``numpy.random.default_rng([seed, e])`` and dealt
round-robin to the ranks (rank ``r`` of ``R`` takes positions ``r, r + R, ...``). A rank reads
its files in that order (those shorter than the longest moved to the end, so that only the
last pool mixes lengths) and groups them into *pools* of ``pool_files`` consecutive files; the
windows of a pool are permuted by ``default_rng([seed, e, rank, pool])``. The epoch's window
stream is the pools one after another; batch ``t`` of the epoch is windows
``[t * batch, (t + 1) * batch)`` of that stream.

Every rank serves the same number of windows in an epoch, hence the same number of batches
(DDP needs every rank to step together). Ranks hold different windows (whole files are
dealt, and files may differ in length), so, as ``torch``'s ``DistributedSampler`` does:

* ``drop_last=False`` (the default): every rank serves as many windows as the rank with
  the most; a rank with fewer serves its stream, then its stream again from the start
  until it has as many (window ``w`` of the epoch is window ``w % rank_windows`` of the
  stream). Every window of the directory is served at least once per epoch; the repeated
  ones are the first :attr:`EpochPlan.repeated` of each short rank's stream. With one
  rank nothing is repeated: every window exactly once.
* ``drop_last=True``: every rank serves the whole batches of the rank with the fewest
  windows; the rest of each stream is left out (:attr:`EpochPlan.left_out`).

A position is ``(epoch, window)``: the windows this rank has served in that epoch. Resuming
at a position re-reads only the pool that holds it (see :class:`EpochPlan.pool_of`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EpochPlan", "plan_epoch", "pool_permutation"]


@dataclass(frozen=True)
class EpochPlan:
    """One rank's epoch.

    Attributes:
        epoch: the epoch.
        files: indices into the directory's files, in read order.
        file_windows: windows of each of those files.
        pool_files: files per pool.
        batch: windows per batch.
        windows: windows this rank serves in the epoch (the same on every rank).
        rank_windows: windows in this rank's files (its stream's length).
    """

    epoch: int
    files: tuple[int, ...]
    file_windows: tuple[int, ...]
    pool_files: int
    batch: int
    windows: int
    rank_windows: int

    @property
    def left_out(self) -> int:
        """Windows of this rank's files that ``drop_last`` leaves out of the epoch."""
        return max(0, self.rank_windows - self.windows)

    @property
    def repeated(self) -> int:
        """Windows served twice (or more) to match the rank with the most: ``windows - rank_windows``, or 0."""
        return max(0, self.windows - self.rank_windows)

    @property
    def steps(self) -> int:
        """Batches in the epoch (the last may be short unless ``drop_last``)."""
        return -(-self.windows // self.batch)

    @property
    def pools(self) -> int:
        return -(-len(self.files) // self.pool_files)

    def pool_range(self, pool: int) -> tuple[int, int]:
        """``(first, end)`` positions in :attr:`files` of ``pool``'s files."""
        first = pool * self.pool_files
        return first, min(first + self.pool_files, len(self.files))

    def pool_start(self, pool: int) -> int:
        """Windows of the epoch's stream before ``pool``."""
        return int(sum(self.file_windows[: pool * self.pool_files]))

    def pool_of(self, window: int) -> int:
        """The pool that holds window ``window`` of the stream (0 <= window < :attr:`rank_windows`)."""
        ends = np.cumsum([sum(self.file_windows[slice(*self.pool_range(p))]) for p in range(self.pools)])
        return int(np.searchsorted(ends, window, side="right"))


def _rank_files(n_files: int, *, seed: int, epoch: int, shard_id: int, num_shards: int, shuffle: bool) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(n_files) if shuffle else np.arange(n_files)
    return order[shard_id::num_shards]


def plan_epoch(file_windows: tuple[int, ...], *, epoch: int, seed: int, shard_id: int, num_shards: int,
               batch: int, pool_files: int, shuffle: bool = True, drop_last: bool = False) -> EpochPlan:
    """Rank ``shard_id``'s plan for ``epoch`` over files of ``file_windows`` windows each.

    Every rank gets the same :attr:`EpochPlan.windows`: ``drop_last=False``, those of the rank
    with the most (the others repeat the start of their streams; the last batch may be short,
    equally on every rank); ``drop_last=True``, the whole batches of the rank with the fewest
    (the rest of each stream is left out).
    """
    files = _rank_files(len(file_windows), seed=seed, epoch=epoch, shard_id=shard_id, num_shards=num_shards, shuffle=shuffle)
    full = max(file_windows)
    files = np.concatenate([files[[file_windows[i] == full for i in files]], files[[file_windows[i] < full for i in files]]])
    counts = tuple(int(file_windows[i]) for i in files)
    per_rank = [sum(int(file_windows[i]) for i in _rank_files(len(file_windows), seed=seed, epoch=epoch, shard_id=r,
                                                               num_shards=num_shards, shuffle=shuffle))
                for r in range(num_shards)]
    windows = min(per_rank) // batch * batch if drop_last else max(per_rank)
    return EpochPlan(epoch, tuple(int(i) for i in files), counts, pool_files, batch, windows, sum(counts))


def pool_permutation(n: int, *, seed: int, epoch: int, shard_id: int, pool: int, shuffle: bool = True) -> np.ndarray:
    """The order of the ``n`` windows of one pool (``arange`` without shuffling)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch, shard_id, pool]).permutation(n)
