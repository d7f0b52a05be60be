"""What a long call says while it works: :func:`reporter`, for ``from_pretrained(progress=)``.

A call made of phases (convert, measure, load) takes ``progress``:

* ``True`` (the default): on a terminal (stderr), a rich bar per phase, redrawn in place and
  left on screen as one line when the phase ends (bytes for a conversion, the step being
  measured, the time taken); off a terminal (a pipe, a log file, CI), one plain line per
  phase on stderr, as it starts.
* ``False`` or ``None``: nothing.
* a :class:`logging.Logger`: one ``INFO`` record per phase, and per step inside it.
* a callable: called with the same lines (``progress=print``, ``progress=lines.append``).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Union

from gds_offload.errors import ConfigError
from gds_offload.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

__all__ = ["Phase", "ProgressArg", "Reporter", "reporter"]

#: What ``progress=`` takes (see the module doc).
ProgressArg = Union[bool, None, logging.Logger, Callable[[str], None]]


class Phase:
    """One phase under way: :meth:`step` says which part of it runs (a measurement), :meth:`bytes`
    how far it has come (``convert``'s ``progress(group, done_bytes, total_bytes)``)."""

    def step(self, what: str) -> None:
        """A part of the phase starts (``measure``'s ``progress``)."""

    def bytes(self, group: str, done: int, total: int) -> None:
        """``done`` of ``total`` bytes are through, the last in ``group``."""


class Reporter:
    """Says each phase of a call; the silent one (``progress=False``) says nothing."""

    @contextlib.contextmanager
    def phase(self, title: str) -> Iterator[Phase]:
        """Around one phase; ``title`` says what it does."""
        yield Phase()


class _LinePhase(Phase):
    def __init__(self, emit: Callable[[str], None], title: str, *, steps: bool) -> None:
        self._emit, self._title, self._steps = emit, title, steps

    def step(self, what: str) -> None:
        if self._steps:
            self._emit(f"{self._title}: {what}")


class _Lines(Reporter):
    """A line per phase to ``emit`` (and, with ``steps``, a line per step inside it)."""

    def __init__(self, emit: Callable[[str], None], *, steps: bool) -> None:
        self._emit, self._steps = emit, steps

    @contextlib.contextmanager
    def phase(self, title: str) -> Iterator[Phase]:
        self._emit(title)
        yield _LinePhase(self._emit, title, steps=self._steps)


class _BarPhase(Phase):
    def __init__(self, bar: Progress, task: TaskID, title: str) -> None:
        self._bar, self._task, self._title = bar, task, title
        self.total = 0  # bytes, once a phase reports them

    def step(self, what: str) -> None:
        self._bar.update(self._task, description=f"{self._title}: {what}", refresh=True)

    def bytes(self, group: str, done: int, total: int) -> None:
        self.total = total
        detail = f"{format_bytes(done)} of {format_bytes(total)} ({group})"
        self._bar.update(self._task, completed=done, total=max(total, 1), detail=detail, refresh=True)


class _Bars(Reporter):
    """A rich bar per phase on ``console`` (a terminal), left on screen as one line when it ends."""

    def __init__(self, console: Console) -> None:
        self._console = console

    @contextlib.contextmanager
    def phase(self, title: str) -> Iterator[Phase]:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        columns = (SpinnerColumn(finished_text="[green]done[/]"), TextColumn("{task.description}"), BarColumn(bar_width=24),
                   TextColumn("{task.fields[detail]}"), TimeElapsedColumn())  # fmt: skip
        with Progress(*columns, console=self._console) as bar:
            task = bar.add_task(title, total=None, detail="")
            phase = _BarPhase(bar, task, title)
            yield phase
            bar.update(task, description=title, total=1, completed=1, detail=format_bytes(phase.total) if phase.total else "")


def reporter(progress: ProgressArg, *, name: str, console: Console | None = None) -> Reporter:
    """The :class:`Reporter` ``progress`` asks for (see the module doc); ``name`` starts each plain
    line (``from_pretrained: measuring ...``); ``console`` stands for stderr (the tests' terminal).

    Raises:
        ConfigError: ``progress`` is none of the kinds above.
    """
    if progress is None or progress is False:
        return Reporter()
    if isinstance(progress, logging.Logger):
        logger = progress
        return _Lines(lambda line: logger.info("%s: %s", name, line), steps=True)
    if progress is True:
        from rich.console import Console

        err = console or Console(stderr=True)
        if err.is_terminal:
            return _Bars(err)
        return _Lines(lambda line: print(f"{name}: {line}", file=err.file, flush=True), steps=False)  # err.file: sys.stderr as it is now
    if callable(progress):
        return _Lines(progress, steps=True)
    raise ConfigError(f"progress={progress!r} ({type(progress).__name__}) must be True (a bar on a terminal, else a line per "
                      f"phase on stderr), False (nothing), a logging.Logger, or a callable taking a line of text")
