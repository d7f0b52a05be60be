"""``gds-offload report``: regenerate ``docs/performance.md``, and the README's headline results, from ``docs/results/*.json``."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from gds_offload.bench.docs.headline import render_headline, splice
from gds_offload.bench.docs.report import Section, load_sections, render_page
from gds_offload.bench.docs.stale import freshness

_DEFAULTS = {"--results": "docs/results", "--out": "docs/performance.md", "--readme": "README.md"}
HELP = "regenerate the performance page (docs/performance.md) from the result files in docs/results/"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", default=_DEFAULTS["--results"], help="directory of result files (default: docs/results)")
    p.add_argument("--out", default=_DEFAULTS["--out"], help="the page to write (default: docs/performance.md)")
    p.add_argument("--readme", default=_DEFAULTS["--readme"], help="the README whose headline results to rewrite between their markers (default: README.md; '' for none)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the page or the README's headline is not what the result files give, "
                        "or if a result is stale: measured at a commit older than the last change to the code it measures")
    p.add_argument("--ignore-stale", action="store_true",
                   help="with --check: list stale results but do not fail on them (the page's own check alone)")


def _report_stale(sections: list[Section], results: Path) -> bool:
    """Print (on stderr) each result measured before the last change to the code it measures,
    and those that could not be checked; True when one is stale."""
    checked = freshness(sections, results)
    stale = [f for f in checked if f.stale]
    for f in stale + [f for f in checked if f.unchecked]:
        print(f"gds-offload report: {f.line()}", file=sys.stderr)
    return bool(stale)


def run(args: argparse.Namespace) -> int:

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
    outputs = {out: page}
    if args.readme:
        readme = Path(args.readme)
        try:
            link = os.path.relpath(out, readme.parent)
            outputs[readme] = splice(readme.read_text(), render_headline(sections, link))
        except (OSError, ValueError) as exc:
            print(f"gds-offload report: --readme {readme}: {exc}", file=sys.stderr)
            return 2
    stale_results = _report_stale(sections, results)
    if args.check:
        outdated = [str(p) for p, text in outputs.items() if (p.read_text() if p.exists() else "") != text]
        if outdated:
            given = "".join(" " + shlex.quote(word) for word in _given(args))
            print(f"gds-offload report: {', '.join(outdated)} out of date; run `gds-offload report{given}`", file=sys.stderr)
        return 1 if outdated or (stale_results and not args.ignore_stale) else 0
    for p, text in outputs.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    print(f"{out}: {len(sections)} result file(s)" + (f"; headline results in {args.readme}" if args.readme else ""))
    return 0


def _given(args: argparse.Namespace) -> list[str]:
    """The flags given other than ``--check``: the command that rewrites what ``--check`` compared."""
    values = {"--results": args.results, "--out": args.out, "--readme": args.readme}
    return [word for flag, value in values.items() if value != _DEFAULTS[flag] for word in (flag, value)]
