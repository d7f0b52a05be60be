"""What the runs' children would refuse, refused before the first one starts: the model name,
every offload mode's ``attach()`` arguments and spill directory, and the memory a run needs.

``bench``, ``demo``, ``rok`` and ``demo --nproc`` call :func:`check_runs` on the
:class:`~gds_offload.bench.train.spec.RunSpec` their flags describe; :func:`check_fits`
refuses a built-in GPT run that cannot fit in this machine's memory, with the estimate.
"""
from __future__ import annotations

import importlib.util
from typing import Any

from gds_offload.activations.config import OffloadConfig
from gds_offload.bench.train.spec import parse_mode
from gds_offload.bench.train.workload import BUILTIN_MODELS
from gds_offload.errors import ConfigError
from gds_offload.models.gpt import GPTConfig, estimate_memory
from gds_offload.units import format_bytes

__all__ = ["available_memory", "check_fits", "check_model_name", "check_runs", "mode_needs"]


def check_model_name(model: str) -> None:
    """``--model`` names a built-in model or an importable ``pkg.module:factory``.

    Raises:
        ConfigError: an unknown name, a module that cannot be found, or transformers missing for llama/gpt2.
    """

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
