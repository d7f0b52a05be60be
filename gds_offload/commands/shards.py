"""``gds-offload shards``: write aligned ``.npy`` token shards; check a shard path; benchmark the loader.

Examples::

    gds-offload shards data/shards --text corpus/*.txt --seq 512      # byte-level tokens, EOT after each file
    gds-offload shards data/shards --synthetic 50000000 --vocab 4096  # random tokens, seeded
    gds-offload shards --check data/shards                            # can DALI's GDS reader work there?
    gds-offload shards --bench data/shards --out docs/results/loader-cpu.json

The set's index, ``shards.json``, is written last, atomically: a run stopped midway (Ctrl-C,
``kill -9``) leaves a directory the loader refuses; run it again with ``--overwrite``.
``--check`` exits 0 when reads go straight to GPU memory (``gds``), 1 for another reader
that works (``gpu-compat``, ``cpu``), 2 when the loader cannot run there. The layout and
why it keeps reads large and aligned: :mod:`gds_offload.data`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gds_offload.commands.run_args import check_outputs
from gds_offload.errors import ConfigError
from gds_offload.units import format_bytes, parse_bytes

_BENCH_OUT = "results/loader.json"
HELP = "write aligned .npy token shards from text files or synthetic tokens; --check a path; --bench the loader"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", nargs="?", default=None, help="directory to write the shards to (with --text or --synthetic)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", nargs="+", metavar="PATH", help="text files (or directories of them) to tokenize byte by byte")
    src.add_argument("--synthetic", type=int, metavar="N", help="write N random tokens instead")
    src.add_argument("--check", metavar="DIR", help="say whether DALI's GDS numpy reader can work at DIR, and why")
    src.add_argument("--bench", metavar="DIR", help="loader throughput on DIR's shards against a DataLoader over np.memmap and the demo step")
    p.add_argument("--seq", type=int, default=512, help="tokens per training sequence; windows hold seq + 1 (default: 512)")
    p.add_argument("--vocab", type=int, default=4096, help="--synthetic: tokens are drawn from [0, vocab) (default: 4096)")
    p.add_argument("--seed", type=int, default=0, help="--synthetic: seed of the tokens; --bench: seed of the orders (default: 0)")
    p.add_argument("--windows-per-file", type=int, default=None, help="windows per shard file (default: about --file-bytes, whole 4 KiB pages)")
    p.add_argument("--file-bytes", default="4MiB", help="target size of one shard file (default: 4MiB)")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in the output directory")
    p.add_argument("--json", action="store_true", help="--check: print JSON")
    p.add_argument("--out", dest="bench_out", default=_BENCH_OUT, help="--bench: result JSON ('' for none) (default: results/loader.json)")
    p.add_argument("--batches", default="4,64", help="--bench: comma-separated batch sizes (default: 4,64)")
    p.add_argument("--rounds", type=int, default=3, help="--bench: interleaved rounds per loader (default: 3)")
    p.add_argument("--max-windows", type=int, default=None, help="--bench: stop each loader after this many windows (default: one epoch)")
    p.add_argument("--device", default="cpu", help="--bench: cpu or cuda (default: cpu)")


def _text_files(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for text in paths:
        path = Path(text)
        out.extend(sorted(q for q in path.rglob("*") if q.is_file()) if path.is_dir() else [path])
    return out


def _write(args: argparse.Namespace) -> int:
    from gds_offload.data.writer import BYTE_VOCAB, synthetic_tokens, text_documents, write_shards

    if args.out is None:
        raise _usage("name the output directory: gds-offload shards DIR --text FILE... (or --synthetic N)")
    common = dict(seq=args.seq, windows_per_file=args.windows_per_file, overwrite=args.overwrite,
                  file_bytes=parse_bytes(args.file_bytes, name="--file-bytes"))
    if args.text:
        files = _text_files(args.text)
        if not files:
            raise _usage(f"--text {' '.join(args.text)}: no files found")
        summary = write_shards(args.out, text_documents(files), vocab=BYTE_VOCAB, tokenizer="bytes",
                               sources=[str(f) for f in files], **common)
    else:
        if args.synthetic < 1:
            raise _usage(f"--synthetic {args.synthetic}: pass a positive number of tokens")
        summary = write_shards(args.out, synthetic_tokens(args.synthetic, vocab=args.vocab, seed=args.seed),
                               vocab=args.vocab, tokenizer="synthetic", sources=[f"--synthetic {args.synthetic} --seed {args.seed}"],
                               **common)
    print(f"{summary.directory}: {len(summary.files)} file{'s' if len(summary.files) != 1 else ''}, {summary.windows:,} windows of {summary.seq + 1} {summary.dtype} "
          f"tokens ({format_bytes(summary.nbytes)}), {summary.windows_per_file} windows per file, vocab {summary.vocab}")
    if summary.tail_tokens:
        print(f"left out: the last {summary.tail_tokens} token(s) of the stream, fewer than one window of {summary.seq + 1}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from gds_offload.data.check import input_path_status

    status = input_path_status(args.check)
    if args.json:
        print(json.dumps(status.as_dict(), indent=2))
    else:
        print(f"{status.path}: reader {status.reader} ({'GDS: drive to GPU memory' if status.gds else 'no GDS'})")
        print(f"  {status.reason}")
        for name, detail in status.facts.items():
            print(f"  {name:13} {detail}")
        if status.fix:
            print(f"  fix: {status.fix}")
    return {"gds": 0, "gpu-compat": 1, "cpu": 1}.get(status.reader, 2)


def _bench(args: argparse.Namespace) -> int:
    from gds_offload.bench.data.bench import run_loader_bench

    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1 or args.rounds < 1:
        raise _usage(f"--batches {args.batches} --rounds {args.rounds}: positive numbers, please")
    doc = run_loader_bench(args.bench, batches=batches, rounds=args.rounds, device=args.device, max_windows=args.max_windows,
                           seed=args.seed, command=getattr(args, "command_line", ""),
                           progress=lambda msg: print(f"measuring {msg}", file=sys.stderr))
    widths = [max(len(str(c)), *(len(r[i]) for r in doc["table"]["rows"])) for i, c in enumerate(doc["table"]["columns"])]
    for row in [doc["table"]["columns"], *doc["table"]["rows"]]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)))
    print(doc["about"])
    if args.bench_out:
        Path(args.bench_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.bench_out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.bench_out}")
    return 0


def _usage(message: str) -> Exception:
    return ConfigError(message)


def run(args: argparse.Namespace) -> int:
    try:
        check_outputs(("--out", args.bench_out, _BENCH_OUT))
        if args.check:
            return _check(args)
        if args.bench:
            return _bench(args)
        if args.text or args.synthetic is not None:
            return _write(args)
        raise _usage("pass --text FILE... or --synthetic N (with an output DIR), --check DIR or --bench DIR")
    except ConfigError as exc:
        print(f"gds-offload shards: {exc}", file=sys.stderr)
        return 2
