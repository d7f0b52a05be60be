"""Ctrl-C, faults and threads against streamed weights: whatever interrupts a forward, a
generate or a backward (a signal at any line of the weight half's code, a read that fails,
cannot start or comes back corrupt, a hook that raises, a second thread), the ring is left
consistent and the next call is ``torch.equal`` to the resident model.

The signals are real (``SIGINT`` sent to this process, handled by Python's own handler, which
raises ``KeyboardInterrupt``), sent at the ``n``-th line event of ``gds_offload/weights``'s code
(a ``sys.settrace`` counter), for every ``n`` a call reaches: deterministic, no timers.
Faults come from :class:`~gds_offload.io.faults.FaultyEngine` through ``use_engine``.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.gates import ENGINES  # noqa: E402

import gds_offload.weights  # noqa: E402
from gds_offload.errors import ConfigError, OffloadError  # noqa: E402
from gds_offload.io.faults import Fault, FaultyEngine  # noqa: E402
from gds_offload.weights import StoreCorruptError, as_reference, convert, load_streamed  # noqa: E402

LAYERS = 3
TRAIN = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
WEIGHTS_DIR = str(Path(gds_offload.weights.__file__).parent)


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip


@pytest.fixture(scope="module")
def ckpt_store() -> Iterator[tuple[Path, Path]]:
    base = real_disk_base() / f"gds_offload-weights-interrupts-{os.getpid()}"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config()).save_pretrained(base / "ckpt")
    convert(base / "ckpt", base / "store")
    yield base / "ckpt", base / "store"
    shutil.rmtree(base, ignore_errors=True)


pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))


def _skeleton(store: Path) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(store)).eval()


def _trainable(model: torch.nn.Module) -> torch.nn.Module:
    for n, p in model.named_parameters():
        p.requires_grad_(n in TRAIN)
    return model


# -- what each workload computes (its result, compared with torch.equal) ------------------------
def _forward(model: torch.nn.Module) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(IDS).logits]


def _generate(model: torch.nn.Module) -> list[torch.Tensor]:
    out = model.generate(IDS, max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return [out.sequences, *out.scores]


def _train(model: torch.nn.Module) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    params = dict(model.named_parameters())
    return [loss.detach(), *(params[n].grad.clone() for n in TRAIN)]


WORKLOADS: dict[str, Callable[[torch.nn.Module], list[torch.Tensor]]] = {
    "forward": _forward,
    "generate": _generate,
    "train": _train,
    "checkpointed": _train,
}


def _prepare(model: torch.nn.Module, workload: str) -> torch.nn.Module:
    """``model`` set up for ``workload``: the trained resident tensors unfrozen, checkpointing on."""
    if workload in ("train", "checkpointed"):
        _trainable(model)
    if workload == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # HF checkpoints layers in train mode only; dropout is 0 in this config
    return model


def _reference(ckpt: Path, workload: str) -> list[torch.Tensor]:
    model = _prepare(as_reference(transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()), workload)
    return WORKLOADS[workload](model)


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what}: result {i} differs from the resident model's"


# -- Ctrl-C at every line ------------------------------------------------------------------------
def _sigint_at(n: int, call: Callable[[], Any]) -> int:
    """Run ``call`` with SIGINT sent to this process at the ``n``-th line event in
    gds_offload/weights (never, if it has fewer); returns the line events it ran. A call that
    received the signal must raise ``KeyboardInterrupt`` (caught here)."""
    count = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(WEIGHTS_DIR):
            return None
        if event == "line":
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGINT)
        return tracer

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "Python's own Ctrl-C handler"
    interrupted = False
    sys.settrace(tracer)
    try:
        call()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sys.settrace(None)
    assert interrupted == (count[0] >= n), f"SIGINT at line event {n} of {count[0]}: KeyboardInterrupt raised={interrupted}"
    return count[0]


_SWEEPS = [
    ("forward", 1, 1, "posix"),
    ("forward", 2, 1, "posix"),
    ("generate", 2, 5, "posix"),
    ("generate", 3, 7, "posix"),
    ("train", 1, 3, "posix"),
    ("train", 2, 5, "posix"),
    ("checkpointed", 1, 5, "posix"),
    ("checkpointed", 2, 7, "posix"),
] + [(w, 2, 4, "compat") for w in ("forward", "train", "checkpointed") if "compat" in ENGINES]


@pytest.mark.parametrize("workload, slots, stride, engine", _SWEEPS)
def test_ctrl_c_at_any_line_leaves_the_next_call_exact(ckpt_store: tuple[Path, Path], workload: str, slots: int, stride: int, engine: str) -> None:
    """SIGINT at line event 1, 1 + stride, ... of every event the call reaches (a stride > 1 keeps
    the slow workloads' sweeps short); after each, the next call equals the resident model."""
    ckpt, store = ckpt_store
    want = _reference(ckpt, workload)
    run = WORKLOADS[workload]
    with load_streamed(_skeleton(store), store, slots=slots, engine=engine) as lm:
        model = _prepare(lm.model, workload)
        total = _sigint_at(10**9, lambda: run(model))
        assert total > 100, "the call runs the weight half's code"
        for n in range(1, total + 1, stride):
            _sigint_at(n, lambda: run(model))
            _assert_same(run(model), want, f"the call after SIGINT at line event {n} of {total}")


# -- faults at every read ------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("workload", ["forward", "train", "checkpointed"])
@pytest.mark.parametrize("kind", ["eio", "raise", "corrupt"])
def test_a_failed_read_anywhere_leaves_the_next_call_exact(ckpt_store: tuple[Path, Path], engine: str, workload: str, kind: str) -> None:
    """Each read of a call (a prefetch, a miss, a backward read, a recompute's) fails in turn,
    once: the call raises, naming the layer, and the next one is exact (the failed slot is read again)."""
    ckpt, store = ckpt_store
    want = _reference(ckpt, workload)
    run = WORKLOADS[workload]
    verify = kind == "corrupt"
    expected = StoreCorruptError if verify else OffloadError
    with load_streamed(_skeleton(store), store, slots=2, engine=engine, verify=verify) as lm:
        model = _prepare(lm.model, workload)
        counting = FaultyEngine(lm.engine)  # type: ignore[arg-type]
        lm.use_engine(counting)
        run(model)
        reads = counting.counts()["read"]
        assert reads >= LAYERS
        for nth in range(1, reads + 1):
            counting.add(Fault("read", kind, nth=counting.counts()["read"] + 1))  # the next read of the call after this one
            with pytest.raises(expected, match=r"model\.layers\.\d|injected"):
                run(model)
            _assert_same(run(model), want, f"the call after read {nth} of {reads} failed ({kind})")
        assert not counting.overlaps


def test_ctrl_c_while_a_layer_waits_for_its_read_keeps_the_slot(ckpt_store: tuple[Path, Path]) -> None:
    """The read of layer 1 is held in flight; Ctrl-C comes while the forward waits for it (layer 0
    has run). The slot must stay with that read: a new read into it, or a layer computing from it,
    before the held read has landed would mix two layers' bytes."""
    ckpt, store = ckpt_store
    want = _reference(ckpt, "forward")
    main = threading.main_thread()
    with load_streamed(_skeleton(store), store, slots=2) as lm:
        faulty = FaultyEngine(lm.engine, [Fault("read", "hold", nth=2)])  # type: ignore[arg-type]
        lm.use_engine(faulty)  # refills the ring through it: layer 0's read, then layer 1's, which is held
        try:
            assert faulty.holding() == 1
            interrupter = threading.Thread(target=lambda: (_until_blocked(main), os.kill(os.getpid(), signal.SIGINT)))
            interrupter.start()
            with pytest.raises(KeyboardInterrupt):
                _forward(lm.model)
            interrupter.join()
            assert faulty.holding() == 1, "the held read is still in flight"
            resumer = threading.Thread(target=lambda: (_until_blocked(main), faulty.resume()))
            resumer.start()
            _assert_same(_forward(lm.model), want, "the forward after Ctrl-C during a read")
            resumer.join()
            assert not faulty.overlaps, faulty.overlaps
            _assert_same(_forward(lm.model), want, "the forward after that")
        finally:
            faulty.resume()  # never leave a read held: close() waits for it


def _until_blocked(thread: threading.Thread) -> None:
    """Return once ``thread`` is blocked waiting for a transfer (an ``IOFuture``'s wait on a condition)."""
    while True:
        frame = sys._current_frames().get(thread.ident or 0)
        names = set()
        while frame is not None:
            names.add((Path(frame.f_code.co_filename).name, frame.f_code.co_name))
            frame = frame.f_back
        if ("threading.py", "wait") in names and {("base.py", "error"), ("base.py", "wait")} & names:
            return
        threading.Event().wait(0.001)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("where", ["pre-hook", "post-hook", "layer"])
def test_an_exception_in_a_layer_or_its_hooks_leaves_the_next_call_exact(ckpt_store: tuple[Path, Path], where: str, engine: str) -> None:
    """A user's hook that raises before our pre-hook's binding is used, one before our post-hook
    (it then runs from torch's ``always_call`` path), or the layer's own forward raising."""
    ckpt, store = ckpt_store
    want = _reference(ckpt, "train")
    with load_streamed(_skeleton(store), store, slots=1, engine=engine) as lm:
        model = _prepare(lm.model, "train")
        layer = model.model.layers[1]

        def boom(*args: Any) -> None:
            raise RuntimeError("boom")

        if where == "pre-hook":
            handle = layer.register_forward_pre_hook(boom)
        elif where == "post-hook":
            handle = layer.register_forward_hook(boom, prepend=True)
        else:
            handle = layer.mlp.register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            _train(model)
        handle.remove()
        _assert_same(_train(model), want, f"the step after an exception in the {where}")


# -- threads -------------------------------------------------------------------------------------
def test_a_second_thread_is_refused_at_once_and_the_first_is_exact(ckpt_store: tuple[Path, Path]) -> None:
    ckpt, store = ckpt_store
    want = _reference(ckpt, "forward")
    inside, go_on = threading.Event(), threading.Event()
    with load_streamed(_skeleton(store), store, slots=2) as lm:

        def park(*args: Any) -> None:
            inside.set()
            assert go_on.wait(30)

        handle = lm.model.model.layers[1].register_forward_pre_hook(park)
        got: list[Any] = []
        first = threading.Thread(target=lambda: got.append(_forward(lm.model)))
        first.start()
        assert inside.wait(30)
        with pytest.raises(OffloadError, match="another thread is running the StreamedModel"):
            _forward(lm.model)  # refused at once: the first thread is parked inside its forward
        with pytest.raises(OffloadError, match="another thread"):
            with torch.no_grad():
                lm.model.model.layers[2](torch.zeros(1, 2, 32))  # a layer called on its own, too
        go_on.set()
        first.join()
        handle.remove()
        _assert_same(got[0], want, "the first thread's forward")
        _assert_same(_forward(lm.model), want, "a forward after it")


def test_threads_taking_turns_are_exact(ckpt_store: tuple[Path, Path]) -> None:
    ckpt, store = ckpt_store
    want = _reference(ckpt, "forward")
    results: list[Any] = []
    errors: list[BaseException] = []
    with load_streamed(_skeleton(store), store, slots=2) as lm:

        def worker() -> None:
            for _ in range(10):
                try:
                    results.append(_forward(lm.model))
                except OffloadError as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) + len(errors) == 40 and results
    for r in results:
        _assert_same(r, want, "a forward that was not refused")
    assert all("another thread" in str(e) for e in errors)


# -- closed, claimed, arguments ------------------------------------------------------------------
def test_calling_a_closed_model_says_so(ckpt_store: tuple[Path, Path]) -> None:
    ckpt, store = ckpt_store
    model = _skeleton(store)
    lm = load_streamed(model, store)
    lm.close()
    assert lm.closed
    with pytest.raises(OffloadError, match="was closed.*load the store again"):
        _forward(model)
    with load_streamed(model, store) as again:  # the same skeleton streams again
        _assert_same(_forward(again.model), _reference(ckpt, "forward"), "a skeleton loaded again after close")


def test_a_model_streamed_twice_at_once_is_refused(ckpt_store: tuple[Path, Path]) -> None:
    _, store = ckpt_store
    model = _skeleton(store)
    with load_streamed(model, store):
        with pytest.raises(ConfigError, match="already streamed.*close\\(\\) it first"):
            load_streamed(model, store)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"slots": 1.5}, r"slots=1\.5 \(float\) must be an int >= 1"),
        ({"slots": "2"}, r"slots='2' \(str\) must be an int"),
        ({"slots": True}, r"slots=True \(bool\) must be an int"),
        ({"slots": 0}, r"slots=0 must be an int >= 1"),
        ({"resident_layers": 1.0}, r"resident_layers=1\.0 \(float\) must be an int >= 0"),
        ({"resident_layers": -1}, r"resident_layers=-1 must be an int >= 0"),
        ({"num_threads": "4"}, r"num_threads='4' \(str\) must be an int >= 1"),
        ({"verify": "no"}, r"verify='no' \(str\) must be True or False"),
        ({"verify": 1}, r"verify=1 \(int\) must be True or False"),
        ({"max_memory": [1]}, r"max_memory=\[1\] \(list\) is not a size"),
        ({"max_memory": "lots"}, r"max_memory='lots' is not a size"),
        ({"tier": "ssd"}, r"tier='ssd': expected 'drive'"),
        ({"engine": 3}, r"engine=3 is not an engine"),
        ({"device": 0}, r"device=0 \(int\) is not a torch device"),
    ],
)
def test_bad_arguments_are_one_config_error_before_anything_is_read(ckpt_store: tuple[Path, Path], kw: dict[str, Any], match: str) -> None:
    _, store = ckpt_store
    model = _skeleton(store)
    with pytest.raises(ConfigError, match=match):
        load_streamed(model, store, **kw)
    assert all(p.is_meta for p in model.parameters()), "nothing was loaded"
