"""Spill files and directories are private; nothing read from disk is ever interpreted."""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from helpers.disks import is_root
from helpers.models import MLP, make, train_step

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


@pytest.mark.parametrize("needle", [r"\bpickle\b", r"(?<!\.)\beval\(", r"(?<!\.)\bexec\(", r"\bmarshal\b", r"\bshelve\b", r"torch\.load\("])
def test_nothing_on_disk_is_interpreted(needle: str) -> None:
    """Spill metadata lives in memory; no deserializer or evaluator exists anywhere in the package."""
    hits = []
    for py in PACKAGE.rglob("*.py"):
        for n, line in enumerate(py.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(needle, code):
                hits.append(f"{py.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not hits, hits


@pytest.mark.root
@pytest.mark.skipif(not is_root(), reason="needs root to make a directory owned by another user (chown)")
@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o755], ids=oct)
def test_default_directory_made_by_another_user_refused(mode: int, tmp_path, monkeypatch) -> None:
    """``<tmp>/gds_offload-<uid>`` planted by someone else is refused, with how to choose another
    path and no advice to chmod a directory the victim does not own, whatever its mode (1777 too)."""
    monkeypatch.delenv("GDS_OFFLOAD_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    planted = tmp_path / f"gds_offload-{os.getuid()}"
    planted.mkdir()
    planted.chmod(mode)
    os.chown(planted, 12345, 12345)
    with pytest.raises(ConfigError) as info:
        gds_offload.attach(MLP(), mode="posix")
    msg = str(info.value)
    assert f"the default spill directory {planted} belongs to uid 12345" in msg, msg
    assert "GDS_OFFLOAD_DIR" in msg and "path=" in msg and "chmod" not in msg, msg
    assert os.listdir(planted) == []


@pytest.mark.root
@pytest.mark.skipif(not is_root(), reason="needs root to make a directory owned by another user (chown)")
def test_others_world_writable_directory_refused_without_chmod_advice(tmp_path) -> None:
    d = tmp_path / "theirs"
    d.mkdir()
    d.chmod(0o777)
    os.chown(d, 12345, 12345)
    with pytest.raises(ConfigError, match=r"world-writable \(mode 777\) without the sticky bit.*belongs to uid 12345") as info:
        _attach(d)
    assert "chmod 700" not in str(info.value)


def test_named_file_fallback_refuses_a_substituted_file(tmp_path, monkeypatch) -> None:
    """Without O_TMPFILE the spill file is a named file unlinked at once. Another user who
    swaps the name for a file of their own right after it is created must not get our bytes:
    the store never reopens the name, so it cannot write into the substitute."""
    from gds_offload.activations.spill import store

    monkeypatch.setattr(store.os, "O_TMPFILE", 0)  # open(dir, O_RDWR) then fails: the fallback runs
    plain = tmp_path / "plain"
    plain.mkdir(mode=0o700)
    s = store.SpillStore([plain])
    assert "no O_TMPFILE" in s.files[0].note and os.fstat(s.files[0].fd).st_nlink == 0 and os.listdir(plain) == []
    s.close()
    theirs = tmp_path / "substitute"
    real_open = os.open
    swapped: list[int] = []

    def open_then_swap(file, flags, mode=0o777, *, dir_fd=None):
        fd = real_open(file, flags, mode, dir_fd=dir_fd)
        name = os.path.basename(os.fsdecode(file))
        if flags & os.O_CREAT and name.startswith(".gds_offload") and not swapped:
            where = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) if dir_fd is not None else Path(os.fsdecode(file)).parent
            os.rename(where / name, tmp_path / "moved")  # the attacker moves ours away ...
            theirs.write_bytes(b"")  # ... and puts theirs in its place
            os.rename(theirs, where / name)
            swapped.append(os.stat(where / name).st_ino)
        return fd

    monkeypatch.setattr(store.os, "open", open_then_swap)
    spill = tmp_path / "spill"
    spill.mkdir(mode=0o700)
    try:
        s = store.SpillStore([spill])
    except ConfigError as exc:
        assert "replaced" in str(exc), exc
        return
    try:
        assert swapped, "the fallback did not create a named file"
        assert os.fstat(s.files[0].fd).st_ino != swapped[0], "the store writes into the substituted file"
    finally:
        s.close()
