"""Streamed inference on a GPU (gds_offload.weights with ``device="cuda"``): layers read from the
store straight into device memory (KvikIO ``CuFile.pread``: GDS where usable, else compat;
posix through host bounce buffers), or copied from a pinned host tier on a side stream, give
logits and tokens ``torch.equal`` to the resident model on the same GPU.

The race tests widen the window in which a slot could be overwritten too early: a pre-hook
queues ``torch.cuda._sleep`` before each layer's kernels (after its parameters point at the
slot), so the CPU runs far ahead of the GPU; with one slot the next layer's fill targets the
slot those kernels are about to read, and only the slot's release event holds it back. They
run on a non-default stream, which nothing but that event orders the fills after.

Marked ``gpu``: ``pytest -m gpu`` (``scripts/gpu_check.sh``) runs them; without CUDA each skips
naming the missing GPU.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.gates import requires_cuda  # noqa: E402
from helpers.llama import VOCAB, assert_same_generation, llama_config, meta_skeleton, resident_model, save_checkpoint  # noqa: E402

from gds_offload.io.kvikio.engine import kvikio_status  # noqa: E402
from gds_offload.weights import as_reference, convert, load_streamed  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_cuda]

#: About 30-60 ms of GPU time per layer: long against a tiny layer's read, short for the suite.
_SLEEP_CYCLES = 60_000_000
_COMPAT = pytest.mark.skipif(not kvikio_status()[0], reason=f"KvikIO unusable: {kvikio_status()[1]}")


@pytest.fixture(scope="module")
def ckpt_store() -> Iterator[tuple[Path, Path]]:
    d = Path(os.environ.get("GDS_TEST_DIR") or real_disk_base()) / f"gds_offload-weights-gpu-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    try:
        ckpt = save_checkpoint(llama_config(), d / "ckpt")
        convert(ckpt, d / "store")
        yield ckpt, d / "store"
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()


def _slow_layers(h: object) -> list[object]:
    """Queue a GPU sleep before every streamed layer's kernels (after the slot is bound)."""
    hooks = []
    for name in h.stats().streamed_layers:  # type: ignore[attr-defined]
        layer = h.model.get_submodule(name)  # type: ignore[attr-defined]
        hooks.append(layer.register_forward_pre_hook(lambda *_: torch.cuda._sleep(_SLEEP_CYCLES)))
    return hooks


@pytest.mark.parametrize(
    ("tier", "engine", "ring"),
    [
        pytest.param("drive", "auto", "device", id="drive-auto"),
        pytest.param("drive", "compat", "device", id="drive-compat", marks=_COMPAT),
        pytest.param("drive", "posix", "device", id="drive-posix"),
        pytest.param("host", "auto", "pinned", id="host"),
    ],
)
def test_cuda_logits_equal_resident(ckpt_store: tuple[Path, Path], ids: torch.Tensor, tier: str, engine: str, ring: str) -> None:
    ckpt, store = ckpt_store
    with torch.no_grad():
        want = resident_model(ckpt).cuda()(ids).logits
        with load_streamed(meta_skeleton(store), store, device="cuda", tier=tier, engine=engine, verify=True) as h:
            for _ in range(3):
                got = h(ids).logits
                assert got.is_cuda and torch.equal(got, want)
            s = h.stats()
    assert s.ring == ring and s.misses == 0 and s.loads == [3] * len(s.streamed_layers)
    assert s.device.startswith("cuda") and (s.host_nbytes > 0) == (tier == "host")


@pytest.mark.parametrize("tier", ["drive", "host"])
def test_cuda_generate_matches_resident(ckpt_store: tuple[Path, Path], ids: torch.Tensor, tier: str) -> None:
    ckpt, store = ckpt_store
    kw = dict(max_new_tokens=6, attention_mask=torch.ones_like(ids), pad_token_id=0, do_sample=False, output_scores=True, return_dict_in_generate=True)
    want = as_reference(resident_model(ckpt).cuda()).generate(ids, **kw)
    with load_streamed(meta_skeleton(store), store, device="cuda", tier=tier, resident_layers=1) as h:
        got = h.generate(ids, **kw)
        assert h.stats().misses == 0
    assert got.sequences.shape[1] == ids.shape[1] + 6 and len(want.scores) == 6
    assert_same_generation(got, want)


@pytest.mark.parametrize("tier", ["drive", "host"])
def test_cuda_slot_not_overwritten_while_a_kernel_reads_it(ckpt_store: tuple[Path, Path], ids: torch.Tensor, tier: str) -> None:
    ckpt, store = ckpt_store
    with torch.no_grad():
        want = resident_model(ckpt).cuda()(ids).logits
        with load_streamed(meta_skeleton(store), store, device="cuda", tier=tier, slots=1) as h:
            hooks = _slow_layers(h)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                got = [h(ids).logits for _ in range(2)]
            torch.cuda.current_stream().wait_stream(side)
            for hook in hooks:
                hook.remove()
    for g in got:
        assert torch.equal(g, want)


def test_cuda_close_leaves_resident_tensors_on_the_gpu(ckpt_store: tuple[Path, Path]) -> None:
    _, store = ckpt_store
    h = load_streamed(meta_skeleton(store), store, device="cuda", tier="host")
    h.close()
    h.close()  # idempotent
    assert h.model.model.embed_tokens.weight.is_cuda and h.model.model.layers[0].mlp.up_proj.weight.is_meta
    assert h.model.model.rotary_emb.inv_freq.is_cuda


#: The tensors trained by the backward tests: resident ones (streamed parameters are frozen).
_TRAIN = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def _train_step(model: torch.nn.Module, ids: torch.Tensor, *, checkpointing: bool = False) -> list[torch.Tensor]:
    """One backward of the language-model loss: ``[loss, grads of _TRAIN...]``."""
    for n, p in model.named_parameters():
        p.requires_grad_(n in _TRAIN)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    params = dict(model.named_parameters())
    return [loss.detach()] + [params[n].grad for n in _TRAIN]


@pytest.mark.parametrize("tier", ["drive", "host"])
def test_cuda_backward_through_streamed_layers_equals_resident(ckpt_store: tuple[Path, Path], ids: torch.Tensor, tier: str) -> None:
    """Gradients to the resident tensors through one-slot streamed layers on the GPU (the weights
    read again for backward, :mod:`gds_offload.weights.streaming.backward`), with the GPU slowed as above."""
    ckpt, store = ckpt_store
    want = _train_step(resident_model(ckpt).cuda(), ids)
    with load_streamed(meta_skeleton(store), store, device="cuda", tier=tier, slots=1) as h:
        hooks = _slow_layers(h)
        got = _train_step(h.model, ids)
        for hook in hooks:
            hook.remove()
        s, n = h.stats(), len(h.stats().streamed_layers)
        # The last layer is still in the one slot after the forward: copied out of it, not read again.
        assert s.backward_reads == [1] * (n - 1) + [0] and s.backward_copies == [0] * (n - 1) + [1]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("tier", ["drive", "host"])
def test_cuda_gradient_checkpointing_recomputes_with_the_streamed_weights(ckpt_store: tuple[Path, Path], ids: torch.Tensor, tier: str) -> None:
    """Hugging Face gradient checkpointing on the GPU: backward's recompute (on the autograd
    device thread) binds each layer again (:mod:`gds_offload.weights.streaming.recompute`)."""
    ckpt, store = ckpt_store
    want = _train_step(resident_model(ckpt).cuda(), ids, checkpointing=True)
    with load_streamed(meta_skeleton(store), store, device="cuda", tier=tier, slots=1) as h:
        got = _train_step(h.model, ids, checkpointing=True)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_cuda_a_gemm_on_a_256_byte_aligned_view_equals_one_on_an_allocator_block() -> None:
    """Why stores place tensors at 256 bytes: cuBLASLt picks kernels by operand alignment. A weight
    viewed at a 256-byte offset of a buffer multiplies like a fresh allocation (512-aligned) does."""
    torch.manual_seed(0)
    w = torch.randn(1000, 1000, device="cuda")
    x = torch.randn(37, 1000, device="cuda")
    buf = torch.empty(4096 + w.numel() * 4, dtype=torch.uint8, device="cuda")
    view = buf[256 : 256 + w.numel() * 4].view(torch.float32).view(1000, 1000)
    view.copy_(w)
    assert view.data_ptr() % 256 == 0
    assert torch.equal(x @ view.t(), x @ w.t())


def test_cuda_a_store_with_64_byte_offsets_warns_that_outputs_may_differ(tmp_path: Path) -> None:
    ckpt = save_checkpoint(llama_config(hidden_size=48, intermediate_size=100), tmp_path / "ckpt")
    convert(ckpt, tmp_path / "store", tensor_align=64)
    with pytest.warns(UserWarning, match="Convert it again"):
        lm = load_streamed(meta_skeleton(tmp_path / "store"), tmp_path / "store", device="cuda")
    lm.close()


def test_cuda_checksum_of_device_bytes_does_not_wait_for_queued_compute() -> None:
    """``verify`` hashes each device fill on an engine thread; its copy to host must not wait for
    the kernels queued on the default stream (that would stall every prefetch behind compute)."""
    from gds_offload.io.integrity import checksum

    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    want = checksum(data.cpu())
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES * 20)  # about a second of GPU time queued on the default stream
    got = checksum(data)
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert got == want and still_busy, "the checksum waited for the default stream's queued kernel"
