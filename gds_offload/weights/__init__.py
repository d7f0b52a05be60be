"""Weight offloading (the Balance Beam half): a model's weights in an aligned store on NVMe,
streamed layer by layer into a ring of preallocated buffers (host memory, or GPU memory through
KvikIO/GPUDirect Storage) while the previous layer computes.

* :func:`convert` / :func:`verify_store`: a safetensors checkpoint -> a store (``gds-offload convert``);
  :func:`export`: a store -> a sharded safetensors checkpoint ``transformers`` loads (``gds-offload export``).
* :func:`load_streamed` -> :class:`StreamedModel`: a meta-device skeleton whose layers stream from a store.
* :func:`read_manifest`, :class:`Manifest`: where every tensor lies, and its checksums.
* :func:`as_reference`: the resident model a streamed one is bit-identical to.
* :func:`plan` (``gds-offload plan``): measure the model here and choose the shape of a workload
  (:class:`Generate`) under a memory limit: a :class:`Plan`; ``load_streamed(..., plan=)``,
  :meth:`StreamedModel.generate_many` (layer-major: several micro-batches per weight load).
* :func:`from_pretrained`: convert if needed, plan, and stream, in one call.
* :class:`StreamedTrainer`: full fine-tuning, the streamed layers' weights and optimizer state
  on the drive, a step written whole or not at all (:mod:`~gds_offload.weights.store.steps`).
"""
from __future__ import annotations

from gds_offload.weights.errors import (
    ConfigMismatchError,
    StoreCorruptError,
    StoreFormatError,
    StoreSpaceError,
    StoreTrustError,
    WeightsMismatchError,
)
from gds_offload.weights.planning.planner import Generate, Plan
from gds_offload.weights.run.model import StreamedModel, StreamStats, load_streamed
from gds_offload.weights.run.plan import plan
from gds_offload.weights.run.pretrained import from_pretrained
from gds_offload.weights.run.reference import as_reference
from gds_offload.weights.store.convert import StoreCheck, convert, verify_store
from gds_offload.weights.store.export import Exported, export
from gds_offload.weights.store.manifest import FileEntry, GroupEntry, Manifest, TensorEntry, config_fingerprint, read_manifest
from gds_offload.weights.train.trainer import StreamedTrainer

__all__ = [
    "convert",
    "verify_store",
    "export",
    "Exported",
    "load_streamed",
    "StreamedModel",
    "StreamStats",
    "as_reference",
    "plan",
    "Plan",
    "Generate",
    "from_pretrained",
    "StreamedTrainer",
    "read_manifest",
    "config_fingerprint",
    "Manifest",
    "TensorEntry",
    "GroupEntry",
    "FileEntry",
    "StoreCheck",
    "StoreFormatError",
    "StoreTrustError",
    "StoreSpaceError",
    "StoreCorruptError",
    "WeightsMismatchError",
    "ConfigMismatchError",
]
