"""Spill files and directories are private; nothing read from disk is ever interpreted."""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from models import MLP, is_root, make, train_step

import gds_offload
from gds_offload.errors import ConfigError

PACKAGE = Path(gds_offload.__file__).resolve().parent


def _attach(path, **kw):
    return gds_offload.attach(MLP(), path=path, mode="posix", min_bytes=0, keep_last=0, **kw)


def test_spill_files_are_0600_and_unnamed(tmp_path) -> None:
    model, inputs = make("mlp")
    with gds_offload.attach(model, path=tmp_path, mode="posix", min_bytes=0, keep_last=0) as off:
        train_step(model, inputs)
        for f in off.store.files:
            st = os.fstat(f.fd)
            assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
            assert st.st_uid == os.getuid()
            assert st.st_nlink == 0, "unnamed: no directory entry to open it by"
        assert os.listdir(tmp_path) == []


def test_default_directory_created_0700(tmp_path, monkeypatch) -> None:
    target = tmp_path / "deep" / "spill"
    monkeypatch.setenv("GDS_OFFLOAD_DIR", str(target))
    old = os.umask(0)  # even with a permissive umask
    try:
        with gds_offload.attach(MLP(), mode="posix"):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_world_writable_directory_refused(tmp_path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(ConfigError, match="world-writable .*chmod 700"):
        _attach(d)


def test_sticky_world_writable_directory_allowed(tmp_path) -> None:
    """Like /tmp: others cannot remove or replace our (unnamed) files."""
    d = tmp_path / "sticky"
    d.mkdir()
    d.chmod(0o1777)
    with _attach(d) as off:
        assert off.attached


@pytest.mark.root
@pytest.mark.skipif(not is_root(), reason="needs root to plant a symlink owned by another user (lchown)")
def test_symlink_planted_by_another_user_refused(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, 12345, 12345)
    with pytest.raises(ConfigError, match="symlink owned by uid 12345"):
        _attach(link)


def test_own_symlink_followed(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with _attach(link) as off:
        assert off.attached


@pytest.mark.parametrize("needle", [r"\bpickle\b", r"\beval\(", r"\bexec\(", r"\bmarshal\b", r"\bshelve\b", r"torch\.load\("])
def test_nothing_on_disk_is_interpreted(needle: str) -> None:
    """Spill metadata lives in memory; no deserializer or evaluator exists anywhere in the package."""
    hits = []
    for py in PACKAGE.rglob("*.py"):
        for n, line in enumerate(py.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(needle, code):
                hits.append(f"{py.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not hits, hits
