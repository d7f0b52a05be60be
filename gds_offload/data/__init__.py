"""The input side: token shards on NVMe, read by DALI into GPU memory through GPUDirect Storage.

* :func:`write_shards` / :class:`ShardWriter` (``gds-offload shards``): text files (byte-level
  tokens) or synthetic tokens -> aligned ``.npy`` shards and a ``shards.json`` manifest.
* :class:`TokenLoader`: ``{"input_ids", "labels"}`` batches from a DALI pipeline
  (``fn.readers.numpy(device="gpu")`` on a GPU, the CPU reader without one), sharded by rank,
  shuffled by seed, resumable from a step or a ``state_dict()``.
* :func:`input_path_status`: whether DALI's GDS reader can work at a path, and why.

Layout, and why the unit of a read is one file of many windows
--------------------------------------------------------------
Each shard file is one array ``[windows, seq + 1]`` (about 2 MB by default: a multiple of
the rows that fill whole 4 KiB pages), its header padded so the tokens start at byte 4096.
The loader's DALI pipeline reads files whole, a pool of them per DALI batch. Why not the
alternatives:

* **One file per window** makes every read as small as a window (1 KiB for 512 ``uint16``
  tokens, less than the 4 KiB-aligned header in front of it), and a corpus of a billion
  tokens two million files: the open, header parse and close of each file, and the fixed
  cost of each cuFile request, then outweigh moving the bytes.
* **ROI reads from large per-shard files** (``roi_start``/``roi_end`` on axis 0): DALI's
  GPU numpy reader reads the *whole file* into GPU memory and slices the ROI out with a
  kernel afterwards (``numpy_reader_gpu_op_impl.cu``), so each window would read its shard
  in full. The CPU reader does read only the ROI, but as small, unaligned ``pread``s.

A file of a few MB is one large read, starting 4 KiB-aligned in the file and, as the files
of a batch are whole pages laid end to end, at a 4 KiB-aligned offset of the batch's
``cudaMalloc`` buffer; DALI cuts it into ``DALI_GDS_CHUNK_SIZE`` (2 MiB) cuFile requests.
Shuffling then needs a second stage: the windows of the ``pool_files`` files of one DALI
batch are permuted together (:mod:`gds_offload.data.order`).
"""
from __future__ import annotations

from gds_offload.data.check import InputPathStatus, input_path_status
from gds_offload.data.format import ShardError, ShardFile, ShardSet, read_shard_header, scan_shards
from gds_offload.data.loader import TokenLoader
from gds_offload.data.writer import BYTE_VOCAB, EOT, ShardWriter, WriteSummary, synthetic_tokens, text_documents, write_shards

__all__ = [
    "TokenLoader",
    "ShardWriter",
    "WriteSummary",
    "write_shards",
    "text_documents",
    "synthetic_tokens",
    "scan_shards",
    "read_shard_header",
    "ShardSet",
    "ShardFile",
    "ShardError",
    "input_path_status",
    "InputPathStatus",
    "BYTE_VOCAB",
    "EOT",
]
