"""The offloader's state survives what real programs do around it: refused forwards, forks,
threads, partial and failed transfers, and a drive slower than forward.

Each test compares losses and gradients with ``torch.equal`` against a run without the
offloader (``assert_same``), and forces the timing it depends on (``synchronize()``,
delayed chunks, a bandwidth cap) so that it cannot pass by luck.
"""
from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers.gates import ENGINES
from helpers.models import Result, TanhStack, assert_same, make, offload_everything, param_grads, settled, train_step
from torch import nn

import gds_offload
from gds_offload.errors import OffloadError
from gds_offload.io.faults import Fault, inject
from gds_offload.io.posix import PosixEngine
from gds_offload.io.spill import SpillStore


# ---------------------------------------------------------------------------- refused forwards
def test_forward_refused_by_pytorch_leaves_offloader_working(engine: str, tmp_path) -> None:
    """A forward inside ``disable_saved_tensors_hooks`` raises PyTorch's own error; the next
    ordinary steps still offload (pack more than 0 bytes) and stay exact."""
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path, engine) as off:
        with torch.autograd.graph.disable_saved_tensors_hooks("hooks are off here"):
            with pytest.raises(RuntimeError, match="hooks are off here"):
                model(*inputs)
        assert off.stats().steps == 0
        assert_same(ref, train_step(model, inputs))
        assert_same(ref, train_step(model, inputs))
        st = settled(off)
        assert st.steps == 2 and st.bytes_offloaded > 0


def test_failed_begin_forward_leaves_offloader_working(engine: str, tmp_path) -> None:
    """on_error='raise': a failed write surfaces at the next forward's start; the forward after
    that is exact (no KeyError in begin_layer)."""
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path, engine, on_error="raise") as off:
        train_step(model, inputs)
        off.synchronize()
        writes = off.engine.stats().writes
        inject(off, Fault("write", "eio", nth=writes))  # the last write of the next forward
        model.zero_grad(set_to_none=True)
        loss = model(*inputs).pow(2).mean()
        off.synchronize()
        del loss  # the error is still pending: no hook ran since the write failed
        with pytest.raises(OffloadError, match="could not offload"):
            model(*inputs)
        before = settled(off)
        assert_same(ref, train_step(model, inputs))
        after = settled(off)
        assert after.steps == before.steps + 1 and after.bytes_offloaded > before.bytes_offloaded


def test_torch_func_gets_pytorchs_message_and_paused_runs_it(tmp_path) -> None:
    """``torch.func.grad`` refuses saved-tensor hooks with PyTorch's message; inside ``paused()``
    it runs without them, and ordinary steps still offload exactly."""
    model, inputs = make("mlp")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, inputs).pow(2).mean()

    ref_func = torch.func.grad(loss_of)(params)
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path) as off:
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            torch.func.grad(loss_of)(params)
        with off.paused():
            got = torch.func.grad(loss_of)(params)
        assert all(torch.equal(ref_func[k], got[k]) for k in ref_func)
        assert_same(ref, train_step(model, inputs))
        assert settled(off).bytes_offloaded > 0


# ---------------------------------------------------------------------------- threads
def test_threads_each_run_forward_and_backward(engine: str, tmp_path) -> None:
    """Four threads train one attached model at once, each on its own inputs (PyTorch supports
    this; before: KeyError). Every thread's gradients equal the plain ones."""
    torch.manual_seed(0)
    model = TanhStack()
    xs = [torch.randn(32, 64) for _ in range(4)]
    ref = [param_grads(model, x) for x in xs]
    got: list[list[bool]] = [[] for _ in xs]
    start = threading.Barrier(len(xs))
    with offload_everything(model, tmp_path, engine) as off:

        def run(i: int) -> None:
            start.wait()
            for _ in range(5):
                got[i].append(all(torch.equal(a, b) for a, b in zip(ref[i], param_grads(model, xs[i]), strict=True)))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        st = settled(off)
    assert got == [[True] * 5] * len(xs)
    assert st.steps == 20 and st.bytes_offloaded > 0 and st.resident_bytes == 0


def test_paused_is_per_thread(tmp_path) -> None:
    """``paused()`` on one thread leaves another thread's forwards offloaded."""
    torch.manual_seed(0)
    model, x = TanhStack(), torch.randn(32, 64)
    with offload_everything(model, tmp_path) as off:
        seen: list[int] = []
        with off.paused():
            param_grads(model, x)
            t = threading.Thread(target=lambda: (param_grads(model, x), seen.append(off.stats().bytes_packed)))
            t.start()
            t.join()
        assert seen[0] > 0 and off.stats().steps == 1


# ---------------------------------------------------------------------------- fork
_FORK_WORKER = """
import os, sys, warnings
import torch
torch.set_num_threads(1)  # libgomp's pool does not survive fork: plain PyTorch hangs in the child otherwise
sys.path.insert(0, sys.argv[1])
from helpers.models import TanhStack, offload_everything, param_grads, settled

torch.manual_seed(0)
model, x = TanhStack(), torch.randn(64, 64)
ref = param_grads(model, x)
off = offload_everything(model, sys.argv[2], sys.argv[3])
param_grads(model, x)
pids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:  # the child: exact for 10 steps, through a store of its own
        code = 1
        try:
            warnings.simplefilter("ignore")  # KvikIO -> posix in the child is announced, and expected
            ok = all(all(torch.equal(a, b) for a, b in zip(ref, param_grads(model, x), strict=True)) for _ in range(10))
            st = settled(off)
            code = 0 if ok and st.bytes_offloaded > 0 and off.engine.name in ("posix", "host") else 2
        finally:
            os._exit(code)
    pids.append(pid)
ok = all(all(torch.equal(a, b) for a, b in zip(ref, param_grads(model, x), strict=True)) for _ in range(10))
codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
off.detach()
print("parent", ok, "children", codes)
sys.exit(0 if ok and codes == [0, 0, 0] else 1)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_children_get_their_own_store(engine: str, tmp_path) -> None:
    """Children forked after attach train on their own spill files while the parent trains on
    (sharing the parent's descriptor and slot allocator, they would overwrite each other's
    slots). Runs in a fresh interpreter with one intra-op thread, as fork needs."""
    tests = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", _FORK_WORKER, tests, str(tmp_path), engine], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "parent True children [0, 0, 0]" in done.stdout


# ---------------------------------------------------------------------------- partial and failed transfers
class _ChunkFaults(PosixEngine):
    """The posix engine on two threads, 4 KiB chunks: the chunk at ``held_at`` waits for
    :attr:`release` before it writes, the one at ``fail_at`` fails (EIO), and :attr:`later_started`
    is set when the chunk at ``later_at`` starts. Chunks run in order, so while the held chunk
    keeps one thread, the failed chunk and then the later one run on the other: once the later
    one has started, everything the failed chunk's task does is done."""

    def __init__(self, held_at: int, fail_at: int, later_at: int) -> None:
        super().__init__(num_threads=2, chunk_bytes=4096)
        self.held_at, self.fail_at, self.later_at = held_at, fail_at, later_at
        self.release, self.held_done, self.later_started = threading.Event(), threading.Event(), threading.Event()

    def _pwrite_all(self, fd: int, data: memoryview, offset: int) -> None:
        lo = offset  # the only slot of a fresh store starts at offset 0
        if lo == self.fail_at:
            raise OSError(errno.EIO, "injected EIO")
        if lo == self.later_at:
            self.later_started.set()
        if lo == self.held_at:
            assert self.release.wait(timeout=120), "the test never released the held chunk"
            super()._pwrite_all(fd, data, offset)
            self.held_done.set()
            return
        super()._pwrite_all(fd, data, offset)


def test_failed_chunk_completes_the_write_only_after_every_chunk(tmp_path) -> None:
    """One chunk fails while another is still writing: the write's future stays pending until
    the held chunk ends, so its slot cannot be freed and reused under it."""
    engine = _ChunkFaults(held_at=0, fail_at=4096, later_at=2 * 4096)
    store = SpillStore([tmp_path])
    try:
        slot = store.allocate(3 * 4096)
        src = torch.full((3 * 4096,), 7, dtype=torch.uint8)
        fut = engine.write(src, slot)
        assert engine.later_started.wait(timeout=60), "the chunk after the failed one never started"
        assert not fut.done(), "the failed chunk completed the write while chunk 0 was in flight"
        engine.release.set()
        with pytest.raises(OffloadError, match="injected EIO"):
            fut.wait(60)
        assert engine.held_done.is_set()
    finally:
        engine.release.set()
        engine.close()
        store.close()


def test_failed_read_is_released_at_once_and_never_matched(engine: str, tmp_path) -> None:
    """A read that fails marks its tensors lost: memory and slots are freed without waiting for
    the garbage collector, and the next steps (new forwards) are exact."""
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    gc.disable()
    try:
        with offload_everything(model, tmp_path, engine) as off:
            inject(off, Fault("read", "eio", nth=1))
            model.zero_grad(set_to_none=True)
            loss = model(*inputs).pow(2).mean()
            off.synchronize()
            with pytest.raises(OffloadError, match="cannot restore a saved tensor"):
                loss.backward()
            del loss
            off.synchronize()  # reads prefetched for the dropped graph end; their slots go then
            st = off.stats()
            assert st.resident_bytes == 0 and off.store.allocated_bytes() == 0
            for _ in range(2):
                assert_same(ref, train_step(model, inputs))
    finally:
        gc.enable()


# ---------------------------------------------------------------------------- the write window
def test_write_window_bounds_memory_on_a_slow_drive(tmp_path) -> None:
    """With the drive capped far below forward's pace, writes in flight never hold more than the
    window (plus the one write always allowed); the pack hook waits instead, and it is exact."""
    model, inputs = make("gpt")
    ref = train_step(model, inputs)
    window = 256 << 10
    with offload_everything(model, tmp_path, max_bandwidth="20MB/s", write_window=window) as off:
        assert_same(ref, train_step(model, inputs))
        st = settled(off)
    biggest = max(L.bytes_offloaded for L in st.layers)
    assert st.write_window_bytes == window
    assert 0 < st.peak_writing_bytes <= window + biggest, st
    assert st.write_wait_s > 0 and st.io_wait_s >= st.write_wait_s


def test_default_write_window_follows_the_layer_size(tmp_path) -> None:
    model, inputs = make("gpt")
    with offload_everything(model, tmp_path) as off:
        train_step(model, inputs)
        st = settled(off)
    assert st.write_window_bytes == max(64 << 20, 2 * max(L.bytes_offloaded for L in st.layers))


@pytest.mark.parametrize("bad", [-1, "lots", float("nan")])
def test_write_window_refuses_bad_values(bad: object, tmp_path: Path) -> None:
    with pytest.raises(gds_offload.ConfigError, match="write_window"):
        gds_offload.attach(make("mlp")[0], path=tmp_path, write_window=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- life and death
def _spill_fds(directory: Path) -> tuple[int, int]:
    """(descriptors of this process open on files in ``directory``, bytes those files hold on disk)."""
    count = held = 0
    prefix = str(directory.resolve()) + "/"
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            st = os.fstat(int(name))
        except OSError:
            continue
        if target.startswith(prefix):
            count += 1
            held += st.st_blocks * 512
    return count, held


def test_model_dropped_without_detach_releases_its_spill_file(engine: str, tmp_path) -> None:
    """Attach, train, drop the model (no ``detach()``), collect: the engine and store go with
    the offloader: no spill descriptor and no disk space is held per dropped model."""
    import weakref

    refs = []
    for _ in range(8):
        model, inputs = make("mlp")
        off = offload_everything(model, tmp_path, engine)
        train_step(model, inputs)
        off.synchronize()
        assert _spill_fds(tmp_path)[0] >= 1
        refs.append(weakref.ref(off))
        del model, off
        gc.collect()
    assert all(r() is None for r in refs), "something still holds a dropped offloader"
    assert _spill_fds(tmp_path) == (0, 0)


def test_offloader_kept_alive_by_a_graph_still_serves_backward(engine: str, tmp_path) -> None:
    """Dropping the model and offloader between forward and backward: the graph still holds what
    it needs, backward is exact, and afterwards everything is released."""
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    off = offload_everything(model, tmp_path, engine)
    model.zero_grad(set_to_none=True)
    loss = model(*inputs).pow(2).mean()
    off.synchronize()
    params = dict(model.named_parameters())
    del model, off
    gc.collect()
    loss.backward()
    assert_same(ref, Result(loss.detach(), {n: p.grad for n, p in params.items()}))
    del loss
    gc.collect()
    assert _spill_fds(tmp_path) == (0, 0)


def test_torchscript_modules_refused_before_anything_is_allocated(tmp_path) -> None:
    """``jit.script`` cannot take hooks and ``jit.trace`` never runs its submodules' hooks (the
    graph runs whole): both are refused with the fix before a spill file is opened, so no
    descriptor leaks per call, and a traced module is not silently left unoffloaded."""
    model, inputs = make("mlp")
    for jitted in (torch.jit.script(model), torch.jit.trace(model, inputs)):
        for _ in range(3):
            with pytest.raises(gds_offload.ConfigError, match="TorchScript.*attach to the eager module"):
                gds_offload.attach(jitted, path=tmp_path, mode="posix")
    assert _spill_fds(tmp_path) == (0, 0)


def test_detach_works_when_the_module_forwards_its_attributes(tmp_path) -> None:
    """A module that stores attributes elsewhere (as ``jit.trace`` wrappers do): ``detach()``
    still completes and leaves no trace of the offloader on it."""

    class Forwarding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = make("mlp")[0]
            object.__setattr__(self, "_store", {})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

        def __setattr__(self, name: str, value: object) -> None:
            if name.startswith("_gds"):
                self._store[name] = value
            else:
                super().__setattr__(name, value)

        def __getattr__(self, name: str) -> object:
            store = object.__getattribute__(self, "__dict__").get("_store", {})
            return store[name] if name in store else super().__getattr__(name)

        def __delattr__(self, name: str) -> None:
            if name in self._store:  # only `del` by the name it was set by is refused, like jit's
                raise AttributeError(name)
            super().__delattr__(name)

    model = Forwarding()
    off = gds_offload.attach(model, path=tmp_path, mode="posix", min_bytes=0, keep_last=0)
    model(torch.randn(4, 128)).sum().backward()
    off.detach()
    assert not off.attached
    assert _spill_fds(tmp_path) == (0, 0)
    gds_offload.attach(model, path=tmp_path, mode="posix").detach()  # attachable again


assert ENGINES  # the engine fixture (conftest) runs each test above on every engine here
