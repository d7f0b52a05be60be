"""The KV cache on the drive (gds_offload.weights.run.kv.KVPool): what is read back equals what was
appended, bit for bit, on every engine; a finished write's buffer is let go at the next append
whichever region it wrote (the planner's memory model counts only the writes in flight); a failed
write is raised naming its micro-batch and layer."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.disks import real_disk_base
from helpers.gates import ENGINES

from gds_offload.errors import OffloadError
from gds_offload.io.base import Engine, IOFuture
from gds_offload.io.factory import make_engine
from gds_offload.io.faults import Fault, FaultyEngine
from gds_offload.weights.run.kv import KVPool, KVShape

MEMBERS, LAYERS, CHUNK = 3, 4, 5
SHAPE = KVShape(layers=LAYERS, batch=2, kv_heads=2, head_dim=8, max_positions=16, dtype=torch.float32)


class _Recording(FaultyEngine):
    """``inner`` (with ``faults``), keeping every write's future so a test can wait for them all."""

    def __init__(self, inner: Engine, faults: list[Fault] | None = None) -> None:
        super().__init__(inner, faults or [])
        self.writes: list[IOFuture] = []

    def write(self, src: torch.Tensor, slot: Any, *, ready: Any = None) -> IOFuture:
        future = super().write(src, slot, ready=ready)
        self.writes.append(future)
        return future


@pytest.fixture
def kv_dir() -> Iterator[Path]:
    d = real_disk_base() / f"gds_offload-kv-pool-{os.getpid()}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _pool(engine: Engine, kv_dir: Path) -> KVPool:
    return KVPool([SHAPE] * MEMBERS, engine=engine, directory=kv_dir, device=torch.device("cpu"))


def _kv(member: int, layer: int, start: int, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * member + 10 * layer + start)
    shape = (SHAPE.batch, SHAPE.kv_heads, new, SHAPE.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("engine", ENGINES)
def test_finished_writes_are_let_go_at_the_next_append_and_reads_return_what_was_written(engine: str, kv_dir: Path) -> None:
    inner = _Recording(make_engine(engine))  # type: ignore[arg-type]
    pool = _pool(inner, kv_dir)
    try:
        # A prefill chunk, layer-major: every micro-batch at layer 0, then at layer 1, ...
        for layer in range(LAYERS):
            for member in range(MEMBERS):
                pool.append(member, layer, *_kv(member, layer, 0, CHUNK))
        for future in inner.writes:
            future.wait()
        chunk_nbytes = CHUNK * SHAPE.record_nbytes
        assert pool.write_nbytes_held <= MEMBERS * LAYERS * chunk_nbytes  # finished, not yet let go
        # The next append lets go of every finished write, not only its own region's.
        pool.append(0, 0, *_kv(0, 0, CHUNK, 1))
        assert pool.write_nbytes_held <= SHAPE.record_nbytes
        for layer in range(LAYERS):
            for member in range(MEMBERS):
                past = pool.past(member, layer)
                assert past is not None
                keys, values = _kv(member, layer, 0, CHUNK)
                if (member, layer) == (0, 0):
                    k1, v1 = _kv(0, 0, CHUNK, 1)
                    keys, values = torch.cat([keys, k1], dim=-2), torch.cat([values, v1], dim=-2)
                assert torch.equal(past[0], keys) and torch.equal(past[1], values), (member, layer)
    finally:
        pool.close()
        inner.close()


def test_a_failed_write_is_raised_naming_its_micro_batch_and_layer(kv_dir: Path) -> None:
    inner = _Recording(make_engine("posix"), [Fault("write", "eio", nth=2)])
    pool = _pool(inner, kv_dir)
    try:
        pool.append(0, 0, *_kv(0, 0, 0, CHUNK))
        pool.append(1, 0, *_kv(1, 0, 0, CHUNK))  # the pool's second write: fails
        for future in inner.writes:
            future.error()
        with pytest.raises(OffloadError, match="micro-batch 1, layer 0 to the drive failed"):
            pool.append(2, 0, *_kv(2, 0, 0, CHUNK))
        with pytest.raises(OffloadError, match="micro-batch 1, layer 0 to the drive failed"):
            pool.past(1, 0)
    finally:
        pool.close()
        inner.close()
