"""Full fine-tuning of a streamed model: every weight trains, the streamed layers' weights and
optimizer state live on the drive (:class:`StreamedTrainer`).

``trainer.step(batches)`` does what resident training does with one optimizer over every parameter::

    for batch in batches:
        loss(model(**batch), batch).backward()
    clip_grad_norm_(model.parameters(), max_norm)        # when max_norm is given
    optimizer.step(); optimizer.zero_grad()

* Forward and backward are :meth:`StreamedModel.accumulate
  <gds_offload.weights.run.model.StreamedModel.accumulate>` (``per_load`` micro-batches per weight
  load), with the streamed layers' parameters trainable (:meth:`StreamedModel.train_layers
  <gds_offload.weights.run.model.StreamedModel.train_layers>`): each gradient is taken off the
  slot's parameter as autograd accumulates it and summed per parameter in the order autograd
  would sum it into ``.grad``.
* Clipping by global norm: the norm of each gradient, then of those norms in the model's
  parameter order, then each gradient scaled, as ``torch.nn.utils.clip_grad_norm_`` does.
* The update, layer by layer: the layer's weights of the current step read from the drive (and
  checked), its optimizer state read, the user's optimizer class built over that layer alone
  (``optimizer(params)``, with the hyperparameters of :attr:`StreamedTrainer.optimizer`'s first
  group, so a scheduler stepping that one steers every layer), stepped, and the new weights and
  state written to the next generation (:mod:`gds_offload.weights.store.steps`). The resident
  parameters (embeddings, head, norms, resident layers) are updated by :attr:`optimizer`, and
  written to the same generation with its state, so a step is on the drive whole or not at all.

Exact: the per-parameter update of ``torch.optim``'s single-tensor and foreach paths does not
depend on which other parameters share the optimizer, so weights, optimizer state and losses
are ``torch.equal`` to resident training with the same optimizer on the same micro-batches.

Mixed precision (bf16 compute over fp32 masters): call ``step`` inside ``torch.autocast(device_type,
dtype=torch.bfloat16)``, as resident AMP training runs forward and backward there. The store's
fp32 weights are the masters, autocast casts them for its matmuls, gradients and optimizer state
stay fp32, and clipping and every update run outside autocast (the trainer leaves it, also when a
layer's update runs inside backward), so the result is ``torch.equal`` to resident training whose
``loss.backward()`` runs under the same autocast and whose ``optimizer.step()`` runs after it.

Without clipping, a layer is updated in backward, as soon as the last micro-batch's gradient
of its last parameter is in (on the thread running backward), so one layer's gradient is held
at a time, plus the writes in flight (four buffers at most). The next layer's weights and state
are read while a layer updates (one more layer's of each in memory), and a state the optimizer
updated in place is written from the buffer it was read into (no copy).

.. warning:: Costs of this version
   With ``max_norm`` every streamed layer's gradient is held in host memory until the norm is
   known (the streamed weights' size); the update's compute runs between the backward of its
   layer and the one below (only its reads and writes overlap them); each layer is read once
   more for its update. A gradient checkpointed model, LoRA adapters (use
   :meth:`StreamedModel.accumulate` for those), ``verify=True``, ``tier="host"`` and optimizers
   whose step needs every parameter at once (LBFGS) are refused.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gds_offload.errors import ConfigError
from gds_offload.io.base import Engine
from gds_offload.io.directory import missing_parent
from gds_offload.io.factory import make_engine
from gds_offload.runtime.interrupts import held
from gds_offload.weights.run.accumulate import Loss
from gds_offload.weights.run.model import StreamedModel
from gds_offload.weights.store.files import StoreFiles, aligned_host_buffer, view_of
from gds_offload.weights.store.manifest import GroupEntry
from gds_offload.weights.store.steps import Generations, GroupRead, StateRead, StepWriter
from gds_offload.weights.streaming.adapters import unwrap

__all__ = ["StreamedTrainer"]

#: ``optimizer(params) -> torch.optim.Optimizer``: e.g. ``functools.partial(torch.optim.AdamW, lr=1e-4)``.
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
_RESIDENT = "resident"  # the state group of every parameter held in memory


class StreamedTrainer:
    """Train every parameter of ``lm`` (see the module doc).

    Args:
        lm: a :class:`StreamedModel` of a plain transformers model, ``tier="drive"``.
        optimizer: builds the optimizer for a list of parameters (called once for the resident
            parameters, kept as :attr:`optimizer`, and at every step for each streamed layer).
        state_dir: where the steps go (default ``STORE/train``); an existing one is resumed at its last
            complete step, a new one starts from the converted weights: ``lm`` is put at that step's
            weights whichever step :func:`~gds_offload.weights.run.model.load_streamed` read.

    Raises:
        ConfigError: LoRA adapters, ``verify=True``, nothing streamed from the drive, an
            ``optimizer`` that does not build a ``torch.optim.Optimizer``.
        StoreFormatError, StoreCorruptError: a damaged training directory.
    """

    def __init__(self, lm: StreamedModel, optimizer: OptimizerFactory, *, state_dir: str | os.PathLike[str] | None = None) -> None:
        base, _ = unwrap(lm.model)
        if base is not lm.model:
            raise ConfigError("StreamedTrainer trains every weight of a plain model; for LoRA adapters use lm.accumulate(batches) and your optimizer")
        if lm.verify:
            raise ConfigError("verify=True checks the checksums of the weights load_streamed read, which every step changes; "
                              "load_streamed(..., verify=False) (the trainer checks every step's bytes itself)")  # fmt: skip
        if lm.engine is None:
            raise ConfigError("StreamedTrainer needs layers streamed from the drive (tier='drive', at least one layer not resident)")
        if any(getattr(m, "gradient_checkpointing", False) is True for m in base.modules()):
            raise ConfigError("StreamedTrainer does not train a gradient-checkpointed model yet; call model.gradient_checkpointing_disable() "
                              "(offload activations with gds_offload.attach(lm.model) instead)")  # fmt: skip
        if not callable(optimizer):
            raise ConfigError(f"optimizer={optimizer!r}: give a callable building a torch.optim.Optimizer from a list of parameters, "
                              "e.g. functools.partial(torch.optim.AdamW, lr=1e-4)")  # fmt: skip
        no_parent = None if state_dir is None else missing_parent(Path(state_dir))
        if no_parent is not None:
            raise ConfigError(f"state_dir={str(state_dir)!r}: {no_parent}")
        self._lm, self._base, self._factory = lm, base, optimizer
        manifest = lm.manifest
        stats = lm.stats()
        self._streamed = [manifest.group(n) for n in stats.streamed_layers]
        held_groups = ([manifest.resident] if manifest.resident else []) + [manifest.group(n) for n in stats.resident_layers]
        self._in_memory: list[GroupEntry] = held_groups
        self._resident = {n: self._model_tensor(n) for g in held_groups for n in lm.binding.by_group.get(g.name, [])}
        params = [t for t in self._resident.values() if isinstance(t, nn.Parameter)]
        for p in params:
            p.requires_grad_(True)
        #: The optimizer of the parameters held in memory; its first group's hyperparameters steer the streamed layers' too.
        self.optimizer = self._build(list(dict.fromkeys(params)), what="the resident parameters")
        self._gens = Generations(Path(state_dir) if state_dir is not None else lm.store_dirs[0] / "train", manifest, lm.store_dirs)
        self._gens.check_writable(_state_ratio(optimizer))
        self._engine = make_engine(lm.engine.name, num_threads=4)  # type: ignore[arg-type]  # the engine the layers stream through
        self._grads: dict[int, dict[str, torch.Tensor]] = {}
        self._params_of = [[n for n in lm.binding.by_group.get(g.name, []) if lm.binding.targets[n][0].is_param] for g in self._streamed]
        self._pending = _Pending(self._gens, self._engine, micro_batches=None)
        try:
            if self._gens.current.generation is not None or lm.step != 0:
                self._restore()
            lm.train_layers(self._on_grad)
        except BaseException:
            self._engine.close()
            raise

    # -- public -------------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Optimizer steps on the drive (0: the converted store)."""
        return self._gens.current.step

    @property
    def state_dir(self) -> Path:
        return self._gens.root

    def step(
        self,
        batches: Sequence[Mapping[str, Any]],
        *,
        per_load: int | None = None,
        max_norm: float | None = None,
        loss: Loss | None = None,
        seed: int | None = None,
    ) -> list[torch.Tensor]:
        """One optimizer step over the micro-batches ``batches`` (see the module doc); their losses, in order.

        Args:
            per_load, loss, seed: as :meth:`StreamedModel.accumulate`.
            max_norm: clip the gradients to this global 2-norm first.
        """
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ConfigError(f"max_norm={max_norm!r}: give a positive number, or None for no clipping")
        # Without clipping a layer is updated as soon as its last micro-batch's gradient is in (its
        # gradient then leaves memory); clipping needs every gradient's norm first.
        self._pending = _Pending(self._gens, self._engine, micro_batches=len(batches) if max_norm is None else None)
        try:
            losses = self._lm.accumulate(batches, per_load=per_load, loss=loss, seed=seed)
            with self._no_autocast():  # as resident AMP: clipping and the update outside autocast
                if max_norm is not None:
                    self._clip(float(max_norm))
                self._finish()
        except BaseException:
            if not self._pending.committed:
                with held():
                    self._restore()
            raise
        finally:
            self._pending.close()
            self._grads = {}
        return losses

    def close(self) -> None:
        """Close the trainer's engine (the model stays open; close it yourself)."""
        self._engine.close()

    def __enter__(self) -> StreamedTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the step -----------------------------------------------------------------------------
    def _on_grad(self, pos: int, name: str, grad: torch.Tensor) -> None:
        if grad.device.type != "cpu":
            grad = grad.cpu()  # held in host memory until the update (additions round alike on both)
        acc = self._grads.setdefault(pos, {})
        if name in acc:
            acc[name].add_(grad)  # AccumulateGrad's in-place sum, in the same order
        else:
            acc[name] = grad
        p = self._pending
        if p.count(pos, name) and all(p.counts[pos].get(n, 0) == p.micro_batches for n in self._params_of[pos]):
            with self._no_autocast():  # backward runs inside the caller's autocast; the update never does
                # Every micro-batch's gradient is in; backward reaches the layer below next.
                self._update_layer(pos, self._streamed[pos], p.files, p.writer(), after=pos - 1 if pos > 0 else None)
            p.done.add(pos)
            del self._grads[pos]

    def _clip(self, max_norm: float) -> None:
        streamed = {n: g for acc in self._grads.values() for n, g in acc.items()}
        grads = []
        for name, p in self._base.named_parameters():
            g = p.grad if not p.is_meta else streamed.get(name)
            if g is not None:
                grads.append(g)
        if not grads:
            return
        # As torch.nn.utils.get_total_norm: grouped by dtype (in order of appearance), each gradient's norm
        # where the model computes (foreach kernels on a GPU), then the norm of those norms.
        dev = self._lm.device
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        norms = [torch.linalg.vector_norm(g, 2.0) if dev.type == "cpu" else torch._foreach_norm([g.to(dev)], 2.0)[0]
                 for group in by_dtype.values() for g in group]  # fmt: skip
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))

    def _finish(self) -> None:
        p = self._pending
        writer = p.writer()
        left = [pos for pos in range(len(self._streamed)) if pos not in p.done]
        for pos, after in zip(left, [*left[1:], None]):
            self._update_layer(pos, self._streamed[pos], p.files, writer, after=after)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for g in self._in_memory:
            writer.write_group(g, self._pack(g))
        writer.write_state(_RESIDENT, self._state_entries(self.optimizer, self._resident))
        with held():  # the step on the drive and the files the model reads change together
            step = self._gens.commit(writer)
            p.committed = True
            self._lm.use_files(self._gens.files(step), step=step.step).close()

    def _update_layer(self, pos: int, g: GroupEntry, files: StoreFiles, writer: StepWriter, *, after: int | None) -> None:
        """Update streamed layer ``pos``; the reads of layer ``after`` (the next to update) start once
        this one's have landed, so they overlap this update and the backward before the next."""
        read = self._pending.reads.pop(pos, None) or self._start_read(g, files)
        try:
            buf, stored = read.weights.wait(), read.state.wait()
        finally:
            read.close()
        if after is not None and after not in self._pending.reads:
            self._pending.reads[after] = self._start_read(self._streamed[after], files)
        binding, dev = self._lm.binding, self._lm.device
        views = {n: view_of(buf, binding.entries[n], g.offset) for n in binding.by_group.get(g.name, []) if binding.targets[n][0].is_param}
        # The update runs where the model computes (the resident one's optimizer does too): on a GPU a copy of the layer there.
        params = {n: nn.Parameter(v if dev.type == "cpu" else v.to(dev)) for n, v in views.items()}
        grads = self._grads.get(pos, {})
        for n, p in params.items():
            grad = grads.get(n)
            p.grad = None if grad is None else grad.to(dev)
        opt = self._build(list(params.values()), what=f"layer {g.layer} ({g.name})")
        hyper = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        opt.param_groups[0].update(hyper)
        for n, state in stored.items():
            if n in params:
                opt.state[params[n]] = {k: v.to(dev) if dev.type != "cpu" and k != "step" else v for k, v in state.items()}
        opt.step()
        if dev.type != "cpu":
            for n, v in views.items():
                v.copy_(params[n].detach())
        # Updated in place, the state is still where it was read: that buffer is written as is.
        writer.write_state(g.name, [(n, k, t.cpu()) for n, k, t in self._state_entries(opt, params)], read=read.state)
        writer.write_group(g, buf)

    def _start_read(self, g: GroupEntry, files: StoreFiles) -> _LayerRead:
        weights = self._gens.start_group(self._engine, files, g)
        try:
            return _LayerRead(weights, self._gens.start_state(self._engine, g.name))
        except BaseException:
            weights.close()
            raise

    # -- helpers ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _no_autocast(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for kind in dict.fromkeys(("cpu", self._lm.device.type)):
                stack.enter_context(torch.autocast(kind, enabled=False))
            yield

    def _build(self, params: list[nn.Parameter], *, what: str) -> torch.optim.Optimizer:
        opt = self._factory(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"optimizer(params) for {what} returned a {type(opt).__name__}, not a torch.optim.Optimizer")
        if isinstance(opt, torch.optim.LBFGS):
            # Its step re-evaluates the loss through a closure and its history spans every parameter at once.
            raise ConfigError(f"optimizer(params) for {what} is LBFGS, whose step needs the whole model's loss and gradients at once; "
                              "the trainer applies the optimizer layer by layer: use a per-parameter one (AdamW, Adam, SGD, ...)")
        if len(opt.param_groups) != 1:
            raise ConfigError(f"optimizer(params) for {what} made {len(opt.param_groups)} parameter groups; the trainer applies it "
                              "per layer and needs exactly one")  # fmt: skip
        return opt

    @staticmethod
    def _state_entries(opt: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]) -> list[tuple[str, str, torch.Tensor]]:
        out = []
        seen: set[int] = set()
        for n, p in params.items():
            if id(p) in seen:
                continue
            seen.add(id(p))
            for key, value in sorted(opt.state.get(p, {}).items()):
                if value is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    raise ConfigError(f"the optimizer's state {key!r} of {n} is a {type(value).__name__}; the trainer stores tensors only")
                out.append((n, key, value))
        return out

    def _model_tensor(self, name: str) -> torch.Tensor:
        t = self._lm.binding.targets[name][0]
        return (t.module._parameters if t.is_param else t.module._buffers)[t.leaf]  # type: ignore[return-value]

    def _pack(self, g: GroupEntry) -> torch.Tensor:
        buf = aligned_host_buffer(g.padded_nbytes)
        buf.zero_()
        for n in self._lm.binding.by_group.get(g.name, []):
            e = self._lm.binding.entries[n]
            view_of(buf, e, g.offset).copy_(self._resident[n].detach())
        return buf

    def _restore(self) -> None:
        """Put the current step's resident tensors and optimizer state in place, drop any gradient,
        and read the streamed layers from its files: at load, and after a step that raised (a
        Ctrl-C or an I/O error mid-update leaves memory as the last complete step had it)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
        files = self._gens.files()
        try:
            with torch.no_grad():
                for g in self._in_memory:
                    buf = self._gens.read_group(self._engine, files, g)
                    for n in self._lm.binding.by_group.get(g.name, []):
                        self._resident[n].copy_(view_of(buf, self._lm.binding.entries[n], g.offset))
        finally:
            files.close()
        for n, state in self._gens.read_state(self._engine, _RESIDENT).items():
            p = self._resident.get(n)
            if p is not None:
                self.optimizer.state[p] = {k: v if k == "step" else v.to(p.device) for k, v in state.items()}
        self._lm.use_files(self._gens.files(), step=self._gens.current.step).close()

    def state_of(self, name: str) -> dict[str, torch.Tensor]:
        """The optimizer state of parameter ``name`` (the store's name) after the last step: the
        resident optimizer's, or read from the drive for a streamed layer's (``{}`` before any step)."""
        if name in self._resident:
            return dict(self.optimizer.state.get(self._resident[name], {}))
        entry = self._lm.binding.entries.get(name)
        if entry is None:
            raise ConfigError(f"{name!r} is not a tensor of this model's store")
        return self._gens.read_state(self._engine, entry.group).get(name, {})


@dataclass(eq=False)
class _LayerRead:
    """A streamed layer's weights and optimizer state of the current step, being read for its update."""

    weights: GroupRead
    state: StateRead

    def close(self) -> None:
        """Wait for both reads to land (their buffers are in use until then) and close the state file."""
        self.weights.close()
        self.state.close()


class _Pending:
    """One step in progress: the files of the step it reads, the writer of the next (made at first
    use), and, when layers are updated as their gradients complete, how many each parameter got."""

    def __init__(self, gens: Generations, engine: Engine, *, micro_batches: int | None) -> None:
        self._gens, self._engine, self.micro_batches = gens, engine, micro_batches
        self.counts: dict[int, dict[str, int]] = {}
        self.done: set[int] = set()
        self.committed = False
        self._files: StoreFiles | None = None
        self._writer: StepWriter | None = None
        #: Layers whose reads for their update started ahead of it (closed before the files they read).
        self.reads: dict[int, _LayerRead] = {}

    @property
    def files(self) -> StoreFiles:
        if self._files is None:
            self._files = self._gens.files()
        return self._files

    def writer(self) -> StepWriter:
        if self._writer is None:
            self._writer = self._gens.begin(self._engine)
        return self._writer

    def count(self, pos: int, name: str) -> bool:
        """Count a gradient of ``name``; whether layers are updated as they complete."""
        if self.micro_batches is None:
            return False
        c = self.counts.setdefault(pos, {})
        c[name] = c.get(name, 0) + 1
        return True

    def close(self) -> None:
        for read in self.reads.values():
            read.close()
        self.reads.clear()
        if self._writer is not None and not self.committed:
            self._writer.close()  # abandoned: step.json still names the step before
        if self._files is not None:
            self._files.close()


def _state_ratio(optimizer: OptimizerFactory) -> float:
    """Bytes of optimizer state per byte of weights that ``optimizer`` keeps (AdamW: 2, SGD with
    momentum: 1), measured on a small probe parameter after one step; scalar entries (``step``) not counted."""
    probe = nn.Parameter(torch.zeros(256))
    probe.grad = torch.ones(256)
    try:
        opt = optimizer([probe])
        opt.step()
    except Exception:  # noqa: BLE001 - an optimizer the probe cannot step: assume Adam's two moments
        return 2.0
    kept = sum(t.nbytes for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.numel() > 1)
    return kept / probe.nbytes
