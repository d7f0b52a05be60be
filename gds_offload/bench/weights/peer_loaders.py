"""How each peer of the weight benchmarks (:mod:`gds_offload.bench.weights.peers`) loads a checkpoint: one function per peer, each
returning a :class:`Loaded` whose ``model`` is the Hugging Face causal LM to call ``generate`` on.

Every loader runs in the peer's child process (:mod:`gds_offload.bench.weights.peers`), after
the parent put it in its memory group; the peer's own package (``accelerate``, ``airllm``,
``deepspeed``) is imported by its loader, not at import time, so that a missing package fails
only the peer that needs it (:func:`peer_support` says so before any child starts).

* :func:`load_resident` (the reference, not a peer): ``bench-weights``' ``resident`` mode,
  every weight in the process's own memory.
* :func:`load_accelerate_disk`: the ``accelerate-disk`` mode of ``bench-weights``, loaded by its
  own code (:func:`gds_offload.bench.weights.child.load_mode`): ``from_pretrained`` with a
  ``device_map`` sending every decoder layer to ``"disk"`` (Accelerate's ``dispatch_model``;
  with a safetensors checkpoint the offload folder stays empty and each layer is read from the
  checkpoint, memory-mapped, at every forward).
* :func:`load_airllm`: AirLLM's generic streaming model (:class:`airllm.AirLLMBaseModel`): the
  transformers model on ``meta``, a forward pre-hook per module (embeddings, each decoder layer,
  final norm, lm_head) that reads its per-layer safetensors shard and a post-hook that moves it
  back to ``meta``; the next module's shard is read on a worker thread meanwhile.
* :func:`load_deepspeed`: the ZeRO-Inference recipe: ``HfDeepSpeedConfig`` (so that
  ``from_pretrained`` builds the model under ``deepspeed.zero.Init``), ZeRO stage 3 with
  ``offload_param`` to NVMe, ``deepspeed.initialize``, ``generate`` on the engine's module.

What each peer needs on a CPU-only Linux host (torch CPU, transformers 5.24, accelerate 1.15):

* ``accelerate-disk``: nothing beyond ``accelerate``.
* ``airllm`` (4.0.0): installed without its dependencies' resolution
  (``pip install --no-deps airllm scipy sentencepiece``: its other requirements, torch,
  transformers, accelerate, safetensors, huggingface-hub and tqdm, are already there; a plain
  ``pip install airllm`` would replace the CPU torch with CUDA wheels). Its code is not patched:
  4.0.0 lets transformers run the forward (it only hooks the modules), so it works with
  transformers 5.24 as it is. What it needs here: ``device="cpu"`` (it defaults to
  ``cuda:0``; on the CPU it skips pinning and its ``torch.cuda.empty_cache()`` is a no-op),
  and a subclass whose ``get_tokenizer`` returns ``None``: it loads a tokenizer from the
  checkpoint directory, which holds none. As shipped, after every streamed module it runs
  ``gc.collect()`` and ``malloc_trim`` (its ``clean_memory``), a fixed cost per module and
  forward that is part of what is measured. Its first load splits the checkpoint into
  per-layer shards in :func:`airllm_dir` (a copy of the weights).
* ``deepspeed-zero-inference`` (0.19): ``DS_ACCELERATOR=cpu``; one process with the gloo backend
  (``RANK=0``, ``WORLD_SIZE=1``, a free local port); ``libaio-dev`` for its ``async_io`` op, which
  torch's JIT builds at first use together with its ``pin_memory`` op (minutes; cached in
  ``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions/py<ver>_cpu``; see
  :func:`deepspeed_aio_built`). Its swap buffers are ``mlock``-ed: as root (``CAP_IPC_LOCK``)
  any size; otherwise ``ulimit -l`` must cover ``buffer_count x buffer_size x`` the element
  size. DeepSpeed swaps no tensor under 1 MiB: those stay in memory.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gds_offload.bench.procs import child_env
from gds_offload.bench.weights.bench import BenchSpec
from gds_offload.bench.weights.child import load_mode

__all__ = ["Loaded", "LOADERS", "PACKAGES", "airllm_dir", "airllm_ready", "build_deepspeed_ops", "peer_support", "deepspeed_aio_built", "deepspeed_config", "deepspeed_nvme_dir", "load_accelerate_disk", "load_airllm",
           "load_deepspeed", "load_resident"]  # fmt: skip


@dataclass
class Loaded:
    """A peer's loaded model: ``model`` (a transformers ``*ForCausalLM``), what to call when done."""

    model: Any
    close: Callable[[], None] = field(default=lambda: None)
    #: Settings the peer ran with (reported with its result).
    settings: dict[str, Any] = field(default_factory=dict)


def load_resident(checkpoint: str, workdir: str) -> Loaded:
    """The reference: ``bench-weights``' ``resident`` mode (``from_pretrained``, every weight in own memory)."""
    model, _ = load_mode(BenchSpec(mode="resident", checkpoint=checkpoint, store="", workdir=workdir, device="cpu"))
    return Loaded(model)


def load_accelerate_disk(checkpoint: str, workdir: str) -> Loaded:
    """``bench-weights``' ``accelerate-disk`` mode (its loader, called as is)."""
    model, _ = load_mode(BenchSpec(mode="accelerate-disk", checkpoint=checkpoint, store="", workdir=workdir, device="cpu"))
    folder = Path(workdir) / f"accelerate-offload-{os.getpid()}"  # load_mode's offload folder (empty here)
    return Loaded(model, close=lambda: shutil.rmtree(folder, ignore_errors=True), settings={"offload_folder": str(folder)})


def airllm_dir(workdir: str | Path) -> Path:
    """Where AirLLM's per-layer shards of the checkpoint go (``<dir>/splitted_model``)."""
    return Path(workdir) / "airllm"


def airllm_ready(checkpoint: str | Path, workdir: str | Path) -> bool:
    """Whether AirLLM's split of ``checkpoint`` in :func:`airllm_dir` is complete: the marker
    (``<module>.safetensors.done``) it writes after each module's shard, for the embeddings,
    every decoder layer, the final norm and (untied) the lm_head. AirLLM splits again otherwise."""
    try:
        cfg = json.loads(Path(checkpoint, "config.json").read_text())
        layers = int(cfg["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    names = ["model.embed_tokens.", *(f"model.layers.{i}." for i in range(layers)), "model.norm."]
    names += [] if cfg.get("tie_word_embeddings") else ["lm_head."]
    shards = airllm_dir(workdir) / "splitted_model"
    return all((shards / f"{n}safetensors.done").is_file() for n in names)


def _airllm_class() -> Any:
    import airllm

    class NoTokenizer(airllm.AirLLMBaseModel):
        """AirLLM loads a tokenizer from the checkpoint it is given, to offer it to callers; ours
        holds none (token ids in, token ids out), so there is none to load."""

        def get_tokenizer(self, hf_token: Any = None) -> None:
            return None

    return NoTokenizer


def load_airllm(checkpoint: str, workdir: str, *, prefetching: bool = True) -> Loaded:
    """AirLLM on the CPU (``device="cpu"``, the checkpoint's own dtype) over its per-layer shards in
    :func:`airllm_dir`; it splits the checkpoint there first if they are not all present (its
    one-time conversion, loading the whole checkpoint once per module: done before any
    measurement by :func:`gds_offload.bench.weights.peers_run.prepare_peer`)."""
    cls = _airllm_class()
    am = cls(checkpoint, device="cpu", layer_shards_saving_path=str(airllm_dir(workdir)), prefetching=prefetching)

    def close() -> None:
        if am._executor is not None:  # its prefetch thread
            am._executor.shutdown(wait=True)

    return Loaded(am.model, close=close, settings={"shards": str(am.checkpoint_path), "prefetching": prefetching, "dtype": str(am.running_dtype)})


def deepspeed_nvme_dir(workdir: str | Path) -> Path:
    """DeepSpeed's ``offload_param.nvme_path`` (it swaps into ``zero_stage_3/`` there)."""
    return Path(workdir) / "deepspeed-nvme"


def deepspeed_config(model_config: Any, nvme_path: Path, *, buffer_count: int = 4) -> dict[str, Any]:
    """The ZeRO-Inference configuration for a model of ``model_config``: stage 3, parameters offloaded
    to ``nvme_path`` (the model's own dtype: no fp16/bf16 section).

    ``offload_param.buffer_size`` (elements) must hold the largest parameter (here the embeddings
    or lm_head, ``vocab x hidden``); DeepSpeed allocates ``buffer_count`` such buffers up front,
    page-locked (``mlock``), so they count in full against a memory cap. Each parameter being
    fetched takes one buffer; prefetching is limited to what the other buffers can hold
    (``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``: both ``buffer_count - 1``
    largest parameters). Parameters under ``stage3_param_persistence_threshold`` elements (the
    norms) stay in memory unpartitioned.
    """
    h, inter, vocab = model_config.hidden_size, model_config.intermediate_size, model_config.vocab_size
    largest = max(vocab * h, inter * h)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 10 * h,
            "stage3_prefetch_bucket_size": (buffer_count - 1) * largest,
            "stage3_max_live_parameters": (buffer_count - 1) * largest,
            "stage3_max_reuse_distance": 0,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme_path), "pin_memory": True, "buffer_count": buffer_count,
                              "buffer_size": largest},  # fmt: skip
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False, "overlap_events": True},
        "wall_clock_breakdown": False,
    }


def deepspeed_aio_built() -> tuple[bool, str]:
    """``(ready, why)``: whether DeepSpeed's ``async_io`` op (and the ``pin_memory`` op it loads first)
    are in torch's JIT extension cache, so that ZeRO's NVMe offload starts without compiling
    them (minutes on a small machine; they need ``libaio-dev``). Build them once with
    ``DS_ACCELERATOR=cpu python -c "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()"``."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", ""))  # torch's own rule: this directory as is, else a per-build folder
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        accel = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        root = Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accel}"
    missing = [op for op in ("pin_memory", "async_io") if not (root / op / f"{op}.so").is_file()]
    if missing:
        return False, (f"DeepSpeed's {' and '.join(missing)} op{'s are' if len(missing) > 1 else ' is'} not built in {root} (needs libaio-dev; "
                       'build once: DS_ACCELERATOR=cpu python -c "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()")')  # fmt: skip
    return True, f"built in {root}"


def build_deepspeed_ops(builders: tuple[str, ...] = ("AsyncIOBuilder",), *, timeout_s: float = 1800) -> tuple[bool, str]:
    """``(built, why_not)``: load DeepSpeed's ops (``builders``, names in ``deepspeed.ops.op_builder``;
    ``AsyncIOBuilder`` loads ``pin_memory`` too) once in a child of their own, uncapped, with a
    benchmark child's environment, so that torch's JIT builder finds them up to date when a
    capped child loads them.

    Why: torch re-runs ninja at every load, and a ninja that cannot trust the build log (another
    ninja version wrote it) recompiles; a compiler inside a 1.2 GiB cap fails, and the peer with it."""
    names = ", ".join(builders)
    code = f"from deepspeed.ops.op_builder import {names}; " + "; ".join(f"{b}().load()" for b in builders)
    try:
        done = subprocess.run([sys.executable, "-c", code], env=child_env({"DS_ACCELERATOR": "cpu"}), capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return False, f"building DeepSpeed's ops ({names}) took over {timeout_s:g} s"
    if done.returncode != 0:
        tail = " | ".join(line.strip() for line in done.stderr.strip().splitlines()[-4:])
        return False, f"building DeepSpeed's ops ({names}) failed (exit {done.returncode}): {tail}"[:600]
    return True, ""


#: The Python package each peer needs.
PACKAGES = {"resident": "transformers", "accelerate-disk": "accelerate", "airllm": "airllm", "deepspeed-zero-inference": "deepspeed"}


def peer_support(peer: str) -> tuple[bool, str]:
    """``(runs_here, why_not)``: whether ``peer``'s package is installed (and, for DeepSpeed, its
    ``async_io`` op built: :func:`deepspeed_aio_built`), without importing the package."""
    package = PACKAGES[peer]
    if importlib.util.find_spec(package) is None:
        return False, f"{peer} needs the Python package {package!r}, which is not installed (see the install notes in {__name__})"
    if peer == "deepspeed-zero-inference":
        ready, why = deepspeed_aio_built()
        if not ready:
            return False, f"{peer}: {why}"
    return True, ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_deepspeed(checkpoint: str, workdir: str, *, buffer_count: int = 4) -> Loaded:
    """ZeRO-Inference on DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``), one process with gloo."""
    for k, v in {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cfg = transformers.AutoConfig.from_pretrained(checkpoint)
    nvme = deepspeed_nvme_dir(workdir)
    nvme.mkdir(parents=True, exist_ok=True)
    ds_config = deepspeed_config(cfg, nvme, buffer_count=buffer_count)
    keep = HfDeepSpeedConfig(ds_config)  # must live while the model is built: from_pretrained then uses zero.Init
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=cfg.dtype)
    engine = deepspeed.initialize(model=model, config=ds_config)[0]
    engine.module.eval()
    settings = {"ds_config": ds_config} | _nvme_placement(engine.module, nvme)

    def close() -> None:
        del keep.config
        engine.destroy()
        shutil.rmtree(nvme, ignore_errors=True)
        import deepspeed.comm as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    return Loaded(engine.module, close=close, settings=settings)


def _nvme_placement(model: Any, nvme: Path) -> dict[str, int]:
    """Where ZeRO-3 put the parameters: how many (and their bytes) live on NVMe, how many stay in
    memory (under ``stage3_param_persistence_threshold``, or under 1 MiB: DeepSpeed swaps no smaller
    tensor), and the bytes of its swap files."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    on: list[Any] = []
    off: list[Any] = []
    for p in model.parameters():
        where = getattr(getattr(p, "ds_tensor", None), "final_location", None)
        (on if where == OffloadDeviceEnum.nvme else off).append(p)
    return {"params_on_nvme": len(on), "param_bytes_on_nvme": sum(p.ds_numel * p.element_size() for p in on), "params_in_memory": len(off),
            "nvme_file_bytes": sum(f.stat().st_size for f in nvme.rglob("*") if f.is_file())}  # fmt: skip


#: Each peer's loader, and the reference's: ``loader(checkpoint, workdir) -> Loaded``.
LOADERS: dict[str, Callable[[str, str], Loaded]] = {
    "resident": load_resident,
    "accelerate-disk": load_accelerate_disk,
    "airllm": load_airllm,
    "deepspeed-zero-inference": load_deepspeed,
}
