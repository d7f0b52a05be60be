"""The token data path under faults: an interrupted ``gds-offload shards``, shards changed after
their index was written, states from other data sets or damaged, and ranks with uneven shares.

The set's index (``shards.json``) is written last, atomically; the loader refuses a
directory without it and files it does not describe. A resumed loader refuses a state taken
on other shards, naming the first one that differs. Every rank serves as many batches per
epoch (the README's multi-rank call, on 3 ranks, in one process and under ``torchrun``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers.disks import real_disk_base

from gds_offload.cli import main
from gds_offload.data.format import MANIFEST_NAME, ShardError, scan_shards, write_shard
from gds_offload.data.loader import STATE_FORMAT, TokenLoader
from gds_offload.data.order import plan_epoch
from gds_offload.data.writer import synthetic_tokens, write_shards
from gds_offload.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "distributed" / "data_worker.py"
requires_dali = pytest.mark.skipif(
    importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None,
    reason="NVIDIA DALI is not installed (pip install 'gds_offload[data]')",
)
#: ``gds-offload shards`` arguments of the ``shards`` fixture's set: 624 windows of 33 tokens, 12 files of 50 and one of 24.
SET_ARGS = ["--synthetic", "20000", "--seq", "32", "--windows-per-file", "50", "--vocab", "4096"]


def synthetic(path: Path, tokens: np.ndarray | None = None, *, seed: int = 0, overwrite: bool = False):
    """The set of :data:`SET_ARGS` (``tokens``: another stream of the same length) at ``path``."""
    stream = [tokens] if tokens is not None else synthetic_tokens(20_000, vocab=4096, seed=seed)
    return write_shards(path, stream, seq=32, vocab=4096, tokenizer="synthetic", windows_per_file=50, overwrite=overwrite)


def windows_of(path: Path) -> Counter:
    """Every window of the directory's files, as a multiset of tuples."""
    return Counter(map(tuple, np.concatenate([np.load(f.path) for f in scan_shards(path).files]).tolist()))


def served(batches) -> list[tuple[int, ...]]:
    """The windows of ``batches`` (input_ids plus the last label) in order."""
    return [tuple(w) for b in batches for w in torch.cat([b["input_ids"], b["labels"][:, -1:]], 1).tolist()]


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
    with pytest.raises(ShardError, match=r"no shards\.json: the set is incomplete \(was gds-offload shards interrupted\?\)") as info:
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


# ---------------------------------------------------------------------- ranks: as many batches each
def _plans(shards: Path, epoch: int, ranks: int = 3, batch: int = 8):
    files = tuple(f.windows for f in scan_shards(shards).files)
    return [plan_epoch(files, epoch=epoch, seed=0, shard_id=r, num_shards=ranks, batch=batch, pool_files=8) for r in range(ranks)]


def _check_epoch(shards: Path, epoch: int, per_rank: list[list[tuple[int, ...]]], sizes: list[list[int]]) -> None:
    """Every rank the same batches' sizes; its own stream once, then its stream's start again; every window served."""
    plans = _plans(shards, epoch)
    most = max(p.rank_windows for p in plans)
    assert sizes[0] == sizes[1] == sizes[2] and sum(sizes[0]) == most and len(sizes[0]) == -(-most // 8)
    assert sum((Counter(w[: p.rank_windows]) for w, p in zip(per_rank, plans)), Counter()) == windows_of(shards)
    for w, p in zip(per_rank, plans):
        assert len(w) == most and p.repeated == most - p.rank_windows
        assert w[p.rank_windows :] == w[: p.repeated]
    assert sum(p.repeated for p in plans) > 0  # the case the ranks would hang on


@requires_dali
def test_the_readme_call_gives_three_ranks_as_many_batches(shards: Path) -> None:
    loaders = [TokenLoader(shards, batch_size=8, shard_id=rank, num_shards=3, seed=0) for rank in range(3)]
    for epoch in range(2):
        assert len({len(lo) for lo in loaders}) == 1
        batches = [list(lo) for lo in loaders]
        _check_epoch(shards, epoch, [served(b) for b in batches], [[x["input_ids"].shape[0] for x in b] for b in batches])


@requires_dali
def test_a_rank_resumes_exactly_inside_its_repeated_windows(shards: Path) -> None:
    plan = next(p for p in _plans(shards, 0) if p.repeated >= 16)
    rank = _plans(shards, 0).index(plan)
    full = served(TokenLoader(shards, batch_size=8, shard_id=rank, num_shards=3))
    cut = plan.rank_windows // 8 + 1  # a step inside the repeats
    first = TokenLoader(shards, batch_size=8, shard_id=rank, num_shards=3)
    it = iter(first)
    for _ in range(cut):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = TokenLoader(shards, batch_size=8, shard_id=rank, num_shards=3)
    resumed.load_state_dict(state)
    assert served(resumed) == full[cut * 8 :] and resumed.epoch == 1
    assert served(TokenLoader(shards, batch_size=8, shard_id=rank, num_shards=3, start_step=cut)) == full[cut * 8 :]


@requires_dali
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_three_torchrun_ranks_step_together_under_ddp(shards: Path) -> None:
    out = Path(tempfile.mkdtemp(prefix="gds_offload-data-ranks-", dir=real_disk_base()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--monitor-interval", "0.2", "--standalone",
           str(WORKER), str(shards), str(out), "2"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    for epoch in range(2):
        records = [r[epoch] for r in ranks]
        assert [r["disagreed"] for r in records] == [None] * 3, "a rank ran out of batches before the others"
        _check_epoch(shards, epoch, [list(map(tuple, r["windows"])) for r in records], [r["sizes"] for r in records])
