"""What :func:`~gds_offload.weights.load_streamed` was asked for, validated before anything is
read or allocated: :class:`StreamOptions`.

Every argument is checked for its type and range as :func:`~gds_offload.attach` checks its
own: one :class:`~gds_offload.errors.ConfigError` naming the argument, the value and the
fix; no coercion (``slots=1.5``, ``slots="2"`` and ``verify="no"`` are refused, not rounded
or taken as true).
"""
from __future__ import annotations

import difflib
import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from gds_offload.errors import ConfigError
from gds_offload.units import checked_bool, checked_int, parse_bytes

__all__ = ["KVPlacement", "StreamOptions", "Tier", "TIERS", "resolve_device"]

class KVPlacement(str, enum.Enum):
    """Where the KV caches of layer-major micro-batches live between the layers that use them
    (:mod:`gds_offload.weights.run.kv`)."""

    DEVICE = "device"  #: Hugging Face's own DynamicCache, on the model's device
    #: Host memory: on CUDA, Hugging Face's ``DynamicCache(offloading=True)`` (each layer's cache
    #: copied to host memory after the layer, the next layer's brought back on a side stream);
    #: on the CPU the host is the device, so it is :attr:`DEVICE`'s cache.
    HOST = "host"
    DRIVE = "drive"  #: a KVPool's regions in a spill file, read back per layer


Tier = Literal["drive", "host"]
TIERS: tuple[Tier, ...] = ("drive", "host")
#: Engines a store can be read with (``host`` keeps no files).
_ENGINES = ("auto", "gds", "compat", "posix")


@dataclass(frozen=True)
class StreamOptions:
    """:func:`~gds_offload.weights.load_streamed`'s arguments but the model and the store, validated."""

    device: torch.device
    tier: Tier
    slots: int
    resident_layers: int | None
    #: Bytes of ``device`` memory for weights; ``None``: no limit.
    max_memory: int | None
    verify: bool
    engine: str
    num_threads: int | None
    #: Stream the converted store's weights even where a training step exists.
    converted: bool = False
    #: A :class:`~gds_offload.weights.train.trainer.StreamedTrainer` directory to stream the last step of
    #: (``None``: ``STORE/train``, when it holds one).
    train_dir: Path | None = None

    @classmethod
    def from_kwargs(
        cls,
        *,
        device: object = "cpu",
        tier: object = "drive",
        slots: object = 2,
        resident_layers: object = None,
        max_memory: object = None,
        verify: object = False,
        engine: object = "auto",
        num_threads: object = None,
        converted: object = False,
        train_dir: object = None,
    ) -> StreamOptions:
        """Validate ``load_streamed``'s keyword arguments.

        Raises:
            ConfigError: the first bad argument, with its value and the fix; a CUDA device without CUDA.
        """
        if tier not in TIERS:
            raise ConfigError(f"tier={tier!r}: expected 'drive' (read layers from the store every forward) or 'host' (keep them in memory)")
        if engine == "host":
            raise ConfigError("engine='host' keeps no files to read; for layers in host memory use tier='host'")
        if not isinstance(engine, str) or engine not in _ENGINES:
            hint = difflib.get_close_matches(str(engine).lower(), (*_ENGINES, "host"), n=1)
            raise ConfigError(
                f"engine={engine!r} is not an engine that reads a weight store; expected one of {', '.join(_ENGINES)}"
                + (f" (did you mean {hint[0]!r}?" + (" For layers in host memory use tier='host')" if hint[0] == "host" else ")") if hint else "")
            )
        n_slots = checked_int("slots", slots, low=1, what="ring buffers for streamed layers; 2 overlaps a read with a layer's compute")
        resident = None if resident_layers is None else checked_int(
            "resident_layers", resident_layers, low=0, what="leading layers kept on the device; None: what max_memory allows, else 0"
        )
        threads = None if num_threads is None else checked_int(
            "num_threads", num_threads, low=1, what="engine threads doing the reads; None for the engine's default"
        )
        if train_dir is not None and not isinstance(train_dir, (str, os.PathLike)):
            raise ConfigError(f"train_dir={train_dir!r} ({type(train_dir).__name__}) is not a path; pass the directory "
                              "StreamedTrainer(state_dir=...) wrote, or None for STORE/train")  # fmt: skip
        if checked_bool("converted", converted) and train_dir is not None:
            raise ConfigError(f"converted=True with train_dir={train_dir!r}: converted streams the store's own weights, train_dir a "
                              "training step; pass one of them")  # fmt: skip
        if max_memory is not None and not isinstance(max_memory, (int, float, str)):
            raise ConfigError(f"max_memory={max_memory!r} ({type(max_memory).__name__}) is not a size; pass an int or a string like '20GiB'")
        return cls(
            device=resolve_device(device),
            tier="drive" if tier == "drive" else "host",
            slots=n_slots,
            resident_layers=resident,
            max_memory=None if max_memory is None else parse_bytes(max_memory, name="max_memory"),
            verify=checked_bool("verify", verify),
            engine=engine,
            num_threads=threads,
            converted=converted is True,
            train_dir=None if train_dir is None else Path(train_dir),
        )


def resolve_device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` with its index (``"cuda"``: the current GPU).

    Raises:
        ConfigError: not a device, not ``cpu``/``cuda``, or a CUDA device without CUDA.
    """
    if not isinstance(device, (str, torch.device)):
        raise ConfigError(f"device={device!r} ({type(device).__name__}) is not a torch device; use 'cpu' or 'cuda'")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is not a torch device ({exc}); use 'cpu' or 'cuda'") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"device={dev}: weights stream into host memory ('cpu') or a GPU ('cuda'); {dev.type} is not supported")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={dev}: needs an NVIDIA GPU, but torch.cuda.is_available() is False; use device='cpu'")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
