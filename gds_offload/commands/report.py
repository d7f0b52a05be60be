"""``gds-offload report``: regenerate ``docs/performance.md`` from ``docs/results/*.json``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "regenerate the performance page (docs/performance.md) from the result files in docs/results/"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", default="docs/results", help="directory of result files (default: docs/results)")
    p.add_argument("--out", default="docs/performance.md", help="the page to write (default: docs/performance.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is not what the result files give")


def run(args: argparse.Namespace) -> int:
    from gds_offload.bench.report import load_sections, render_page

    results, out = Path(args.results), Path(args.out)
    if not results.is_dir():
        print(f"gds-offload report: --results {results} is not a directory; run it from the repository root", file=sys.stderr)
        return 2
    try:
        sections = load_sections(results)
    except ValueError as exc:
        print(f"gds-offload report: {exc}", file=sys.stderr)
        return 2
    page = render_page(sections, out.parent, command="gds-offload report")
    if args.check:
        current = out.read_text() if out.exists() else ""
        if current != page:
            print(f"gds-offload report: {out} is out of date; run gds-offload report", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"{out}: {len(sections)} result file(s)")
    return 0
