"""The engines' device-memory routes, run on the CPU with the CUDA calls replaced at the boundary.

What a GPU is needed for (streams, events, pinned memory, cuFile) is replaced by fakes that
record what they were asked to do: :class:`FakeBackend` stands in for
:class:`gds_offload.io.staging.CudaBackend`, and the engines' ``on_device`` test is patched
so that CPU tensors take the device route. Everything else is real: the chunking, the
double buffering, the staging buffers' alignment, ``pwrite``/``preadv`` and KvikIO's host
I/O on a real spill file, and every round trip is compared with ``torch.equal`` against the
bytes written. What only a GPU shows (that the side streams do not wait for the compute
stream, exactness of device memory) is in ``tests/test_gpu.py``.

Also here: cuFile's compat-fallback switch (:mod:`gds_offload.io.kvikio.cufile_params`) against a
fake ``libcufile``, the strict ``gds`` engine, and the bench-io/gds-check labels of which
memory a figure was measured with.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gds_offload.errors import ConfigError, GDSUnavailableError
from gds_offload.io.kvikio.engine import kvikio_status
from gds_offload.io.spill import SpillStore
from gds_offload.io.staging import CudaBackend, SideStreams, Staging, StagingPool, copy_in_chunks, copy_out_chunks, held_nbytes

KVIK_OK, KVIK_WHY = kvikio_status()
needs_kvikio = pytest.mark.skipif(not KVIK_OK, reason=f"needs KvikIO (and libcuda.so.1 for its host I/O): {KVIK_WHY}")
CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------- fakes
class FakeEvent:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("sync_event", self.name))

    def query(self) -> bool:
        return True


class FakeStream:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name = log, name
        self.cuda_stream = 0x5EED0000 + int(name[1:])

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def synchronize(self) -> None:
        self.log.append(("sync_stream", self.name))


class FakeBackend(CudaBackend):
    """Streams and events that log what they are asked; CPU memory instead of pinned."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.streams: list[FakeStream] = []
        self._n = 0

    def stream(self, device: torch.device) -> FakeStream:
        self._n += 1
        self.streams.append(FakeStream(self.log, f"s{self._n}"))
        return self.streams[-1]

    def event(self) -> FakeEvent:
        self._n += 1
        return FakeEvent(self.log, f"e{self._n}")

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        self.log.append(("use", stream.name))
        return contextlib.nullcontext()

    def pinned(self, nbytes: int) -> torch.Tensor:
        # page-aligned, as cudaHostAlloc's blocks are (mmap gives whole pages)
        self.log.append(("pinned", nbytes))
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)

    def current_device(self) -> int:
        return 0

    def count(self, kind: str) -> int:
        return sum(1 for entry in self.log if entry[0] == kind)


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _where(buf: Any) -> str:
    """Whose memory a buffer handed to KvikIO is: ``cpu`` (a numpy array or a host tensor) or a device type."""
    return buf.device.type if isinstance(buf, torch.Tensor) else "cpu"


def _index(log: list[tuple[Any, ...]], entry: tuple[Any, ...]) -> int:
    return log.index(entry)


# ----------------------------------------------------------------------------- staging pipelines
CHUNK = 8192


def test_staging_buffers_are_page_aligned_and_sized() -> None:
    stage = Staging(CUDA, CHUNK, FakeBackend())
    assert all(b.numel() == CHUNK and b.data_ptr() % 4096 == 0 for b in stage.buffers)
    with pytest.raises(ValueError, match="multiple of 4096"):
        Staging(CUDA, 1000, FakeBackend())


@pytest.mark.parametrize("count", [2, 1])
@pytest.mark.parametrize("nbytes", [1, CHUNK - 1, CHUNK, 2 * CHUNK + 17, 5 * CHUNK])
def test_copy_out_chunks_hands_every_byte_and_overlaps_the_next_copy(nbytes: int, count: int) -> None:
    """Every chunk reaches the sink once its copy is waited for; with two buffers the next
    chunk's copy is queued before the sink writes the current one; a buffer is refilled only
    after the sink wrote what it held; the side stream is drained before returning."""
    backend = FakeBackend()
    stage = Staging(CUDA, CHUNK, backend, count=count)
    src = _random(nbytes, 1)
    got = bytearray()
    log = backend.log

    def sink(host: torch.Tensor, lo: int, n: int) -> None:
        assert lo == len(got) and host.numel() == CHUNK
        got.extend(host[:n].numpy().tobytes())
        log.append(("sink", lo))

    copy_out_chunks(stage, src, sink)
    assert bytes(got) == src.numpy().tobytes()
    sinks = [e for e in log if e[0] == "sink"]
    records = [i for i, e in enumerate(log) if e[0] == "record"]
    assert len(sinks) == len(records) == -(-nbytes // CHUNK)
    events = [e.name for e in stage.events]
    for k in range(len(sinks)):
        at = _index(log, ("sink", k * CHUNK))
        assert ("sync_event", events[k % count]) in log[:at], f"chunk {k} handed over before its copy was waited for"
        if k + 1 < len(sinks) and count == 2:
            assert records[k + 1] < at, f"the copy of chunk {k + 1} was not queued before chunk {k} was written"
        if k >= count:
            # chunk k reuses the buffer of chunk k - count: its copy comes after that chunk was written
            assert records[k] > _index(log, ("sink", (k - count) * CHUNK)), f"buffer of chunk {k - count} refilled before it was written"
    assert log[-1] == ("sync_stream", stage.stream.name)


@pytest.mark.parametrize("count", [2, 1])
@pytest.mark.parametrize("nbytes", [0, 1, CHUNK, 3 * CHUNK + 5])
def test_copy_in_chunks_reads_before_waiting_and_waits_once(nbytes: int, count: int) -> None:
    """The drive read of the first chunk comes before the side stream waits for ``ready``;
    the wait is queued once, before the first copy into ``dst``; a buffer is refilled only
    after the copy out of it was waited for; every byte arrives."""
    backend = FakeBackend()
    stage = Staging(CUDA, CHUNK, backend, count=count)
    data = _random(nbytes, 2)
    dst = torch.full((nbytes,), 0xA5, dtype=torch.uint8)
    ready = FakeEvent(backend.log, "ready")
    log = backend.log

    def source(host: torch.Tensor, lo: int, n: int) -> None:
        host[:n].copy_(data[lo : lo + n])
        log.append(("source", lo))

    copy_in_chunks(stage, dst, source, ready=ready)
    assert torch.equal(dst, data)
    waits = [i for i, e in enumerate(log) if e == ("wait_event", stage.stream.name, "ready")]
    if nbytes == 0:
        assert not waits and log[-1][0] == "sync_stream"
        return
    assert len(waits) == 1 and _index(log, ("source", 0)) < waits[0] < [i for i, e in enumerate(log) if e[0] == "record"][0]
    events = [e.name for e in stage.events]
    for k in range(count, -(-nbytes // CHUNK)):
        before = log[_index(log, ("source", (k - count) * CHUNK)) : _index(log, ("source", k * CHUNK))]
        assert ("sync_event", events[k % count]) in before, f"buffer refilled for chunk {k} before its copy was done"
    assert log[-1] == ("sync_stream", stage.stream.name)


def test_a_failing_sink_or_source_still_drains_the_side_stream() -> None:
    backend = FakeBackend()
    stage = Staging(CUDA, CHUNK, backend)

    def sink(host: torch.Tensor, lo: int, n: int) -> None:
        if lo:
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        copy_out_chunks(stage, _random(3 * CHUNK, 3), sink)
    assert backend.log[-1] == ("sync_stream", stage.stream.name)
    backend.log.clear()

    def source(host: torch.Tensor, lo: int, n: int) -> None:
        if lo:
            raise OSError("short read")

    with pytest.raises(OSError, match="short read"):
        copy_in_chunks(stage, torch.empty(3 * CHUNK, dtype=torch.uint8), source)
    assert backend.log[-1] == ("sync_stream", stage.stream.name)


class _MisalignedBackend(FakeBackend):
    """Blocks that start 64 bytes past a page: the pool must ask again for a page more and align."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.log.append(("pinned", nbytes))
        return torch.frombuffer(mmap.mmap(-1, nbytes + 4096), dtype=torch.uint8)[64 : 64 + nbytes]


def test_a_staging_buffer_is_page_aligned_even_if_the_allocator_is_not() -> None:
    backend = _MisalignedBackend()
    stage = Staging(CUDA, CHUNK, backend, count=1)
    assert stage.buffers[0].data_ptr() % 4096 == 0 and stage.buffers[0].numel() == CHUNK
    assert [e[1] for e in backend.log if e[0] == "pinned"] == [CHUNK, CHUNK + 4096]
    assert stage.pinned_nbytes == held_nbytes(CHUNK + 4096)  # the block the buffer keeps
    assert held_nbytes(8 << 20) == 8 << 20 and held_nbytes((8 << 20) + 4096) == 16 << 20 and held_nbytes(1) == 1


def test_staging_pool_and_side_streams_are_per_thread_and_device() -> None:
    import threading

    backend = FakeBackend()
    pool, streams = StagingPool(CHUNK, backend), SideStreams(backend)
    mine = pool.get(CUDA)
    assert pool.get(CUDA) is mine and pool.get(torch.device("cuda", 1)) is not mine
    assert streams.get(CUDA) is streams.get(CUDA)
    other: list[Any] = []
    t = threading.Thread(target=lambda: other.extend([pool.get(CUDA), streams.get(CUDA)]))
    t.start()
    t.join()
    assert other[0] is not mine and other[1] is not streams.get(CUDA)
    assert pool.get(torch.device("cuda")) is pool.get(torch.device("cuda", 0)), "cuda is the current device, cuda:0 here"
    # exactly the chunk, not a page more: torch's caching host allocator would round 8 KiB + 4 KiB up to 16 KiB
    assert [e for e in backend.log if e[0] == "pinned"][0] == ("pinned", CHUNK)
    assert pool.pinned_bytes == 3 * 2 * held_nbytes(CHUNK) == 3 * 2 * CHUNK
    assert StagingPool(CHUNK, backend, count=1).get(CUDA).buffers.__len__() == 1
    pool.close()
    assert pool.pinned_bytes == 0


# ----------------------------------------------------------------------------- engines, device route forced
SIZES = [0, 1, 4095, 4096, 70_001, 300_000]


@contextlib.contextmanager
def _store(spill_dir: Path) -> Iterator[SpillStore]:
    store = SpillStore([spill_dir])
    try:
        yield store
    finally:
        store.close()


def _round_trips(engine: Any, store: SpillStore, backend: FakeBackend) -> None:
    """Each size written then read through the engine's device route, byte-exact; the write
    synchronizes ``ready`` on the engine thread, the read waits for it on a side stream."""
    for i, n in enumerate(SIZES):
        src = _random(n, 10 + i)
        slot = store.allocate(engine.slot_bytes(n, CUDA))
        assert slot.nbytes >= n
        ready_w, ready_r = FakeEvent(backend.log, f"ready-w{i}"), FakeEvent(backend.log, f"ready-r{i}")
        assert engine.write(src, slot, ready=ready_w).wait(timeout_s=60) == n
        assert engine.data_offset(slot) == slot.offset, "device bytes start at the slot's start"
        dst = torch.full((n,), 0xA5, dtype=torch.uint8)
        assert engine.read(dst, slot, ready=ready_r).wait(timeout_s=60) == n
        assert torch.equal(dst, src), f"{engine.name}: {n} bytes read back differ"
        if n:
            assert ("sync_event", f"ready-w{i}") in backend.log, "the write did not wait for the producing stream"
            assert any(e[0] == "wait_event" and e[2] == f"ready-r{i}" for e in backend.log), "the read did not order its copy after ready"
            assert ("sync_event", f"ready-r{i}") not in backend.log, "the read blocked its thread on ready before reading the drive"
        engine.release(slot)
        store.free(slot)


def test_posix_device_route_stages_through_pinned_buffers_on_side_streams(spill_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gds_offload.io import posix
    from gds_offload.io.posix import PosixEngine

    monkeypatch.setattr(posix, "on_device", lambda t: True)
    backend = FakeBackend()
    engine = PosixEngine(num_threads=3, chunk_bytes=64 << 10, cuda=backend)
    try:
        with _store(spill_dir) as store:
            assert store.files[0].direct, "the spill file should be O_DIRECT here (real disk)"
            _round_trips(engine, store, backend)
    finally:
        engine.close()
    assert backend.count("record") > 0 and backend.count("pinned") > 0
    assert engine.stats().bounced_bytes == 0, "device memory went through the pageable bounce buffers"


@needs_kvikio
def test_compat_device_route_gives_kvikio_host_pages_copied_on_side_streams(spill_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gds_offload.io import kvikio_engine
    from gds_offload.io.kvikio.engine import KvikIOEngine

    monkeypatch.setattr(kvikio_engine, "on_device", lambda t: True)
    import kvikio

    backend = FakeBackend()
    engine = KvikIOEngine("compat", num_threads=2, task_bytes=64 << 10, cuda=backend)
    handed: list[Any] = []

    class HandedCuFile(kvikio.CuFile):  # what the engine hands KvikIO, logged on the way
        def pwrite(self, buf: Any, size: int, file_offset: int = 0, task_size: int | None = None) -> Any:
            handed.append(("write", _where(buf), size, file_offset))
            return super().pwrite(buf, size, file_offset, task_size)

        def pread(self, buf: Any, size: int, file_offset: int = 0, task_size: int | None = None) -> Any:
            handed.append(("read", _where(buf), size, file_offset))
            return super().pread(buf, size, file_offset, task_size)

    monkeypatch.setattr(kvikio, "CuFile", HandedCuFile)
    try:
        with _store(spill_dir) as store:
            _round_trips(engine, store, backend)
    finally:
        engine.close()
    assert handed and all(dev == "cpu" for _, dev, _, _ in handed), "KvikIO was handed device memory"
    assert all(n % 4096 == 0 and off % 4096 == 0 for _, _, n, off in handed), f"O_DIRECT needs whole pages: {handed}"


class FakeCuFile:
    """``kvikio.CuFile`` over the real spill file: the stream API (``raw_*_async``) and
    ``pread``/``pwrite``, each logged with the stream handle it was given."""

    log: list[tuple[Any, ...]] = []

    def __init__(self, path: str, flags: str) -> None:
        self.fd = os.open(path, os.O_RDWR)

    def close(self) -> None:
        os.close(self.fd)

    class _Done:
        def __init__(self, n: int) -> None:
            self.n = n

        def check_bytes_done(self) -> int:
            return self.n

        def get(self) -> int:
            return self.n

    def raw_write_async(self, buf: torch.Tensor, stream: int, size: int, offset: int, dev_offset: int) -> Any:
        self.log.append(("raw_write_async", stream, size, offset))
        return self._Done(os.pwrite(self.fd, buf.numpy().tobytes()[:size], offset))

    def raw_read_async(self, buf: torch.Tensor, stream: int, size: int, offset: int, dev_offset: int) -> Any:
        self.log.append(("raw_read_async", stream, size, offset))
        data = os.pread(self.fd, size, offset)
        buf[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return self._Done(len(data))

    def pwrite(self, arr: Any, size: int, offset: int, task: int) -> Any:
        self.log.append(("pwrite", size, offset))
        return self._Done(os.pwrite(self.fd, bytes(arr.numpy() if isinstance(arr, torch.Tensor) else arr)[:size], offset))

    def pread(self, arr: Any, size: int, offset: int, task: int) -> Any:
        self.log.append(("pread", size, offset))
        data = os.pread(self.fd, size, offset)
        target = arr if isinstance(arr, torch.Tensor) else torch.from_numpy(arr)
        target[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return self._Done(len(data))


@needs_kvikio
@pytest.mark.parametrize("stream_io", [True, False], ids=["stream-api", "no-cufile-json"])
def test_gds_device_route_queues_cufile_stream_ops_on_a_side_stream(
    stream_io: bool, spill_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stream_io``: every device transfer is a cuFile stream operation on the thread's side
    stream (the read's wait for ``ready`` queued on that stream first), never ``pread``/
    ``pwrite`` (which synchronize the default stream). Without a cufile.json: ``pread``/
    ``pwrite`` after a host-side wait. Byte-exact either way."""
    import kvikio

    from gds_offload.io import kvikio_engine
    from gds_offload.io.kvikio.engine import KvikIOEngine

    monkeypatch.setattr(kvikio_engine, "on_device", lambda t: True)
    monkeypatch.setattr(kvikio, "CuFile", FakeCuFile)
    FakeCuFile.log = []
    backend = FakeBackend()
    engine = KvikIOEngine("gds", num_threads=2, cuda=backend)  # no CUDA here: cuFile's settings are not touched
    engine.stream_io = stream_io
    try:
        with _store(spill_dir) as store:
            for i, n in enumerate([1, 4096, 300_001]):
                src = _random(n, 20 + i)
                slot = store.allocate(engine.slot_bytes(n, CUDA))
                ready_r = FakeEvent(backend.log, f"ready-r{i}")
                engine.write(src, slot, ready=FakeEvent(backend.log, f"ready-w{i}")).wait(timeout_s=60)
                dst = torch.zeros(n, dtype=torch.uint8)
                engine.read(dst, slot, ready=ready_r).wait(timeout_s=60)
                assert torch.equal(dst, src), f"{n} bytes read back differ"
                if stream_io:
                    assert any(e[0] == "wait_event" and e[2] == f"ready-r{i}" for e in backend.log)
                else:
                    assert ("sync_event", f"ready-r{i}") in backend.log
        side = {s.cuda_stream for s in backend.streams}
    finally:
        engine.close()
    kinds = {e[0] for e in FakeCuFile.log}
    if stream_io:
        assert kinds == {"raw_write_async", "raw_read_async"}, kinds
        assert side and {e[1] for e in FakeCuFile.log} <= side, "a cuFile stream op was not queued on an engine side stream"
    else:
        assert kinds == {"pwrite", "pread"}, kinds


# ----------------------------------------------------------------------------- cuFile's compat fallback
class FakeCufileLib:
    """``cuFileSetParameterBool``/``cuFileGetParameterBool`` over a dict; ``open_`` makes Set fail as cuFile does once the driver is open."""

    def __init__(self, *, driver_open: bool = False, values: dict[int, bool] | None = None) -> None:
        from gds_offload.io import cufile_params as cp

        self.cp, self.driver_open = cp, driver_open
        self.values = {cp.PARAM_ALLOW_COMPAT_MODE: True, cp.PARAM_FORCE_COMPAT_MODE: False} | (values or {})
        self.calls: list[tuple[str, int, bool]] = []
        lib = self

        def setter(param: int, value: bool) -> Any:
            lib.calls.append(("set", param, value))
            if lib.driver_open:
                return cp._CUfileError(cp.CU_FILE_DRIVER_ALREADY_OPEN, 0)
            lib.values[param] = value
            return cp._CUfileError(cp.CU_FILE_SUCCESS, 0)

        def getter(param: int, ref: Any) -> Any:
            lib.calls.append(("get", param, lib.values[param]))
            ref._obj.value = lib.values[param]
            return cp._CUfileError(cp.CU_FILE_SUCCESS, 0)

        self.cuFileSetParameterBool, self.cuFileGetParameterBool = setter, getter


def _cufile_json(tmp_path: Path, allow: str) -> dict[str, str]:
    path = tmp_path / "cufile.json"
    path.write_text('// cuFile accepts comments\n{"properties": {"allow_compat_mode": %s}}\n' % allow)
    return {"CUFILE_ENV_PATH_JSON": str(path)}


def test_strict_gds_stages_the_fallback_off_before_the_driver_opens() -> None:
    from gds_offload.io import cufile_params as cp

    lib = FakeCufileLib()
    got = cp.compat_fallback(disable=True, lib=lib, env={})
    assert got.off and "staged" in got.detail
    assert lib.values == {cp.PARAM_ALLOW_COMPAT_MODE: False, cp.PARAM_FORCE_COMPAT_MODE: False}


@pytest.mark.parametrize("allow", [True, False])
def test_strict_gds_reads_what_an_already_open_driver_runs_with(allow: bool) -> None:
    from gds_offload.io import cufile_params as cp

    got = cp.compat_fallback(disable=True, lib=FakeCufileLib(driver_open=True, values={cp.PARAM_ALLOW_COMPAT_MODE: allow}), env={})
    assert got.off is (not allow)
    assert "already open" in got.detail and ("allow_compat_mode true" in got.detail) is allow


def test_without_the_parameter_api_only_cufile_json_can_turn_the_fallback_off(tmp_path: Path) -> None:
    from gds_offload.io import cufile_params as cp

    assert cp.compat_fallback(disable=True, lib=object(), env=_cufile_json(tmp_path, "false")).off
    got = cp.compat_fallback(disable=True, lib=object(), env=_cufile_json(tmp_path, "true"))
    assert not got.off and "cuFileSetParameterBool" in got.detail and "allow_compat_mode true" in got.detail
    got = cp.compat_fallback(disable=True, lib=object(), env={"CUFILE_ENV_PATH_JSON": str(tmp_path / "none.json")})
    assert not got.off


def test_auto_only_reads_cufile_json_and_never_touches_cufile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gds_offload.io import cufile_params as cp

    monkeypatch.setattr(cp, "load_libcufile", lambda: pytest.fail("auto loaded libcufile"))
    assert cp.compat_fallback(disable=False, env=_cufile_json(tmp_path, "false")).off
    assert not cp.compat_fallback(disable=False, env=_cufile_json(tmp_path, "true")).off
    forced = cp.compat_fallback(disable=False, env=_cufile_json(tmp_path, "false") | {"CUFILE_FORCE_COMPAT_MODE": "true"})
    assert not forced.off and "CUFILE_FORCE_COMPAT_MODE" in forced.detail


def test_a_libcufile_that_does_not_load_is_not_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    from gds_offload.io import cufile_params as cp

    monkeypatch.setattr(cp, "load_libcufile", lambda: None)
    got = cp.compat_fallback(disable=True, env={})
    assert not got.off and "does not load" in got.detail


def test_the_fake_error_struct_matches_cufile_h() -> None:
    from gds_offload.io import cufile_params as cp

    assert ctypes.sizeof(cp._CUfileError) == 8  # CUfileOpError + CUresult, two 4-byte enums
    assert cp.CU_FILE_DRIVER_ALREADY_OPEN == 5000 + 26


@needs_kvikio
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("off", [True, False])
def test_gds_engine_on_a_gpu_is_strict_only_when_asked(
    strict: bool, off: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CUDA (faked): a strict engine whose fallback cannot be turned off raises naming
    the fix; otherwise ``uses_gds`` says whether the fallback is off, and the description
    which route device memory takes (stream API with a cufile.json, else pread/pwrite)."""
    from gds_offload.io import cufile_params as cp
    from gds_offload.io import kvikio_engine
    from gds_offload.io.kvikio.engine import KvikIOEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen: list[bool] = []
    # What the engine asks of cuFile's settings (the name it calls), answered without a driver.
    monkeypatch.setattr(kvikio_engine, "compat_fallback", lambda *, disable: seen.append(disable) or cp.CompatFallback(off, "because"))
    config = tmp_path / "cufile.json"
    config.write_text("{}")
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(config))
    if strict and not off:
        with pytest.raises(GDSUnavailableError, match="allow_compat_mode.*false"):
            KvikIOEngine("gds", strict=strict, num_threads=2)
        assert seen == [True]
        return
    engine = KvikIOEngine("gds", strict=strict, num_threads=2)
    engine.close()
    assert seen == [strict] and engine.uses_gds is off and engine.stream_io
    assert "stream API" in engine.description and ("fallback off" if off else "fallback possible") in engine.description
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(tmp_path / "missing.json"))
    if os.path.exists("/etc/cufile.json"):
        return
    engine = KvikIOEngine("gds", strict=strict, num_threads=2)
    engine.close()
    assert not engine.stream_io and "synchronize the default CUDA stream" in engine.description


@needs_kvikio
def test_gds_engine_without_cuda_claims_no_gds() -> None:
    from gds_offload.io.kvikio.engine import KvikIOEngine

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    engine = KvikIOEngine("gds", num_threads=2)
    engine.close()
    assert not engine.uses_gds and not engine.stream_io and "host memory only" in engine.description


def test_only_mode_gds_by_name_is_strict(spill_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gds_offload.node import choice
    from gds_offload.node.verdict import Verdict

    # A node where the direct path works: a GPU, and gds-check's verdict (the name choose_engine asks) says gds.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(choice, "node_verdict", lambda path: Verdict("gds", "usable", "", ()))
    assert choice.choose_engine("gds", spill_dir).strict
    assert choice.choose_engine("auto", spill_dir).engine == "gds" and not choice.choose_engine("auto", spill_dir).strict


def test_attach_hands_the_choice_strictness_to_make_engine(spill_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gds_offload
    from gds_offload.activations import offloader as hooks
    from gds_offload.io.factory import make_engine
    from gds_offload.node.choice import Choice

    seen: list[bool] = []
    monkeypatch.setattr(hooks, "choose_engine", lambda *a, **k: Choice("posix", "test", strict=True))
    monkeypatch.setattr(hooks, "make_engine", lambda name, **kw: seen.append(kw["strict"]) or make_engine(name, **kw))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with gds_offload.attach(model, path=spill_dir):
        pass
    assert seen == [True]


# ----------------------------------------------------------------------------- which memory a figure is of
def test_io_bench_labels_cpu_figures_as_host_memory(spill_dir: Path) -> None:
    from gds_offload.bench.io import measure_engine

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: auto measures device memory (tests/test_gpu.py)")
    row = measure_engine("posix", spill_dir, 2 << 20, 1 << 20)
    assert row["memory"] == "host" and row["label"] == "host memory, pwrite/pread" and row["verified"]
    if KVIK_OK:
        row = measure_engine("compat", spill_dir, 2 << 20, 1 << 20)
        assert row["memory"] == "host" and row["label"] == "host memory through KvikIO (POSIX)"


def test_buffer_labels_say_when_gds_is_not_gpudirect() -> None:
    from gds_offload.bench.io import buffer_label

    assert buffer_label("gds", "host", False) == "host memory through KvikIO (POSIX, not GPUDirect: no CUDA device)"
    assert buffer_label("gds", "cuda:0", True) == "cuda:0 memory, cuFile direct (GPUDirect)"
    assert "fallback not ruled out" in buffer_label("gds", "cuda:0", False)
    assert buffer_label("compat", "cuda:1", False).startswith("cuda:1 memory staged through pinned host buffers")


def test_io_bench_refuses_device_memory_without_a_gpu_before_measuring(spill_dir: Path) -> None:
    from gds_offload.bench.io import measure_engine, run_bench

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        measure_engine("posix", spill_dir, 1 << 20, 1 << 20, memory="cuda")
    with pytest.raises(ConfigError, match="expected auto, host or a CUDA device"):
        run_bench(spill_dir, total_bytes=1 << 20, tensor_sizes=[1 << 20], engines=["posix"], raw=False, memory="disk")


def test_bench_io_and_gds_check_show_the_label(capsys: pytest.CaptureFixture[str]) -> None:
    from gds_offload.bench.io import IOBenchReport, buffer_label
    from gds_offload.check.cli import bandwidth_check, bandwidth_rate
    from gds_offload.commands.bench_io import render

    label = buffer_label("gds", "host", False)
    row = {"engine": "gds", "memory": "host", "label": label, "threads": 16, "chunk_bytes": 8 << 20, "tensor_bytes": 1 << 20,
           "write_gbps": 1.5, "read_gbps": 2.5, "page_cache_after_write_bytes": 0, "page_cache_after_read_bytes": 0}
    from gds_offload.bench.machine import describe_machine

    render(IOBenchReport(machine=describe_machine("/tmp").as_dict(), raw=None, rows=[row]))
    assert "not GPUDirect" in " ".join(capsys.readouterr().out.split())
    rate = bandwidth_rate(row, "gds")
    assert rate["memory"] == "host" and rate["label"] == label

    class _Probe:
        path = "/p"

    class _Report:
        paths = [_Probe()]

    check = bandwidth_check(_Report(), [{"gds": rate}], [], [], 1 << 20)  # type: ignore[arg-type]
    assert label in check.detail


def test_a_kvikio_older_than_the_floor_is_unusable_with_the_fix_named() -> None:
    from gds_offload.io.kvikio.engine import KVIKIO_FLOOR, version_status

    assert KVIKIO_FLOOR == (25, 12)
    ok, why = version_status("25.10.0")
    assert not ok and "older than 25.12" in why and "kvikio-cu12>=25.12" in why
    assert version_status("25.12.1") == (True, "KvikIO 25.12.1") and version_status("26.10.0")[0]
    assert version_status("nightly")[0]  # a development build's settings cannot be told from its name


def test_a_strict_gds_refusal_names_a_loaded_module_known_to_open_the_driver() -> None:
    from gds_offload.io.kvikio.engine import driver_openers

    assert driver_openers({"torch": object()}) == ""
    assert "nvidia.dali" in driver_openers({"nvidia.dali": object()}) and "own process" in driver_openers({"nvidia.dali": object()})
