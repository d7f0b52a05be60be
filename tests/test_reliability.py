"""Reliability: full drives, I/O errors, corruption, crashes, interrupts, long runs, concurrency, bad input.

Faults come from a real small tmpfs (root only) and from the fault-injecting engine
wrapper (:mod:`gds_offload.io.faults`), which fails the Nth transfer deterministically.
"""
from __future__ import annotations

import errno
import gc
import os
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from helpers.disks import fill, is_root, tmpfs
from helpers.models import MLP, SparseInputNet, assert_same, grads_of, make, offload_everything, settled, train_step
from torch import nn

from gds_offload.errors import ConfigError, OffloadError
from gds_offload.io.faults import Fault, inject, parse_faults

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
needs_root = pytest.mark.skipif(not is_root(), reason="needs root to mount a tmpfs")


def _offload_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "gds_offload" in str(w.message)]


def _child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO), str(TESTS)) if p)
    return os.environ | {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}


#: Every write done only once waited for (the slowest drive): a test that forces its timing passes with it.
LATE_WRITES = Fault("write", "late", nth=1, count=0)
#: The timings the tests that need a write settled run under: as it comes, and with every write late.
WRITES = ["natural", "late"]


def _late(writes: str) -> list[Fault]:
    return [LATE_WRITES] if writes == "late" else []


def _forward_settled(model, inputs, off) -> torch.Tensor:
    """Forward, then let every write land, so that backward reads the tensors back from the drive
    (a write still in flight when backward needs its tensor is served from memory, and no read
    or check of that transfer happens); the loss, backward not run."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    out = model(*inputs)
    off.synchronize()
    assert off.spilled(), "some tensor is only on disk"
    return out if out.dim() == 0 else out.float().pow(2).mean()


def _step_settled(model, inputs, off):
    """:func:`models.train_step` with every write settled before backward (:func:`_forward_settled`)."""
    loss = _forward_settled(model, inputs, off)
    loss.backward()
    return grads_of(model, loss)


# ---------------------------------------------------------------------------- drive full
@needs_root
@pytest.mark.root
def test_full_tmpfs_falls_back_warns_once_and_recovers(tmp_path) -> None:
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    with tmpfs(tmp_path / "small", "4m") as small:
        filler = fill(small)
        with offload_everything(model, small) as off:
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                assert_same(ref, train_step(model, inputs))
                assert_same(ref, train_step(model, inputs))
            st = settled(off)
            msgs = _offload_warnings(rec)
            assert len(msgs) == 1, msgs  # one warning, not one per tensor
            assert str(small) in msgs[0] and "bytes" in msgs[0] and "stay in memory" in msgs[0]
            assert st.bytes_fallback > 0 and st.bytes_offloaded == 0
            # space freed later is used again
            filler.unlink()
            assert_same(ref, train_step(model, inputs))
            off.synchronize()
            st2 = settled(off)
            assert st2.bytes_offloaded > 0 and st2.bytes_fallback == st.bytes_fallback


@needs_root
@pytest.mark.root
def test_striping_skips_the_full_directory(tmp_path) -> None:
    model, inputs = make("gpt")
    ref = train_step(model, inputs)
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    with tmpfs(tmp_path / "small", "4m") as small:
        fill(small)
        with offload_everything(model, [small, roomy]) as off:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no fallback, so no warning
                assert_same(ref, train_step(model, inputs))
            st = settled(off)
            assert st.bytes_fallback == 0 and st.bytes_offloaded > 0
            full, ok = off.store.files
            assert full.size == 0 and ok.size > 0


@needs_root
@pytest.mark.root
def test_nearly_full_drive_still_used(tmp_path) -> None:
    """A drive with less free space than the store's growth step (64 MiB) still takes slots that fit."""
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    with tmpfs(tmp_path / "small", "16m") as small:
        with offload_everything(model, small) as off:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert_same(ref, train_step(model, inputs))
            st = settled(off)
        assert st.bytes_fallback == 0 and st.bytes_offloaded > 0


@pytest.mark.parametrize("writes", WRITES)
def test_enospc_on_write_falls_back(writes: str, engine: str, tmp_path) -> None:
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path, engine) as off:
        faulty = inject(off, Fault("write", "enospc", nth=2, count=3), *_late(writes))
        with warnings.catch_warnings(record=True) as rec:  # a failed write warns when it completes: before backward
            warnings.simplefilter("always")
            assert_same(ref, _step_settled(model, inputs, off))
            assert_same(ref, _step_settled(model, inputs, off))
        st = settled(off)
        msgs = _offload_warnings(rec)
        assert len(faulty.injected) == 3
        assert len(msgs) == 1, msgs
        assert str(tmp_path) in msgs[0] and "No space left on device" in msgs[0] and "bytes" in msgs[0]
        assert st.bytes_fallback == 3 * 32 * 1024 and st.bytes_offloaded > 0
        off.synchronize()
        assert off.store.allocated_bytes() == 0


def test_on_error_raise(engine: str, tmp_path) -> None:
    """on_error='raise': the failure surfaces at the next pack/unpack on the training thread, as an
    OffloadError; the tensor was still in memory, and the next step (no fault) is exact."""
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path, engine, on_error="raise") as off:
        inject(off, Fault("write", "eio", nth=1))
        with pytest.raises(OffloadError, match="could not offload .* Input/output error"):
            train_step(model, inputs)
        gc.collect()
        assert_same(ref, train_step(model, inputs))


def test_on_error_raise_surfaces_in_backward(engine: str, tmp_path) -> None:
    """The last write of a forward fails: no pack follows, so the next unpack raises."""
    model, inputs = make("mlp")
    with offload_everything(model, tmp_path, engine, on_error="raise") as off:
        train_step(model, inputs)
        writes = off.engine.stats().writes
        inject(off, Fault("write", "eio", nth=writes))  # the last write of the next forward
        model.zero_grad(set_to_none=True)
        loss = model(*inputs).pow(2).mean()
        off.synchronize()
        with pytest.raises(OffloadError, match="could not offload"):
            loss.backward()


def test_read_failure_while_detaching(engine: str, tmp_path) -> None:
    """detach() reads back what a live graph needs; a failed read does not break detach (threads
    stop, files close) and the error surfaces when backward needs the tensor."""
    model, inputs = make("mlp")
    off = offload_everything(model, tmp_path, engine)
    inject(off, Fault("read", "eio", nth=1))
    loss = model(*inputs).pow(2).mean()
    off.synchronize()
    off.detach()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gds_offload-")]
    with pytest.raises(OffloadError):
        loss.backward()


# ---------------------------------------------------------------------------- I/O errors
@pytest.mark.parametrize("writes", WRITES)
@pytest.mark.parametrize("delay_s", [0.0, 0.3], ids=["failed-before-unpack", "failed-while-waited-for"])
def test_failed_read_names_layer_tensor_file_offset_and_os_error(delay_s: float, writes: str, engine: str, tmp_path) -> None:
    model, inputs = make("mlp")
    with offload_everything(model, tmp_path, engine) as off:
        inject(off, Fault("read", "eio", nth=1, delay_s=delay_s), *_late(writes))
        loss = _forward_settled(model, inputs, off)
        with pytest.raises(OffloadError) as ei:
            loss.backward()
        msg = str(ei.value)
        for part in ("layer blocks.", "shape (64, 128)", "torch.float32", str(tmp_path), "offset", "Input/output error"):
            assert part in msg, (part, msg)
        del ei
        gc.collect()
        ref = train_step(make("mlp")[0], inputs)
        assert_same(ref, train_step(model, inputs))  # the next step works


@pytest.mark.parametrize("writes", WRITES)
@pytest.mark.parametrize("op", ["write", "read"])
def test_short_transfer_through_wrapper_never_returns_garbage(op: str, writes: str, engine: str, tmp_path) -> None:
    """A transfer that reports fewer bytes than asked: a short write falls back (data kept in memory),
    a short read raises instead of returning half-filled memory."""
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path, engine) as off:
        inject(off, Fault(op, "short", nth=1), *_late(writes))
        if op == "write":
            with warnings.catch_warnings(record=True) as rec:  # the short write warns when it completes: before backward
                warnings.simplefilter("always")
                assert_same(ref, _step_settled(model, inputs, off))
            assert "short write" in " ".join(_offload_warnings(rec))
            assert settled(off).bytes_fallback > 0
        else:
            loss = _forward_settled(model, inputs, off)
            with pytest.raises(OffloadError, match="short read"):
                loss.backward()


def test_short_pwrite_and_preadv_retried_to_completion(tmp_path, monkeypatch) -> None:
    """The posix engine loops over short pwrite/preadv (as the kernel may return them)."""
    model, inputs = make("gpt")
    ref = train_step(model, inputs)
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def half(n: int) -> int:
        return max(4096, n // 2 // 4096 * 4096) if n > 4096 else n  # O_DIRECT: stay 4 KiB aligned

    def short_pwrite(fd, data, offset):
        return real_pwrite(fd, memoryview(data)[: half(len(data))], offset)

    def short_preadv(fd, bufs, offset):
        (buf,) = bufs
        return real_preadv(fd, [memoryview(buf)[: half(len(buf))]], offset)

    with offload_everything(model, tmp_path, "posix") as off:
        monkeypatch.setattr(os, "pwrite", short_pwrite)
        monkeypatch.setattr(os, "preadv", short_preadv)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        loss = model(*inputs)
        off.synchronize()  # everything on disk: backward reads it all back
        loss.backward()
        monkeypatch.undo()
        assert_same(ref, grads_of(model, loss))
        assert off.engine.stats().retries > 0
        assert settled(off).bytes_read > 0 and settled(off).bytes_fallback == 0


def test_spill_directory_removed_under_the_run(engine: str, tmp_path) -> None:
    """Spill files are unnamed: removing the directory does not touch their data."""
    d = tmp_path / "spill"
    d.mkdir()
    model, inputs = make("gpt")
    refs = [train_step(model, inputs, seed=s) for s in range(3)]
    with offload_everything(model, d, engine) as off:
        assert_same(refs[0], train_step(model, inputs, seed=0))
        shutil.rmtree(d)
        for s in (1, 2):
            assert_same(refs[s], train_step(model, inputs, seed=s))
        assert settled(off).bytes_fallback == 0


# ---------------------------------------------------------------------------- integrity
def _forward_then_tamper(model, inputs, off, tamper) -> torch.Tensor:
    """:func:`_forward_settled`, then change the spill file under the largest tensor on disk."""
    loss = _forward_settled(model, inputs, off)
    slot, _ = max(off.spilled(), key=lambda s: s[1])
    tamper(off.engine.data_offset(slot), slot)
    return loss



def _scribble(data_offset: int, slot) -> None:
    # Another writer (root can) changes bytes of a live slot through /proc/<pid>/fd.
    with open(f"/proc/{os.getpid()}/fd/{slot.file.fd}", "r+b", buffering=0) as fh:
        os.pwrite(fh.fileno(), b"\xff" * 256, data_offset)


def test_verify_detects_bytes_changed_on_disk(engine: str, tmp_path) -> None:
    model, inputs = make("gpt")
    with offload_everything(model, tmp_path, engine, verify=True) as off:
        loss = _forward_then_tamper(model, inputs, off, _scribble)
        with pytest.raises(OffloadError) as ei:
            loss.backward()
        msg = str(ei.value)
        for part in ("corrupt spill slot", "layer", "shape (", str(tmp_path), "offset", "expected"):
            assert part in msg, (part, msg)
        del ei, loss
        gc.collect()
        ref = train_step(make("gpt")[0], inputs)
        assert_same(ref, train_step(model, inputs))  # clean steps verify fine


def test_without_verify_corruption_goes_undetected(tmp_path) -> None:
    """Documents why verify exists: the same tampering without it silently changes gradients."""
    model, inputs = make("gpt")
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path) as off:
        loss = _forward_then_tamper(model, inputs, off, _scribble)
        loss.backward()
        got = grads_of(model, loss)
    assert not all(torch.equal(g, got.grads[n]) for n, g in ref.grads.items())


def test_truncated_spill_file_raises(engine: str, tmp_path) -> None:
    model, inputs = make("gpt")
    with offload_everything(model, tmp_path, engine, verify=True) as off:
        loss = _forward_then_tamper(model, inputs, off, lambda _, slot: os.ftruncate(slot.file.fd, 0))
        with pytest.raises(OffloadError, match=f"cannot restore a saved tensor of layer .*{tmp_path}"):
            loss.backward()


@pytest.mark.parametrize("writes", WRITES)
@pytest.mark.parametrize("op", ["write", "read"])
def test_verify_detects_corrupt_transfers(op: str, writes: str, engine: str, tmp_path) -> None:
    """A transfer that moves wrong bytes and reports success is caught when backward reads the
    tensor back. Every write settles before backward, so backward reads from the drive whatever
    the drive's speed (``late``: no write done until waited for)."""
    model, inputs = make("mlp")
    with offload_everything(model, tmp_path, engine, verify=True) as off:
        inject(off, Fault(op, "corrupt", nth=1), *_late(writes))
        loss = _forward_settled(model, inputs, off)
        with pytest.raises(OffloadError, match="corrupt spill slot .* checksum [0-9a-f]{16}, expected [0-9a-f]{16}"):
            loss.backward()


def test_backward_is_served_from_memory_while_writes_are_in_flight(engine: str, tmp_path) -> None:
    """Why the tests above settle the writes first: with every write still in flight at backward
    (``late``), backward uses the tensors still in memory, exactly, and reads nothing back, so a
    corrupted write or read is never seen."""
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path, engine, verify=True) as off:
        faulty = inject(off, LATE_WRITES, Fault("write", "corrupt", nth=1), Fault("read", "corrupt", nth=1, count=0))
        assert_same(ref, train_step(model, inputs))
        assert faulty.counts()["read"] == 0 and faulty.counts()["write"] > 0
        assert settled(off).bytes_offloaded > 0  # the writes were real, and land once waited for


@pytest.mark.parametrize("writes", WRITES)
def test_verify_exact_when_nothing_is_wrong(writes: str, engine: str, tmp_path) -> None:
    model, inputs = make("conv")
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path, engine, verify=True) as off:
        if writes == "late":
            inject(off, LATE_WRITES)
        assert_same(ref, _step_settled(model, inputs, off))
        assert settled(off).bytes_read > 0  # checked on the way back from the drive


# ---------------------------------------------------------------------------- crashes and interrupts
_KILL_CHILD = """
import sys, threading, torch, gds_offload
from gds_offload.io.faults import Fault, inject
from helpers.models import make, train_step
model, inputs = make("gpt")
off = gds_offload.attach(model, path=sys.argv[1], mode=sys.argv[2], min_bytes=0, keep_last=0, write_window="1GiB")
train_step(model, inputs)
off.synchronize()  # the spill file holds a step's bytes; nothing in flight
held = inject(off, Fault("write", "hold", nth=1, count=0))
loss = model(*inputs)  # mid-step: every write of this forward submitted, none finished, until the kill
print(held.holding(), flush=True)
threading.Event().wait()
"""


def _free_bytes(p: Path) -> int:
    st = os.statvfs(p)
    return st.f_bfree * st.f_frsize


def test_sigkill_leaves_nothing_on_disk(engine: str, tmp_path) -> None:
    """A child killed mid-step, its writes in flight (held by the fault engine until the kill),
    leaves no file behind and, on a private tmpfs (root), every byte of space free again."""

    def run(d: Path) -> None:
        before = _free_bytes(d)
        child = subprocess.Popen(
            [sys.executable, "-c", _KILL_CHILD, str(d), engine], stdout=subprocess.PIPE, env=_child_env()
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline().strip()
            assert line.isdigit() and int(line) > 0, f"the child reports the writes it has in flight: {line!r}"
            if is_root():
                assert _free_bytes(d) < before, "the child's spill file holds space"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        assert os.listdir(d) == []
        if is_root():
            assert _free_bytes(d) == before, "disk space returned"

    if is_root():
        with tmpfs(tmp_path / "t", "256m") as d:
            run(d)
    else:
        run(tmp_path)


class _Interrupt(BaseException):
    pass


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupt_mid_forward_releases_everything(exc: type[BaseException], tmp_path) -> None:
    """KeyboardInterrupt (or SystemExit) from inside forward: forward hooks with always_call do not
    run for BaseExceptions, yet the offloader's saved-tensor hooks must be popped at once."""
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    off = offload_everything(model, tmp_path)

    def boom(_m, _a, _o):
        raise exc()

    h = model.blocks[2].register_forward_hook(boom)
    with pytest.raises(exc):
        model(*inputs)
    h.remove()
    gc.collect()
    packed = settled(off).bytes_packed
    assert packed > 0
    # a plain forward/backward outside the model goes nowhere near the offloader
    w = torch.randn(128, 128, requires_grad=True)
    torch.tanh(inputs[0] @ w).sum().backward()
    assert settled(off).bytes_packed == packed
    off.synchronize()
    assert off.store.allocated_bytes() == 0  # the aborted graph is gone, so are its slots
    assert_same(ref, train_step(model, inputs))  # and the model trains on, exactly
    off.detach()
    assert "forward" not in model.__dict__
    assert not [t for t in threading.enumerate() if t.name.startswith("gds_offload-")]


def test_detach_during_in_flight_step(engine: str, tmp_path) -> None:
    model, inputs = make("gpt")
    ref = train_step(model, inputs)
    off = offload_everything(model, tmp_path, engine, max_bandwidth="5MB/s")
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = model(*inputs)
    st = off.stats()
    assert st.bytes_offloaded < st.bytes_packed - st.bytes_kept, "writes still in flight"
    off.detach()
    loss.backward()
    assert_same(ref, grads_of(model, loss))


# ---------------------------------------------------------------------------- load and long runs
def test_soak_flat() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "soak.py"), "--steps", "250", "--every", "50", "--warmup", "100"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_child_env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK: flat after warm-up" in out.stdout
    assert out.stdout.count("step ") >= 5


def test_soak_detects_growth(monkeypatch) -> None:
    """The soak script's growth check fails when something grows."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import soak
    finally:
        sys.path.remove(str(REPO / "scripts"))
    a = soak.Sample(100, 100 << 20, 7, 5, 64 << 20, 0)
    assert soak.growth(a, soak.Sample(200, 101 << 20, 7, 5, 64 << 20, 0), 32 << 20) == []
    assert soak.growth(a, soak.Sample(200, 100 << 20, 8, 5, 64 << 20, 0), 32 << 20)
    assert soak.growth(a, soak.Sample(200, 100 << 20, 7, 5, 128 << 20, 0), 32 << 20)
    assert soak.growth(a, soak.Sample(200, 200 << 20, 7, 5, 64 << 20, 0), 32 << 20)


def test_ten_thousand_small_tensors_per_step(tmp_path) -> None:
    from helpers.models import ManySmall

    model = ManySmall(10_000)
    x = torch.randn(10_000, 16)
    ref = train_step(model, x)
    with offload_everything(model, tmp_path) as off:
        assert_same(ref, train_step(model, x))
        off.synchronize()
        assert off.engine.stats().writes >= 10_000
        assert off.store.allocated_bytes() == 0


class _Scale(nn.Module):
    """``(x * w).sum()``: saves ``x`` whole, one storage, for w's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum()


def test_a_tensor_across_the_2_and_4_gib_offsets_of_a_sparse_spill_file(engine: str, spill_dir: Path, monkeypatch) -> None:
    """File offsets past 31 and 32 bits in every CI run, with megabytes of memory and disk: the
    spill file grows sparse (no fallocate, as on a filesystem without it), and slots the test
    takes itself, never written, push each step's 12 MiB saved tensor across 2^31, then 2^32.
    Backward reads every byte back from the drive (synchronized first): exact. Lengths past 32
    bits need a tensor that large: :func:`test_one_huge_tensor` (``-m slow``)."""
    import gds_offload.io.spill as store_mod

    def no_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "no fallocate: the spill file grows sparse")

    monkeypatch.setattr(store_mod.os, "posix_fallocate", no_fallocate)
    torch.manual_seed(0)
    x = torch.randn(3 << 20)  # 12 MiB
    model = _Scale()
    ref = train_step(model, x, loss_fn=lambda o: o)
    with offload_everything(model, spill_dir, engine, layers=[]) as off:
        store, slots, end = off.store, [], 0
        allocate = store.allocate
        monkeypatch.setattr(store, "allocate", lambda nbytes: slots.append(allocate(nbytes)) or slots[-1])
        for boundary in (1 << 31, 1 << 32):
            hole = allocate(boundary - (4 << 20) - end)  # [end, 4 MiB short of the boundary): first fit puts the tensor after it
            end = hole.offset + hole.nbytes
            before, slots[:] = off.stats(), []
            assert_same(ref, train_step(model, x, loss_fn=lambda o: o, sync=off.synchronize))
            st = settled(off)
            assert len(slots) == 1 and slots[0].offset == boundary - (4 << 20) < boundary < slots[0].offset + slots[0].nbytes, slots
            assert st.bytes_read - before.bytes_read == st.bytes_offloaded - before.bytes_offloaded == 12 << 20, st
    assert os.listdir(spill_dir) == []


@pytest.mark.slow
def test_one_huge_tensor(tmp_path) -> None:
    """A single saved tensor over 2 GiB (offsets and lengths past 32 bits). About 20 s and 7 GiB of RAM;
    run with ``-m slow`` or ``GDS_OFFLOAD_SLOW=1`` (conftest deselects it otherwise).
    Offsets alone run in every CI run: :func:`test_a_tensor_across_the_2_and_4_gib_offsets_of_a_sparse_spill_file`."""

    torch.manual_seed(0)
    x = torch.randn((9 << 30) // 4 // 4, dtype=torch.float32)  # 2.25 GiB, saved whole for w's gradient
    model = _Scale()
    ref = train_step(model, x, loss_fn=lambda o: o)
    with offload_everything(model, tmp_path, layers=[]) as off:
        assert_same(ref, train_step(model, x, loss_fn=lambda o: o))
        st = settled(off)
    assert st.bytes_offloaded >= 2 << 30 and st.bytes_read >= 2 << 30


# ---------------------------------------------------------------------------- concurrency
_TWO_PROC_CHILD = """
import sys, torch, gds_offload
from helpers.models import make, train_step, assert_same, settled
model, inputs = make(sys.argv[2])
refs = [train_step(model, inputs, seed=s) for s in range(6)]
with gds_offload.attach(model, path=sys.argv[1], mode="posix", min_bytes=0, keep_last=0) as off:
    for s in range(6):
        assert_same(refs[s], train_step(model, inputs, seed=s))
    assert settled(off).bytes_offloaded > 0
print("exact", flush=True)
"""


def test_two_processes_share_a_directory(tmp_path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_PROC_CHILD, str(tmp_path), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_child_env(),
        )
        for name in ("gpt", "conv")
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == b"exact", err.decode()[-2000:]
    assert os.listdir(tmp_path) == []


def test_two_offloaders_in_one_process_share_a_directory(engine: str, tmp_path) -> None:
    (m1, in1), (m2, in2) = make("gpt"), make("conv")
    refs1 = [train_step(m1, in1, seed=s) for s in range(3)]
    refs2 = [train_step(m2, in2, seed=s) for s in range(3)]
    with offload_everything(m1, tmp_path, engine) as o1, offload_everything(m2, tmp_path, engine) as o2:
        for s in range(3):
            assert_same(refs1[s], train_step(m1, in1, seed=s))
            assert_same(refs2[s], train_step(m2, in2, seed=s))
        # interleaved: both graphs alive at once
        l1 = m1(*in1)
        m2.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        l2 = m2(*in2).float().pow(2).mean()
        l1.backward()
        l2.backward()
        assert_same(refs2[0], grads_of(m2, l2))
        assert settled(o1).bytes_offloaded > 0 and settled(o2).bytes_offloaded > 0


def test_threads_joined_on_detach(engine: str, tmp_path) -> None:
    model, inputs = make("mlp")
    with offload_everything(model, tmp_path, engine):
        train_step(model, inputs)
        assert [t for t in threading.enumerate() if t.name.startswith("gds_offload-")]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gds_offload-")]


_EXIT_CHILD = """
import atexit, sys, torch, gds_offload
from helpers.models import make, train_step
model, inputs = make("gpt")
off = gds_offload.attach(
    model, path=sys.argv[1], mode=sys.argv[2], min_bytes=0, keep_last=0, max_bandwidth="100KB/s", num_threads=1
)
# atexit runs after threading's exit hooks (the offloader's, then the I/O threads' join): what
# the engine wrote by then is all it will ever write.
atexit.register(lambda: print("written", off.engine.stats().bytes_written, flush=True))
loss = model(*inputs)   # a graph alive and ~40 s of queued writes at exit; no detach
print("exiting", off.stats().bytes_packed, flush=True)
"""


def test_exit_without_detach_is_prompt_and_clean(engine: str, tmp_path) -> None:
    """Exit does not wait for a write backlog (queued transfers are dropped; the unnamed spill
    files vanish with the process anyway), prints nothing, and leaves nothing behind. The child
    reports the bytes its forward queued for writing and, once its I/O threads have stopped at
    exit, the bytes written: had exit run the backlog, they would be equal (no clock involved)."""
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD, str(tmp_path), engine],
        capture_output=True,
        text=True,
        timeout=300,
        env=_child_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.strip() == "", out.stderr[-3000:]
    (said, queued), (tail, written) = (line.split() for line in out.stdout.strip().splitlines())
    assert (said, tail) == ("exiting", "written"), out.stdout
    assert int(written) < int(queued), f"exit waited for the queued writes: {written} of {queued} bytes written"
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------- bad input
def test_fault_specs() -> None:
    assert parse_faults("write:eio:5,read:corrupt:2:0") == [Fault("write", "eio", 5), Fault("read", "corrupt", 2, 0)]
    for bad in ("write", "write:melt", "sideways:eio", "write:eio:x", "write:eio:0"):
        with pytest.raises(ConfigError):
            parse_faults(bad)


def test_sparse_saved_tensor_kept_and_exact(engine: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = SparseInputNet()
    dense = torch.randn(48, 64) * (torch.rand(48, 64) < 0.1)
    x = dense.to_sparse()
    ref = train_step(model, x)
    with offload_everything(model, tmp_path, engine) as off:
        assert_same(ref, train_step(model, x))
        off.synchronize()
        st = settled(off)
    assert st.bytes_unsupported > 0 and st.bytes_offloaded > 0


class _ScaleBySaved(torch.autograd.Function):
    """``w * total(aux)``, saving ``aux`` (a nested or quantized tensor) for backward."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, box: tuple[torch.Tensor]) -> torch.Tensor:
        (aux,) = box  # in a tuple: autograd does not inspect it as an input
        ctx.save_for_backward(aux)
        return w * _total(aux)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad * _total(aux), None


def _total(aux: torch.Tensor) -> torch.Tensor:
    if aux.is_nested:
        return sum(t.sum() for t in aux.unbind())
    return aux.dequantize().sum() if aux.is_quantized else aux.sum()


class _WithAux(nn.Module):
    """An MLP whose loss also goes through :class:`_ScaleBySaved` with an unsupported ``aux`` tensor."""

    def __init__(self, aux: torch.Tensor) -> None:
        super().__init__()
        self.mlp = MLP(depth=2)
        self.aux = aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).pow(2).mean() + _ScaleBySaved.apply(self.mlp.head.bias, (self.aux,)).sum()


@pytest.mark.parametrize("kind", ["nested", "quantized"])
def test_nested_and_quantized_saved_tensors_kept_and_exact(kind: str, tmp_path) -> None:
    torch.manual_seed(0)
    if kind == "nested":
        aux = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    else:
        aux = torch.quantize_per_tensor(torch.randn(64, 64), 0.05, 0, torch.qint8)
    model, x = _WithAux(aux), torch.randn(16, 128)
    ref = train_step(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # prototype/deprecation notices of torch itself
        with offload_everything(model, tmp_path) as off:
            assert_same(ref, train_step(model, x))
            off.synchronize()
            st = settled(off)
    assert st.bytes_unsupported > 0 and st.bytes_offloaded > 0


@pytest.mark.gpu
def test_tensor_on_another_device_than_the_model(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: a CPU-only machine has no second device")
    model = MLP().cuda()
    x = torch.randn(64, 128)
    ref = train_step(model, x.cuda())
    with offload_everything(model, tmp_path):
        assert_same(ref, train_step(model, x.cuda()))
