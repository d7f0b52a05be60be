"""``gds-check --ranks [N]``: the spill directory each local rank of this node would use.

Builds the placements with :func:`gds_offload.activations.spill.ranks.node_placements` (the same code
``attach()`` runs in each rank), then renders them as a table or, with ``--json``, as a
list of objects. Creates nothing.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gds_offload.activations.spill.ranks import node_placements
from gds_offload.errors import ConfigError
from gds_offload.node.system import probe_gpus

__all__ = ["local_world_size", "rank_rows", "show_ranks"]


def local_world_size(requested: int | None, env: Mapping[str, str], root: Path) -> int:
    """``requested`` when given (> 0), else ``LOCAL_WORLD_SIZE``/``SLURM_NTASKS_PER_NODE``, else the GPU count, else 1."""
    if requested:
        return requested
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        text = env.get(name, "").split("(")[0]
        if text.isdigit() and int(text) > 0:
            return int(text)

    return max(1, len(probe_gpus(root).gpus))


def _path_argument(paths: Sequence[str]) -> Any:
    """``--path`` values as ``attach(path=...)`` would get them: none (default), one, or a stripe."""
    if not paths:
        return None
    return paths[0] if len(paths) == 1 else list(paths)


def rank_rows(paths: Sequence[str], nproc: int | None, *, env: Mapping[str, str] | None = None,
              root: Path = Path("/")) -> list[dict[str, Any]]:
    """One row per local rank: ``rank``, ``local_rank``, ``gpu``, ``paths``, ``how``.

    Raises:
        ConfigError: a path the ranks cannot resolve (the message says why).
    """

    env = os.environ if env is None else env
    n = local_world_size(nproc, env, root)
    return [
        {"rank": p.rank, "local_rank": p.local_rank, "gpu": p.gpu, "paths": [str(d) for d in p.paths], "how": p.how}
        for p in node_placements(_path_argument(paths), n, env, root=root)
    ]


def show_ranks(paths: Sequence[str], nproc: int | None, *, json_out: bool, root: Path) -> int:
    """Print the mapping; 0, or 3 (usage error) when the paths cannot be resolved."""
    from rich.console import Console
    from rich.table import Table

    try:
        rows = rank_rows(paths, nproc, root=root)
    except ConfigError as exc:
        print(f"gds-check --ranks: {exc}", file=sys.stderr)
        return 3
    if json_out:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    table = Table(title=f"spill directory per rank ({len(rows)} local rank{'s' if len(rows) != 1 else ''})",
                  title_justify="left")
    for col in ("local rank", "rank", "GPU", "spill directory", "chosen by"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["local_rank"]), str(r["rank"]), "-" if r["gpu"] is None else str(r["gpu"]),
                      "\n".join(r["paths"]), r["how"])
    Console().print(table)
    return 0
