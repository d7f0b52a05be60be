"""``gds-offload convert``: a safetensors checkpoint -> a weight store laid out for GPUDirect Storage.

Examples::

    gds-offload convert ./llama-ckpt /mnt/nvme0/llama-store           # convert
    gds-offload convert ./llama-ckpt /mnt/nvme0/llama-store --check   # convert, then re-read every checksum
    gds-offload convert --check /mnt/nvme0/llama-store                # check an existing store only
    gds-offload convert ./ckpt /mnt/nvme0/s /mnt/nvme1/s              # stripe layers over two drives

Exit status: 0 done (and checked), 1 a checksum mismatch (the layer is named), 2 anything
else, in one line naming the file and the problem: a usage or input error (no checkpoint, a
damaged one, an output directory that holds other files), no room (nothing was written, or,
when the drive filled up meanwhile, nothing was left), a damaged or untrusted store, an I/O error.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gds_offload.errors import ConfigError, OffloadError
from gds_offload.units import format_bytes

HELP = "convert a safetensors checkpoint into an aligned weight store (--check: verify every layer's checksum)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                   help="CHECKPOINT OUT [OUT2 ...] (OUT2...: stripe layers over more drives); with --check and one PATH: the store to check")  # fmt: skip
    p.add_argument("--check", action="store_true", help="re-read the store and check every group's xxh3-64 checksum")
    p.add_argument("--layer-prefix", default=None, help="module path of the repeated blocks, e.g. model.layers (default: found from the names)")
    p.add_argument("--tensor-align", type=int, default=256, help="alignment of tensors inside a layer, in bytes (divides 4096; default 256: what cuBLASLt looks at)")
    p.add_argument("--force", action="store_true", help="replace a store already in OUT")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


class ByteBar:
    """A rich bar on stderr, in bytes, for ``convert``'s and ``verify_store``'s ``progress``; drawn only on a terminal."""

    def __init__(self, label: str, *, quiet: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        console = Console(stderr=True)
        self._bar = Progress(TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                             TextColumn("{task.description}"), console=console, transient=True, disable=quiet or not console.is_terminal)  # fmt: skip
        self._task = self._bar.add_task("", total=None)

    def __enter__(self) -> ByteBar:
        self._bar.__enter__()
        return self

    def __call__(self, group: str, done: int, total: int) -> None:
        self._bar.update(self._task, completed=done, total=total, description=group)

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(None, None, None)


def run(args: argparse.Namespace) -> int:
    from gds_offload.weights import StoreCorruptError, StoreSpaceError, convert, verify_store

    result: dict[str, object] = {}
    try:
        if len(args.paths) == 1:
            if not args.check:
                print("gds-offload convert: give CHECKPOINT OUT (or --check STORE to check a store)", file=sys.stderr)
                return 2
            outs = args.paths
        else:
            ckpt, outs = args.paths[0], args.paths[1:]
            with ByteBar("converting", quiet=args.json) as bar:
                m = convert(ckpt, [str(o) for o in outs] if len(outs) > 1 else outs[0], layer_prefix=args.layer_prefix,
                            tensor_align=args.tensor_align, overwrite=args.force, progress=bar)  # fmt: skip
            result["converted"] = {"store": [str(o) for o in outs], "layers": len(m.layers), "layer_prefix": m.layer_prefix,
                                   "tensors": len(m.tensors), "nbytes": m.total_nbytes(), "config_sha256": m.config_sha256}  # fmt: skip
            if not args.json:
                print(f"converted {ckpt} -> {', '.join(map(str, outs))}: {len(m.tensors)} tensors, {len(m.layers)} layers "
                      f"({m.layer_prefix}.*), {format_bytes(m.total_nbytes())}")  # fmt: skip
        if args.check:
            with ByteBar("checking", quiet=args.json) as bar:
                c = verify_store([str(o) for o in outs] if len(outs) > 1 else outs[0], progress=bar)
            result["check"] = {"ok": True, "groups": c.groups, "nbytes": c.nbytes, "seconds": round(c.seconds, 3), "train_step": c.train_step}
            if not args.json:
                print(f"check: all {c.groups} groups match their checksums ({format_bytes(c.nbytes)} in {c.seconds:.2f} s)")
                if c.train_step:
                    print(f"check: training step {c.train_step}: every group and {c.train_states} optimizer state files match step.json")
    except StoreCorruptError as exc:
        result["check"] = {"ok": False, "error": str(exc)}
        print(json.dumps(result, indent=2) if args.json else f"check FAILED: {exc}", file=sys.stdout if args.json else sys.stderr)
        return 1
    except (ConfigError, StoreSpaceError, OffloadError) as exc:
        print(f"gds-offload convert: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:  # an I/O error outside what the library names: the file and the OS's words
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"gds-offload convert: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def one_line(msg: str) -> str:
    """``msg`` on one line (a mismatch listing spans several)."""
    return " ".join(part.strip() for part in msg.splitlines() if part.strip())
