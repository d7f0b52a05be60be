"""Measure committed results again, one after another, on the commit checked out here: each
result file's recorded ``command``, its ``--out`` pointed at the file itself; then
``gds-offload report`` regenerates the page and the README's headline table.

    python scripts/remeasure.py activations        # every result of `gds-offload bench` (the activation half)
    python scripts/remeasure.py weights            # bench-weights, bench-finetune, bench-plan
    python scripts/remeasure.py docs/results/dedup-gpt2.json ...

Run it on a quiet machine: the results' time ratios are taken within each run, but a run beside
other work takes longer and spreads more. ``--dry-run`` prints the commands.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
#: Which subcommands' results each group reruns.
GROUPS = {"activations": ("bench",), "weights": ("bench-weights", "bench-finetune", "bench-plan")}


def _command(result: Path) -> list[str]:
    """The recorded command of ``result``, writing to ``result`` itself."""
    data = json.loads(result.read_text())
    words = shlex.split(data["command"])
    if words[:1] != ["gds-offload"]:
        raise SystemExit(f"{result}: its command does not start with gds-offload: {data['command']}")
    out = [_program(), *words[1:]]
    if "--out" in out:
        out[out.index("--out") + 1] = str(result)
    else:
        out += ["--out", str(result)]
    return out


def _program() -> str:
    """``gds-offload`` of this interpreter's environment (the one ``scripts/setup.sh`` made), else on PATH."""
    here = Path(sys.executable).parent / "gds-offload"
    return str(here) if here.is_file() else (shutil.which("gds-offload") or "gds-offload")


def _selected(names: list[str]) -> list[Path]:
    chosen: list[Path] = []
    for name in names:
        if name in GROUPS:
            for f in sorted(RESULTS.glob("*.json")):
                words = shlex.split(json.loads(f.read_text()).get("command", ""))
                if words[1:2] and words[1] in GROUPS[name]:
                    chosen.append(f)
        else:
            path = Path(name)
            if not path.is_file():
                raise SystemExit(f"{name}: neither a group ({', '.join(GROUPS)}) nor a result file")
            chosen.append(path.resolve())
    return chosen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="+", help=f"a group ({', '.join(GROUPS)}) or result files")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args()
    results = _selected(args.what)
    for i, result in enumerate(results, 1):
        cmd = _command(result)
        print(f"[{i}/{len(results)}] {shlex.join(cmd)}", flush=True)
        if not args.dry_run:
            done = subprocess.run(cmd, cwd=REPO)
            if done.returncode != 0:
                print(f"{result.name}: exit {done.returncode}; the results after it were not measured again", file=sys.stderr)
                return done.returncode
    if not args.dry_run:
        return subprocess.run([_program(), "report"], cwd=REPO).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
