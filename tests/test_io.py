"""Storage engines (``gds_offload.io``): byte-exact round trips, concurrency, stats, retries,
errors, the bandwidth cap, and engine selection. Every engine that runs here is exercised
through :func:`gds_offload.io.make_engine` and a real :class:`~gds_offload.io.spill.SpillStore`."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
from helpers.gates import ENGINE_MODES, FILE_ENGINE_MODES
from helpers.tensors import byte_view

from gds_offload.errors import ConfigError, GDSUnavailableError, OffloadError
from gds_offload.io import make_engine, validate_mode
from gds_offload.io import posix as posix_mod
from gds_offload.io.kvikio.engine import kvikio_status
from gds_offload.io.layout import ALIGN, Slot
from gds_offload.io.pages import HUGE_PAGE, HostBufferPool, empty_like_head, map_anonymous, span_bytes
from gds_offload.io.spill import SpillStore
from gds_offload.node import choice as select_mod
from gds_offload.node.choice import choose_engine
from gds_offload.units import parse_bandwidth

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8]
#: 0-d, empty, one element, odd byte counts (not multiples of 4 KiB), more than one posix chunk.
SHAPES = [(), (0,), (0, 7), (1,), (3, 4097), (1_000_003,), (2_500_001,)]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bits of ``dtype`` (floats include NaNs with payloads, infinities, -0.0, subnormals)."""
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def roundtrip(engine, store: SpillStore, t: torch.Tensor) -> tuple[torch.Tensor, Slot]:
    """Write ``t``'s storage bytes to a fresh slot and read them into a fresh storage;
    return the tensor rebuilt on the new storage (same offset, size, stride) and the slot."""
    src = byte_view(t)
    slot = store.allocate(src.numel())
    assert engine.write(src, slot).wait(timeout_s=60) == src.numel()
    out = torch.full((src.numel(),), 0xA5, dtype=torch.uint8)  # garbage that must be overwritten
    assert engine.read(out, slot).wait(timeout_s=60) == src.numel()
    assert torch.equal(out, src), "bytes read back differ from the bytes written"
    back = torch.empty(0, dtype=t.dtype).set_(out.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return back, slot


def assert_bit_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
    if a.numel():
        # Compare bits (NaN != NaN as values); reshape(-1) gathers strided views.
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_roundtrip_dtypes_and_shapes(engine_and_store, dtype: torch.dtype) -> None:
    engine, store = engine_and_store
    gen = torch.Generator().manual_seed(DTYPES.index(dtype))
    for shape in SHAPES:
        t = random_tensor(shape, dtype, gen)
        back, slot = roundtrip(engine, store, t)
        assert_bit_identical(back, t)
        assert slot.offset % ALIGN == 0 and slot.nbytes % ALIGN == 0 and slot.nbytes >= max(t.untyped_storage().nbytes(), 1)
        if dtype in (torch.int64, torch.bool, torch.uint8):
            assert torch.equal(back, t)


def test_roundtrip_non_contiguous(engine_and_store) -> None:
    engine, store = engine_and_store
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(300, 257, generator=gen)
    cases = {
        "transposed": base.t(),
        "strided slice with offset": base[7:, 3:100:2],
        "expanded (stride 0)": torch.randn(5, 1, generator=gen).expand(5, 1000),
        "channels_last": torch.randn(2, 3, 17, 19, generator=gen).to(memory_format=torch.channels_last).to(torch.bfloat16),
    }
    for name, t in cases.items():
        assert not t.is_contiguous(), name
        back, _ = roundtrip(engine, store, t)
        assert_bit_identical(back, t)
        assert torch.equal(back, t), name


@pytest.fixture(scope="module")
def big_tensor() -> torch.Tensor:
    """300 MiB + 1234 bytes: larger than 256 MiB, not a multiple of 4 KiB."""
    nbytes = (300 << 20) + 1234
    words = torch.empty(nbytes // 8 + 1, dtype=torch.int64).random_(generator=torch.Generator().manual_seed(3))
    return words.view(torch.uint8)[:nbytes].clone()


def test_roundtrip_very_large(engine_and_store, big_tensor: torch.Tensor) -> None:
    engine, store = engine_and_store
    back, slot = roundtrip(engine, store, big_tensor)
    assert torch.equal(back, big_tensor)
    assert slot.nbytes == (300 << 20) + ALIGN


def test_many_concurrent_futures(engine_and_store) -> None:
    """200 writes in flight at once, then 200 reads in flight at once; every byte comes back."""
    engine, store = engine_and_store
    gen = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, 300_000, (200,), generator=gen).tolist()
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    slots = [store.allocate(n) for n in sizes]
    writes = [engine.write(s, slot) for s, slot in zip(srcs, slots)]
    assert [f.wait(timeout_s=60) for f in writes] == sizes
    dsts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    reads = [engine.read(d, slot) for d, slot in zip(dsts, slots)]
    assert [f.wait(timeout_s=60) for f in reads] == sizes
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        assert torch.equal(s, d), f"tensor {i} of {len(sizes)}"
    assert len({(slot.file.id, slot.offset) for slot in slots}) == len(slots), "slots overlap"
    stats = engine.stats()
    assert (stats.writes, stats.reads) == (200, 200)
    assert stats.bytes_written == stats.bytes_read == sum(sizes)


def test_engine_stats_counters(engine_and_store) -> None:
    engine, store = engine_and_store
    assert engine.stats().bytes_written == 0
    a = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8)
    b = torch.randint(0, 256, (12345,), dtype=torch.uint8)
    slot_a, slot_b = store.allocate(a.numel()), store.allocate(b.numel())
    engine.write(a, slot_a).wait()
    engine.write(b, slot_b).wait()
    engine.read(torch.empty_like(a), slot_a).wait()
    s = engine.stats()
    assert (s.writes, s.reads) == (2, 1)
    assert (s.bytes_written, s.bytes_read) == (a.numel() + b.numel(), a.numel())
    assert s.write_busy_s > 0 and s.read_busy_s > 0
    assert s.write_gbps() > 0 and s.read_gbps() > 0
    d = s.as_dict()
    assert d["bytes_written"] == s.bytes_written and d["write_gbps"] == s.write_gbps()
    assert engine.stats() is not engine.stats(), "stats() returns a snapshot"


@pytest.mark.parametrize("mode", FILE_ENGINE_MODES)
def test_engine_reused_with_a_new_store_writes_to_the_new_file(mode: str, spill_dir: Path) -> None:
    """An engine must write where ``slot.file`` says, even after an earlier store with the same
    file ids was closed (KvikIO handles were cached by file id and went to the old file)."""
    engine = make_engine(mode)  # type: ignore[arg-type]
    try:
        first = SpillStore([spill_dir])
        engine.write(torch.ones(ALIGN, dtype=torch.uint8), first.allocate(ALIGN)).wait()
        first.close()
        second = SpillStore([spill_dir])
        try:
            src = torch.randint(0, 256, (2 * ALIGN,), dtype=torch.uint8)
            slot = second.allocate(src.numel())
            engine.write(src, slot).wait()
            fd = os.open(slot.file.proc_path, os.O_RDONLY)  # buffered: any buffer alignment
            try:
                on_disk = os.pread(fd, src.numel(), slot.offset)
            finally:
                os.close(fd)
            assert on_disk == bytes(src.numpy()), "the bytes went to another file than slot.file"
        finally:
            second.close()
    finally:
        engine.close()


# ------------------------------------------------------------------ zero-copy page spans
def _at_head(nbytes: int, head: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, view): ``view`` is ``nbytes`` of ``raw`` starting ``head`` bytes into a page."""
    raw = torch.full((nbytes + 3 * ALIGN,), fill, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw, raw[skip + head : skip + head + nbytes]


@pytest.mark.parametrize("mode", FILE_ENGINE_MODES)
@pytest.mark.parametrize("head", [0, 64, 4032])
def test_host_tensors_move_as_whole_pages(mode: str, head: int, spill_dir: Path) -> None:
    """An O_DIRECT write of a host tensor part-way into a page goes straight from its pages:
    the bytes land ``head`` into the slot, and a buffer from ``engine.empty`` is read in place."""
    engine = make_engine(mode)
    store = SpillStore([spill_dir])
    try:
        assert store.files[0].direct
        n = 3 * (8 << 20) + 12_345  # more than one posix chunk, not a page multiple
        _, src = _at_head(n, head, 0)
        src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(head)))
        slot = store.allocate(engine.slot_bytes(n, src.device))
        assert engine.write(src, slot).wait(60) == n
        assert engine.stats().bounced_bytes == 0, "zero-copy: no bounce buffer may be used"
        assert engine.data_offset(slot) == slot.offset + head
        fd = os.open(f"/proc/self/fd/{slot.file.fd}", os.O_RDONLY)  # buffered: any offset and length
        try:
            on_disk = os.pread(fd, n, engine.data_offset(slot))
        finally:
            os.close(fd)
        assert on_disk == bytes(src.numpy()), "the file holds other bytes at data_offset"
        dst = engine.empty(n, slot, src.device)
        assert dst.data_ptr() % ALIGN == head and dst.storage_offset() % 64 == 0
        assert engine.read(dst, slot).wait(60) == n
        assert torch.equal(dst, src)
        engine.release(slot)
        assert engine.data_offset(slot) == slot.offset
    finally:
        engine.close()
        store.close()


@pytest.mark.parametrize("mode", FILE_ENGINE_MODES)
def test_reading_pages_into_a_foreign_buffer_touches_only_its_bytes(mode: str, spill_dir: Path) -> None:
    """A read into a buffer whose page span is not its own (not from ``engine.empty``) must not
    write a byte outside it: the engine reads the pages elsewhere and copies."""
    engine = make_engine(mode)
    store = SpillStore([spill_dir])
    try:
        n = (1 << 20) + 3
        _, src = _at_head(n, 640, 0)
        src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
        slot = store.allocate(engine.slot_bytes(n, src.device))
        engine.write(src, slot).wait(60)
        raw, dst = _at_head(n, 100, 0xAB)  # another head, neighbours inside the same pages
        assert engine.read(dst, slot).wait(60) == n
        assert torch.equal(dst, src)
        outside = torch.cat([raw[: dst.storage_offset()], raw[dst.storage_offset() + n :]])
        assert bool((outside == 0xAB).all()), "the read wrote outside its buffer"
    finally:
        engine.close()
        store.close()


@pytest.mark.parametrize("mode", FILE_ENGINE_MODES)
def test_unaligned_or_too_big_spans_take_the_copying_path(mode: str, spill_dir: Path) -> None:
    """A tensor starting at an odd address, or whose span does not fit its slot, still round-trips."""
    engine = make_engine(mode)
    store = SpillStore([spill_dir])
    try:
        n = 200_000
        for head, slot_bytes in ((1, engine.slot_bytes(n, torch.device("cpu"))), (4032, n)):
            _, src = _at_head(n, head, 0)
            src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(head)))
            slot = store.allocate(slot_bytes)
            engine.write(src, slot).wait(60)
            assert engine.data_offset(slot) == slot.offset, "no page span: the bytes start at the slot"
            dst = engine.empty(n, slot, src.device)
            engine.read(dst, slot).wait(60)
            assert torch.equal(dst, src)
    finally:
        engine.close()
        store.close()


def test_read_buffers_are_reused_once_freed_and_the_idle_pool_is_capped() -> None:
    pool = HostBufferPool(max_idle_bytes=3 * span_bytes(1 << 20))
    a = empty_like_head(1 << 20, 128, pool)
    ptr = a.untyped_storage().data_ptr()
    assert a.data_ptr() % ALIGN == 128 and (pool.mapped, pool.reused) == (1, 0)
    view = a[10:20].view(torch.int16)  # a view keeps the buffer in use
    del a
    b = empty_like_head(1 << 20, 0, pool)
    assert b.untyped_storage().data_ptr() != ptr, "a buffer still viewed was handed out again"
    del view
    c = empty_like_head(1 << 20, 64, pool)
    assert c.untyped_storage().data_ptr() == ptr and pool.reused == 1 and pool.idle_bytes == 0
    bufs = [empty_like_head(1 << 20, 0, pool) for _ in range(5)]
    del b, c, bufs
    assert pool.idle_bytes == 3 * span_bytes(1 << 20), "idle buffers beyond the cap are unmapped"
    pool.clear()
    assert pool.idle_bytes == 0


def test_trim_keeps_idle_read_buffers_only_up_to_the_reads_to_come() -> None:
    """``trim(keep_bytes)`` (called with the bytes backward has still to read) unmaps the idle
    buffers beyond it at once, and buffers that die later beyond it; a later call with more to
    read lets the pool keep buffers again, up to its cap, and reuse them. ``in_use_bytes`` and the
    mapped peak count the buffers of live tensors too."""
    n = span_bytes(1 << 20)
    pool = HostBufferPool(max_idle_bytes=2 * n)
    a, b, c = (empty_like_head(1 << 20, 0, pool) for _ in range(3))
    assert pool.in_use_bytes == pool.peak_mapped_bytes == 3 * n
    del a, b
    assert pool.idle_bytes == 2 * n and pool.in_use_bytes == n
    pool.trim(n)  # one buffer's worth of reads to come
    assert pool.idle_bytes == n and pool.keep_bytes == n
    pool.trim()  # nothing left to read
    assert pool.idle_bytes == 0
    del c
    assert pool.idle_bytes == 0 and pool.in_use_bytes == 0, "a buffer dying with nothing left to read is unmapped"
    pool.trim(10 * n)  # the next backward: the cap bounds what is kept
    assert pool.keep_bytes == 2 * n
    d = empty_like_head(1 << 20, 0, pool)
    kept = d.untyped_storage().data_ptr()
    del d
    assert pool.idle_bytes == n
    e = empty_like_head(1 << 20, 0, pool)
    assert e.untyped_storage().data_ptr() == kept and pool.reused == 1 and pool.idle_bytes == 0
    assert pool.peak_mapped_bytes == 3 * n
    pool.reset_peaks()
    assert pool.peak_mapped_bytes == n


def _vm_flags(start: int, end: int) -> list[tuple[int, int, set[str]]]:
    """(start, end, VmFlags) of this process's mappings that overlap ``[start, end)``."""
    out, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = (lo, hi) if lo < end and hi > start else None
        elif current is not None and line.startswith("VmFlags:"):
            out.append((*current, set(line.split()[1:])))
    return out


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="needs a Linux kernel with transparent huge pages (no /sys/kernel/mm/transparent_hugepage)")
def test_read_buffers_ask_for_huge_pages_and_only_for_whole_ones() -> None:
    """The pool's mappings are private, advised MADV_HUGEPAGE over their whole huge pages and
    MADV_NOHUGEPAGE over the tail (so a kernel with THP "always" spends no extra huge page on it)."""
    import ctypes

    length = 3 * HUGE_PAGE + 5 * ALIGN
    mm = map_anonymous(length)
    start = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    try:
        assert len(mm) == 4 * HUGE_PAGE and start % HUGE_PAGE == 0, "rounded to huge pages, at a huge-page boundary"
        vmas = _vm_flags(start, start + len(mm))
        huge = [(lo, hi) for lo, hi, flags in vmas if "hg" in flags]
        tail = [(lo, hi) for lo, hi, flags in vmas if "nh" in flags]
        assert huge == [(start, start + 3 * HUGE_PAGE)], vmas
        assert tail == [(start + 3 * HUGE_PAGE, start + 4 * HUGE_PAGE)], vmas
        assert all("sh" not in flags for _, _, flags in vmas), "private, not shared memory"
        pool = HostBufferPool(max_idle_bytes=0)
        buf = pool.take(length)
        assert buf.numel() == length and buf.data_ptr() % HUGE_PAGE == 0
    finally:
        mm.close()


@pytest.mark.parametrize("mode", FILE_ENGINE_MODES)
def test_a_read_buffer_dropped_mid_read_is_not_reused_before_the_read_ends(mode: str, spill_dir: Path) -> None:
    """The caller may drop its reference while the read is in flight (autograd freed the
    handle); the engine holds the buffer, so the pool cannot hand it to another read."""
    engine = make_engine(mode, max_bandwidth=parse_bandwidth("40MB/s"))  # a read of 8 MiB takes ~0.2 s
    store = SpillStore([spill_dir])
    try:
        n = 8 << 20
        src = torch.ones(n, dtype=torch.uint8)
        slots = [store.allocate(engine.slot_bytes(n, src.device)) for _ in range(2)]
        for slot in slots:
            engine.write(src, slot).wait(60)
        dst = engine.empty(n, slots[0], src.device)
        ptr = dst.untyped_storage().data_ptr()
        first = engine.read(dst, slots[0])
        del dst
        other = engine.empty(n, slots[1], src.device)
        assert not first.done(), "the read ended too soon to test anything"
        assert other.untyped_storage().data_ptr() != ptr, "a buffer was handed out while a read was landing in it"
        engine.read(other, slots[1]).wait(60)
        first.wait(60)
        assert torch.equal(other, src)
    finally:
        engine.close()
        store.close()


# -------------------------------------------------------------------------------- short I/O
class ShortIO:
    """Stands in for ``os`` in the posix engine: ``pwrite``/``preadv`` move at most half of each
    request (in 4 KiB multiples, as O_DIRECT requires), like a device that returns short counts."""

    def __init__(self, *, zero: bool = False) -> None:
        self.calls = 0
        self.zero = zero

    def __getattr__(self, name: str):  # noqa: ANN204 - everything else is the real os
        return getattr(os, name)

    @staticmethod
    def _short(n: int) -> int:
        return n if n <= ALIGN else max(ALIGN, n // 2 // ALIGN * ALIGN)

    def pwrite(self, fd: int, data, offset: int) -> int:  # noqa: ANN001
        self.calls += 1
        if self.zero:
            return 0
        return os.pwrite(fd, data[: self._short(len(data))], offset)

    def preadv(self, fd: int, bufs, offset: int) -> int:  # noqa: ANN001
        self.calls += 1
        return os.preadv(fd, [bufs[0][: self._short(len(bufs[0]))]], offset)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_posix_short_writes_and_reads_are_retried(monkeypatch: pytest.MonkeyPatch, spill_dir: Path, direct: bool) -> None:
    fake = ShortIO()
    monkeypatch.setattr(posix_mod, "os", fake)
    engine = make_engine("posix")
    store = SpillStore([spill_dir], direct=direct)
    try:
        assert store.files[0].direct is direct
        t = torch.randint(0, 256, ((1 << 20) + 777,), dtype=torch.uint8)
        back, _ = roundtrip(engine, store, t)
        assert torch.equal(back, t)
        assert fake.calls > 4, "the fault injector was not used"
        assert engine.stats().retries > 0
    finally:
        engine.close()
        store.close()


def test_posix_write_without_progress_fails_naming_file_and_offset(monkeypatch: pytest.MonkeyPatch, spill_dir: Path) -> None:
    monkeypatch.setattr(posix_mod, "os", ShortIO(zero=True))
    engine = make_engine("posix")
    store = SpillStore([spill_dir])
    try:
        slot = store.allocate(ALIGN)
        slot = store.allocate(ALIGN)  # a non-zero offset
        with pytest.raises(OffloadError) as info:
            engine.write(torch.ones(100, dtype=torch.uint8), slot).wait()
        msg = str(info.value)
        assert store.files[0].describe() in msg and f"offset {slot.offset}" in msg
        assert isinstance(info.value.__cause__, OSError)
        assert engine.stats().writes == 0, "a failed write is not counted as written"
    finally:
        engine.close()
        store.close()


# ---------------------------------------------------------------------------------- errors
def test_read_past_end_of_file_names_file_and_offset(engine_and_store) -> None:
    engine, store = engine_and_store
    store.allocate(ALIGN)
    f = store.files[0]
    slot = Slot(f, f.size + (1 << 30), 2 * ALIGN)  # beyond the end: nothing was ever written there
    with pytest.raises(OffloadError) as info:
        engine.read(torch.empty(2 * ALIGN, dtype=torch.uint8), slot).wait(timeout_s=30)
    msg = str(info.value)
    assert f.describe() in msg and f"offset {slot.offset}" in msg, msg
    assert info.value.__cause__ is not None


def test_posix_bad_descriptor_and_closed_store_raise_offload_error(spill_dir: Path) -> None:
    engine = make_engine("posix")
    store = SpillStore([spill_dir])
    f = store.files[0]
    ro = os.open("/dev/zero", os.O_RDONLY)
    good = f.fd
    try:
        slot = store.allocate(3 * ALIGN)
        engine.write(torch.ones(3 * ALIGN, dtype=torch.uint8), slot).wait()
        f.fd = ro  # a descriptor that cannot be written
        try:
            with pytest.raises(OffloadError, match=rf"write of {3 * ALIGN} bytes at .*#0 in {re.escape(str(spill_dir))} offset {slot.offset}"):
                engine.write(torch.ones(3 * ALIGN, dtype=torch.uint8), slot).wait()
        finally:
            f.fd = good
        store.close()
        with pytest.raises(OffloadError, match=rf"read of .* offset {slot.offset} failed: .*Bad file descriptor"):
            engine.read(torch.empty(3 * ALIGN, dtype=torch.uint8), slot).wait()
    finally:
        os.close(ro)
        engine.close()
        store.close()


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_closed_engine_refuses_transfers(mode: str, spill_dir: Path) -> None:
    engine = make_engine(mode)  # type: ignore[arg-type]
    store = SpillStore([spill_dir] if engine.needs_files else [])
    slot = store.allocate(ALIGN)
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(OffloadError, match="closed"):
        engine.write(torch.ones(ALIGN, dtype=torch.uint8), slot)
    store.close()


# ------------------------------------------------------------------------------ bandwidth cap
def test_token_bucket_caps_bandwidth(spill_dir: Path) -> None:
    rate = parse_bandwidth("128MB/s")
    engine = make_engine("posix", max_bandwidth=rate)
    store = SpillStore([spill_dir])
    try:
        t = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
        slot = store.allocate(t.numel())
        start = time.perf_counter()
        engine.write(t, slot).wait()
        elapsed = time.perf_counter() - start
        # 64 MiB at 128 MB/s is 0.52 s; the bucket's burst (5%) lets a little through at once.
        assert elapsed >= 0.4, f"64 MiB took {elapsed:.3f}s under a 128 MB/s cap"
        out = torch.empty_like(t)
        engine.read(out, slot).wait()
        assert torch.equal(out, t)
    finally:
        engine.close()
        store.close()


# --------------------------------------------------------------------------------- selection
no_gpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is present: what auto/gds pick depends on the node's GDS stack"
)


@no_gpu
def test_auto_picks_posix_for_a_cpu_model(spill_dir: Path) -> None:
    import gds_offload

    assert choose_engine("auto", spill_dir, "cpu").engine == "posix"
    assert choose_engine("compat", spill_dir, "cpu").engine == "compat" or not kvikio_status()[0]
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with gds_offload.attach(model, path=spill_dir) as off:
        assert off.engine.name == "posix" and "CPU" in off.stats().engine_reason


def test_auto_picks_compat_without_gpu(spill_dir: Path) -> None:
    ok, why = kvikio_status()
    if not ok:
        pytest.skip(f"KvikIO unusable: needs libcuda.so.1 ({why})")
    choice = choose_engine("auto", spill_dir)
    assert choice.engine == "compat"
    assert re.search(r"no (CUDA )?GPU", choice.reason), choice.reason


@no_gpu
def test_auto_without_kvikio_picks_posix(monkeypatch: pytest.MonkeyPatch, spill_dir: Path) -> None:
    monkeypatch.setattr(select_mod, "kvikio_status", lambda: (False, "KvikIO needs libcuda.so.1"))
    choice = choose_engine("auto", spill_dir)
    assert choice.engine == "posix" and "libcuda.so.1" in choice.reason
    with pytest.raises(ConfigError, match=r"mode='compat' needs KvikIO: KvikIO needs libcuda.so.1; or use mode='posix'"):
        choose_engine("compat", spill_dir)


@no_gpu
def test_gds_without_gpu_names_the_missing_piece(spill_dir: Path) -> None:
    with pytest.raises(GDSUnavailableError) as info:
        choose_engine("gds", spill_dir)
    msg = str(info.value)
    assert re.search(r"no (CUDA )?GPU", msg) and "gds-check" in msg and "compat" in msg, msg


def test_unknown_mode_suggests_the_nearest() -> None:
    with pytest.raises(ConfigError, match=r"mode='compta' is not an engine; expected one of .*did you mean 'compat'"):
        choose_engine("compta", None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="did you mean 'posix'"):
        validate_mode("posx")
    with pytest.raises(ConfigError, match="expected gds, compat, posix or host"):
        make_engine("bogus")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["posix", "host"])
def test_explicit_modes_need_no_probe(mode: str) -> None:
    choice = choose_engine(mode, None)  # type: ignore[arg-type]
    assert choice.engine == mode and mode in choice.reason


# --------------------------------------------------------------------------------- benchmark
def test_page_cache_bytes_sees_buffered_but_not_direct_writes(spill_dir: Path) -> None:
    from gds_offload.bench.raw_io import page_cache_bytes

    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    for direct in (True, False):
        store = SpillStore([spill_dir], direct=direct)
        engine = make_engine("posix")
        try:
            engine.write(data, store.allocate(data.numel())).wait()
            cached = page_cache_bytes(store.files[0].fd, store.files[0].size)
            assert cached == 0 if direct else cached >= data.numel(), (direct, cached)
        finally:
            engine.close()
            store.close()


def test_bench_io_command_smoke(spill_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``gds-offload bench-io`` runs end to end at a tiny size (figures are not checked: noise)."""
    import json

    from gds_offload.cli import main

    engines = ",".join(p.values[0] for p in ENGINE_MODES if not p.marks)
    out = tmp_path / "io.json"
    argv = ["bench-io", "--path", str(spill_dir), "--size", "8MiB", "--tensor-sizes", "1MiB,1000000", "--engines", engines]
    assert main([*argv, "--threads", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["raw"]["write_gbps"] > 0 and report["raw"]["read_gbps"] > 0
    assert {r["engine"] for r in report["rows"]} == set(engines.split(","))
    for r in report["rows"]:
        assert r["verified"] and r["write_gbps"] > 0 and r["read_gbps"] > 0 and r["write_ratio"] > 0
        if r["engine"] == "posix":
            assert r["threads"] == 2 and r["page_cache_after_write_bytes"] == 0
    table = capsys.readouterr().out
    assert "raw O_DIRECT" in table and "w/raw" in table
    assert main(["bench-io", "--path", str(spill_dir), "--size", "40 gigs"]) == 2
    assert "is not a size" in capsys.readouterr().err
    assert os.listdir(spill_dir) == [], "the benchmark left files behind"


def test_raw_bandwidth_falls_back_to_dd(monkeypatch: pytest.MonkeyPatch, spill_dir: Path) -> None:
    import shutil

    from gds_offload.bench import raw_io

    real_which = shutil.which
    monkeypatch.setattr(raw_io.shutil, "which", lambda name: None if name == "fio" else real_which(name))
    raw = raw_io.raw_direct_bandwidth(spill_dir, 64 << 20)
    assert raw["tool"] == "dd" and raw["write_gbps"] > 0 and raw["read_gbps"] > 0
    assert "oflag=direct" in raw["command"] and "iflag=direct" in raw["command"]
    assert os.listdir(spill_dir) == []
    monkeypatch.setattr(raw_io.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs fio or dd"):
        raw_io.raw_direct_bandwidth(spill_dir, 64 << 20)


def test_info_names_the_engine_for_gpu_and_for_cpu_models(spill_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from gds_offload.cli import main

    assert main(["info", "--json", "--path", str(spill_dir)]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["engine_for_cpu_models"] == "posix"
    assert facts["engine"] == choose_engine("auto", spill_dir).engine and facts["reason"]


def test_negative_read_pool_is_refused() -> None:
    from gds_offload.io.posix import PosixEngine

    with pytest.raises(ValueError, match=r"read_pool_bytes=-1.*use 0"):
        PosixEngine(read_pool_bytes=-1)


@pytest.mark.skipif(not kvikio_status()[0], reason="needs KvikIO (and libcuda.so.1 for its host I/O)")
def test_engines_opening_handles_at_once_leave_kvikio_compat_mode_as_it_was(monkeypatch: pytest.MonkeyPatch, spill_dir: Path) -> None:
    """``kvikio.defaults.set("compat_mode", ...)`` is process-wide: a gds and a compat engine opening
    handles at the same time must each open with their own mode and leave the process's mode as
    it was (one lock per engine is not enough: the process could end with compat mode OFF).

    ``CuFile`` is replaced by a slow fake that records the mode it was opened under: a real
    compat-OFF open needs the GDS driver, which this machine lacks."""
    import threading

    import kvikio
    import kvikio.defaults

    from gds_offload.io.kvikio.engine import KvikIOEngine

    seen: list[tuple[str, object]] = []

    class SlowCuFile:
        def __init__(self, path: str, flags: str) -> None:
            mode = kvikio.defaults.get("compat_mode")
            time.sleep(0.002)  # widen the window in which the other engine could change the mode
            seen.append((threading.current_thread().name, mode))

        def close(self) -> None:
            pass

    monkeypatch.setattr(kvikio, "CuFile", SlowCuFile)
    before = kvikio.defaults.get("compat_mode")
    engines = {"gds": KvikIOEngine("gds", num_threads=2), "compat": KvikIOEngine("compat", num_threads=2)}
    stores = [SpillStore([spill_dir]) for _ in range(80)]

    def open_all(name: str) -> None:
        for store in stores:
            engines[name]._handle(store.files[0])

    try:
        threads = [threading.Thread(target=open_all, args=(n,), name=n) for n in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for e in engines.values():
            e.close()
        for store in stores:
            store.close()
    expected = {"gds": kvikio.CompatMode.OFF, "compat": kvikio.CompatMode.ON}
    assert all(mode == expected[name] for name, mode in seen), seen
    assert kvikio.defaults.get("compat_mode") == before


@pytest.mark.skipif(not kvikio_status()[0], reason="needs KvikIO (and libcuda.so.1 for its host I/O)")
def test_an_engine_made_while_reads_are_in_flight_leaves_kvikios_pool_alone(spill_dir: Path) -> None:
    """KvikIO's one thread pool is rebuilt whenever num_threads is set: a second engine of the same
    or a smaller size (a trainer's beside a streamed model's) must not set it while the first one's
    reads are in flight; the reads all complete, exactly."""
    import kvikio.defaults

    from gds_offload.io.kvikio.engine import KvikIOEngine
    from gds_offload.io.spill import SpillStore

    first = KvikIOEngine("compat", num_threads=4)
    store = SpillStore([spill_dir])
    src = torch.arange(64 << 18, dtype=torch.int32).view(torch.uint8)  # 64 MiB
    slot = store.allocate(src.numel())
    try:
        first.write(src, slot).wait()
        dst = torch.empty_like(src)
        rebuilt: list[object] = []
        original = kvikio.defaults.set

        def recording(*args: object, **kwargs: object) -> object:
            config = args[0] if args and isinstance(args[0], dict) else {}
            if "num_threads" in config or args[:1] == ("num_threads",):
                rebuilt.append(args)
            return original(*args, **kwargs)

        kvikio.defaults.set = recording  # type: ignore[assignment]
        try:
            future = first.read(dst, slot)
            second = KvikIOEngine("compat", num_threads=4)
            third = KvikIOEngine("compat", num_threads=2)
        finally:
            kvikio.defaults.set = original  # type: ignore[assignment]
        future.wait()
        assert rebuilt == [] and kvikio.defaults.get("num_threads") >= 4
        assert torch.equal(dst, src)
        second.close()
        third.close()
    finally:
        store.free(slot)
        store.close()
        first.close()
