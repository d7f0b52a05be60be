"""The end-of-run skip summary groups each reason as missing hardware, missing privileges, or set-up."""
from __future__ import annotations

import pytest
from helpers.skips import group_of, summary


@pytest.mark.parametrize(("reason", "group"), [
    ("needs an NVIDIA GPU (CUDA): torch.cuda.is_available() is False", "hardware"),
    ("needs the nvidia-fs kernel driver (/proc/driver/nvidia-fs) and GDS_TEST_DIR", "hardware"),
    ("needs root to mount a tmpfs", "privileges"),
    ("needs root privileges and a cgroup v1 memory hierarchy", "privileges"),
    ("transformers is not installed (pip install 'gds_offload[hf]')", "set-up"),
    ("needs DeepSpeed's async_io op built beforehand", "set-up"),
    ("DeepSpeed's ops are not built in /root/.cache/torch_extensions (needs libaio-dev)", "set-up"),
])  # fmt: skip
def test_each_reason_has_its_group(reason: str, group: str) -> None:
    assert group_of(reason) == group


def test_the_summary_counts_each_group_and_the_set_up_skips() -> None:
    lines, setup = summary(["needs root to mount tmpfs"] * 2 + ["peft is not installed"])
    assert setup == 1
    assert lines == ["skipped for privileges: 2", "  2 x needs root to mount tmpfs", "skipped for set-up: 1", "  1 x peft is not installed"]
