"""Shared fixtures and hardware gates.

Fixtures:
    spill_dir: a private (0700) directory on the real disk, removed afterwards.
    engine_modes: parametrize a test over the engines that run here
        (posix; compat when KvikIO is usable; host).
    engine_and_store: ``(engine, store)`` for the current ``engine_modes`` value.
    cuda_device: ``torch.device("cuda")``, or a skip naming the missing GPU.

Helpers (``from conftest import ...``): :func:`byte_view`, :data:`requires_cuda`,
:func:`cuda_test`, :data:`requires_root`, :data:`ENGINE_MODES`, :func:`real_disk_base`, :func:`fstype`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gds_offload.io import make_engine
from gds_offload.io.kvikio_engine import kvikio_status

#: Filesystems that are not a drive: spill tests there would test RAM, not O_DIRECT.
_NOT_A_DISK = {"tmpfs", "ramfs", "overlay", "squashfs", "devtmpfs", "nfs", "nfs4", "9p", "fuse", "virtiofs"}


def schema_violations(doc: object) -> list[str]:
    """Where ``doc`` breaks ``gds-check``'s published JSON schema (jsonschema, draft 2020-12); empty when it holds."""
    import jsonschema

    from gds_offload.check.report import JSON_SCHEMA

    validator = jsonschema.Draft202012Validator(JSON_SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path)) or '$'}: {e.message}" for e in validator.iter_errors(doc)]


def fstype(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    from gds_offload.io.directory import mount_of

    return mount_of(path)[2]


def real_disk_base() -> Path:
    """Where spill test directories go: ``$GDS_OFFLOAD_TEST_DIR``, else the system temp dir
    if it is on a real filesystem, else ``<repo>/.pytest_cache/spill`` (git-ignored)."""
    env = os.environ.get("GDS_OFFLOAD_TEST_DIR")
    if env:
        return Path(env)
    tmp = Path(tempfile.gettempdir())
    if fstype(tmp) not in _NOT_A_DISK:
        return tmp
    base = Path(__file__).resolve().parent.parent / ".pytest_cache" / "spill"
    base.mkdir(parents=True, exist_ok=True)
    return base


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """All bytes of ``t``'s storage as a 1-D uint8 tensor (no copy), as the scheduler sees them."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


_KVIK_OK, _KVIK_WHY = kvikio_status()
_COMPAT_SKIP = (
    f"KvikIO unusable: needs libcuda.so.1 (the NVIDIA driver library; Debian: apt-get install libcuda1) "
    f"and kvikio-cu12 ({_KVIK_WHY})"
)

#: The engines that run on this machine, as pytest params.
ENGINE_MODES = [
    pytest.param("posix", id="posix"),
    pytest.param("compat", id="compat", marks=() if _KVIK_OK else pytest.mark.skip(reason=_COMPAT_SKIP)),
    pytest.param("host", id="host"),
]
#: The engines that write files (for file-only tests).
FILE_ENGINE_MODES = ENGINE_MODES[:2]

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA): torch.cuda.is_available() is False"
)
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount tmpfs")


def cuda_test(fn):  # noqa: ANN001, ANN201 - a decorator
    """Mark ``fn`` as a GPU test and skip it without CUDA."""
    return pytest.mark.gpu(requires_cuda(fn))


@pytest.fixture
def spill_dir() -> Iterator[Path]:
    """A private 0700 directory on the real disk (see :func:`real_disk_base`), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="gds_offload-test-", dir=real_disk_base()))
    os.chmod(d, 0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=ENGINE_MODES)
def engine_modes(request: pytest.FixtureRequest) -> str:
    """One engine name per test instance: posix, compat (if KvikIO is usable), host."""
    return request.param


@pytest.fixture
def engine_and_store(engine_modes: str, spill_dir: Path):  # noqa: ANN201
    """``(engine, store)`` for the current engine; both closed afterwards."""
    from gds_offload.activations.spill.store import SpillStore

    engine = make_engine(engine_modes)  # type: ignore[arg-type]
    store = SpillStore([spill_dir] if engine.needs_files else [])
    try:
        yield engine, store
    finally:
        engine.close()  # waits for in-flight transfers first
        store.close()


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (CUDA): torch.cuda.is_available() is False")
    return torch.device("cuda")


@pytest.fixture(params=__import__("models").ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """Each drive engine that runs here (posix; compat where KvikIO is usable)."""
    return request.param
