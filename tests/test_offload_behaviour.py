"""What attach() does besides being exact: stats, memory, slots, layers, errors, forwarding, prefetch."""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from helpers.disks import is_root, tmpfs
from helpers.models import MLP, TinyGPT, assert_same, make, offload_everything, settled, train_step
from torch import nn

import gds_offload
from gds_offload.errors import ConfigError, GDSUnavailableError
from gds_offload.io.base import Engine
from gds_offload.io.posix import PosixEngine


# ---------------------------------------------------------------------------- stats
def test_bytes_really_go_to_storage(engine: str, tmp_path) -> None:
    model, inputs = make("mlp")
    with offload_everything(model, tmp_path, engine) as off:
        train_step(model, inputs)
        off.synchronize()
        st = settled(off)
        written = off.engine.stats().bytes_written
    assert st.bytes_offloaded > 0 and st.spill_file_bytes > 0
    assert written == st.bytes_offloaded
    assert st.bytes_read + st.bytes_forwarded >= st.bytes_offloaded


def test_fused_qkv_views_deduplicated(engine: str, tmp_path) -> None:
    """q, k, v are views of one storage: written once, counted in bytes_deduplicated."""
    model, inputs = make("qkv")
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path, engine) as off:
        assert_same(ref, train_step(model, inputs))
        st = settled(off)
    # Per layer, SDPA saves q, k and v: two of the three are deduplicated against the fused output.
    qkv_bytes = 4 * 16 * 3 * 64 * 4
    assert st.bytes_deduplicated >= 2 * qkv_bytes * len(model.layers), st


def test_peak_resident_well_under_keep_everything(tmp_path) -> None:
    torch.manual_seed(0)
    model, x = MLP(width=256, depth=8), torch.randn(256, 256)
    peaks = {}
    for keep_last in (1000, 0):
        # Writes that finish inside the pack hook: a source waiting on a slow drive is resident
        # by design, and the drive's speed must not decide this comparison.
        with use_sync_engine(offload_everything(model, tmp_path, keep_last=keep_last)) as off:
            for _ in range(2):
                train_step(model, x)
            peaks[keep_last] = settled(off).peak_resident_bytes
    assert peaks[1000] > 0
    assert peaks[0] < 0.5 * peaks[1000], peaks


def test_no_slot_left_and_spill_file_flat(engine: str, tmp_path) -> None:
    model, inputs = make("gpt")
    with offload_everything(model, tmp_path, engine) as off:
        sizes = []
        for step in range(8):
            train_step(model, inputs, seed=step)
            off.synchronize()
            assert off.store.allocated_bytes() == 0, f"slots still allocated after step {step}"
            sizes.append(settled(off).spill_file_bytes)
        assert settled(off).resident_bytes == 0
    assert sizes[0] > 0 and len(set(sizes[1:])) == 1, sizes


def test_unpack_twice_identical(engine: str, tmp_path) -> None:
    """Unpacking a handle twice (retain_graph, or reading grad_fn._saved_*) returns the same bytes."""
    torch.manual_seed(0)
    w = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    model = nn.Sequential(w, nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    with offload_everything(model, tmp_path, engine) as off:
        y = model(x)
        off.synchronize()
        expected = torch.tanh(w(x)).detach()
        first = y.grad_fn.next_functions[0][0]  # AddmmBackward of the 2nd Linear
        a = first._saved_mat1
        b = first._saved_mat1
        assert torch.equal(a, expected) and torch.equal(b, expected)
        assert settled(off).bytes_read > 0  # really came back from storage
        y.sum().backward()


class _SyncEngine(Engine):
    """An engine whose writes and reads complete before ``write``/``read`` return
    (done callbacks then run inside the caller, while it holds the scheduler lock)."""

    name = "posix"

    def __init__(self) -> None:
        super().__init__()
        self.inner = PosixEngine(num_threads=1)

    def close(self) -> None:
        super().close()
        self.inner.close()

    def _done(self, f) -> Future:
        out: Future = Future()
        out.set_result(f.wait())
        return out

    def _submit_write(self, src, slot, ready):
        return self._done(self.inner.write(src, slot))

    def _submit_read(self, dst, slot, ready):
        return self._done(self.inner.read(dst, slot))


def use_sync_engine(off: gds_offload.Offloader) -> gds_offload.Offloader:
    """``off``, its engine replaced by a :class:`_SyncEngine` (before any step ran)."""
    old = off.engine
    off.use_engine(_SyncEngine())
    old.close()
    return off


def test_write_completing_inside_engine_write_keeps_the_bytes(tmp_path) -> None:
    """A write whose future is done before the pack hook returns: its bytes must stay reachable."""
    model, inputs = make("mlp")
    ref = train_step(model, inputs)
    off = use_sync_engine(offload_everything(model, tmp_path))
    try:
        assert_same(ref, train_step(model, inputs))
        assert settled(off).bytes_read > 0
    finally:
        off.detach()


# ---------------------------------------------------------------------------- errors
def test_attach_twice_refused(tmp_path) -> None:
    model = MLP()
    assert gds_offload.offloader_of(model) is None
    with offload_everything(model, tmp_path) as off:
        assert gds_offload.offloader_of(model) is off
        with pytest.raises(ConfigError, match="already attached"):
            offload_everything(model, tmp_path)
        assert gds_offload.offloader_of(model) is off  # the refused attach changed nothing
    assert gds_offload.offloader_of(model) is None


def test_missing_path_created_private(tmp_path) -> None:
    """An explicit path that does not exist, under a folder that does, is created 0700 whatever the
    umask."""
    target = tmp_path / "spill"
    old = os.umask(0)
    try:
        with offload_everything(MLP(), target) as off:
            assert off.attached
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_a_path_whose_parent_is_missing_is_refused_naming_the_disk_it_would_land_on(tmp_path) -> None:
    """``path="/mnt/nvme9/spill"`` (a mistyped drive) would be made on the disk above it: refused,
    naming the nearest folder that exists and its filesystem; nothing is created."""
    from gds_offload.io.directory import mount_of

    target = tmp_path / "nvme9" / "spill"
    device, mnt, fstype = mount_of(tmp_path)
    with pytest.raises(ConfigError) as caught:
        offload_everything(MLP(), target)
    msg = str(caught.value)
    assert msg.startswith(f"path={str(target)!r}: its parent {tmp_path / 'nvme9'} does not exist"), msg
    assert f"the nearest existing parent is {tmp_path}, on {device} ({fstype}, mounted at {mnt}" in msg, msg
    assert not (tmp_path / "nvme9").exists()


def test_non_directory_refused(tmp_path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a directory"):
        offload_everything(MLP(), f)


def test_non_writable_path_refused(tmp_path) -> None:
    d = tmp_path / "ro"
    if is_root():  # root writes through mode bits: use a read-only filesystem instead
        with tmpfs(d, "1m", readonly=True):
            with pytest.raises(ConfigError, match="not writable"):
                offload_everything(MLP(), d)
        return
    d.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="not writable"):
        offload_everything(MLP(), d)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mode": "posx"}, "did you mean 'posix'"),
        ({"mode": "nvme"}, "expected one of"),
        ({"policy": "al"}, "did you mean 'all'"),
        ({"policy": "everything"}, "expected one of"),
        ({"on_error": "ignore"}, "on_error"),
        ({"keep_last": -1}, "keep_last"),
        ({"num_threads": 0}, "num_threads"),
        ({"min_bytes": "40 gigs"}, "min_bytes='40 gigs' is not a size"),
        ({"min_bytes": -5}, "negative"),
        ({"prefetch_bytes": "lots"}, "prefetch_bytes"),
        ({"max_bandwidth": "0MB/s"}, "must be positive"),
        ({"max_bandwidth": "fast"}, "max_bandwidth"),
        ({"layers": ["blocks.99"]}, "not a submodule"),
        ({"layers": [nn.Linear(2, 2)]}, "not a submodule"),
        ({"layers": [3]}, "pass nn.Module"),
        ({"path": []}, "names no directory"),
    ],
)
def test_bad_arguments(kw: dict, match: str, tmp_path) -> None:
    kw = {"path": tmp_path} | kw
    with pytest.raises(ConfigError, match=match):
        gds_offload.attach(MLP(), mode=kw.pop("mode", "posix"), **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"min_bytes": float("nan")}, r"min_bytes=nan is not a finite number; pass a byte count"),
        ({"prefetch_bytes": float("inf")}, r"prefetch_bytes=inf is not a finite number"),
        ({"write_window": "1e400"}, r"write_window='1e400' is not a finite number"),
        ({"max_bandwidth": float("inf")}, r"max_bandwidth=inf is not a finite number"),
        ({"budget": float("nan")}, r"nan is not a finite number"),
        ({"path": b".."}, r"path=b'\.\.' is bytes; pass the directory as a str"),
        ({"path": 123}, r"path=123 \(int\) is not a directory; pass a str or pathlib.Path"),
        ({"path": ""}, r"path='' is empty; pass a directory \(the current directory is not assumed\)"),
        ({"path": [Path("/tmp"), 7]}, r"path=\[\.\.\., 7, \.\.\.\] \(int\) is not a directory"),
        ({"path": "/proc/self"}, r"path='/proc/self' is on proc .*holds no files; pass another directory as path="),
        ({"path": "/sys/kernel"}, r"path='/sys/kernel' is on sysfs .*holds no files; pass another directory as path="),
        ({"path": "/sys/kernel/spill"}, r"path='/sys/kernel/spill' does not exist and cannot be created: /sys/kernel is on sysfs"),
        ({"path": "/tmp/" + "x" * 300}, r"has a name of 300 bytes .*at most 255 bytes per name; pass another directory"),
        ({"path": "/tmp/" + "d/" * 2100}, r"bytes long; the kernel accepts paths under 4096 bytes"),
        ({"verify": "no"}, r"verify='no' \(str\) must be True or False"),
        ({"verify": 1}, r"verify=1 \(int\) must be True or False"),
        ({"num_threads": True}, r"num_threads=True \(bool\) must be an int >= 1"),
        ({"keep_last": 1.0}, r"keep_last=1.0 \(float\) must be an int >= 0"),
        ({"layers": "blocks"}, r"layers='blocks' is a str, not a list; pass a list of modules or qualified names, e.g. layers=\['blocks'\]"),
        ({"layers": ["blocks.0", "blocks.0"]}, r"layers\[1\]='blocks.0' repeats layers\[0\]"),
        ({"layers": ["blocks.1", "blocks.0", "blocks.1"]}, r"layers\[2\]='blocks.1' repeats layers\[0\]"),
        ({"policy": ["all"]}, r"policy=\['all'\] is unknown"),
    ],
)
def test_bad_arguments_name_the_argument_value_and_fix(kw: dict, match: str, tmp_path) -> None:
    """No silent coercion (verify='no' is not True, num_threads=True not 1, layers='blocks' not
    one layer per character, path='' not the current directory) and no raw TypeError, OSError
    or OverflowError: each is a ConfigError naming the argument, the value and the fix."""
    kw = {"path": tmp_path} | kw
    with pytest.raises(ConfigError, match=match):
        gds_offload.attach(MLP(), mode="posix", **kw)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("missing", [False, True])
def test_read_only_gds_offload_dir_refused_naming_the_variable(missing: bool, tmp_path, monkeypatch) -> None:
    d = tmp_path / "ro"
    target = d / "spill" if missing else d
    monkeypatch.setenv("GDS_OFFLOAD_DIR", str(target))
    if is_root():  # root writes through mode bits: use a read-only filesystem instead
        ctx = tmpfs(d, "1m", readonly=True)
    else:
        d.mkdir(mode=0o500)
        ctx = contextlib.nullcontext()
    with ctx:
        with pytest.raises(ConfigError, match=rf"GDS_OFFLOAD_DIR={target} .*(read-only|not writable).*set GDS_OFFLOAD_DIR to another directory"):
            gds_offload.attach(MLP(), mode="posix")


def test_sizes_parse(tmp_path) -> None:
    with offload_everything(MLP(), tmp_path, min_bytes="1MiB", prefetch_bytes="40GiB", max_bandwidth="2GB/s") as off:
        assert off.config.min_bytes == 1 << 20
        assert off.config.prefetch_bytes == 40 << 30
        assert off.config.max_bandwidth == 2e9


def test_gds_mode_without_gds() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: mode='gds' may work here")
    with pytest.raises(GDSUnavailableError, match="GPUDirect Storage is not usable"):
        gds_offload.attach(MLP(), mode="gds")


def test_not_a_module() -> None:
    with pytest.raises(ConfigError, match="needs a torch.nn.Module"):
        gds_offload.attach(lambda x: x)  # type: ignore[arg-type]


def test_model_without_parameters(tmp_path) -> None:
    with pytest.raises(ConfigError, match="has no parameters"):
        offload_everything(nn.Sequential(nn.ReLU(), nn.Tanh()), tmp_path)


def test_compiled_module_refused(tmp_path) -> None:
    compiled = torch.compile(MLP())  # lazy: nothing is compiled until the first call
    with pytest.raises(ConfigError, match="torch.compile"):
        offload_everything(compiled, tmp_path)


def test_failed_attach_leaves_no_threads(tmp_path, monkeypatch) -> None:
    import threading

    import gds_offload.io.spill as store

    def no_file(*_a: object, **_kw: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(store, "open_unnamed", no_file)  # fails after the engine started
    with pytest.raises(OSError, match="Too many open files"):
        offload_everything(MLP(), tmp_path)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gds_offload-")]


# ---------------------------------------------------------------------------- layers
def test_layers_found_on_gpt_and_bert_structures(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with offload_everything(TinyGPT(), tmp_path) as off:
        assert off.layer_names == ["h.0", "h.1", "h.2"]
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertModel(
        transformers.BertConfig(
            hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, vocab_size=100
        )
    )
    with offload_everything(bert, tmp_path) as off:
        assert off.layer_names == ["encoder.layer.0", "encoder.layer.1", "encoder.layer.2"]


def test_layers_override_by_name_and_module(tmp_path) -> None:
    model = MLP(depth=4)
    with offload_everything(model, tmp_path, layers=["blocks.0", "blocks.2"]) as off:
        assert off.layer_names == ["blocks.0", "blocks.2"]
    with offload_everything(model, tmp_path, layers=[model.blocks[1], model.head]) as off:
        assert off.layer_names == ["blocks.1", "head"]
        train_step(model, torch.randn(8, 128))
        names = {s.name for s in settled(off).layers}
        assert {"blocks.1", "head"} <= names


# ---------------------------------------------------------------------------- forwarding and prefetch
def test_forwarding_when_backward_overtakes_writes(engine: str, tmp_path) -> None:
    """A throttled engine: backward starts while writes are in flight; those tensors are served from
    memory (bytes_forwarded) and the result is exact."""
    model, inputs = make("gpt")
    ref = train_step(model, inputs)
    with offload_everything(model, tmp_path, engine, max_bandwidth="5MB/s") as off:
        assert_same(ref, train_step(model, inputs))
        st = settled(off)
    assert st.bytes_forwarded > 0, st


def test_slow_engine_exact(engine: str, tmp_path) -> None:
    model, inputs = make("conv")
    ref = [train_step(model, inputs, seed=s) for s in (1, 2)]
    model, inputs = make("conv")
    with offload_everything(model, tmp_path, engine, max_bandwidth="50MB/s") as off:
        for r, s in zip(ref, (1, 2)):
            assert_same(r, train_step(model, inputs, seed=s))
        assert settled(off).bytes_offloaded > 0


class _Deep(nn.Module):
    """Layers with enough compute per saved byte that reads issued ahead can finish in time."""

    def __init__(self, width: int = 384, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            for _ in range(4):  # reuse the layer: more compute, same parameters
                x = layer(x)
        return x


@pytest.mark.parametrize("prefetch_bytes", [None, 0])
def test_prefetch_reads_ahead(tmp_path, prefetch_bytes) -> None:
    """With a read-ahead, every read is requested before backward unpacks its tensor; with
    ``prefetch_bytes=0`` backward requests each read itself. Counted by requests, not by how
    soon they complete, so the outcome does not depend on the machine's speed; every write
    lands before backward (``synchronize``), so every offloaded tensor is read from the drive."""
    torch.manual_seed(0)
    model, x = _Deep(), torch.randn(512, 384)
    kw = {} if prefetch_bytes is None else {"prefetch_bytes": prefetch_bytes}
    with offload_everything(model, tmp_path, **kw) as off:
        for _ in range(3):
            train_step(model, x, sync=off.synchronize)
        st = settled(off)
        reads = off.engine.stats().reads
    assert reads > 0 and st.bytes_read > 0
    assert st.reads_at_unpack == (0 if prefetch_bytes is None else reads), (st.reads_at_unpack, reads)


def test_unknown_engine_refused() -> None:
    from gds_offload.io import make_engine

    with pytest.raises(ConfigError, match="engine 'nvme' unknown"):
        make_engine("nvme")  # type: ignore[arg-type]


def test_stats_and_plan_print_a_short_summary_with_units(tmp_path) -> None:
    """``print(off.stats())`` and ``print(off.plan())``: a few lines with units, not a 1,500-character
    repr with bytes as integers; the dataclass repr and fields stay for programs."""
    model, (x,) = make("gpt")
    with gds_offload.attach(model, path=tmp_path, mode="posix", min_bytes="16KiB") as off:
        for _ in range(2):
            model(x).backward()
        st = settled(off)
        text, plan = str(st), str(off.plan())
    lines = text.splitlines()
    assert 3 <= len(lines) <= 6 and all(len(line) <= 160 for line in lines), text
    assert lines[0].startswith("gds_offload: 2 steps, engine posix") and "per step:" in lines[1] and "KiB" in lines[1]
    assert "under min_bytes" in lines[1] and st.bytes_small > 0, "the model saves tensors under 16 KiB"
    assert "hidden behind compute" in text and str(st.bytes_offloaded) not in text
    assert repr(st).startswith("OffloadStats(engine=") and st.as_dict()["bytes_offloaded"] == st.bytes_offloaded
    plan_lines = plan.splitlines()
    assert plan_lines[0].startswith("gds_offload plan (all): ") and "offload 3 of 4 units" in plan_lines[1], plan
    assert len(plan_lines) <= 6 and all(len(line) <= 160 for line in plan_lines), plan
