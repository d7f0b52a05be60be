"""The weight store against bad and hostile input: output directories that hold something else,
configs that are not the store's, ties the checkpoint breaks, damaged or edited manifests, data
files outside the store or not regular files, stores other users could change, and drives that
fill up during a conversion. Real files, real FIFOs, a real tmpfs; tiny Hugging Face models built
from configs (nothing downloaded); the command run as a user runs it."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import (  # noqa: E402
    fill,
    is_root,
    real_disk_base,  # noqa: E402
    tmpfs,
)

import gds_offload.weights as weights_pkg  # noqa: E402
from gds_offload.cli import main as cli_main  # noqa: E402
from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.weights import (  # noqa: E402
    ConfigMismatchError,
    StoreFormatError,
    StoreSpaceError,
    StoreTrustError,
    convert,
    load_streamed,
    read_manifest,
    verify_store,
)

ROOT = Path(__file__).resolve().parent.parent
LAYERS, VOCAB = 3, 256
OTHER_UID = 12345
needs_root = pytest.mark.skipif(not is_root(), reason="needs root (chown to another uid, mount a tmpfs)")


def _config(**kw: object) -> transformers.LlamaConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    return transformers.LlamaConfig(**(base | kw))


def _save(cfg: transformers.PretrainedConfig, path: Path) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _skeleton(config_dir: Path) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config_dir)).eval()


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _edit_manifest(store: Path, edit: Any) -> None:
    path = store / "manifest.json"
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def _cli(*args: object, timeout: float = 120) -> tuple[int, list[str]]:
    """``gds-offload ARGS`` in its own process, as a user runs it: (exit status, stderr lines)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    p = subprocess.run([sys.executable, "-m", "gds_offload.cli", *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, [line for line in p.stderr.splitlines() if line.strip() and "[WARNING]" not in line]


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    d = real_disk_base() / f"gds_offload-store-trust-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ckpt(base: Path) -> Path:
    return _save(_config(), base / "ckpt")


@pytest.fixture(scope="module")
def store(base: Path, ckpt: Path) -> Path:
    convert(ckpt, base / "store")
    return base / "store"


@pytest.fixture
def copy(tmp_path: Path, store: Path) -> Path:
    """A fresh copy of the store to damage."""
    return Path(shutil.copytree(store, tmp_path / "store"))


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


# -- 5: convert and configs ---------------------------------------------------------------------
def test_an_out_holding_another_checkpoint_is_refused_even_with_force(tmp_path: Path, ckpt: Path) -> None:
    other = _save(_config(rms_norm_eps=1e-5), tmp_path / "other")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=r"holds files that are not part of a weight store \(model.safetensors\)"):
            convert(ckpt, other, overwrite=overwrite)
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before  # nothing overwritten, nothing added
    rc, err = _cli("convert", ckpt, other, "--force")
    assert rc == 2 and len(err) == 1 and f"out={other} holds files that are not part of a weight store" in err[0]


def test_convert_into_the_checkpoint_itself_is_refused(tmp_path: Path, ckpt: Path) -> None:
    own = Path(shutil.copytree(ckpt, tmp_path / "ckpt"))
    before = sorted(p.name for p in own.iterdir())
    rc, err = _cli("convert", own, own)
    assert rc == 2 and len(err) == 1 and f"out={own} is the checkpoint directory itself" in err[0]
    with pytest.raises(ConfigError, match="is the checkpoint directory itself"):
        convert(own, own, overwrite=True)
    assert sorted(p.name for p in own.iterdir()) == before  # no weights.bin, no partial file


def test_force_from_a_checkpoint_without_config_leaves_no_old_config(tmp_path: Path, ckpt: Path, ids: torch.Tensor) -> None:
    out = tmp_path / "store"
    convert(ckpt, out)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(ckpt / "model.safetensors", bare / "model.safetensors")  # the same weights, no config.json
    m = convert(bare, out, overwrite=True)
    assert not (out / "config.json").exists() and not (out / "generation_config.json").exists()
    assert m.config_sha256 is None and m.config_file_sha256 is None and m.generation_config_sha256 is None
    with pytest.warns(UserWarning, match=r"records no model config .* not checked against it"):
        with load_streamed(_skeleton(ckpt), out) as h:
            assert torch.equal(_logits(h, ids), _logits(transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval(), ids))
    # A config.json put there afterwards (an earlier version kept the old store's) is not taken for the store's.
    shutil.copy(ckpt / "config.json", out / "config.json")
    with pytest.raises(StoreFormatError, match=r"config.json is not this store's: the manifest .* records no config.json"):
        load_streamed(_skeleton(ckpt), out)


def test_a_config_json_that_is_not_the_one_converted_is_refused(copy: Path) -> None:
    cfg = json.loads((copy / "config.json").read_text())
    recorded = read_manifest(copy).config_file_sha256
    assert recorded is not None
    (copy / "config.json").write_text(json.dumps(cfg | {"rms_norm_eps": 1e-5}))
    with pytest.raises(StoreFormatError, match=rf"config.json \(sha256 [0-9a-f]{{12}}\.\.\.\) is not the config.json this store was converted from \(sha256 {recorded[:12]}\.\.\."):
        read_manifest(copy)
    (copy / "config.json").unlink()  # a store without its copy still loads: the fingerprint identifies the config
    assert read_manifest(copy).config_file_sha256 == recorded


def test_format_1_stores_still_load(copy: Path, ckpt: Path, ids: torch.Tensor) -> None:
    def to_v1(d: dict[str, Any]) -> None:
        d["format_version"] = 1
        del d["generation_config_sha256"]
        for t in d["tensors"]:
            del t["xxh3_64"]

    _edit_manifest(copy, to_v1)
    with load_streamed(_skeleton(copy), copy, verify=True) as h:
        assert torch.equal(_logits(h, ids), _logits(transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval(), ids))


def _tie_over(tmp_path: Path, name: str, *, equal_head: bool) -> Path:
    """A checkpoint holding both lm_head.weight and the embeddings, with tie_word_embeddings=True in its config."""
    ck = _save(_config(), tmp_path / name)
    state = safetensors_torch.load_file(ck / "model.safetensors")
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    if equal_head:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    safetensors_torch.save_file(state, ck / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    return ck


@pytest.mark.parametrize("equal_head", [False, True])
def test_a_tie_over_a_checkpoint_with_its_own_head_follows_from_pretrained(tmp_path: Path, ids: torch.Tensor, equal_head: bool) -> None:
    ck = _tie_over(tmp_path, "tied-config", equal_head=equal_head)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ck).eval()
    # transformers ties them only if the checkpoint's two tensors are equal.
    assert (ref.lm_head.weight is ref.model.embed_tokens.weight) == equal_head
    convert(ck, tmp_path / "store")
    with load_streamed(_skeleton(tmp_path / "store"), tmp_path / "store") as h:
        assert (h.model.lm_head.weight is h.model.model.embed_tokens.weight) == equal_head
        assert torch.equal(_logits(h, ids), _logits(ref, ids))


def test_a_format_1_store_cannot_tell_a_tie_and_says_so(tmp_path: Path) -> None:
    ck = _tie_over(tmp_path, "tied-config", equal_head=False)
    convert(ck, tmp_path / "store")

    def to_v1(d: dict[str, Any]) -> None:
        d["format_version"] = 1
        del d["generation_config_sha256"]
        for t in d["tensors"]:
            del t["xxh3_64"]

    _edit_manifest(tmp_path / "store", to_v1)
    with pytest.raises(ConfigError, match=r"the model ties .*, and the store holds .*this store \(format 1\) records no tensor checksums.*Convert the checkpoint again"):
        load_streamed(_skeleton(tmp_path / "store"), tmp_path / "store")


# -- 6: manifest trust ------------------------------------------------------------------------------
def _tensor(d: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in d["tensors"] if t["name"] == name)


def _group(d: dict[str, Any], name: str) -> dict[str, Any]:
    return next(g for g in d["groups"] if g["name"] == name)


def _nbytes_off(d: dict[str, Any]) -> None:  # a smaller nbytes than the shape needs
    _tensor(d, "model.layers.1.mlp.up_proj.weight")["nbytes"] //= 2


def _two_at_one_offset(d: dict[str, Any]) -> None:  # same shape, one offset: both read the gate's bytes
    up, gate = _tensor(d, "model.layers.1.mlp.up_proj.weight"), _tensor(d, "model.layers.1.mlp.gate_proj.weight")
    up["offset"] = gate["offset"]


def _offset_a_string(d: dict[str, Any]) -> None:
    _group(d, "model.layers.1")["offset"] = str(_group(d, "model.layers.1")["offset"])


def _shape_of_floats(d: dict[str, Any]) -> None:
    t = _tensor(d, "model.norm.weight")
    t["shape"] = [float(s) for s in t["shape"]]


def _dtype_not_a_dtype(d: dict[str, Any]) -> None:
    _tensor(d, "model.norm.weight")["dtype"] = "load"


def _tensor_in_another_layer(d: dict[str, Any]) -> None:
    _tensor(d, "model.layers.2.input_layernorm.weight")["group"] = "resident"


@pytest.mark.parametrize(("edit", "match"), [
    (_nbytes_off, r"model.layers.1.mlp.up_proj.weight is float32 \(128, 64\), 32768 bytes, but the manifest gives it 16384"),
    (_two_at_one_offset, r"tensors model.layers.1.mlp.(gate|up)_proj.weight and model.layers.1.mlp.(gate|up)_proj.weight overlap"),
    (_offset_a_string, r"group 'model.layers.1' offset is '\d+', not a non-negative integer"),
    (_shape_of_floats, r"tensor 'model.norm.weight' shape\[0\] is 64.0, not a non-negative integer"),
    (_dtype_not_a_dtype, r"tensor 'model.norm.weight' has dtype 'load', not one a store holds"),
    (_tensor_in_another_layer, r"model.layers.2.input_layernorm.weight is listed in group resident, which is not its layer"),
])  # fmt: skip
def test_a_damaged_or_edited_manifest_is_refused_before_anything_is_read(copy: Path, edit: Any, match: str) -> None:
    _edit_manifest(copy, edit)
    with pytest.raises(StoreFormatError, match=match):
        load_streamed(_skeleton(copy), copy, verify=True)
    with pytest.raises(StoreFormatError, match=match):
        verify_store(copy)


def test_a_group_inflated_past_its_tensors_is_refused_before_allocation(copy: Path) -> None:
    """A group of 1 GiB (the file extended, sparse, to hold it) would be allocated and read."""
    inflate = 1 << 30
    with open(copy / "weights.bin", "r+b") as fh:
        fh.truncate(os.fstat(fh.fileno()).st_size + inflate)

    def edit(d: dict[str, Any]) -> None:
        _group(d, "model.layers.2")["nbytes"] += inflate
        d["files"][0]["nbytes"] += inflate

    _edit_manifest(copy, edit)
    with pytest.raises(StoreFormatError, match=r"group model.layers.2 gives \d+ bytes, but its tensors end \d+ bytes after its start"):
        load_streamed(_skeleton(copy), copy)


def test_a_data_file_of_another_size_is_refused(copy: Path) -> None:
    size = (copy / "weights.bin").stat().st_size
    with open(copy / "weights.bin", "ab") as fh:
        fh.write(bytes(4096))
    with pytest.raises(StoreFormatError, match=rf"weights.bin has {size + 4096} bytes, the manifest says {size}: it is not the file"):
        verify_store(copy)


def test_a_store_given_twice_in_a_stripe_is_refused(tmp_path: Path, ckpt: Path) -> None:
    one = tmp_path / "one"
    convert(ckpt, one)
    _edit_manifest(one, lambda d: d["files"].append({"path": "weights.bin", "dir": 1, "nbytes": d["files"][0]["nbytes"]}))
    with pytest.raises(StoreFormatError, match="are one file: a directory was given twice"):
        verify_store([one, one])


# -- 9: manifest paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("outside", ["../elsewhere/weights.bin", "ABSOLUTE"])
def test_a_data_file_named_outside_the_store_is_not_opened(tmp_path: Path, copy: Path, outside: str) -> None:
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(copy / "weights.bin", tmp_path / "elsewhere" / "weights.bin")  # a file that would pass every other check
    name = str(tmp_path / "elsewhere" / "weights.bin") if outside == "ABSOLUTE" else outside
    (copy / "weights.bin").unlink()

    def edit(d: dict[str, Any]) -> None:
        d["files"][0]["path"] = name

    _edit_manifest(copy, edit)
    with pytest.raises(StoreFormatError, match="is not a plain file name inside the store directory"):
        verify_store(copy)


def test_fifos_and_symlinks_in_a_store_are_refused_without_blocking(tmp_path: Path, copy: Path) -> None:
    # Before, opening a FIFO blocked until a writer came (forever); the command runs in its own process to show it returns.
    data = copy / "weights.bin"
    data.rename(tmp_path / "real.bin")
    os.mkfifo(data)
    rc, err = _cli("convert", "--check", copy, timeout=60)
    assert rc == 2 and len(err) == 1 and f"{data} is a FIFO, not a regular file" in err[0]
    data.unlink()
    data.symlink_to(tmp_path / "real.bin")  # your own link, to a good copy: still not followed
    with pytest.raises(StoreTrustError, match=r"weights.bin is a symlink; a store's files are regular files"):
        verify_store(copy)
    data.unlink()
    (tmp_path / "real.bin").rename(data)
    manifest = copy / "manifest.json"
    manifest.rename(tmp_path / "manifest.json")
    os.mkfifo(manifest)
    rc, err = _cli("convert", "--check", copy, timeout=60)
    assert rc == 2 and len(err) == 1 and f"{manifest} is a FIFO, not a regular file" in err[0]


# -- 10: permissions and owners -----------------------------------------------------------------------------
def test_convert_under_umask_000_makes_an_owner_writable_store(tmp_path: Path, ckpt: Path) -> None:
    old = os.umask(0)
    try:
        convert(ckpt, tmp_path / "store")
    finally:
        os.umask(old)
    out = tmp_path / "store"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == dict.fromkeys(
        ["weights.bin", "manifest.json", "config.json", "generation_config.json"], 0o644)  # fmt: skip
    os.umask(0o077)  # a stricter umask is kept
    try:
        convert(ckpt, tmp_path / "private")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "private" / "weights.bin").stat().st_mode) == 0o600


@pytest.mark.parametrize("name", [".", "weights.bin", "manifest.json", "config.json"])
def test_a_store_others_can_write_is_refused_with_the_fix(copy: Path, name: str) -> None:
    path = copy / name if name != "." else copy
    path.chmod(stat.S_IMODE(path.stat().st_mode) | stat.S_IWOTH)
    shown = copy if name == "." else copy / name
    with pytest.raises(StoreTrustError, match=rf"{shown} is writable by others \(mode [0-7]+\): .* Run chmod go-w {shown}"):
        verify_store(copy)


def test_swapped_layers_in_a_world_writable_store_are_not_loaded(copy: Path, ckpt: Path, ids: torch.Tensor) -> None:
    """What another user could do to a store 0666/0777: swap two layers, checksums included; verify cannot see it."""
    m = read_manifest(copy)
    a, b = m.group("model.layers.0"), m.group("model.layers.1")
    assert a.padded_nbytes == b.padded_nbytes
    with open(copy / "weights.bin", "r+b") as fh:
        fh.seek(a.offset)
        ba = fh.read(a.padded_nbytes)
        fh.seek(b.offset)
        bb = fh.read(b.padded_nbytes)
        fh.seek(a.offset)
        fh.write(bb)
        fh.seek(b.offset)
        fh.write(ba)

    def swap(d: dict[str, Any]) -> None:
        ga, gb = _group(d, "model.layers.0"), _group(d, "model.layers.1")
        ga["xxh3_64"], gb["xxh3_64"] = gb["xxh3_64"], ga["xxh3_64"]

    _edit_manifest(copy, swap)
    for p in (copy, copy / "weights.bin", copy / "manifest.json"):
        p.chmod(0o777 if p.is_dir() else 0o666)
    with pytest.raises(StoreTrustError, match="is writable by group and others"):
        load_streamed(_skeleton(ckpt), copy, verify=True)


@needs_root
@pytest.mark.parametrize("name", [".", "weights.bin", "manifest.json"])
def test_a_store_another_user_owns_is_refused(copy: Path, ckpt: Path, name: str) -> None:
    path = copy / name if name != "." else copy
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(StoreTrustError, match=rf"{path} belongs to uid {OTHER_UID}, not to you \(uid 0\) nor root .*\(chown -R 0 {path}\)"):
        verify_store(copy)
    with pytest.raises(StoreTrustError, match=rf"belongs to uid {OTHER_UID}"):
        load_streamed(_skeleton(ckpt), copy, verify=True)


@needs_root
def test_another_users_symlinks_are_not_followed(tmp_path: Path, copy: Path) -> None:
    real = copy.rename(tmp_path / "real-store")
    copy.symlink_to(real)
    os.lchown(copy, OTHER_UID, OTHER_UID)
    with pytest.raises(StoreTrustError, match=rf"is a symlink owned by uid {OTHER_UID}, not by you \(uid 0\) nor root; refusing to follow it"):
        read_manifest(copy)
    copy.unlink()
    os.lchown(real / "weights.bin", 0, 0)
    (real / "weights.bin").rename(tmp_path / "weights.bin")
    (real / "weights.bin").symlink_to(tmp_path / "weights.bin")
    os.lchown(real / "weights.bin", OTHER_UID, OTHER_UID)
    with pytest.raises(StoreTrustError, match="weights.bin is a symlink"):
        verify_store(real)


def test_convert_refuses_an_out_others_can_write(tmp_path: Path, ckpt: Path) -> None:
    out = tmp_path / "shared"
    out.mkdir()
    out.chmod(0o777)
    with pytest.raises(StoreTrustError, match=rf"{out} is writable by group and others \(mode 777\).*chmod go-w {out}"):
        convert(ckpt, out)
    assert list(out.iterdir()) == []


# -- 12: convert's errors: one line, exit 2 -----------------------------------------------------------------
def test_convert_errors_are_one_line_and_exit_2(tmp_path: Path, ckpt: Path) -> None:
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"this is not a safetensors file at all" * 10)
    no_map = Path(shutil.copytree(ckpt, tmp_path / "no-map"))
    (no_map / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    bad_config = Path(shutil.copytree(ckpt, tmp_path / "bad-config"))
    (bad_config / "config.json").write_text("{not json")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        ((garbage, tmp_path / "o1"), f"{garbage / 'model.safetensors'} is not a readable safetensors file"),
        ((no_map, tmp_path / "o2"), f"{no_map / 'model.safetensors.index.json'} has no weight_map"),
        ((bad_config, tmp_path / "o3"), f"{bad_config / 'config.json'} is not valid JSON"),
        ((ckpt, a_file), f"out={a_file} is a file, not a directory"),
    ]
    for args, want in cases:
        rc, err = _cli("convert", *args)
        assert rc == 2 and len(err) == 1 and err[0].startswith("gds-offload convert: ") and want in err[0], (args, err)
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


@needs_root
def test_a_drive_filled_after_the_reservation_is_a_space_error_and_leaves_nothing(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    need = sum(p.stat().st_size for p in ckpt.iterdir())
    with tmpfs(tmp_path / "small", f"{need // (1 << 20) + 4}m") as small:
        out = small / "store"

        def filler(group: str, done: int, total: int) -> None:
            if done == total:  # every group's write issued into the reserved file: now another writer takes the rest
                fill(small)

        with pytest.raises(StoreSpaceError, match=rf"{out}/.*: the drive filled up while the weight store was written .* Nothing of the store was left"):
            convert(ckpt, out, progress=filler)
        assert sorted(p.name for p in out.iterdir()) == []
        (small / "filler").unlink()
        # The command: one line, exit 2 (the package's convert, as the command calls it, with the filler as its progress).
        real = weights_pkg.convert
        monkeypatch.setattr(weights_pkg, "convert", lambda *a, **kw: real(*a, **(kw | {"progress": filler})))
        assert cli_main(["convert", str(ckpt), str(out)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and "the drive filled up while the weight store was written" in err[0]
        assert sorted(p.name for p in out.iterdir()) == []


# -- 16: another architecture ---------------------------------------------------------------------------------
def test_a_store_of_another_architecture_names_model_type_first(tmp_path: Path) -> None:
    gpt2 = _save(transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64), tmp_path / "gpt2")
    convert(gpt2, tmp_path / "store")
    with torch.device("meta"):
        llama = transformers.AutoModelForCausalLM.from_config(_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigMismatchError, match=r": another architecture \(model_type: model 'llama', store 'gpt2', .*, and \d+ more\)"):
            load_streamed(llama, tmp_path / "store")
