"""Integrations with training frameworks: :mod:`gds_offload.integrations.transformers` (Hugging Face ``Trainer``).

The integrations are imported on first use, as the package's subpackages are: after
``import gds_offload``, ``gds_offload.integrations.transformers.OffloadCallback`` imports
``transformers`` then, and not before.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gds_offload.integrations import transformers

#: The integration modules, served as attributes.
__all__ = ["transformers"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'gds_offload.integrations' has no attribute {name!r}; the integrations: {', '.join(__all__)}")
    module = importlib.import_module(f"gds_offload.integrations.{name}")
    globals()[name] = module
    return module


def __dir__() -> list[str]:
    return sorted(__all__)
