"""The fenced code blocks of the project's Markdown files, and what each needs to run.

A block is marked by an HTML comment on the line right above its fence:

* ``<!-- needs: cuda -->`` (or ``gpus``, ``gds``, ...): it needs hardware; the test skips it,
  naming what it needs, where that is missing;
* ``<!-- run: ci -->``: the set-up and test commands, which the suite cannot run inside itself; it checks that ``.ci/run`` runs them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "code_blocks"]

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(needs|run):\s*([\w ,-]+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, text, where it starts, and its marks."""

    path: Path
    line: int
    lang: str
    text: str
    needs: tuple[str, ...] = ()
    run: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` (a Markdown file), in order."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        mark = _MARK.match(lines[start - 1]) if start else None
        needs = tuple(w.strip() for w in mark.group(2).split(",")) if mark and mark.group(1) == "needs" else ()
        run = mark.group(2) if mark and mark.group(1) == "run" else ""
        out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n", needs, run))
        i = j + 1
    return out
