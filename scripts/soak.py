#!/usr/bin/env python
"""Soak test: train a small model with the offloader for many steps and check nothing grows.

Every ``--every`` steps (after draining writes in flight) prints one line: RSS, open file
descriptors, threads, spill file bytes and spill bytes still allocated. After ``--warmup`` steps, exits 1 if any of them
grew beyond its tolerance (RSS: ``--rss-tolerance``, default 64 MiB; the others: not at all), else 0.
Also exits 1 if a step's loss or gradients differ from the run without the offloader.

    python scripts/soak.py --steps 1000
    python scripts/soak.py --steps 300 --mode compat --faults "write:eio:50:5"   # a chaos run
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gds_offload  # noqa: E402
from gds_offload.io.faults import inject  # noqa: E402


@dataclass(frozen=True)
class Sample:
    step: int
    rss_bytes: int
    fds: int
    threads: int
    spill_file_bytes: int
    allocated_bytes: int

    def line(self) -> str:
        return (
            f"step {self.step:6d}  rss {self.rss_bytes / 2**20:8.1f} MiB  fds {self.fds:4d}  "
            f"threads {self.threads:3d}  spill file {self.spill_file_bytes / 2**20:7.1f} MiB  "
            f"allocated {self.allocated_bytes}"
        )


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sample(step: int, off: gds_offload.Offloader) -> Sample:
    # Writes still in flight hold their source tensors and slots; they are a backlog, not a
    # leak (the drive is slower than compute on a busy machine). Drain them, then measure.
    off.synchronize()
    gc.collect()
    return Sample(
        step=step,
        rss_bytes=rss_bytes(),
        fds=len(os.listdir("/proc/self/fd")),
        threads=threading.active_count(),
        spill_file_bytes=off.store.file_bytes(),
        allocated_bytes=off.store.allocated_bytes(),
    )


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(), nn.Dropout(0.1)) for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x).pow(2).mean()


def step(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def growth(first: Sample, last: Sample, rss_tolerance: int) -> list[str]:
    bad = []
    if last.rss_bytes - first.rss_bytes > rss_tolerance:
        bad.append(f"RSS grew by {(last.rss_bytes - first.rss_bytes) / 2**20:.1f} MiB")
    for name in ("fds", "threads", "spill_file_bytes", "allocated_bytes"):
        if getattr(last, name) > getattr(first, name):
            bad.append(f"{name} grew from {getattr(first, name)} to {getattr(last, name)}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100, help="print a sample every N steps")
    ap.add_argument("--warmup", type=int, default=100, help="growth is measured from this step on")
    ap.add_argument("--mode", default="posix")
    ap.add_argument("--path", default=None, help="spill directory (default: a fresh temporary one)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--check-every", type=int, default=50, help="compare with a run without offloader every N steps")
    ap.add_argument("--rss-tolerance", default="64MiB", help="allowed RSS growth (allocator high-water marks move)")
    ap.add_argument("--faults", default="", help="inject faults, e.g. 'write:eio:50:5' (see gds_offload.io.faults)")
    ap.add_argument("--verify", action="store_true", help="attach with verify=True")
    args = ap.parse_args(argv)
    from gds_offload.units import parse_bytes

    rss_tolerance = parse_bytes(args.rss_tolerance, name="--rss-tolerance")
    torch.manual_seed(0)
    model = Net(args.width, args.depth)
    x = torch.randn(args.batch, args.width)
    refs = {s: step(model, x, s) for s in range(0, args.steps, args.check_every)}
    tmp = None if args.path else tempfile.TemporaryDirectory(prefix="gds_offload-soak-")
    path = args.path or tmp.name  # type: ignore[union-attr]
    samples: list[Sample] = []
    wrong = errors = 0
    with gds_offload.attach(model, path=path, mode=args.mode, min_bytes=0, keep_last=0, verify=args.verify) as off:
        if args.faults:
            inject(off, args.faults)
        for s in range(args.steps):
            try:
                loss, grads = step(model, x, s)
            except gds_offload.OffloadError as exc:  # a failed read is fatal to its step, not to the run
                errors += 1
                print(f"step {s}: {exc}", flush=True)
                continue
            if s in refs:
                ref_loss, ref_grads = refs[s]
                if not (torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))):
                    wrong += 1
                    print(f"step {s}: loss or gradients differ from the run without the offloader", flush=True)
            if (s + 1) % args.every == 0 or s + 1 == args.steps:
                samples.append(sample(s + 1, off))
                print(samples[-1].line(), flush=True)
        st = off.stats()
    print(
        f"done: {st.steps} steps, {st.bytes_offloaded / 2**20:.0f} MiB offloaded, "
        f"{st.bytes_fallback} bytes fell back, {st.stalls} stalls, {errors} steps failed",
        flush=True,
    )
    if tmp is not None:
        tmp.cleanup()
    after = [smp for smp in samples if smp.step >= args.warmup]
    problems = growth(after[0], after[-1], rss_tolerance) if len(after) >= 2 else []
    if wrong:
        problems.append(f"{wrong} checked steps were not bit-identical")
    if errors and not args.faults:
        problems.append(f"{errors} steps raised OffloadError with no faults injected")
    for p in problems:
        print(f"FAIL: {p}", flush=True)
    if not problems:
        print("OK: flat after warm-up", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
