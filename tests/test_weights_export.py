"""gds-offload export: a store back to a safetensors checkpoint that transformers' own
``from_pretrained`` loads, bit for bit the checkpoint converted; and every refusal, before
anything is written (or with nothing left)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.llama import VOCAB, llama_config, resident_model, save_checkpoint  # noqa: E402

from gds_offload.cli import main as cli_main  # noqa: E402
from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.weights import StoreCorruptError, convert, export, read_manifest  # noqa: E402
from gds_offload.weights.store.export import INDEX_NAME  # noqa: E402


@pytest.fixture(scope="module")
def base() -> Path:
    d = real_disk_base() / f"gds_offload-export-{os.getpid()}"
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


def _same_model(a: Path, b: Path) -> None:
    ma, mb = resident_model(a), resident_model(b)
    sa, sb = ma.state_dict(), mb.state_dict()
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ma(ids).logits, mb(ids).logits)


def test_one_shard_round_trip_loads_in_transformers(base: Path, ckpt: Path, store: Path) -> None:
    out = base / "out-one"
    e = export(store, out)
    assert e.shards == ("model.safetensors",) and not (out / INDEX_NAME).exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(["model.safetensors", "config.json", "generation_config.json"])
    assert (out / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
    original, back = safetensors_torch.load_file(ckpt / "model.safetensors"), safetensors_torch.load_file(out / "model.safetensors")
    assert sorted(original) == sorted(back) and all(torch.equal(original[k], back[k]) and original[k].dtype == back[k].dtype for k in original)
    _same_model(ckpt, out)


def test_sharded_round_trip_writes_transformers_index(base: Path, ckpt: Path, store: Path) -> None:
    m = read_manifest(store)
    out = base / "out-many"
    e = export(store, out, shard_bytes=max(g.nbytes for g in m.groups))  # about a group per shard
    assert len(e.shards) > 2 and e.shards[0] == f"model-00001-of-{len(e.shards):05d}.safetensors"
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == {t.name for t in m.tensors} and set(index["weight_map"].values()) == set(e.shards)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in m.tensors)
    layer0 = {v for k, v in index["weight_map"].items() if k.startswith("model.layers.0.")}
    assert len(layer0) == 1, "a layer is never split over shards"
    _same_model(ckpt, out)


def test_a_tied_model_round_trips(base: Path) -> None:
    ckpt = save_checkpoint(llama_config(tie_word_embeddings=True), base / "ckpt-tied")
    convert(ckpt, base / "store-tied")
    export(base / "store-tied", base / "out-tied")
    _same_model(ckpt, base / "out-tied")


def test_the_cli_exports_and_prints_json(base: Path, ckpt: Path, store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = base / "out-cli"
    assert cli_main(["export", str(store), str(out), "--shard-size", "64KiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["out"] == str(out) and len(result["shards"]) > 1 and result["tensors"] == len(read_manifest(store).tensors)
    _same_model(ckpt, out)


def test_refusals_come_before_anything_is_written(base: Path, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files \(notes.txt\); export into a new or empty directory"):
        export(store, full)
    assert sorted(p.name for p in full.iterdir()) == ["notes.txt"]
    with pytest.raises(ConfigError, match="is the store's own directory"):
        export(store, store)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file; give a new or empty directory"):
        export(store, tmp_path / "file")
    with pytest.raises(ConfigError, match="shard_bytes"):
        export(store, tmp_path / "x", shard_bytes="lots")
    assert not (tmp_path / "x").exists()
    assert cli_main(["export", str(store), str(full)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds files" in err


def test_a_corrupt_store_is_refused_by_layer_and_nothing_is_left(base: Path, ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad-store"
    convert(ckpt, bad)
    g = read_manifest(bad).layers[2]
    with open(bad / "weights.bin", "r+b") as f:  # one flipped byte inside layer 2
        f.seek(g.offset + 100)
        byte = f.read(1)
        f.seek(g.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "out"
    with pytest.raises(StoreCorruptError, match=r"layer 2 \(model.layers.2\) is corrupt"):
        export(bad, out, shard_bytes=g.nbytes)  # shards before layer 2 were written, then removed
    assert list(out.iterdir()) == []
    assert cli_main(["export", str(bad), str(out)]) == 1
    assert "layer 2" in capsys.readouterr().err and list(out.iterdir()) == []
