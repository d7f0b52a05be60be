"""What only a GPU can show: device memory through every engine, stream ordering, exact CUDA
training, GPU memory saved, CUDA-event timing.

Run with ``pytest -m "gpu or gds"`` on a machine with an NVIDIA GPU (``scripts/gpu_check.sh``
does). Without a GPU every test here skips, naming the missing hardware; on a GPU node without
GPUDirect Storage the ``gds`` tests skip with gds-check's reason. ``tests/test_gpu_static.py``
(CPU) checks that these tests are collected, marked and skipped that way.

* Engines move *device* memory: ``gds`` through cuFile's stream API on side streams (DMA),
  ``compat`` and ``posix`` through pinned staging buffers copied on side streams
  (``gds_offload/io/staging.py``), ``host`` copies on a side stream into pinned buffers.
* Stream ordering: engines run on their own threads and streams, so before touching a device
  buffer they wait for a ``ready`` event recorded on the stream that produced the bytes
  (writes) or that may still read the recycled block (reads). The race tests widen those
  windows with ``torch.cuda._sleep`` (torchtune's technique) on a *non-default* stream: torch
  streams are non-blocking, so nothing but that event orders an engine's copy after them.
* The built-in GPT trains bit-identically with and without the offloader (fp32 and bf16
  autocast, deterministic algorithms); with ``policy="all"`` it needs far less GPU memory;
  ``policy="adaptive"`` times units with CUDA events.
* With two GPUs: a model on a GPU other than the current device (engine threads start on
  device 0), which the ``host`` engine's side stream and the scheduler's ``Clock`` must follow.

Spill files go to ``$GDS_TEST_DIR`` when set (an NVMe directory; needed by the ``gds`` tests),
else to a private directory on a real disk (see ``conftest.real_disk_base``).

Determinism: ``CUBLAS_WORKSPACE_CONFIG`` is set at import, while pytest collects and before any
test creates a cuBLAS handle; tests that compare training runs use deterministic kernels for
their duration (fixture ``deterministic``: ``use_deterministic_algorithms(True)`` without
``warn_only``, SDPA's math backend, deterministic cuDNN; excluded from the comparison: SDPA's
flash, memory-efficient and cuDNN kernels, and any op without a deterministic CUDA kernel,
which raises).

* Overlap: engines move device memory on their own non-blocking side streams, so a transfer
  finishes while a long kernel still runs on the legacy default stream (where training runs);
  ``io_bench`` measures device buffers when a GPU is present.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.disks import real_disk_base
from helpers.models import Result, assert_same, grads_of, settled
from helpers.tensors import byte_view
from torch import nn

import gds_offload
from gds_offload import OffloadStats
from gds_offload.bench.train.determinism import deterministic_kernels, set_cublas_workspace
from gds_offload.io import make_engine
from gds_offload.io.base import Engine
from gds_offload.io.kvikio.engine import kvikio_status
from gds_offload.io.spill import SpillStore
from gds_offload.models.gpt import GPTConfig, lm_loss, make_gpt, synthetic_batch

# cuBLAS reads this when it creates a handle's workspace; deterministic mode refuses cuBLAS
# calls without it. Set here, at collection, before any test touches CUDA.
set_cublas_workspace()

#: The device under test (a module constant so the logic can be dry-run on CPU with stubs).
CUDA = torch.device("cuda")
NO_GPU = "needs an NVIDIA GPU (torch.cuda.is_available() is False)"
_GPU_MARKS = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU))


def gpu_test(fn: Callable[..., None]) -> Callable[..., None]:
    """Mark ``fn`` as a GPU test and skip it without CUDA."""
    for mark in reversed(_GPU_MARKS):
        fn = mark(fn)
    return fn


def _engine_param(mode: str) -> object:
    if mode == "gds":  # skipped by _require() with gds-check's reason (needs GDS_TEST_DIR)
        return pytest.param("gds", id="gds", marks=pytest.mark.gds)
    return pytest.param(mode, id=mode, marks=_GPU_MARKS)


#: Every engine, device memory in and out. ``gds`` needs GPUDirect Storage at $GDS_TEST_DIR.
ENGINES = [_engine_param(m) for m in ("compat", "host", "posix", "gds")]


@functools.cache
def _gds_missing() -> str | None:
    """Why the direct (GDS) path cannot be tested on this node; None when it can."""
    if not torch.cuda.is_available():
        return "needs GPUDirect Storage, which needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    root = os.environ.get("GDS_TEST_DIR", "").strip()
    if not root:
        return (
            "needs GPUDirect Storage: set GDS_TEST_DIR to a directory on a local NVMe ext4/xfs "
            "filesystem of a node with the nvidia-fs driver loaded (GDS_TEST_DIR is not set)"
        )
    ok, why = kvikio_status()
    if not ok:
        return f"needs GPUDirect Storage through KvikIO, which is unusable here: {why}"
    from gds_offload.node.probes import node_verdict

    verdict = node_verdict(Path(root))
    if verdict.mode != "gds":
        return (
            f"needs GPUDirect Storage at GDS_TEST_DIR={root}, but gds-check's verdict is "
            f"{verdict.mode!r}: {verdict.reason} (fix: {verdict.fix})"
        )
    return None


def _require(mode: str) -> None:
    """Skip, naming what is missing, when ``mode`` cannot run on this node."""
    if mode == "gds":
        missing = _gds_missing()
        if missing:
            pytest.skip(missing)
    if mode in ("compat", "gds"):
        ok, why = kvikio_status()
        if not ok:
            pytest.skip(f"mode={mode!r} needs KvikIO (kvikio-cu12 and the driver's libcuda.so.1): {why}")


@pytest.fixture
def spill_path() -> Iterator[Path]:
    """A private (0700) spill directory under $GDS_TEST_DIR, else on a real disk; removed afterwards."""
    root = os.environ.get("GDS_TEST_DIR", "").strip()
    base = Path(root) if root and Path(root).is_dir() else real_disk_base()  # a missing one: gds tests skip
    d = Path(tempfile.mkdtemp(prefix="gds_offload-gpu-test-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def deterministic() -> Iterator[None]:
    """Deterministic kernels for one test, so two runs can be compared bit for bit:
    ``use_deterministic_algorithms(True)`` (``warn_only=False``), SDPA's math backend, cuDNN
    deterministic (:func:`gds_offload.bench.train.determinism.deterministic_kernels`; its
    ``EXCLUDED`` says which kernels are left out of the comparison)."""
    with deterministic_kernels():
        yield


@contextlib.contextmanager
def _engine(mode: str, path: Path) -> Iterator[tuple[Engine, SpillStore]]:
    engine = make_engine(mode)  # type: ignore[arg-type]
    store = SpillStore([path] if engine.needs_files else [])
    try:
        yield engine, store
    finally:
        engine.close()  # waits for transfers in flight
        store.close()


@functools.cache
def _cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on this GPU (measured, as torch's own tests do).

    Call it before opening a race window: it synchronizes the device.
    """
    rates = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        rates.append(1_000_000 / max(start.elapsed_time(end), 1e-3))
    return sorted(rates)[1]


def _sleep_cycles(ms: float) -> int:
    return int(ms * _cycles_per_ms())


def _ready() -> torch.cuda.Event:
    """An event on the current stream: everything queued on it so far."""
    event = torch.cuda.Event()
    event.record()
    return event


def _random_cuda(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bits of ``dtype`` on the GPU (floats include NaNs with payloads, infinities, -0.0)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, device=CUDA, generator=gen).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, device=CUDA, generator=gen)
    return raw.view(dtype).reshape(shape)


def _round_trip(engine: Engine, store: SpillStore, src: torch.Tensor) -> torch.Tensor:
    """Write the device bytes ``src`` to a fresh slot; read them into a device buffer pre-filled with 0xA5."""
    slot = store.allocate(src.numel())
    try:
        assert engine.write(src, slot, ready=_ready()).wait(timeout_s=120) == src.numel()
        dst = torch.full((src.numel(),), 0xA5, dtype=torch.uint8, device=CUDA)
        assert engine.read(dst, slot, ready=_ready()).wait(timeout_s=120) == src.numel()
    finally:
        engine.release(slot)
        store.free(slot)
    return dst


# ------------------------------------------------------------------------- 1. engine round trips
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8]
#: 0-d, empty, one element, odd byte counts (not multiples of 4 KiB), more than one 8 MiB chunk.
SHAPES = [(), (0,), (0, 7), (1,), (3, 4097), (1_000_003,), (2_500_001,)]


@pytest.mark.parametrize("mode", ENGINES)
def test_engine_round_trips_cuda_tensors(mode: str, spill_path: Path) -> None:
    _require(mode)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    with _engine(mode, spill_path) as (engine, store):
        for dtype in DTYPES:
            for shape in SHAPES:
                t = _random_cuda(shape, dtype, gen)
                src = byte_view(t)
                back = _round_trip(engine, store, src)
                assert back.device.type == CUDA.type and torch.equal(back, src), f"{mode}: {dtype} {shape}: bytes read back differ"
                rebuilt = torch.empty(0, dtype=dtype, device=CUDA).set_(
                    back.untyped_storage(), t.storage_offset(), t.size(), t.stride()
                )
                assert (rebuilt.dtype, rebuilt.shape, rebuilt.stride()) == (t.dtype, t.shape, t.stride())
                # Compare bits (NaN != NaN as values).
                assert torch.equal(rebuilt.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("mode", ENGINES)
def test_engine_round_trips_a_cuda_tensor_over_256_mib(mode: str, spill_path: Path) -> None:
    _require(mode)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    t = _random_cuda(((128 << 20) + 6_173,), torch.bfloat16, gen)  # 256 MiB + 12,346 bytes
    src = byte_view(t)
    assert src.numel() > 256 << 20 and src.numel() % 4096
    with _engine(mode, spill_path) as (engine, store):
        back = _round_trip(engine, store, src)
    assert torch.equal(back, src), f"{mode}: {src.numel()} bytes read back differ"


# ------------------------------------------------------------------------- 3a. engine races
#: A size no other tensor in these tests has: after empty_cache() the caching allocator's only
#: free block of this size is the one the read race frees on purpose.
RACE_BYTES = (24 << 20) + 4_321


@pytest.mark.parametrize("mode", ENGINES)
def test_engine_write_waits_for_the_producing_stream(mode: str, spill_path: Path) -> None:
    """Write race. The bytes handed to ``write()`` are produced by a kernel still queued behind a
    50 ms GPU sleep on a non-default stream. An engine that read them without waiting on
    ``ready`` (or waited on the default stream, which does not order non-blocking streams) would
    store what the buffer held before (zeros), and the read-back would not match."""
    _require(mode)
    cycles = _sleep_cycles(50)
    gen = torch.Generator(device=CUDA).manual_seed(2)
    producer = torch.cuda.Stream()
    with _engine(mode, spill_path) as (engine, store):
        slot = store.allocate(RACE_BYTES)
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):
            expected = torch.randint(0, 256, (RACE_BYTES,), dtype=torch.uint8, device=CUDA, generator=gen)
            src = torch.zeros(RACE_BYTES, dtype=torch.uint8, device=CUDA)
            torch.cuda._sleep(cycles)
            src.copy_(expected)  # the producing kernel, queued behind the sleep
            ready = torch.cuda.Event()
            ready.record(producer)
        write = engine.write(src, slot, ready=ready)
        assert not ready.query(), "the GPU finished its 50 ms sleep before write() returned: the race window never opened"
        write.wait(timeout_s=120)
        torch.cuda.synchronize()
        back = torch.empty(RACE_BYTES, dtype=torch.uint8, device=CUDA)
        engine.read(back, slot, ready=_ready()).wait(timeout_s=120)
        engine.release(slot)
        store.free(slot)
    assert torch.equal(back, expected), f"{mode} read the source before the kernel producing it had run"


@pytest.mark.parametrize("mode", ENGINES)
def test_engine_read_waits_for_kernels_still_reading_a_reused_block(mode: str, spill_path: Path) -> None:
    """Read race. A kernel queued behind a 50 ms GPU sleep still reads ``old`` when ``old`` is
    freed; the caching allocator (stream-ordered) hands the same block to the read's destination
    at once. An engine that wrote into it without waiting on ``ready`` would overwrite ``old``
    before that kernel ran: ``seen`` would hold the payload instead of the old bytes."""
    _require(mode)
    cycles = _sleep_cycles(50)
    gen = torch.Generator(device=CUDA).manual_seed(3)
    with _engine(mode, spill_path) as (engine, store):
        slot = store.allocate(RACE_BYTES)
        payload = torch.randint(0, 256, (RACE_BYTES,), dtype=torch.uint8, device=CUDA, generator=gen)
        engine.write(payload, slot, ready=_ready()).wait(timeout_s=120)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so the block freed below is the only free block of its size
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):
            old = torch.randint(0, 256, (RACE_BYTES,), dtype=torch.uint8, device=CUDA, generator=gen)
            old_expected = old.clone()
            torch.cuda._sleep(cycles)
            seen = old.clone()  # a kernel reading `old`, queued behind the sleep
            old_ptr = old.data_ptr()
            del old  # back to the allocator while that kernel is still queued
            dst = torch.empty(RACE_BYTES, dtype=torch.uint8, device=CUDA)
            ready = torch.cuda.Event()
            ready.record(compute)
        assert dst.data_ptr() == old_ptr, (
            "the caching allocator did not reuse the freed block, so this test cannot show the race "
            f"(PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r})"
        )
        read = engine.read(dst, slot, ready=ready)
        assert not ready.query(), "the GPU finished its 50 ms sleep before read() returned: the race window never opened"
        read.wait(timeout_s=120)
        torch.cuda.synchronize()
        engine.release(slot)
        store.free(slot)
    assert torch.equal(seen, old_expected), f"{mode} wrote into the block before the queued kernel had read it"
    assert torch.equal(dst, payload), f"{mode}: bytes read back differ"


# ------------------------------------------------------------------------- 3b. offloader races
class _SleepyMul(torch.autograd.Function):
    """``x * w``. Its backward queues a GPU sleep before the kernels that read the saved ``x``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, backward_sleep_cycles: int) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, w)
        ctx.cycles = backward_sleep_cycles
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        x, w = ctx.saved_tensors
        if ctx.cycles:
            torch.cuda._sleep(ctx.cycles)
        return grad * w, (grad * x).sum(0), None


class _RacyLayer(nn.Module):
    """``sin(x) * w``, with optional GPU sleeps: in forward before ``sin`` (its output is then
    saved while the kernel producing it is still queued), in backward before the kernels that
    read the saved tensors (they still read them when autograd frees them)."""

    def __init__(self, width: int, index: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, width) + 0.1 * index)
        self.forward_sleep_cycles = 0
        self.backward_sleep_cycles = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_sleep_cycles:
            torch.cuda._sleep(self.forward_sleep_cycles)
        h = torch.sin(x)  # autograd saves x here, and h right below
        return _SleepyMul.apply(h, self.w, self.backward_sleep_cycles)


class _RacyNet(nn.Module):
    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_RacyLayer(width, i) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _racy_step(model: nn.Module, x: torch.Tensor, stream: torch.cuda.Stream, off: gds_offload.Offloader | None) -> Result:
    """One step on ``stream`` (a non-default stream). With an offloader, backward starts only once
    every write landed, so every saved tensor comes back from storage (none is forwarded)."""
    torch.cuda.synchronize(x.device)
    with torch.cuda.stream(stream):
        model.zero_grad(set_to_none=True)
        out = model(x)
        if off is not None:
            off.synchronize()
        loss = out.square().mean()
        loss.backward()
    torch.cuda.synchronize(x.device)
    return grads_of(model, loss)


def _poison_free_blocks(stream: torch.cuda.Stream, like: torch.Tensor, count: int = 32) -> None:
    """Fill the cached free blocks of ``like``'s size on ``stream`` with NaN. The caching allocator
    hands the offloaded run the very blocks the reference run used, still holding the values that
    run computed, which are the expected ones: a write that read a block too early would then
    go unnoticed. After this, stale bytes are NaN."""
    with torch.cuda.stream(stream):
        blocks = [torch.full_like(like, float("nan")) for _ in range(count)]
    del blocks


def _check_offloader_race(side: str, mode: str, path: Path, device: torch.device) -> None:
    """The race of ``test_offloader_orders_io_after_the_compute_stream`` on ``device``."""
    cycles = _sleep_cycles(20)
    torch.manual_seed(0)
    model = _RacyNet().to(device)
    for layer in model.layers:
        layer.forward_sleep_cycles = cycles if side == "write" else 0
        layer.backward_sleep_cycles = cycles if side == "read" else 0
    x = torch.randn(4096, 1024, device=device)  # 16 MiB per saved tensor, 2 per layer
    stream = torch.cuda.Stream(device=device)
    ref = _racy_step(model, x, stream, None)
    _poison_free_blocks(stream, x)
    with gds_offload.attach(model, path=path, mode=mode, min_bytes=0, keep_last=0) as off:
        got = _racy_step(model, x, stream, off)
        st = settled(off)
    assert_same(ref, got)
    assert st.bytes_read > 0 and st.bytes_forwarded == 0, st


@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize("side", ["write", "read"])
def test_offloader_orders_io_after_the_compute_stream(side: str, mode: str, spill_path: Path, deterministic: None) -> None:
    """Races through attach(), on a non-default compute stream, 4 layers, 20 ms GPU sleeps.

    ``write``: each layer sleeps before producing ``sin(x)``; the pack hook sees that output at
    once, while the GPU is still asleep. The scheduler must record ``ready`` on the *current*
    stream (not the default one) and the engine wait for it; otherwise the bytes written (and
    read back in backward) are the block's stale contents (NaN: see ``_poison_free_blocks``)
    and the gradients differ.

    ``read``: each layer's backward sleeps before the kernels that read its saved tensors, and
    autograd frees those tensors (back to the allocator) while the kernels are still queued.
    The prefetch of the layers below, issued right after, allocates same-sized blocks on that
    stream and gets those very blocks; an engine that wrote into them without waiting on the
    read's ``ready`` event would corrupt the tensors the queued kernels still read.
    """
    _require(mode)
    _check_offloader_race(side, mode, spill_path, CUDA)


def _two_gpus_missing() -> str | None:
    if not torch.cuda.is_available():
        return NO_GPU
    n = torch.cuda.device_count()
    return None if n >= 2 else f"needs 2 NVIDIA GPUs (torch.cuda.device_count() is {n})"


@pytest.mark.gpu
@pytest.mark.skipif(_two_gpus_missing() is not None, reason=_two_gpus_missing() or "")
@pytest.mark.parametrize("side", ["write", "read"])
def test_model_on_another_gpu_than_the_current_one(side: str, spill_path: Path, deterministic: None) -> None:
    """A model on a GPU that is not the calling thread's current device (engine threads and the
    training thread start on device 0). The ``host`` engine's side stream must be created on the
    tensor's device: a copy runs on the current stream of *its* device, so a side stream on
    device 0 neither waits for ``ready`` nor is the stream synchronized before the future is
    done. The scheduler's ``Clock`` must record its events on the model's device."""
    from gds_offload.activations.planning.profile import Clock

    device = torch.device("cuda", (torch.cuda.current_device() + 1) % torch.cuda.device_count())
    assert Clock(device).mark().device == device, "Clock recorded its event on the current device, not the model's"
    with torch.cuda.device(device):  # the training thread's kernels and sleeps go there; engine threads stay on 0
        _check_offloader_race(side, "host", spill_path, device)


# ------------------------------------------------------------------------- 2. exact training
GPT_CFG = GPTConfig(layers=4, hidden=256, heads=4, seq=128, vocab=1024, dropout=0.1)
GPT_BATCH = 4
GPT_STEPS = 3


def _train_gpt(
    path: Path | None, mode: str | None, *, bf16: bool, verify: bool = False
) -> tuple[list[Result], OffloadStats | None]:
    """``GPT_STEPS`` AdamW steps of the built-in GPT on CUDA; each step's loss and gradients.

    With an offloader (``min_bytes=0, keep_last=0``: every saved tensor goes through the store),
    step 1 waits for the writes before backward, so that every tensor of that step comes back
    from storage; steps 0 and 2 run freely (tensors whose write is still in flight are forwarded).
    """
    model = make_gpt(GPT_CFG, seed=0, device=CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    off = None
    if mode is not None:
        off = gds_offload.attach(model, path=path, mode=mode, min_bytes=0, keep_last=0, verify=verify)
    results = []
    try:
        for step in range(GPT_STEPS):
            tokens = synthetic_batch(GPT_CFG, GPT_BATCH, seed=step, device=CUDA)
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)  # the same dropout masks in every run
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                loss = lm_loss(model, tokens)
            if off is not None and step == 1:
                off.synchronize()
            loss.backward()
            results.append(grads_of(model, loss))
            opt.step()
        stats = settled(off) if off is not None else None
    finally:
        if off is not None:
            off.detach()
    return results, stats


@functools.cache
def _reference(bf16: bool) -> tuple[Result, ...]:
    first, _ = _train_gpt(None, None, bf16=bf16)
    second, _ = _train_gpt(None, None, bf16=bf16)
    for step, (a, b) in enumerate(zip(first, second, strict=True)):
        try:
            assert_same(a, b)
        except AssertionError as exc:
            raise AssertionError(
                f"two runs WITHOUT the offloader differ at step {step} ({exc}): torch is not deterministic "
                f"for this model on this GPU even with use_deterministic_algorithms(True), so a comparison "
                f"with the offloader would prove nothing"
            ) from None
    return tuple(first)


@pytest.mark.parametrize("mode", ENGINES + [pytest.param("compat+verify", id="compat-verify", marks=_GPU_MARKS)])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_gpt_training_is_bit_identical(bf16: bool, mode: str, spill_path: Path, deterministic: None) -> None:
    engine, _, extra = mode.partition("+")
    _require(engine)
    ref = _reference(bf16)
    got, st = _train_gpt(spill_path, engine, bf16=bf16, verify=extra == "verify")
    for step, (r, g) in enumerate(zip(ref, got, strict=True)):
        try:
            assert_same(r, g)
        except AssertionError as exc:
            raise AssertionError(f"step {step} ({engine}, {'bf16 autocast' if bf16 else 'fp32'}): {exc}") from None
    assert st is not None and st.engine == engine, st
    assert st.bytes_offloaded > 0 and st.bytes_read > 0, st


# ------------------------------------------------------------------------- 4. GPU memory
#: 12 blocks saving about 34 MiB each (fp32, 2048 tokens x ~17 x hidden floats): ~400 MiB of
#: activations against ~40 MiB of parameters and gradients; a small vocabulary keeps the logits small.
MEM_CFG = GPTConfig(layers=12, hidden=256, heads=4, seq=256, vocab=512, dropout=0.0)
MEM_BATCH = 8


def _peak_step(model: nn.Module, tokens: torch.Tensor) -> tuple[int, Result]:
    """One forward/backward; its peak of allocated GPU memory above what was allocated before it."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = lm_loss(model, tokens)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return peak, grads_of(model, loss)


@pytest.mark.parametrize("mode", [_engine_param("host"), _engine_param("compat")])
def test_policy_all_cuts_peak_gpu_memory(mode: str, spill_path: Path, deterministic: None) -> None:
    """``policy="all"`` (keep_last=1): the step's GPU memory peak is well under keeping everything.

    Each block waits (forward pre-hook) for the writes issued before it, standing in for a drive
    that keeps pace with compute: without it the peak depends on GPU speed against drive speed,
    which a test must not assert on. What this shows: once written, the device memory really is
    released (no stray reference, the caching allocator gets it back), and backward holds only
    the prefetch window.
    """
    _require(mode)
    model = make_gpt(MEM_CFG, seed=0, device=CUDA)
    tokens = synthetic_batch(MEM_CFG, MEM_BATCH, seed=0, device=CUDA)
    _peak_step(model, tokens)  # warm-up: cuBLAS workspaces and kernels are allocated once
    keep_peak, ref = _peak_step(model, tokens)
    with gds_offload.attach(model, path=spill_path, mode=mode, policy="all") as off:
        hooks = [b.register_forward_pre_hook(lambda *_: off.synchronize()) for b in model.blocks]
        try:
            _peak_step(model, tokens)
            off_peak, got = _peak_step(model, tokens)
        finally:
            for h in hooks:
                h.remove()
        st = settled(off)
    assert_same(ref, got)
    mib = 1 << 20
    assert keep_peak >= 256 * mib, f"the keep-everything step peaked at only {keep_peak / mib:.0f} MiB: the model is too small to show anything"
    assert st.bytes_offloaded > 0 and st.bytes_read > 0, st
    assert off_peak <= 0.6 * keep_peak, (
        f"policy='all' ({mode}) peaked at {off_peak / mib:.0f} MiB above the baseline, keeping everything at "
        f"{keep_peak / mib:.0f} MiB (ratio {off_peak / keep_peak:.2f}, expected <= 0.6); stats: {st}"
    )


# ------------------------------------------------------------------------- 5. CUDA-event timing
@gpu_test
def test_adaptive_policy_times_units_with_cuda_events(spill_path: Path) -> None:
    """``policy="adaptive"`` plans from per-unit times measured with CUDA events (read once the
    backward ends): every layer gets a positive forward time, the kept last layer a positive
    backward time, and the times are seconds (their sum fits in the step's wall time; event
    times are milliseconds, so a missing /1e3 would be 1000x too large)."""
    cfg = GPTConfig(layers=4, hidden=256, heads=4, seq=256, vocab=1024, dropout=0.0)
    model = make_gpt(cfg, seed=0, device=CUDA)
    tokens = synthetic_batch(cfg, GPT_BATCH, seed=0, device=CUDA)
    lm_loss(model, tokens).backward()  # warm-up without the offloader: context, cuBLAS, kernels
    torch.cuda.synchronize()
    with gds_offload.attach(model, path=spill_path, mode="host", policy="adaptive") as off:
        assert "profiling" in off.plan().reason  # before any measured step: says so, claims no times
        for _ in range(2):  # Adaptive.warmup_steps=1: the first step is a warm-up, the second is profiled
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            lm_loss(model, tokens).backward()
            torch.cuda.synchronize()
            wall_s = time.perf_counter() - t0
        plan = off.plan()
        assert "profiling" not in plan.reason, plan.reason
        layer_stats = {s.name: s for s in off.stats().layers}
    names = [f"blocks.{i}" for i in range(cfg.layers)]
    rows = [d for d in plan.decisions if d.name in names]
    assert [d.name for d in rows] == names, plan.decisions
    assert all(d.forward_s > 0 for d in rows), [(d.name, d.forward_s) for d in rows]
    assert rows[-1].backward_s > 0, rows[-1]
    measured_s = sum(d.forward_s + d.backward_s for d in plan.decisions)
    assert 0 < measured_s <= 1.5 * wall_s + 0.01, (measured_s, wall_s, plan.decisions)
    assert all(layer_stats[n].forward_s > 0 for n in names), layer_stats


# ------------------------------------------------------------------------- 6. overlap with compute
#: The GPU sleep a transfer must finish inside. 8 MiB at 100 MB/s (a slow disk) takes 80 ms.
OVERLAP_MS = 500
OVERLAP_BYTES = (8 << 20) + 4_321


def _busy_default_stream(ms: float) -> torch.cuda.Event:
    """Queue a ``ms`` GPU sleep on the legacy default stream (where training runs); return an
    event recorded after it: not done while the sleep runs."""
    torch.cuda._sleep(_sleep_cycles(ms))
    busy = torch.cuda.Event()
    busy.record(torch.cuda.default_stream())
    return busy


@pytest.mark.parametrize("mode", ENGINES)
def test_engine_write_overlaps_a_kernel_on_the_default_stream(mode: str, spill_path: Path) -> None:
    """A write whose ``ready`` event is already complete finishes while a 0.5 s kernel queued after
    it still runs on the default stream. An engine that copied on the legacy default stream,
    on a blocking stream (KvikIO compat's bounce copies), or synchronized the null stream
    (KvikIO ``pwrite`` with compat off) would finish only after the kernel. Bytes exact."""
    _require(mode)
    _cycles_per_ms()  # measured (synchronizing) before the window opens
    gen = torch.Generator(device=CUDA).manual_seed(5)
    with _engine(mode, spill_path) as (engine, store):
        src = torch.randint(0, 256, (OVERLAP_BYTES,), dtype=torch.uint8, device=CUDA, generator=gen)
        warm = store.allocate(engine.slot_bytes(OVERLAP_BYTES, CUDA))
        engine.write(src, warm, ready=_ready()).wait(timeout_s=120)  # handles open, host's pinned slot buffer made
        engine.release(warm)  # the host engine reuses its pinned buffer for the next slot of this size
        store.free(warm)
        engine.warm_up(CUDA)  # each thread's side stream and pinned buffers before the window: pinning synchronizes the device
        torch.cuda.synchronize()
        slot = store.allocate(engine.slot_bytes(OVERLAP_BYTES, CUDA))
        ready = _ready()  # src is produced; nothing queued after this touches it
        busy = _busy_default_stream(OVERLAP_MS)
        write = engine.write(src, slot, ready=ready)
        write.wait(timeout_s=120)
        overlapped = not busy.query()
        torch.cuda.synchronize()
        back = torch.zeros(OVERLAP_BYTES, dtype=torch.uint8, device=CUDA)
        engine.read(back, slot, ready=_ready()).wait(timeout_s=120)
        engine.release(slot)
        store.free(slot)
    assert overlapped, f"{mode} ({engine.description}): the write finished only after the default stream's kernel"
    assert torch.equal(back, src), f"{mode}: bytes read back differ"


@pytest.mark.parametrize("mode", ENGINES)
def test_engine_read_overlaps_a_kernel_on_the_default_stream(mode: str, spill_path: Path) -> None:
    """A read into a buffer nothing queued uses (its ``ready`` is complete) finishes while a 0.5 s
    kernel queued after it still runs on the default stream; the bytes are then visible to
    the default stream. Bytes exact."""
    _require(mode)
    _cycles_per_ms()
    gen = torch.Generator(device=CUDA).manual_seed(6)
    with _engine(mode, spill_path) as (engine, store):
        src = torch.randint(0, 256, (OVERLAP_BYTES,), dtype=torch.uint8, device=CUDA, generator=gen)
        slot = store.allocate(engine.slot_bytes(OVERLAP_BYTES, CUDA))
        engine.write(src, slot, ready=_ready()).wait(timeout_s=120)
        warm = engine.empty(OVERLAP_BYTES, slot, CUDA)
        engine.read(warm, slot, ready=_ready()).wait(timeout_s=120)
        engine.warm_up(CUDA)  # each thread's side stream and pinned buffers before the window: pinning synchronizes the device
        torch.cuda.synchronize()
        dst = engine.empty(OVERLAP_BYTES, slot, CUDA)  # allocated before the window: cudaMalloc synchronizes too
        ready = _ready()
        busy = _busy_default_stream(OVERLAP_MS)
        read = engine.read(dst, slot, ready=ready)
        read.wait(timeout_s=120)
        overlapped = not busy.query()
        same = torch.equal(dst, src)  # queued on the default stream, after the sleep
        engine.release(slot)
        store.free(slot)
    assert overlapped, f"{mode} ({engine.description}): the read finished only after the default stream's kernel"
    assert same and torch.equal(warm, src), f"{mode}: bytes read back differ"


@pytest.mark.parametrize("mode", ENGINES)
def test_io_bench_measures_device_buffers_on_a_gpu(mode: str, spill_path: Path) -> None:
    """bench-io and gds-check measure device memory when a GPU is present (``memory="auto"``)
    and say so; the bytes read back are checked on the device."""
    _require(mode)
    from gds_offload.bench.io import measure_engine

    row = measure_engine(mode, spill_path, 64 << 20, 16 << 20)
    assert row["memory"] == "cuda:0" and row["label"].startswith("cuda:0 memory") and row["verified"], row
    assert row["write_gbps"] > 0 and row["read_gbps"] > 0, row
    if mode == "gds":
        assert row["label"] == "cuda:0 memory, cuFile direct (GPUDirect)", row
