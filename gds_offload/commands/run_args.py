"""The flags that describe a training run, and the checks made before its first child starts.

``bench``, ``demo``, ``rok`` and ``demo --nproc`` train the same models with the same flags
(:func:`add_model_arguments`) into one :class:`~gds_offload.bench.train.spec.RunSpec`
(:func:`base_spec`), and refuse up front what a child process would refuse later
(:func:`check_runs`: the model name, the offloader's arguments, the memory). The argparse
types here (:data:`positive_int`, ...) serve every command: zero never means "the default".
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any

__all__ = [
    "positive_int",
    "non_negative_int",
    "positive_float",
    "add_model_arguments",
    "resolve_device",
    "check_model_name",
    "available_memory",
    "check_fits",
    "check_runs",
    "base_spec",
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

    from gds_offload.errors import ConfigError

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


def check_model_name(model: str) -> None:
    """``--model`` names a built-in model or an importable ``pkg.module:factory``.

    Raises:
        ConfigError: an unknown name, a module that cannot be found, or transformers missing for llama/gpt2.
    """
    import importlib.util

    from gds_offload.bench.train.workload import BUILTIN_MODELS
    from gds_offload.errors import ConfigError

    if model == "gpt":
        return
    if model in ("llama", "gpt2"):
        if importlib.util.find_spec("transformers") is None:
            raise ConfigError(f"--model {model} needs transformers; pip install transformers, or use --model gpt")
        return
    module, sep, attr = model.partition(":")
    if not sep or not module or not attr.isidentifier():
        raise ConfigError(f"--model {model!r} is unknown; expected {', '.join(BUILTIN_MODELS)} or pkg.module:factory")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ConfigError(f"--model {model}: no module {module!r} on sys.path (the current directory or PYTHONPATH)")


def available_memory(device: str) -> tuple[int, str] | None:
    """(bytes, where the figure comes from) a process can still allocate on ``device``; None if unknown."""
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        free, _total = torch.cuda.mem_get_info(index)
        return int(free), f"free memory of {device} (torch.cuda.mem_get_info)"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        return None
    return None


def mode_needs(est: Any, mode: str, device: str) -> dict[str, int]:
    """Bytes ``mode`` needs per memory (``"cpu"``, or the CUDA device and ``"cpu"`` for host copies)."""
    from gds_offload.bench.train.spec import parse_mode

    kind, engine = parse_mode(mode)
    cuda = device.startswith("cuda")
    if kind == "keep":
        return {device: est.keep_bytes()}
    if kind == "recompute":
        return {device: est.recompute_bytes()}
    if kind == "save_on_cpu" or engine == "host":
        if not cuda:
            return {device: est.keep_bytes()}  # host memory is where the activations were anyway
        return {device: est.offload_bytes(), "cpu": est.activation_bytes}
    return {device: est.offload_bytes()}


def check_fits(base: Any, modes: list[str], *, copies: int = 1) -> None:
    """Refuse, with the estimate, a built-in GPT run that cannot fit in this machine's memory.

    ``copies``: processes that run it at once (``--nproc``); they share the host's memory,
    and each has a GPU of its own.

    Raises:
        ConfigError: a mode needs more than is available (:func:`available_memory`).
    """
    from gds_offload.errors import ConfigError
    from gds_offload.models.gpt import GPTConfig, estimate_memory
    from gds_offload.units import format_bytes

    if base.model != "gpt":
        return  # the estimate is the built-in GPT's
    est = estimate_memory(GPTConfig(base.layers, base.hidden, base.heads, base.seq, base.vocab, base.dropout), base.batch)
    free: dict[str, tuple[int, str] | None] = {}
    for mode in modes:
        for where, need in mode_needs(est, mode, base.device).items():
            need *= copies if where == "cpu" else 1
            if where not in free:
                free[where] = available_memory(where)
            got = free[where]
            if got is None or need <= got[0]:
                continue
            have, source = got
            raise ConfigError(
                f"{mode} needs about {format_bytes(need)} on {where}{f' ({copies} processes)' if copies > 1 else ''} (model, gradients and AdamW state "
                f"{format_bytes(est.state_bytes)}; activations {format_bytes(est.activation_bytes)} in all, "
                f"{format_bytes(est.layer_bytes)} per layer) but {format_bytes(have)} is available ({source}). "
                f"Lower the sizes (--batch or --batches, --seq, --layers, --hidden)" + (", or leave out keep" if mode == "keep" else "")
            )


def check_runs(base: Any, modes: list[str]) -> None:
    """Everything the runs' children would refuse, refused now, before the first one starts: the
    model name, every offload mode's attach() arguments and spill directory, and the memory.

    Raises:
        ConfigError: the first problem, naming the flag.
    """
    from gds_offload.activations.config import OffloadConfig
    from gds_offload.bench.train.spec import parse_mode

    check_model_name(base.model)
    for mode in modes:
        kind, engine = parse_mode(mode)
        if kind not in ("offload", "adaptive"):
            continue
        OffloadConfig.from_kwargs(
            path=base.path, mode=engine or "auto", policy="adaptive" if kind == "adaptive" else base.policy,
            keep_last=1 if base.keep_last is None else base.keep_last,
            **({} if base.min_bytes is None else {"min_bytes": base.min_bytes}),
            prefetch_bytes=base.prefetch_bytes, max_bandwidth=base.max_bandwidth, num_threads=base.num_threads,
            origin="--path",
        )
    check_fits(base, modes)


def base_spec(args: argparse.Namespace, device: str) -> Any:
    """The :class:`~gds_offload.bench.train.spec.RunSpec` the options describe (mode left as ``keep``).

    Raises:
        ConfigError: a bad size string or shape.
    """
    from gds_offload.bench.data.train import data_defaults
    from gds_offload.bench.train.spec import RunSpec
    from gds_offload.models.gpt import GPTConfig, demo_preset
    from gds_offload.units import parse_bandwidth, parse_bytes

    preset, preset_batch = demo_preset(device)

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
