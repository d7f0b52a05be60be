"""A descriptor an object holds is never closed twice (gds_offload.io.fds): a KeyboardInterrupt
at every line of :func:`close_fd` (a ``sys.settrace`` counter, deterministic) followed by the
idempotent close a ``finally`` would make never closes the file that reused the number."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import gds_offload
from gds_offload.io import fds
from gds_offload.io.fds import close_fd


class _Holder:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:  # as the package's holders: idempotent
        close_fd(self)


def _interrupt_at_line(n: int) -> Any:
    seen = [0]

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != fds.__file__:
            return None
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt
        return trace

    return trace


@pytest.mark.parametrize("line", range(1, 6))
def test_an_interrupt_anywhere_in_close_never_closes_another_file(tmp_path: Path, line: int) -> None:
    holder = _Holder(os.open(tmp_path / "a", os.O_CREAT | os.O_RDWR, 0o600))
    number = holder.fd
    sys.settrace(_interrupt_at_line(line))
    try:
        holder.close()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    other = os.open(tmp_path / "b", os.O_CREAT | os.O_RDWR, 0o600)  # reuses the number if it was freed
    try:
        holder.close()  # the clean-up after the interrupt
        os.fstat(other)  # still open
        if other != number:
            holder.close()
    finally:
        os.close(other)
    if holder.fd >= 0:  # interrupted before the number was taken out: still this holder's to close
        assert holder.fd == number
        holder.close()


def test_no_descriptor_is_closed_before_its_holder_forgets_it() -> None:
    """Every ``os.close(x.fd)`` in the package goes through :func:`close_fd`."""
    root = Path(gds_offload.__file__).parent
    pattern = re.compile(r"os\.close\(\s*[\w.]+\.(fd|_fd)\s*\)")
    offenders = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p != Path(fds.__file__) for i, line in enumerate(p.read_text().splitlines(), 1)
                 if pattern.search(line)]  # fmt: skip
    assert offenders == []
