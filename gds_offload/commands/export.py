"""``gds-offload export``: a weight store -> a sharded safetensors checkpoint ``transformers`` loads as is.

Examples::

    gds-offload export /mnt/nvme0/llama-store ./llama-out                   # shards of at most 2 GiB
    gds-offload export /mnt/nvme0/s /mnt/nvme1/s --out ./out --shard-size 500MB   # a striped store

Exit status: 0 written, 1 a checksum mismatch (the layer is named; nothing is left in OUT),
2 anything else, in one line: OUT holds files, no store, a damaged or untrusted one, an I/O error.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gds_offload.commands.convert import ByteBar, one_line
from gds_offload.errors import ConfigError, OffloadError
from gds_offload.units import format_bytes

HELP = "write a weight store back as a sharded safetensors checkpoint (with its config) that transformers loads"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                   help="STORE OUT, or the striped store's directories with --out OUT")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="the new or empty directory to write (default: the last PATH)")
    p.add_argument("--shard-size", default="2GiB", help="largest shard, e.g. 2GiB or 500MB (a layer is never split; default 2GiB)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from gds_offload.weights import StoreCorruptError
    from gds_offload.weights.store.export import export

    if args.out is None and len(args.paths) < 2:
        print("gds-offload export: give STORE OUT (or the store's directories and --out OUT)", file=sys.stderr)
        return 2
    stores, out = (args.paths, args.out) if args.out is not None else (args.paths[:-1], args.paths[-1])
    try:
        with ByteBar("exporting", quiet=args.json) as bar:
            e = export([str(s) for s in stores] if len(stores) > 1 else stores[0], out, shard_bytes=args.shard_size, progress=bar)
    except StoreCorruptError as exc:
        print(f"gds-offload export: FAILED, nothing written: {one_line(str(exc))}", file=sys.stderr)
        return 1
    except (ConfigError, OffloadError) as exc:
        print(f"gds-offload export: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"gds-offload export: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    result = {"out": str(e.out), "shards": list(e.shards), "tensors": e.tensors, "nbytes": e.nbytes, "seconds": round(e.seconds, 3)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"exported {', '.join(map(str, stores))} -> {e.out}: {e.tensors} tensors, {format_bytes(e.nbytes)} "
              f"in {len(e.shards)} shard(s), {e.seconds:.2f} s")  # fmt: skip
    return 0
