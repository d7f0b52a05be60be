"""Deprecated module path: :func:`attach` and :func:`offloader_of` now live in
:mod:`gds_offload.activations.attach` (use ``gds_offload.attach``). Kept for one release."""
from __future__ import annotations

import warnings

from gds_offload.activations.attach import attach, offloader_of

__all__ = ["attach", "offloader_of"]

warnings.warn(
    "gds_offload.offloader is deprecated: use gds_offload.attach / gds_offload.offloader_of "
    "(defined in gds_offload.activations.attach)", DeprecationWarning, stacklevel=2,
)
