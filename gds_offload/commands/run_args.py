"""The flags that describe a training run, shared by the commands that train (not a command itself).

``bench-weights`` and ``bench-finetune`` share their working directory, memory cap, modes and
batch sizes (:func:`workdir_arg`, :func:`memory_limit_arg`, :func:`modes_arg`, :func:`batch_sizes_arg`).
``bench``, ``demo``, ``rok`` and ``demo --nproc`` train the same models with the same flags
(:func:`add_model_arguments`) into one :class:`~gds_offload.bench.train.spec.RunSpec`
(:func:`base_spec`), and refuse up front what a child process would refuse later
(:func:`gds_offload.bench.train.checks.check_runs`). The argparse types here
(:data:`positive_int`, ...) serve every command: zero never means "the default".
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from gds_offload.bench.cgroup import check_limit
from gds_offload.errors import ConfigError
from gds_offload.io.directory import missing_parent, prepare_dir
from gds_offload.units import parse_bandwidth, parse_bytes

__all__ = [
    "positive_int",
    "non_negative_int",
    "positive_float",
    "add_model_arguments",
    "resolve_device",
    "base_spec",
    "batch_sizes_arg",
    "modes_arg",
    "default_workdir",
    "workdir_arg",
    "memory_limit_arg",
    "check_outputs",
    "wrote_line",
]


def _number(kind: type, low: float, what: str) -> Any:
    """An argparse ``type`` parsing ``kind`` and refusing values below ``low`` (argparse names the flag)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if math.isnan(value) or math.isinf(value) or value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse's message for a failed conversion
    return parse


#: argparse types: sizes and counts. Zero never means "the default": leave the flag out for that.
positive_int = _number(int, 1, "a positive integer")
non_negative_int = _number(int, 0, "an integer >= 0")
positive_float = _number(float, 1e-300, "a positive number")


def add_model_arguments(p: argparse.ArgumentParser, *, steps: int, warmup: int) -> None:
    """The model, size and offloader options ``bench`` and ``demo`` share."""
    p.add_argument("--model", default="gpt", help="gpt (built-in), llama, gpt2 (HF configs, random weights) or pkg.module:factory (default: gpt)")
    p.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default: the device's demo preset)")
    p.add_argument("--hidden", type=positive_int, default=None, help="model width (default: preset)")
    p.add_argument("--heads", type=positive_int, default=None, help="attention heads (default: preset, or hidden/64)")
    p.add_argument("--seq", type=positive_int, default=None, help="tokens per sequence (default: preset)")
    p.add_argument("--vocab", type=positive_int, default=None, help="vocabulary size (default: preset)")
    p.add_argument("--batch", type=positive_int, default=None, help="sequences per step (default: preset)")
    p.add_argument("--dropout", type=float, default=None, help="dropout probability (default: preset)")
    p.add_argument("--steps", type=positive_int, default=steps, help=f"measured steps (default: {steps})")
    p.add_argument("--warmup", type=positive_int, default=warmup, help=f"warm-up steps before measuring, >= 1 (default: {warmup})")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, batches and dropout (default: 0)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (a GPU if there is one) (default: auto)")
    p.add_argument("--path", default=None, help="spill directory (default: $GDS_OFFLOAD_DIR or <tmp>/gds_offload-<uid>)")
    p.add_argument("--max-bandwidth", default=None, help="cap the engine, e.g. 500MB/s (imitate a slower drive)")
    p.add_argument("--keep-last", type=non_negative_int, default=None, help="layer calls kept in memory at the end (attach default: 1)")
    p.add_argument("--min-bytes", default=None, help="storages under this stay in memory, e.g. 1MiB (attach default)")
    p.add_argument("--prefetch-bytes", default=None, help="read-ahead window in backward, e.g. 512MiB (attach default)")
    p.add_argument("--num-threads", type=positive_int, default=None, help="engine I/O threads (engine default)")
    p.add_argument("--timeout", type=positive_float, default=1800.0, help="seconds before a mode's process is killed (default: 1800)")
    p.add_argument("--data", default=None, help="train on token shards from this directory (gds-offload shards) instead of synthetic tokens; sets --seq (and --vocab) from them")
    p.add_argument("--no-memory", action="store_true", help="CPU: do not measure peak memory; run with glibc's default allocator settings (measuring makes every step slower, every mode alike; see gds_offload.bench.train.runner)")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cpu``, ``cuda`` and ``cuda:N`` checked.

    Raises:
        ConfigError: an unknown device, or a CUDA device this machine does not have.
    """
    import re

    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if device != "cpu" and m is None:
        raise ConfigError(f"--device {device!r} is unknown; pass cpu, cuda, cuda:N or auto")
    if m is not None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {device}: torch sees no CUDA GPU here; pass --device cpu (or auto)")
        if m.group(1) is not None and int(m.group(1)) >= count:
            raise ConfigError(f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return device


def base_spec(args: argparse.Namespace, device: str) -> Any:
    """The :class:`~gds_offload.bench.train.spec.RunSpec` the options describe (mode left as ``keep``).

    Raises:
        ConfigError: a bad size string or shape.
    """
    from gds_offload.bench.train.data import data_defaults
    from gds_offload.bench.train.spec import RunSpec
    from gds_offload.models.gpt import GPTConfig, demo_preset

    preset, preset_batch = demo_preset(device, quick=not getattr(args, "full", True))  # demo without --full

    def given(value: int | None, default: int) -> int:
        return default if value is None else value  # 0 is refused by argparse, never "the default"

    data = os.path.abspath(args.data) if getattr(args, "data", None) else None
    data_seq, data_vocab = data_defaults(data, seq=args.seq) if data else (None, None)
    hidden = given(args.hidden, preset.hidden)
    heads = given(args.heads, preset.heads if args.hidden is None else max(1, hidden // 64))
    cfg = GPTConfig(
        layers=given(args.layers, preset.layers),
        hidden=hidden,
        heads=heads,
        seq=given(args.seq, data_seq or preset.seq),
        vocab=given(args.vocab, max(preset.vocab, data_vocab or 0)),
        dropout=preset.dropout if args.dropout is None else args.dropout,
    )  # validates the shape for every model kind
    if args.max_bandwidth is not None:
        parse_bandwidth(args.max_bandwidth, name="--max-bandwidth")
    return RunSpec(
        mode="keep",
        model=args.model,
        layers=cfg.layers,
        hidden=cfg.hidden,
        heads=cfg.heads,
        seq=cfg.seq,
        vocab=cfg.vocab,
        batch=given(args.batch, preset_batch),
        dropout=cfg.dropout,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        device=device,
        path=None if args.path is None else str(args.path),  # '' is refused with the other attach() arguments
        max_bandwidth=args.max_bandwidth,
        policy=getattr(args, "policy", "all"),
        keep_last=args.keep_last,
        min_bytes=None if args.min_bytes is None else parse_bytes(args.min_bytes, name="--min-bytes"),
        prefetch_bytes=None if args.prefetch_bytes is None else parse_bytes(args.prefetch_bytes, name="--prefetch-bytes"),
        num_threads=args.num_threads,
        measure_memory=not args.no_memory,
        paired=getattr(args, "paired", False),
        data=data,
    )


# ---------------------------------------------------------------- the weight benchmarks' flags
def batch_sizes_arg(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,4") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes must be positive integers")
    return values


def modes_arg(text: str, allowed: tuple[str, ...]) -> list[str]:
    """``--modes``: a comma-separated list of ``allowed`` names.

    Raises:
        ConfigError: an unknown name, or none.
    """

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in allowed]
    if bad or not modes:
        raise ConfigError(f"--modes {text!r}: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(allowed)}")
    return modes


def default_workdir(tiny: bool) -> Path:
    """``<tmp>/gds_offload-bench-weights[-tiny]-<uid>``: the user's own, private (0700) working directory."""
    return Path(tempfile.gettempdir()) / f"gds_offload-bench-weights{'-tiny' if tiny else ''}-{os.getuid()}"


def workdir_arg(given: str | None, *, tiny: bool) -> Path:
    """The working directory of ``--workdir``, or :func:`default_workdir`: judged as ``attach()``
    judges a spill directory (:func:`~gds_offload.io.directory.prepare_dir`; the default must be
    the user's own), created 0700 when missing.

    Raises:
        ConfigError: an empty ``--workdir``, or a directory ``attach()`` would refuse.
    """

    if given is None:
        return prepare_dir(default_workdir(tiny), create=True, origin="default --workdir")
    if not given.strip():
        raise ConfigError(f"--workdir {given!r} is empty; pass a directory, or leave the flag out for {default_workdir(tiny)}")
    return prepare_dir(Path(given), create=True, origin="--workdir")


def memory_limit_arg(text: str | None) -> int | None:
    """``--memory-limit``: ``None`` when left out, else a cap this machine can apply
    (:func:`~gds_offload.bench.cgroup.check_limit`).

    Raises:
        ConfigError: not a size, 0, under 64 MiB, or no memory group can be made here.
    """

    if text is None:
        return None
    limit = parse_bytes(text, name="--memory-limit")
    check_limit(limit, name=f"--memory-limit {text}")
    return limit


# ---------------------------------------------------------------- output files
def check_outputs(*outputs: tuple[str, object, object]) -> None:
    """Refuse an output file the user named (``(flag, value, the flag's default)``) whose folder
    does not exist: a mistyped folder would be made, perhaps on another disk, without a word. The
    command's own default (``results/bench.json``) makes its folder as before; ``''`` and ``'-'``
    (no file, or stdout) pass.

    Raises:
        ConfigError: naming the flag, the path, and the nearest existing parent and its filesystem.
    """
    for flag, value, default in outputs:
        if value is None or str(value) in ("", "-") or (default is not None and str(value) == str(default)):
            continue
        problem = missing_parent(Path(str(value)))
        if problem is not None:
            raise ConfigError(f"{flag} {value}: {problem}")


def wrote_line(results: object, plot: object) -> str:
    """The line that says where a command wrote its results and plot, as absolute paths (a
    default such as ``results/bench.json`` lands in the current directory); ``""`` for neither."""
    parts = [f"{what}: {Path(str(p)).resolve()}" for what, p in (("results", results), ("plot", plot)) if p and str(p) != "-"]
    return ", ".join(parts)
