"""The weight store (gds_offload.weights): conversion, layout, manifest, checks, and streaming
inference bit-identical to the resident model. Tiny Hugging Face models built from configs,
random weights saved with save_pretrained; nothing is downloaded."""
from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.llama import LAYERS, VOCAB, assert_same_generation, llama_config, meta_skeleton, resident_model, save_checkpoint  # noqa: E402

from gds_offload.cli import main as cli_main  # noqa: E402
from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.io.layout import ALIGN  # noqa: E402
from gds_offload.units import parse_bytes  # noqa: E402
from gds_offload.weights import (  # noqa: E402
    ConfigMismatchError,
    Manifest,
    StoreCorruptError,
    StoreFormatError,
    StoreSpaceError,
    WeightsMismatchError,
    as_reference,
    convert,
    load_streamed,
    read_manifest,
    verify_store,
)

#: The module (the package's ``convert`` attribute is the function of that name).
convert_mod = importlib.import_module("gds_offload.weights.store.convert")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = real_disk_base() / f"gds_offload-weights-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ckpt(base: Path) -> Path:
    return save_checkpoint(llama_config(), base / "ckpt")


@pytest.fixture(scope="module")
def store(base: Path, ckpt: Path) -> Path:
    convert(ckpt, base / "store")
    return base / "store"


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


# -- conversion and layout -------------------------------------------------------------------
def test_layout_is_aligned_and_one_range_per_layer(ckpt: Path, store: Path) -> None:
    m = read_manifest(store)
    assert [g.name for g in m.layers] == [f"model.layers.{i}" for i in range(LAYERS)]
    assert m.resident is not None and m.layer_prefix == "model.layers"
    data = (store / "weights.bin").read_bytes()
    assert len(data) == m.files[0].nbytes
    end = 0
    for g in m.groups:  # groups in file order, each 4 KiB-aligned, padded with zeros
        assert g.offset % ALIGN == 0 and g.offset >= end
        assert data[g.offset + g.nbytes : g.offset + g.padded_nbytes] == bytes(g.padded_nbytes - g.nbytes)
        end = g.offset + g.padded_nbytes
        members = sorted(m.tensors_of(g.name), key=lambda t: t.offset)
        assert members and members[0].offset == g.offset and members[-1].offset + members[-1].nbytes == g.offset + g.nbytes
        for a, b in zip(members, members[1:]):
            assert b.offset % m.tensor_align == 0 and 0 <= b.offset - (a.offset + a.nbytes) < m.tensor_align
        for t in members:
            assert (t.group == "resident") == (not t.name.startswith("model.layers."))
    state = safetensors_torch.load_file(ckpt / "model.safetensors")
    assert sorted(state) == sorted(t.name for t in m.tensors)
    for t in m.tensors:  # every tensor's bytes where the manifest says
        assert data[t.offset : t.offset + t.nbytes] == state[t.name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert (store / "config.json").is_file() and not list(store.glob("*.partial"))
    assert m.tensor_align == 256 and all(t.offset % 256 == 0 for t in m.tensors), "new stores: cuBLASLt's alignment"


def test_a_store_written_with_64_byte_offsets_still_loads_and_is_exact(base: Path, ids: torch.Tensor) -> None:
    ckpt = save_checkpoint(llama_config(hidden_size=48, intermediate_size=100), base / "ckpt-48")  # 192-byte norms
    old = convert(ckpt, base / "store-64", tensor_align=64)
    assert old.tensor_align == 64 and any(t.offset % 256 for t in old.tensors)
    assert all(t.offset % 256 == 0 for t in convert(ckpt, base / "store-256").tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on the CPU no kernel choice depends on it: no warning
        with load_streamed(meta_skeleton(base / "store-64"), base / "store-64") as lm, torch.no_grad():
            got = lm.model(ids).logits
    with torch.no_grad():
        assert torch.equal(got, resident_model(ckpt)(ids).logits)


def test_sharded_checkpoint_converts_to_the_same_store(base: Path, store: Path) -> None:
    sharded = save_checkpoint(llama_config(), base / "ckpt-sharded", max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    m = convert(sharded, base / "store-sharded")
    single = read_manifest(store)
    assert m.groups == single.groups and m.tensors == single.tensors and m.config_sha256 == single.config_sha256
    assert (base / "store-sharded" / "weights.bin").read_bytes() == (store / "weights.bin").read_bytes()
    assert m.source["files"] == sorted(p.name for p in sharded.glob("*.safetensors"))


def test_manifest_round_trip_and_validation(store: Path) -> None:
    m = read_manifest(store)
    assert Manifest.from_json(m.to_json()) == m
    d = json.loads(m.to_json())
    d["format_version"] = 99
    with pytest.raises(StoreFormatError, match="format version 99.*Convert the checkpoint again"):
        Manifest.from_json(json.dumps(d))
    d = json.loads(m.to_json())
    d["groups"][1]["offset"] += 64
    with pytest.raises(StoreFormatError, match="not a multiple of 4096"):
        Manifest.from_json(json.dumps(d))
    d = json.loads(m.to_json())
    d["tensors"][0]["nbytes"] += 10**6
    with pytest.raises(StoreFormatError, match=r"65536 bytes, but the manifest gives it 1065536"):
        Manifest.from_json(json.dumps(d))
    with pytest.raises(StoreFormatError, match="holds no manifest.json"):
        read_manifest(store.parent)


def test_existing_store_is_not_overwritten_without_force(ckpt: Path, store: Path) -> None:
    with pytest.raises(ConfigError, match="holds a weight store already.*overwrite=True"):
        convert(ckpt, store)


def test_a_store_or_export_under_a_missing_folder_is_refused(base: Path, ckpt: Path, store: Path) -> None:
    """store="/mnt/nvme9/store" (a mistyped drive) is not made on the disk above it: refused, naming
    the nearest folder there is; a missing store under an existing folder is made as before."""
    from gds_offload.weights import export

    for call in (lambda: convert(ckpt, base / "nvme9" / "store"), lambda: export(store, base / "nvme9" / "out")):
        with pytest.raises(ConfigError, match=re.escape(f"its parent {base / 'nvme9'} does not exist; the nearest existing parent is {base}, on ")):
            call()
        assert not (base / "nvme9").exists()


def test_too_small_drive_is_refused_before_writing(monkeypatch: pytest.MonkeyPatch, base: Path, ckpt: Path) -> None:
    monkeypatch.setattr(convert_mod, "free_bytes", lambda path: 100_000)
    out = base / "store-nospace"
    with pytest.raises(StoreSpaceError, match=r"needs \d+ bytes .* has 100000 bytes .* free.*Nothing was written"):
        convert(ckpt, out)
    assert list(out.iterdir()) == []


def test_fallocate_failure_is_refused_before_writing(monkeypatch: pytest.MonkeyPatch, base: Path, ckpt: Path) -> None:
    import errno

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(convert_mod.os, "posix_fallocate", full)
    out = base / "store-fallocate"
    with pytest.raises(StoreSpaceError, match=r"reserving \d+ bytes .* failed \(No space left on device; \d+ bytes free\)"):
        convert(ckpt, out)
    assert list(out.iterdir()) == []


def test_check_names_the_corrupted_layer(base: Path, store: Path) -> None:
    bad = base / "store-corrupt"
    shutil.copytree(store, bad)
    assert verify_store(bad).groups == LAYERS + 1
    g = read_manifest(bad).group("model.layers.2")
    with open(bad / "weights.bin", "r+b") as fh:
        fh.seek(g.offset + 1000)
        byte = fh.read(1)
        fh.seek(g.offset + 1000)
        fh.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(StoreCorruptError, match=r"layer 2 \(model.layers.2\) is corrupt"):
        verify_store(bad)
    assert cli_main(["convert", "--check", str(bad)]) == 1
    assert cli_main(["convert", "--check", str(store)]) == 0
    with pytest.raises(StoreCorruptError, match=r"layer 2 \(model.layers.2\) is corrupt"):  # verify=True names it at read time
        with load_streamed(meta_skeleton(bad), bad, verify=True) as h, torch.no_grad():
            h(torch.zeros(1, 4, dtype=torch.long))


def test_cli_convert_with_check(base: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = base / "store-cli"
    assert cli_main(["convert", str(ckpt), str(out), "--check", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["converted"]["layers"] == LAYERS and result["check"]["ok"] is True
    assert cli_main(["convert", str(base / "nothing-here"), str(base / "store-none")]) == 2
    assert "neither model.safetensors" in capsys.readouterr().err


def test_convert_and_check_report_progress(base: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[str, int, int]] = []
    m = convert(ckpt, base / "store-progress", progress=lambda *a: seen.append(a))
    total = m.total_nbytes()
    assert [name for name, _, _ in seen] == [g.name for g in m.groups]
    assert [done for _, done, _ in seen] == list(itertools.accumulate(g.nbytes for g in m.groups)) and seen[-1][1:] == (total, total)
    checked: list[tuple[str, int, int]] = []
    verify_store(base / "store-progress", progress=lambda *a: checked.append(a))
    assert sorted(name for name, _, _ in checked) == sorted(g.name for g in m.groups) and checked[-1][1:] == (total, total)
    # The command draws a bar on a terminal (TTY_COMPATIBLE=1 makes rich treat stderr as one), not with --json.
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    assert cli_main(["convert", str(ckpt), str(base / "store-bar"), "--check"]) == 0
    err = capsys.readouterr().err
    assert "converting" in err and "checking" in err
    assert cli_main(["convert", str(ckpt), str(base / "store-bar"), "--check", "--force", "--json"]) == 0
    assert "converting" not in capsys.readouterr().err


# -- streaming ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("tier", "slots", "resident_layers"), [("drive", 2, 0), ("drive", 1, 0), ("drive", 3, 1), ("host", 2, 0)])
def test_logits_bit_identical_to_resident(ckpt: Path, store: Path, ids: torch.Tensor, tier: str, slots: int, resident_layers: int) -> None:
    with torch.no_grad():
        want = resident_model(ckpt)(ids).logits
        with load_streamed(meta_skeleton(store), store, tier=tier, slots=slots, resident_layers=resident_layers, verify=True) as h:
            for _ in range(2):
                assert torch.equal(h(ids).logits, want)
            s = h.stats()
    assert s.misses == 0 and s.wasted_reads == 0
    assert len(s.streamed_layers) == (0 if tier == "host" else LAYERS - resident_layers)


def test_stats_print_a_short_summary_with_units(store: Path, ids: torch.Tensor) -> None:
    with torch.no_grad(), load_streamed(meta_skeleton(store), store, slots=2) as h:
        h(ids)
        s = h.stats()
    text = str(s)
    lines = text.splitlines()
    assert 3 <= len(lines) <= 7 and all(len(line) <= 170 for line in lines), text
    assert lines[0].startswith(f"gds_offload weights: {LAYERS} layers streamed, 0 resident, on cpu") and "KiB" in text
    assert str(s.bytes_read) not in text and repr(s).startswith("StreamStats(tier=")


def test_generate_greedy_and_sampling_match(ckpt: Path, store: Path, ids: torch.Tensor) -> None:
    """Tokens and every step's scores equal the reference: the resident model frozen and aligned as
    a store holds it (as_reference; from_pretrained's own tensors differ in the scores' last bits)."""
    ref = as_reference(resident_model(ckpt))
    kw = dict(max_new_tokens=6, attention_mask=torch.ones_like(ids), pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with load_streamed(meta_skeleton(store), store) as h:
        for tier_kw in ({"do_sample": False}, {"do_sample": True, "top_k": 20}):
            torch.manual_seed(7)
            want = ref.generate(ids, **kw, **tier_kw)
            torch.manual_seed(7)
            got = h.generate(ids, **kw, **tier_kw)
            assert got.sequences.shape[1] == ids.shape[1] + 6 and len(want.scores) == 6
            assert_same_generation(got, want, f"{tier_kw}: ")
        assert h.stats().misses == 0


def test_each_layer_read_once_per_forward(store: Path, ids: torch.Tensor) -> None:
    forwards, slots = 3, 2
    with load_streamed(meta_skeleton(store), store, slots=slots) as h, torch.no_grad():
        start = time.perf_counter()
        for _ in range(forwards):
            h(ids)
        s = h.stats()
        wall = time.perf_counter() - start
    # The time with a fill in flight: reads that overlap count once, so never more than the calls took.
    assert 0 < s.read_s <= wall, (s.read_s, wall)
    layer_bytes = [g.nbytes for g in read_manifest(store).layers]
    assert s.loads == [forwards] * LAYERS
    # One read per layer per forward, plus the reads prefetched for the next forward (one per slot).
    extra = [r - forwards for r in s.reads]
    assert extra == [1] * slots + [0] * (LAYERS - slots)
    assert s.bytes_read == sum(r * n for r, n in zip(s.reads, layer_bytes))
    assert s.misses == 0 and s.wasted_reads == 0 and s.direct


def test_a_ring_that_holds_every_layer_reads_each_once(ckpt: Path, store: Path, ids: torch.Tensor) -> None:
    """With as many slots as streamed layers, a layer stays in its slot between forwards."""
    with torch.no_grad():
        want = resident_model(ckpt)(ids).logits
        with load_streamed(meta_skeleton(store), store, slots=LAYERS) as h:
            for _ in range(3):
                assert torch.equal(h(ids).logits, want)
            s = h.stats()
    assert s.reads == [1] * LAYERS and s.reused == 2 * LAYERS and s.loads == [3] * LAYERS and s.misses == 0


def test_max_memory_keeps_as_many_leading_layers_as_fit(ckpt: Path, store: Path, ids: torch.Tensor) -> None:
    m = read_manifest(store)
    assert m.resident is not None
    layer = max(g.padded_nbytes for g in m.layers)  # the tiny Llama's layers are all one size
    assert {g.padded_nbytes for g in m.layers} == {layer}
    r = m.resident.padded_nbytes
    with torch.no_grad():
        want = resident_model(ckpt)(ids).logits
        # Resident layers + 2 ring slots: 0 -> r + 2 layers, 1 -> r + 3, 2 or 3 -> r + 4; all 4 (no ring) -> r + 4 too.
        for budget, resident in ((r + 2 * layer, 0), (r + 3 * layer - 1, 0), (f"{r + 3 * layer}B", 1), (r + 4 * layer, LAYERS), ("1GiB", LAYERS)):
            with load_streamed(meta_skeleton(store), store, max_memory=budget) as h:
                assert torch.equal(h(ids).logits, want) and torch.equal(h(ids).logits, want)
                s = h.stats()
            assert s.resident_layers == [g.name for g in m.layers[:resident]], budget
            assert s.resident_nbytes + s.slots * s.slot_nbytes <= parse_bytes(budget)
            assert s.loads == [2] * (LAYERS - resident) and s.slots == min(2, LAYERS - resident)


def test_max_memory_too_small_or_with_resident_layers_is_refused(store: Path) -> None:
    m = read_manifest(store)
    assert m.resident is not None
    need = m.resident.padded_nbytes + 2 * max(g.padded_nbytes for g in m.layers)
    with pytest.raises(ConfigError, match=r"holds not even the resident group and the ring.*2 slot\(s\).*or pass fewer slots"):
        load_streamed(meta_skeleton(store), store, max_memory=need - 1)
    with pytest.raises(ConfigError, match="pass one; max_memory chooses resident_layers"):
        load_streamed(meta_skeleton(store), store, max_memory="1GiB", resident_layers=1)
    with pytest.raises(ConfigError, match="max_memory='lots' is not a size"):
        load_streamed(meta_skeleton(store), store, max_memory="lots")
    every = m.resident.padded_nbytes + sum(g.padded_nbytes for g in m.layers)
    with pytest.raises(ConfigError, match="tier='host' on the CPU holds every layer"):
        load_streamed(meta_skeleton(store), store, tier="host", max_memory=every - 1)
    with load_streamed(meta_skeleton(store), store, tier="host", max_memory=every) as h:
        assert len(h.stats().resident_layers) == LAYERS


def test_settle_waits_for_the_prefetched_reads(monkeypatch: pytest.MonkeyPatch, ckpt: Path, store: Path, ids: torch.Tensor) -> None:
    import threading
    import time

    import gds_offload.io.posix as posix_mod

    real, lock, started, ended = os.preadv, threading.Lock(), [0], [0]

    def slow_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:  # a drive slow enough that reads are in flight
        with lock:
            started[0] += 1
        try:
            time.sleep(0.2)
            return real(fd, buffers, offset)
        finally:
            with lock:
                ended[0] += 1

    with torch.no_grad():
        want = resident_model(ckpt)(ids).logits
        monkeypatch.setattr(posix_mod.os, "preadv", slow_preadv)
        with load_streamed(meta_skeleton(store), store, slots=2) as h:
            h.settle()  # the first forward's first two layers, issued at load
            assert started[0] == ended[0]
            started[0] = ended[0] = 0
            issued = sum(h.stats().reads)
            assert torch.equal(h(ids).logits, want)  # its last layer issued the next forward's first two reads
            h.settle()
            # Layers 2 and 3 (0 and 1 were prefetched at load), then the next forward's 0 and 1: every
            # read issued (counted at issue) has run to its end, none is in flight or left queued.
            assert sum(h.stats().reads) - issued == started[0] == ended[0] == LAYERS
            assert torch.equal(h(ids).logits, want) and h.stats().misses == 0


def test_layer_called_out_of_order_is_a_miss_not_wrong(ckpt: Path, store: Path) -> None:
    ref = resident_model(ckpt)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(5)[None]
    with torch.no_grad():
        pe = ref.model.rotary_emb(x, pos)
        want = ref.model.layers[2](x, position_embeddings=pe, attention_mask=None)
        with load_streamed(meta_skeleton(store), store) as h:
            got = h.model.model.layers[2](x, position_embeddings=pe, attention_mask=None)
            s = h.stats()
    assert torch.equal(got[0] if isinstance(got, tuple) else got, want[0] if isinstance(want, tuple) else want)
    assert s.misses == 1 and s.wasted_reads == 2 and s.loads == [0, 0, 1, 0]
    assert h.model.model.layers[2].self_attn.q_proj.weight.is_meta  # real only during its forward


def test_tied_embeddings(base: Path, ids: torch.Tensor) -> None:
    ckpt = save_checkpoint(llama_config(tie_word_embeddings=True), base / "ckpt-tied")
    m = convert(ckpt, base / "store-tied")
    assert "lm_head.weight" not in {t.name for t in m.tensors}
    with torch.no_grad(), load_streamed(meta_skeleton(base / "store-tied", empty_weights=True), base / "store-tied") as h:
        assert h.model.lm_head.weight is h.model.model.embed_tokens.weight and not h.model.lm_head.weight.is_meta
        assert torch.equal(h(ids).logits, resident_model(ckpt)(ids).logits)


def test_config_mismatch_is_refused(store: Path) -> None:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(llama_config(rms_norm_eps=1e-5))
    with pytest.raises(ConfigMismatchError, match=r"rms_norm_eps: model 1e-05, store 1e-06.*AutoConfig.from_pretrained"):
        load_streamed(model, store)


def test_missing_extra_and_misshaped_keys_are_listed(base: Path, ckpt: Path) -> None:
    state = safetensors_torch.load_file(ckpt / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.extra.weight"] = torch.zeros(3)
    state["model.norm.weight"] = torch.ones(32)
    bad = base / "ckpt-bad"
    bad.mkdir()
    safetensors_torch.save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(ckpt / "config.json", bad / "config.json")
    convert(bad, base / "store-bad")
    with pytest.raises(WeightsMismatchError) as info:
        load_streamed(meta_skeleton(base / "store-bad"), base / "store-bad")
    msg = str(info.value)
    assert "in the model but not in the store (1): model.layers.1.mlp.up_proj.weight" in msg
    assert "in the store but not in the model (1): model.layers.0.extra.weight" in msg
    assert "model.norm.weight: model float32 (64,), store float32 (32,)" in msg


def test_gpt2_layers_and_bad_arguments(base: Path, ids: torch.Tensor) -> None:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=64)
    ckpt = save_checkpoint(cfg, base / "ckpt-gpt2")
    m = convert(ckpt, base / "store-gpt2")
    assert m.layer_prefix == "transformer.h" and len(m.layers) == 3
    with torch.no_grad(), load_streamed(meta_skeleton(base / "store-gpt2"), base / "store-gpt2", slots=2) as h:
        assert torch.equal(h(ids).logits, resident_model(ckpt)(ids).logits)
    for kw, match in (({"tier": "ram"}, "tier='ram'"), ({"slots": 0}, "slots=0"), ({"resident_layers": 9}, "resident_layers=9"), ({"device": "meta"}, "device=meta")):
        with pytest.raises(ConfigError, match=match):
            load_streamed(meta_skeleton(base / "store-gpt2"), base / "store-gpt2", **kw)


def test_striped_over_two_directories(base: Path, ckpt: Path, store: Path, ids: torch.Tensor) -> None:
    dirs = [base / "stripe-a", base / "stripe-b"]
    m = convert(ckpt, dirs)
    assert [g.file for g in m.layers] == [0, 1, 0, 1] and m.resident.file == 0 and [f.dir for f in m.files] == [0, 1]
    assert (dirs[1] / "weights.bin").stat().st_size == m.files[1].nbytes and not (dirs[1] / "manifest.json").exists()
    assert verify_store(dirs).groups == LAYERS + 1
    with pytest.raises(StoreFormatError, match="striped over 2 directories but 1 were given"):
        load_streamed(meta_skeleton(dirs[0]), dirs[0])
    with torch.no_grad(), load_streamed(meta_skeleton(dirs[0]), dirs) as h:
        assert torch.equal(h(ids).logits, resident_model(ckpt)(ids).logits)


@pytest.mark.skipif(not __import__("gds_offload.io.kvikio.engine", fromlist=["kvikio_status"]).kvikio_status()[0],
                    reason="KvikIO unusable here (needs kvikio-cu12 and libcuda.so.1)")  # fmt: skip
def test_kvikio_compat_reads_into_the_host_ring(ckpt: Path, store: Path, ids: torch.Tensor) -> None:
    # The engine a GPU uses (KvikIO CuFile.pread), here into host slots; the store is opened read-only.
    with torch.no_grad(), load_streamed(meta_skeleton(store), store, engine="compat", verify=True) as h:
        want = resident_model(ckpt)(ids).logits
        for _ in range(2):
            assert torch.equal(h(ids).logits, want)
        s = h.stats()
    assert "KvikIO" in s.engine and s.ring == "host" and s.misses == 0 and s.loads == [2] * LAYERS


def test_device_and_engine_arguments_are_checked(store: Path) -> None:
    cases = [({"engine": "hots"}, "did you mean 'host'"), ({"engine": "host"}, "use tier='host'"), ({"device": "mps"}, "device=mps")]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, r"needs an NVIDIA GPU, but torch.cuda.is_available\(\) is False"))
    for kw, match in cases:
        with pytest.raises(ConfigError, match=match):
            load_streamed(meta_skeleton(store), store, **kw)
