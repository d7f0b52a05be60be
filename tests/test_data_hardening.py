"""The token data path under faults: an interrupted ``gds-offload shards``, shards changed after
their index was written, and states from other data sets or damaged.

The set's index (``shards.json``) is written last, atomically; the loader refuses a
directory without it and files it does not describe. A resumed loader refuses a state taken
on other shards, naming the first one that differs.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from gds_offload.cli import main
from gds_offload.data.format import MANIFEST_NAME, ShardError, write_shard
from gds_offload.data.loader import STATE_FORMAT, TokenLoader
from gds_offload.data.writer import synthetic_tokens, write_shards
from gds_offload.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
#: ``gds-offload shards`` arguments of the ``shards`` fixture's set: 624 windows of 33 tokens, 12 files of 50 and one of 24.
SET_ARGS = ["--synthetic", "20000", "--seq", "32", "--windows-per-file", "50", "--vocab", "4096"]


def synthetic(path: Path, tokens: np.ndarray | None = None, *, seed: int = 0, overwrite: bool = False):
    """The set of :data:`SET_ARGS` (``tokens``: another stream of the same length) at ``path``."""
    stream = [tokens] if tokens is not None else synthetic_tokens(20_000, vocab=4096, seed=seed)
    return write_shards(path, stream, seq=32, vocab=4096, tokenizer="synthetic", windows_per_file=50, overwrite=overwrite)


def rewrite_later(path: Path) -> None:
    """Rewrite a shard with other tokens of the same shape, a second after it was written."""
    written = path.stat().st_mtime_ns
    write_shard(path, np.load(path)[::-1].copy())
    os.utime(path, ns=(written + 10**9, written + 10**9))  # not within the filesystem's timestamp tick


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    synthetic(tmp_path / "s")
    return tmp_path / "s"


# ---------------------------------------------------------------------- an interrupted gds-offload shards
#: Runs ``gds-offload shards ARGS...`` with the writer's ``POINT`` (``write_shard`` or ``write_index``)
#: held on its ``AFTER``-th call (0-based), before it runs: the child says "held" and waits on stdin for the kill.
_HELD_SHARDS = r"""
import sys
from gds_offload.cli import main
from gds_offload.data import writer

point, after = sys.argv[1], int(sys.argv[2])
real, calls = getattr(writer, point), []

def held(*args, **kwargs):
    if len(calls) == after:
        print("held", flush=True)
        sys.stdin.read()
    calls.append(args)
    return real(*args, **kwargs)

setattr(writer, point, held)
sys.exit(main(["shards", *sys.argv[3:]]))
"""


def kill_shards_command(point: str, after: int, out: Path, *extra: str) -> None:
    """A real ``gds-offload shards`` child SIGKILLed where ``point`` is held (see :data:`_HELD_SHARDS`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", _HELD_SHARDS, point, str(after), str(out), *SET_ARGS, *extra],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line == "held\n", f"the command did not reach {point} #{after}: {line!r} {child.stderr.read()}"  # type: ignore[union-attr]
        child.kill()
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("point,after,overwrite", [("write_shard", 2, False), ("write_index", 0, False), ("write_shard", 1, True)],
                         ids=["after-2-shards", "before-the-index", "overwrite-after-1-shard"])
def test_a_killed_shards_command_leaves_a_set_the_loader_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str], point: str,
                                                                  after: int, overwrite: bool) -> None:
    out = tmp_path / "s"
    if overwrite:  # a complete set that the killed command was replacing
        assert main(["shards", str(out), *SET_ARGS, "--seed", "1"]) == 0
    kill_shards_command(point, after, out, *(["--overwrite"] if overwrite else []))
    written = 13 if point == "write_index" else after
    assert sorted(p.name for p in out.iterdir()) == [f"shard-{i:06d}.npy" for i in range(written)]
    with pytest.raises(ShardError, match=r"no shards\.json: the set is incomplete \(was `gds-offload shards` interrupted\?\)") as info:
        TokenLoader(out, batch_size=4)
    assert str(out) in str(info.value) and "--overwrite" in str(info.value)
    capsys.readouterr()
    assert main(["shards", str(out), *SET_ARGS]) == 2
    assert "an unfinished set: no shards.json" in capsys.readouterr().err
    assert main(["shards", str(out), *SET_ARGS, "--overwrite"]) == 0
    assert TokenLoader(out, batch_size=4).shards.windows == 624


# ---------------------------------------------------------------------- files the index does not describe
@pytest.mark.parametrize("case", ["no-index", "grown", "rewritten", "old-index", "bad-entry"])
def test_the_loader_refuses_files_the_index_does_not_describe(shards: Path, case: str) -> None:
    bad = shards / "shard-000003.npy"
    if case == "no-index":
        (shards / MANIFEST_NAME).unlink()
        bad = shards
    elif case == "grown":
        with open(bad, "ab") as f:
            f.write(b"\0" * 4096)
    elif case == "rewritten":  # the same shape and size, other tokens, later
        rewrite_later(bad)
    elif case in ("old-index", "bad-entry"):
        doc = json.loads((shards / MANIFEST_NAME).read_text())
        if case == "old-index":
            doc["format"] = "gds_offload.shards/1"
        else:
            doc["files"][3]["bytes"] = "67k"
        (shards / MANIFEST_NAME).write_text(json.dumps(doc))
        bad = shards / MANIFEST_NAME
    expected = {"no-index": "no shards.json: the set is incomplete", "grown": "bytes, shards.json says",
                "rewritten": "its bytes are not those shards.json records", "old-index": "records no file sizes or hashes",
                "bad-entry": "corrupted manifest .*'bytes': '67k'"}[case]
    with pytest.raises(ShardError, match=expected) as info:
        TokenLoader(shards, batch_size=4)
    assert str(bad) in str(info.value) and "gds-offload shards" in str(info.value)


def test_a_copy_is_the_same_data_set_with_or_without_its_times(shards: Path, tmp_path: Path) -> None:
    state = TokenLoader(shards, batch_size=10, start_step=7).state_dict()
    kept = tmp_path / "kept"
    shutil.copytree(shards, kept)  # copy2: the modification times too
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing hashed again, nothing to say
        TokenLoader(kept, batch_size=10).load_state_dict(state)
    plain = tmp_path / "plain"
    plain.mkdir()
    for p in shards.iterdir():  # a copy that does not keep the times: every file is hashed again
        shutil.copyfile(p, plain / p.name)
        later = p.stat().st_mtime_ns + 10**9
        os.utime(plain / p.name, ns=(later, later))
    with pytest.warns(UserWarning, match=r"13 of 13 shard\(s\) have other modification times .* their bytes match"):
        TokenLoader(plain, batch_size=10).load_state_dict(state)
    rewrite_later(plain / "shard-000005.npy")
    with pytest.raises(ShardError, match="shard-000005.npy: its bytes are not those shards.json records"):
        TokenLoader(plain, batch_size=10)


# ---------------------------------------------------------------------- resuming on other shards
def test_a_state_from_other_shards_is_refused_naming_the_shard(shards: Path, tmp_path: Path) -> None:
    state = TokenLoader(shards, batch_size=10, start_step=3).state_dict()
    stream = np.concatenate(list(synthetic_tokens(20_000, vocab=4096, seed=0)))
    stream[(7 * 50 + 10) * 32 + 5] ^= 1  # a token inside shard 7 only (not a window's first or last)
    synthetic(tmp_path / "one", stream)
    with pytest.raises(ConfigError, match=r"taken on other shards \(.*one/shard-000007\.npy holds other tokens") as info:
        TokenLoader(tmp_path / "one", batch_size=10).load_state_dict(state)
    assert "resume on the data set it was taken on" in str(info.value)
    synthetic(shards, seed=1, overwrite=True)  # the set rewritten in place: the same names and counts
    loader = TokenLoader(shards, batch_size=10)
    with pytest.raises(ConfigError, match=r"s/shard-000000\.npy holds other tokens"):
        loader.load_state_dict(state)
    assert loader.step == 0


def _state(shards: Path) -> dict:
    return json.loads(json.dumps(TokenLoader(shards, batch_size=8, start_step=5).state_dict()))


@pytest.mark.parametrize("field,value", [("epoch", -1), ("epoch", "0"), ("epoch", 0.5), ("epoch", True), ("epoch", None),
                                         ("window", -8), ("window", 3), ("window", 10**6), ("step", -1), ("step", 4), ("step", 900)])
def test_a_damaged_position_is_a_config_error_naming_it(shards: Path, field: str, value: object) -> None:
    state = _state(shards)  # epoch 0, window 40, step 5
    state[field] = value
    loader = TokenLoader(shards, batch_size=8)
    with pytest.raises(ConfigError, match=f"load_state_dict: {field}={value!r}".replace("(", r"\(").replace(".", r"\.")):
        loader.load_state_dict(state)
    assert (loader.epoch, loader.window, loader.step) == (0, 0, 0)


def test_a_state_of_the_names_and_counts_format_is_refused_with_the_way_back(shards: Path) -> None:
    state = _state(shards)
    state["format"] = "gds_offload.data.TokenLoader/1"
    del state["files"]
    with pytest.raises(ConfigError, match=r"names and counts only.*start_step=5\)"):
        TokenLoader(shards, batch_size=8).load_state_dict(state)
    assert STATE_FORMAT == "gds_offload.data.TokenLoader/2"
