"""``gds-check``: probe the node, build a typed report, render it, exit with the verdict.

Exit codes: 0 ``gds`` (direct path), 1 ``compat`` (bounce buffer or CPU), 2 ``unusable``,
3 usage error. With several ``--path`` the worst verdict decides.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, NoReturn, Sequence

from gds_offload._version import __version__
from gds_offload.bench.procs import Terminated, stop_signals
from gds_offload.check.rank_map import show_ranks
from gds_offload.check.report import EXIT_CODES, BenchProgress, build_document, format_gbps, render
from gds_offload.cli import stopped
from gds_offload.io.directory import Origin, spill_dir_origin
from gds_offload.io.layout import ALIGN
from gds_offload.node.collect import NodeReport, collect_node
from gds_offload.node.findings import CheckResult
from gds_offload.node.verdict import Verdict, decide, report_checks, worst_verdict
from gds_offload.units import parse_bytes

__all__ = ["main", "build_parser", "bench_engines", "measure_bandwidth", "DEFAULT_SIZE_BYTES"]

#: Bytes written then read per engine by the bandwidth measurement.
DEFAULT_SIZE_BYTES = 256 << 20
#: Size of one transfer in the bandwidth measurement (capped at the total).
BENCH_TENSOR_BYTES = 16 << 20
USAGE_EXIT = 3


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors exit 3 (2 means ``unusable``)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message}\n")


def _size(text: str) -> int:
    try:
        value = parse_bytes(text, name="--size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < ALIGN:
        raise argparse.ArgumentTypeError(f"--size={text!r} is below {ALIGN} bytes; pass e.g. 256MiB")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--timeout={text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--timeout={text!r} must be > 0 seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``gds-check`` argument parser."""
    parser = _Parser(
        prog="gds-check",
        description="Check whether this node can offload activations to NVMe through GPUDirect Storage.",
        epilog="exit codes: 0 gds (direct path), 1 compat (bounce buffer or CPU), 2 unusable, 3 usage error. "
               "Default path: $GDS_OFFLOAD_DIR, else <tmp>/gds_offload-<uid>. Nothing is created or changed: "
               "a directory is judged as attach() judges it.",
    )
    parser.add_argument("--path", metavar="DIR", action="extend", nargs="+", default=[],
                        help="spill directory to check (repeatable; several for multi-drive nodes)")
    parser.add_argument("--json", action="store_true", help="print the gds-check/1 JSON document instead of a table")
    parser.add_argument("--no-bench", action="store_true", help="skip the bandwidth measurement")
    parser.add_argument("--size", metavar="BYTES", type=_size, default=DEFAULT_SIZE_BYTES,
                        help="bytes written and read per engine when measuring (default 256MiB; units allowed)")
    parser.add_argument("--timeout", metavar="SECONDS", type=_positive, default=10.0,
                        help="limit for the child process that opens the cuFile driver (default 10)")
    parser.add_argument("--no-driver-probe", action="store_true",
                        help="do not open the cuFile driver (it can hang on a broken install)")
    parser.add_argument("--root", metavar="DIR", type=Path, default=Path("/"),
                        help="read /proc, /sys, /etc, /dev, /run under DIR (chroots, tests)")
    # --ranks: gds_offload/check/rank_map.py
    parser.add_argument("--ranks", metavar="N", nargs="?", type=int, const=0, default=None,
                        help="show the spill directory of each of N local ranks (default: LOCAL_WORLD_SIZE, else one per GPU); "
                             "--path may be a {local_rank}/{rank} template or 'auto'")
    return parser


def bench_engines(report: NodeReport, verdict: Verdict) -> tuple[str, ...]:
    """The engines worth measuring at a path: gds (when the verdict is gds), compat
    (KvikIO importable), posix (always), host (when a GPU is present)."""
    engines: list[str] = []
    if verdict.mode == "gds":
        engines.append("gds")
    if report.kvikio.importable:
        engines.append("compat")
    engines.append("posix")
    if report.gpu.available:
        engines.append("host")
    return tuple(engines)


def bandwidth_rate(result: Mapping[str, Any], engine: str) -> dict[str, Any]:
    out: dict[str, Any] = {"engine": str(result.get("engine", engine))}
    for key in ("write_gbps", "read_gbps"):
        value = result.get(key)
        out[key] = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if isinstance(result.get("tool"), str):
        out["tool"] = result["tool"]  # raw_direct_bandwidth says which tool measured (fio, dd)
    for key in ("memory", "label"):  # measure_engine: host or cuda:N buffers, and what the figure is of
        if isinstance(result.get(key), str):
            out[key] = result[key]
    return out


def measure_bandwidth(
    report: NodeReport,
    verdicts: Sequence[Verdict],
    *,
    size_bytes: int,
    progress_console: Any,
) -> tuple[list[dict[str, dict[str, Any]]], CheckResult]:
    """Measure write/read GB/s per engine and a raw O_DIRECT figure at each usable path.

    Uses ``gds_offload.bench.io.measure_engine`` and ``raw_direct_bandwidth``;
    when that module is missing the check is ``skip`` with the import error.

    Args:
        report: the node facts.
        verdicts: one per path.
        size_bytes: bytes written then read per engine.
        progress_console: rich console for the progress bar.

    Returns:
        Per path ``{engine: {write_gbps, read_gbps, ...}}`` and the ``bandwidth`` check.
    """
    try:
        from gds_offload.bench import io as io_bench

        measure = io_bench.measure_engine
        raw = io_bench.raw_direct_bandwidth
    except Exception as exc:  # noqa: BLE001 - a missing benchmark is a skip, not a crash
        return [], CheckResult("bandwidth", "skip",
                               f"gds_offload.bench.io unavailable ({type(exc).__name__}: {exc})")
    plan: list[tuple[int, str]] = []
    skipped: list[str] = []
    for i, (probe, verdict) in enumerate(zip(report.paths, verdicts)):
        if verdict.mode == "unusable":
            skipped.append(f"{probe.path} unusable")
            continue
        if not probe.exists:
            skipped.append(f"{probe.path} missing (attach would create it)")
            continue
        if probe.free_bytes is not None and probe.free_bytes < 2 * size_bytes:
            skipped.append(f"{probe.path} has under 2x --size free")
            continue
        plan.extend((i, e) for e in bench_engines(report, verdict))
        if probe.o_direct:
            plan.append((i, "raw_o_direct"))
    results: list[dict[str, dict[str, Any]]] = [{} for _ in report.paths]
    errors: list[str] = []
    tensor_bytes = min(BENCH_TENSOR_BYTES, size_bytes)
    with BenchProgress(progress_console, total=len(plan)) as progress:
        for i, engine in plan:
            path = Path(report.paths[i].path)
            progress.start(f"{engine} @ {path}")
            try:
                if engine == "raw_o_direct":
                    rate = bandwidth_rate(raw(path, size_bytes), engine)
                else:
                    rate = bandwidth_rate(measure(engine, path, size_bytes, tensor_bytes), engine)
            except Exception as exc:  # noqa: BLE001 - one engine failing is a finding
                rate = {"engine": engine, "write_gbps": None, "read_gbps": None,
                        "error": f"{type(exc).__name__}: {exc}"}
                errors.append(f"{engine} @ {path}: {rate['error']}")
            results[i][engine] = rate
            progress.advance()
    return results, bandwidth_check(report, results, errors, skipped, size_bytes)


def bandwidth_check(report: NodeReport, results: list[dict[str, dict[str, Any]]], errors: list[str],
                     skipped: list[str], size_bytes: int) -> CheckResult:
    parts = []
    for probe, rates in zip(report.paths, results):
        shown = [f"{e} W {format_gbps(r['write_gbps'])} / R {format_gbps(r['read_gbps'])}"
                 + (f" ({r['label']})" if r.get("label") else "")
                 for e, r in rates.items() if "error" not in r]
        if shown:
            prefix = f"{probe.path}: " if len(report.paths) > 1 else ""
            parts.append(prefix + "; ".join(shown) + " GB/s")
    detail = " | ".join(parts) or "nothing measured"
    detail += f" ({size_bytes >> 20} MiB per engine)"
    if skipped:
        detail += "; skipped " + ", ".join(skipped)
    if errors:
        return CheckResult("bandwidth", "warn", detail + "; failed: " + "; ".join(errors),
                           "see the error; gds-offload bench-io reproduces one engine")
    return CheckResult("bandwidth", "ok" if parts else "skip", detail)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gds-check``.

    Args:
        argv: arguments (``sys.argv[1:]`` when None).

    Returns:
        0 ``gds``, 1 ``compat``, 2 ``unusable`` (3 on usage errors, through ``SystemExit``);
        128 + the signal number when stopped (130: Ctrl-C), after one line on stderr.
    """
    args = build_parser().parse_args(argv)
    import signal

    try:
        with stop_signals():
            return _run(args)
    except KeyboardInterrupt:
        return stopped("gds-check", signal.SIGINT)
    except Terminated as exc:
        return stopped("gds-check", exc.signum)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.ranks is not None:  # gds_offload/check/rank_map.py

        return show_ranks(args.path, args.ranks, json_out=args.json, root=args.root)
    env = os.environ
    origin: Origin
    if args.path:
        paths, origin = [Path(p) for p in args.path], "--path"
    else:
        default, origin = spill_dir_origin(env)
        paths = [default]
    report = collect_node(paths, root=args.root, env=env, probe_driver=not args.no_driver_probe,
                          timeout_s=args.timeout, origin=origin)
    verdicts = [decide(report, i) for i in range(len(paths))]
    overall = worst_verdict(verdicts)
    checks = list(report_checks(report))
    bandwidth: list[dict[str, dict[str, Any]]] = []
    if not args.no_bench:
        bandwidth, check = measure_bandwidth(report, verdicts, size_bytes=args.size,
                                             progress_console=Console(stderr=True))
        checks.append(check)
    doc = build_document(report, overall, verdicts, checks=checks, bandwidth=bandwidth, version=__version__)
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render(Console(), doc)
    return EXIT_CODES[overall.mode]


if __name__ == "__main__":
    sys.exit(main())
