"""``gds-check`` output: the stable JSON document (:data:`JSON_SCHEMA`) and the rich renderer.

Only this module draws for people (rich is imported inside the render functions). The
JSON document is built from the same typed objects the table shows; its shape is
versioned by ``"schema": "gds-check/1"``: fields are only ever added, and a change to an
existing field bumps the version.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from gds_offload.node.collect import NodeReport
from gds_offload.node.findings import CheckResult
from gds_offload.node.paths import PathProbe
from gds_offload.node.topology import best_affinities
from gds_offload.node.verdict import Verdict

if TYPE_CHECKING:
    from types import TracebackType

    from rich.console import Console

__all__ = [
    "SCHEMA_ID", "EXIT_CODES", "JSON_SCHEMA", "build_document", "render", "format_gbps",
    "BenchProgress",
]

SCHEMA_ID = "gds-check/1"
#: Exit code of ``gds-check`` per verdict (3 is reserved for usage errors).
EXIT_CODES: Mapping[str, int] = {"gds": 0, "compat": 1, "unusable": 2}

_NUM_OR_NULL = {"type": ["number", "null"]}
_INT_OR_NULL = {"type": ["integer", "null"]}
_STR = {"type": "string"}
_STR_LIST = {"type": "array", "items": _STR}
_CHECK = {
    "type": "object",
    "required": ["name", "status", "detail", "hint"],
    "additionalProperties": False,
    "properties": {
        "name": _STR,
        "status": {"enum": ["ok", "warn", "fail", "skip"]},
        "detail": _STR,
        "hint": _STR,
    },
}
_RATE = {
    "type": "object",
    "required": ["write_gbps", "read_gbps"],
    "properties": {
        "write_gbps": _NUM_OR_NULL,
        "read_gbps": _NUM_OR_NULL,
        "engine": _STR,
        "tool": _STR,
        "memory": _STR,
        "label": _STR,
        "error": _STR,
    },
}
_BANDWIDTH = {"type": "object", "additionalProperties": _RATE}

#: JSON Schema (draft 2020-12) of the ``gds-check --json`` document.
JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "gds-check/1",
    "title": "gds-check report",
    "description": (
        "What gds-check found on one node. 'verdict' is the worst over 'paths'; exit code "
        "0 = gds, 1 = compat, 2 = unusable. 'bandwidth' holds the first usable path's figures "
        "(engines gds/compat/posix/host plus raw_o_direct); each path carries its own."
    ),
    "type": "object",
    "required": ["schema", "version", "verdict", "reason", "fix", "exit_code", "checks",
                 "bandwidth", "gpus", "paths", "stack", "recommendations", "needs_root"],
    "additionalProperties": False,
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "version": {"type": "string", "description": "gds_offload version"},
        "verdict": {"enum": ["gds", "compat", "unusable"]},
        "reason": _STR,
        "fix": _STR,
        "exit_code": {"enum": [0, 1, 2]},
        "checks": {"type": "array", "items": _CHECK},
        "bandwidth": _BANDWIDTH,
        "gpus": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "name", "total_memory_bytes", "pci_bus_id", "numa_node"],
                "properties": {
                    "index": {"type": "integer"},
                    "name": _STR,
                    "total_memory_bytes": {"type": "integer"},
                    "pci_bus_id": _STR,
                    "compute_capability": _STR,
                    "numa_node": _INT_OR_NULL,
                    "pci_path": _STR_LIST,
                },
            },
        },
        "paths": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["path", "verdict", "reason", "fix", "exists", "writable", "fstype",
                             "device", "nvme", "o_direct", "free_bytes"],
                "properties": {
                    "path": _STR,
                    "verdict": {"enum": ["gds", "compat", "unusable"]},
                    "reason": _STR,
                    "fix": _STR,
                    "exists": {"type": "boolean"},
                    "would_create": {"type": "boolean", "description": "missing; attach() would create it 0700"},
                    "probed": {"type": "string", "description": "the directory examined: path, or the ancestor it would be created under"},
                    "is_dir": {"type": "boolean"},
                    "writable": {"type": "boolean"},
                    "read_only_mount": {"type": "boolean"},
                    "fstype": _STR,
                    "mountpoint": _STR,
                    "mount_source": _STR,
                    "mount_options": _STR_LIST,
                    "device": {"type": ["string", "null"], "description": "MAJ:MIN, null for virtual filesystems"},
                    "disk": _STR,
                    "members": _STR_LIST,
                    "nvme": {"type": "boolean"},
                    "pci_address": _STR,
                    "pci_path": _STR_LIST,
                    "numa_node": _INT_OR_NULL,
                    "o_direct": {"type": ["boolean", "null"]},
                    "o_direct_detail": _STR,
                    "free_bytes": _INT_OR_NULL,
                    "total_bytes": _INT_OR_NULL,
                    "error": _STR,
                    "bandwidth": _BANDWIDTH,
                },
            },
        },
        "stack": {
            "type": "object",
            "required": ["cuda", "libcufile", "kvikio", "nvidia_fs", "cufile_json", "container", "env"],
            "properties": {
                "cuda": {"type": "object"},
                "libcufile": {"type": "object"},
                "kvikio": {"type": "object"},
                "nvidia_fs": {"type": "object"},
                "cufile_json": {"type": "object"},
                "container": {"type": "object"},
                "env": {"type": "object", "additionalProperties": _STR},
            },
        },
        "recommendations": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["gpu", "path", "disk", "link", "hops"],
                "properties": {
                    "gpu": {"type": "integer"},
                    "path": _STR,
                    "disk": _STR,
                    "link": {"enum": ["PIX", "PXB", "PHB", "NODE", "SYS", "unknown"]},
                    "hops": _INT_OR_NULL,
                },
            },
        },
        "needs_root": {"type": "array", "items": _STR,
                       "description": "files that exist but could not be read without root"},
    },
}


def _path_entry(probe: PathProbe, verdict: Verdict, bandwidth: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    dev = probe.device
    return {
        "path": probe.path,
        "verdict": verdict.mode,
        "reason": verdict.reason,
        "fix": verdict.fix,
        "exists": probe.exists,
        "would_create": probe.would_create,
        "probed": probe.probed,
        "is_dir": probe.is_dir,
        "writable": probe.writable,
        "read_only_mount": probe.read_only_mount,
        "fstype": probe.fstype,
        "mountpoint": probe.mountpoint,
        "mount_source": probe.mount_source,
        "mount_options": list(probe.mount_options),
        "device": dev.dev if dev else None,
        "disk": dev.disk if dev else "",
        "members": list(dev.members) if dev else [],
        "nvme": bool(dev and dev.nvme),
        "pci_address": dev.pci_address if dev else "",
        "pci_path": list(dev.pci_path) if dev else [],
        "numa_node": dev.numa_node if dev else None,
        "o_direct": probe.o_direct,
        "o_direct_detail": probe.o_direct_detail,
        "free_bytes": probe.free_bytes,
        "total_bytes": probe.total_bytes,
        "error": probe.error,
        "bandwidth": {k: dict(v) for k, v in bandwidth.items()},
    }


def _best_per_gpu(report: NodeReport) -> list[dict[str, Any]]:
    return [{"gpu": a.gpu_index, "path": a.path, "disk": a.disk, "link": a.link, "hops": a.hops}
            for a in best_affinities(report.gpu_topology, report.affinities)]


def build_document(
    report: NodeReport,
    verdict: Verdict,
    path_verdicts: Sequence[Verdict],
    *,
    checks: Sequence[CheckResult],
    bandwidth: Sequence[Mapping[str, Mapping[str, Any]]] = (),
    version: str = "",
) -> dict[str, Any]:
    """Build the ``gds-check/1`` JSON document (see :data:`JSON_SCHEMA`).

    Args:
        report: the node facts.
        verdict: the overall verdict (worst over paths).
        path_verdicts: one verdict per ``report.paths`` entry.
        checks: every check to list (node checks once, then each path's).
        bandwidth: per path, ``{engine: {"write_gbps", "read_gbps", ...}}`` (may be shorter
            than the path list, or empty with ``--no-bench``).
        version: the gds_offload version.

    Returns:
        A JSON-serialisable dict.
    """
    topo = {t.index: t for t in report.gpu_topology}
    gpus = []
    for g in report.gpu.gpus:
        t = topo.get(g.index)
        gpus.append(asdict(g) | {"numa_node": t.numa_node if t else None,
                                 "pci_path": list(t.pci_path) if t else []})
    per_path = list(bandwidth) + [{}] * (len(report.paths) - len(bandwidth))
    top_bandwidth = next((b for b in per_path if b), {})
    kv = report.kvikio
    return {
        "schema": SCHEMA_ID,
        "version": version,
        "verdict": verdict.mode,
        "reason": verdict.reason,
        "fix": verdict.fix,
        "exit_code": EXIT_CODES[verdict.mode],
        "checks": [asdict(c) for c in checks],
        "bandwidth": {k: dict(v) for k, v in top_bandwidth.items()},
        "gpus": gpus,
        "paths": [_path_entry(p, v, b) for p, v, b in zip(report.paths, path_verdicts, per_path)],
        "stack": {
            "cuda": {"torch": report.gpu.torch_version, "runtime": report.gpu.cuda_runtime,
                     "driver": report.gpu.cuda_driver, "kernel_module": report.gpu.kernel_driver,
                     "error": report.gpu.error},
            "libcufile": asdict(report.libcufile) | {"searched": list(report.libcufile.searched)},
            "kvikio": asdict(kv) | {"properties": {k: _jsonable(v) for k, v in kv.properties.items()}},
            "nvidia_fs": asdict(report.nvidia_fs),
            "cufile_json": {"path": report.cufile_config.path, "found": report.cufile_config.found,
                            "parsed": report.cufile_config.parsed, "error": report.cufile_config.error,
                            "settings": {k: _jsonable(v) for k, v in report.cufile_config.settings.items()}},
            "container": asdict(report.container),
            "env": dict(report.env),
        },
        "recommendations": _best_per_gpu(report),
        "needs_root": list(report.unreadable),
    }


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
_VERDICT_STYLE = {"gds": "bold green", "compat": "bold yellow", "unusable": "bold red"}


def render(console: "Console", doc: Mapping[str, Any]) -> None:
    """Draw the document as a table of checks, a bandwidth table and the verdict.

    Args:
        console: where to draw.
        doc: from :func:`build_document`.
    """
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"gds-check {doc['version']}", show_lines=False, expand=False)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail (and fix)", overflow="fold")
    for check in doc["checks"]:
        detail = Text(check["detail"])
        if check["hint"] and check["status"] != "ok":
            detail.append("\n-> " + check["hint"], style="cyan")
        table.add_row(check["name"], Text(check["status"], style=_STYLE[check["status"]]), detail)
    console.print(table)
    rows = [(p["path"], engine, rate) for p in doc["paths"] for engine, rate in p["bandwidth"].items()]
    if rows:
        bw = Table(title="measured bandwidth (GB/s)")
        for name in ("path", "engine", "write", "read", "note"):
            bw.add_column(name, justify="right" if name in ("write", "read") else "left")
        for path, engine, rate in rows:
            bw.add_row(path, engine, format_gbps(rate.get("write_gbps")), format_gbps(rate.get("read_gbps")),
                       rate.get("error") or rate.get("label", ""))
        console.print(bw)
    for rec in doc["recommendations"]:
        console.print(f"GPU{rec['gpu']} should spill to {rec['path']} ({rec['disk'] or '?'}, {rec['link']})")
    for path in doc["paths"]:
        if len(doc["paths"]) > 1:
            console.print(Text(f"{path['path']}: {path['verdict']} ({path['reason']})",
                               style=_VERDICT_STYLE[path["verdict"]]))
    if doc["needs_root"]:
        console.print(Text("not readable without root: " + ", ".join(doc["needs_root"]), style="yellow"))
    line = Text()
    line.append(f"verdict: {doc['verdict']}", style=_VERDICT_STYLE[doc["verdict"]])
    line.append(f" (exit {doc['exit_code']}): {doc['reason']}")
    console.print(line)
    console.print(Text(f"fix: {doc['fix']}", style="cyan"))


def format_gbps(value: Any) -> str:
    """A GB/s figure with two decimals, ``-`` when it is missing (the table and the bandwidth check)."""
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"


class BenchProgress:
    """A rich progress bar over the bandwidth measurements (one step per engine and path).

    Example:
        >>> with BenchProgress(console, total=3) as progress:  # doctest: +SKIP
        ...     progress.start("compat @ /mnt/nvme")
        ...     progress.advance()
    """

    def __init__(self, console: "Console", total: int) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        # Built here, drawn from __enter__ on: a task added before the display starts is shown once it does.
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                  console=console, transient=False)
        self._task = self._progress.add_task("bandwidth", total=total)

    def __enter__(self) -> "BenchProgress":
        self._progress.__enter__()
        return self

    def start(self, label: str) -> None:
        """Show what is being measured now."""
        self._progress.update(self._task, description=f"measuring {label}")

    def advance(self) -> None:
        """Mark one measurement done."""
        self._progress.advance(self._task)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._progress.update(self._task, description="bandwidth measured")
        self._progress.__exit__(exc_type, exc, tb)
