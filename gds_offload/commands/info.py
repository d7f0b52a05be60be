"""``gds-offload info``: which engine ``mode="auto"`` picks on this machine, and why."""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from gds_offload import __version__
from gds_offload.errors import ConfigError
from gds_offload.io.directory import Origin, spill_dir_origin
from gds_offload.io.spill import SpillStore

HELP = "show which storage engine mode='auto' picks here, and why"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", type=Path, default=None, help="spill directory (default: $GDS_OFFLOAD_DIR or <tmp>/gds_offload-<uid>)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def collect(path: Path | None) -> dict[str, object]:
    """The facts ``info`` shows, as a plain dict."""
    import torch

    from gds_offload.io.factory import make_engine
    from gds_offload.io.kvikio.engine import kvikio_status
    from gds_offload.node.choice import choose_engine

    origin: Origin
    path, origin = (path, "--path") if path else spill_dir_origin()
    choice = choose_engine("auto", path)
    engine = make_engine(choice.engine, strict=choice.strict)
    try:
        store = SpillStore([path] if engine.needs_files else [], create=True, origin=origin)
        spill = store.files[0]
        spill_note = ("O_DIRECT" if spill.direct else "buffered") + (f" ({spill.note})" if spill.note else "")
        store.close()
    finally:
        engine.close()
    kvik_ok, kvik_why = kvikio_status()
    return {
        "gds_offload": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "kvikio": kvik_why if kvik_ok else f"unavailable: {kvik_why}",
        "path": str(path),
        "spill_file": spill_note,
        "engine": choice.engine,
        "engine_description": engine.description,
        "gds": engine.uses_gds,
        "reason": choice.reason,
        "engine_for_cpu_models": choose_engine("auto", path, "cpu").engine,
    }


def run(args: argparse.Namespace) -> int:
    try:
        facts = collect(args.path)
    except ConfigError as exc:
        print(f"gds-offload info: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gds-offload info", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in facts.items():
        table.add_row(k, str(v))
    Console().print(table)
    return 0
