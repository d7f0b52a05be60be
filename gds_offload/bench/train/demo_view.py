"""``gds-offload demo``'s display: the runs' progress as they go, and the comparison at the end.

On a terminal each run is a table redrawn in place (:class:`LiveView`, rich's ``Live``); off a
terminal (a pipe, a log file, CI) every setup and step is one plain line, printed as it happens
(:class:`LineView`), so a log shows progress at once and a stop signal's line starts on a line
of its own. :func:`render_summary` is the keep-vs-offload table, :func:`io_hidden_fraction` the
share of the drive's busy time the training thread did not wait for.
"""
from __future__ import annotations

import contextlib
import statistics
from collections import deque
from collections.abc import Iterator
from typing import Any

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from gds_offload.bench.train.spec import paired_ratios
from gds_offload.units import format_bytes

__all__ = ["PAIRED_NOTE", "LineView", "LiveView", "io_hidden_fraction", "make_view", "render_summary", "summary_notes"]

#: Steps a live table shows.
_HISTORY = 12
#: What a "paused" step is, in one line of at most 80 columns.
PAIRED_NOTE = "(paused): the offloader paused for that step, paired with an offloaded one"


def _phase(ev: dict[str, Any], offloading: bool) -> str:
    """A step's phase as the display names it: warm-up, keep, offload (an offloaded step), paused."""
    phase = str(ev.get("phase", ""))
    if phase == "measure":
        return "offload" if offloading else "keep"
    return {"warmup": "warm-up"}.get(phase, phase)


def _engine_line(setup: dict[str, Any]) -> str:
    """What a run's ``setup`` event says of its engine."""
    if setup.get("engine"):
        return f"engine {setup['engine']} ({'GDS in use' if setup.get('gds') else 'no GDS'}): {setup.get('engine_reason', '')}"
    return "no offloader" if setup else "starting..."


class LiveView:
    """The display on a terminal: which run, its engine, and its last steps, redrawn in place.

    Use: ``with view.run(label):`` around each run, passing :meth:`on_event` as the run's
    ``on_event``; each run's last frame stays on screen."""

    def __init__(self, console: Console, title: str) -> None:
        self.console, self.title = console, title
        self.label = ""
        self.setup: dict[str, Any] = {}
        self.rows: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        self.live: Live | None = None

    @contextlib.contextmanager
    def run(self, label: str) -> Iterator[None]:
        self.label, self.setup = label, {}
        self.rows.clear()
        with Live(self.render(), console=self.console, refresh_per_second=4) as live:
            self.live = live
            try:
                yield
            finally:
                self.live = None

    def on_event(self, ev: dict[str, Any]) -> None:
        if ev.get("event") == "setup":
            self.setup = ev
        elif ev.get("event") == "step":
            self.rows.append(ev)
        if self.live is not None:
            self.live.update(self.render())

    def render(self) -> Table:
        """The run's last steps, in 80 columns: no cell is cut."""
        offloading = bool(self.setup.get("engine"))
        table = Table(title=f"{self.title}\n[bold]{self.label}[/]: {_engine_line(self.setup)}", title_justify="left",
                      box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), collapse_padding=True)  # fmt: skip
        for col in ("step", "phase", "loss", "time", "RSS", "held", "peak held", "GB/s w/r"):
            table.add_column(col, justify="left" if col == "phase" else "right", no_wrap=True)
        for ev in self.rows:
            o = ev.get("offload") or {}
            table.add_row(
                str(ev["step"] + 1),
                _phase(ev, offloading),
                f"{ev['loss']:.6f}",
                f"{ev['step_s']:.2f} s",
                format_bytes(ev.get("rss_bytes")),
                format_bytes(o.get("resident_bytes")) if o else "-",
                format_bytes(o.get("peak_resident_bytes")) if o else "-",
                f"{o['write_gbps']:.1f}/{o['read_gbps']:.1f}" if o else "-",
            )
        if any(ev.get("phase") == "paused" for ev in self.rows):
            table.caption, table.caption_justify = PAIRED_NOTE, "left"
        return table


def io_hidden_fraction(offload: dict[str, Any]) -> float | None:
    """``1 - io_wait_s / (write_s + read_s)``, clamped to [0, 1]; None without I/O."""
    busy = offload.get("write_s", 0.0) + offload.get("read_s", 0.0)
    if busy <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - offload.get("io_wait_s", 0.0) / busy))


def render_summary(keep: Any, off: Any, agree: bool | None) -> Any:
    """The keep-vs-offload table, in 80 columns."""
    table = Table(title="demo summary", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("")
    table.add_column("keep", justify="right")
    table.add_column(f"{off.mode}" if off else "offload", justify="right")
    table.add_column("ratio", justify="right")

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "-"

    k_ok = keep is not None and keep.status == "ok"
    o_ok = off is not None and off.status == "ok"
    k_step = keep.median_step_s if k_ok else None
    o_step = off.median_step_s if o_ok else None
    table.add_row("step time (median)", f"{k_step:.3f} s" if k_step else "-", f"{o_step:.3f} s" if o_step else "-", ratio(o_step, k_step))
    pairs = paired_ratios(off) if o_ok else []
    if pairs:
        table.add_row(f"offloaded / paused, {len(pairs)} pair{'' if len(pairs) == 1 else 's'}", "", "", f"{statistics.median(pairs):.2f}x")
    waits = [statistics.median(r.input_wait_s) if ok and r.input_wait_s else None for r, ok in ((keep, k_ok), (off, o_ok))]
    table.add_row("input wait (median)", *(f"{w:.4f} s" if w is not None else "-" for w in waits), "")
    k_mem = keep.peak_activation_bytes if k_ok else None
    o_mem = off.peak_activation_bytes if o_ok else None
    table.add_row("peak activation memory", format_bytes(k_mem), format_bytes(o_mem), ratio(o_mem, k_mem))
    stats = (off.offload or {}) if o_ok else {}
    steps = max(1, stats.get("steps", 0))
    if stats:
        table.add_row("offloader's peak held", "", format_bytes(stats["peak_resident_bytes"]), "")
        for name in ("bytes_packed", "bytes_offloaded", "bytes_deduplicated", "bytes_forwarded", "bytes_read", "bytes_kept"):
            table.add_row(f"{name.removeprefix('bytes_')} per step", "", format_bytes(stats[name] / steps), "")
        hidden = io_hidden_fraction(stats)
        table.add_row("I/O wait per step", "", f"{stats['io_wait_s'] / steps:.3f} s", "")
        table.add_row("I/O hidden behind compute", "", "-" if hidden is None else f"{hidden:.0%}", "")
        table.add_row("engine", "", f"{stats['engine']} ({'GDS' if stats['gds'] else 'no GDS'})", "")
    table.add_row("loss curves agree", "", "-" if agree is None else "[green]yes[/]" if agree else "[red]NO[/]", "bit-identical")
    return table


def summary_notes(off: Any, min_bytes: int) -> list[str]:
    """What the summary's figures need said: the paired steps, and why nothing moved when nothing did
    (``min_bytes``: the run's floor on the size of a storage to offload)."""
    notes = []
    if off is not None and off.status == "ok" and paired_ratios(off):
        notes.append("offloaded / paused: the offload run alternates steps with the offloader attached and paused, seconds "
                     "apart in one process; on a shared machine that ratio is steadier than the step-time ratio.")
    stats = (off.offload or {}) if off is not None and off.status == "ok" else {}
    steps = max(1, stats.get("steps", 0))
    if stats and stats.get("bytes_packed") and not stats.get("bytes_offloaded"):
        small = stats.get("bytes_small", 0)
        why = (f"every saved tensor was smaller than min_bytes ({format_bytes(min_bytes)})" if small >= stats["bytes_packed"] - stats.get("bytes_deduplicated", 0)
               else f"{format_bytes(small / steps)} of it in tensors smaller than min_bytes ({format_bytes(min_bytes)}), the rest in the last layer (keep_last)")  # fmt: skip
        notes.append(f"Nothing was offloaded: the {format_bytes(stats['bytes_packed'] / steps)} saved per step stayed in memory: {why}, "
                     f"so memory and step time barely differ from keep. Pass --min-bytes 0 to offload small tensors too, "
                     f"or leave out --hidden, --seq and --batch for the demo's own sizes.")  # fmt: skip
    return notes


class LineView:
    """The display off a terminal (a pipe, a log file, CI): one plain line per run, setup and
    step, printed as it happens (as pip and pytest do there), never a redrawn table."""

    def __init__(self, console: Console, title: str) -> None:
        self.console, self.title = console, title
        self.label = ""
        self.said_paired = False
        self.console.print(title, markup=False, highlight=False)

    @contextlib.contextmanager
    def run(self, label: str) -> Iterator[None]:
        self.label = label
        self.console.print(f"{label}: starting", markup=False, highlight=False)
        yield

    def on_event(self, ev: dict[str, Any]) -> None:
        if ev.get("event") == "setup":
            line = f"{self.label}: {_engine_line(ev)}"
        elif ev.get("event") == "step":
            o = ev.get("offload") or {}
            if ev.get("phase") == "paused" and not self.said_paired:
                self.said_paired = True
                self.console.print(PAIRED_NOTE, markup=False, highlight=False)
            line = (f"{self.label}: step {ev['step'] + 1} ({_phase(ev, bool(o))}) loss {ev['loss']:.6f}, {ev['step_s']:.2f} s, "
                    f"RSS {format_bytes(ev.get('rss_bytes'))}")
            if o:
                line += (f", resident {format_bytes(o.get('resident_bytes'))} (peak {format_bytes(o.get('peak_resident_bytes'))}), "
                         f"write {o['write_gbps']:.2f} GB/s, read {o['read_gbps']:.2f} GB/s")
        else:
            return
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)


def make_view(console: Console, title: str) -> LiveView | LineView:
    """:class:`LiveView` on a terminal, else :class:`LineView`."""
    return LiveView(console, title) if console.is_terminal else LineView(console, title)
