"""StreamedTrainer refuses, at construction and before any step computes, a training directory it
cannot write (a store on a read-only mount) or whose drive lacks room for a step's generation;
each refusal names the directory and a fix that works when followed."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import is_root, real_disk_base, tmpfs  # noqa: E402
from helpers.llama import VOCAB, converted, meta_skeleton  # noqa: E402

from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.weights import load_streamed  # noqa: E402
from gds_offload.weights.train.trainer import StreamedTrainer  # noqa: E402

pytestmark = pytest.mark.skipif(not is_root(), reason="needs root privileges (mounts a read-only bind mount and a small tmpfs)")
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


@pytest.fixture(scope="module")
def store() -> Iterator[Path]:
    with converted("trainer-drive") as (_, store):
        yield store


@pytest.fixture
def readonly(store: Path, tmp_path: Path) -> Iterator[Path]:
    ro = real_disk_base() / f"gds_offload-trainer-ro-{os.getpid()}"
    ro.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(store), str(ro)], check=True, capture_output=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True, capture_output=True)
        yield ro
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False, capture_output=True)
        ro.rmdir()


def _batch() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids, "labels": ids}]


def test_a_read_only_store_is_refused_at_construction_and_the_fix_works(readonly: Path, tmp_path: Path) -> None:
    with load_streamed(meta_skeleton(readonly), readonly) as lm:
        with pytest.raises(ConfigError, match=rf"cannot write its steps into {readonly / 'train'} \({readonly}: Read-only file system\); pass StreamedTrainer\(\.\.\., state_dir=DIR\)"):
            StreamedTrainer(lm, ADAMW)
        assert sum(lm.stats().loads) == 0, "refused before any forward"
        state = real_disk_base() / f"gds_offload-trainer-state-{os.getpid()}"
        try:
            with StreamedTrainer(lm, ADAMW, state_dir=state) as trainer:  # the fix, followed
                trainer.step(_batch())
                assert trainer.step_count == 1
        finally:
            shutil.rmtree(state, ignore_errors=True)


def test_a_drive_without_room_for_a_generation_is_refused_before_the_step(store: Path, tmp_path: Path) -> None:
    weights = sum(f.stat().st_size for f in store.glob("*.bin"))
    with tmpfs(tmp_path / "small", size=f"{weights // 1024 + 64}k") as small, load_streamed(meta_skeleton(store), store) as lm:
        with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB free in .*small/train for a step's generation .* and 2x as much optimizer state"):
            StreamedTrainer(lm, ADAMW, state_dir=small / "train")
        assert sum(lm.stats().loads) == 0


def test_a_state_dir_under_a_missing_folder_is_refused_at_construction(store: Path, tmp_path: Path) -> None:
    """state_dir="/mnt/nvme9/train" (a mistyped drive) is not made on the disk above it."""
    with load_streamed(meta_skeleton(store), store) as lm:
        with pytest.raises(ConfigError, match=f"state_dir='{tmp_path / 'nvme9' / 'train'}': its parent {tmp_path / 'nvme9'} does not exist"):
            StreamedTrainer(lm, ADAMW, state_dir=tmp_path / "nvme9" / "train")
    assert not (tmp_path / "nvme9").exists()
