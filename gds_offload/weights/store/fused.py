"""Checkpoints that transformers changes at load: a store in the model's form.

Transformers 5 merges or splits some checkpoint tensors when it loads them (its
``WeightConverter``s): Mixtral's, Qwen-MoE's, DeepSeek's, OLMoE's... experts, written one tensor
per expert as released checkpoints hold them, become one tensor per layer (``mlp.experts.gate_up_proj``).
A store of such a checkpoint holds each tensor *as the model holds it*: :class:`ModelForm`
runs transformers' own loader (``convert_and_load_state_dict_in_model``, the conversion mapping
``from_pretrained`` uses) on a meta skeleton, once on meta tensors to learn the model's names,
shapes and dtypes (the layout), then layer by layer on the checkpoint's tensors to produce the
bytes, which are then bit-identical to what ``from_pretrained`` puts in the model. The manifest
records it (``source["form"] == "model"``), and :mod:`~gds_offload.weights.streaming.bind`
then takes the store's names as the model's.

A checkpoint that transformers loads as it is (every dense model, gpt-oss's already fused
experts) is stored as it is: :meth:`ModelForm.of` returns ``None``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from gds_offload.errors import ConfigError
from gds_offload.weights.store.hf_checkpoint import Checkpoint, CheckpointTensor

__all__ = ["MODEL_FORM", "ModelForm"]

#: ``manifest.source["form"]`` of a store whose tensors are the model's, not the checkpoint's.
MODEL_FORM = "model"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' loader draws a progress bar per call: none here (convert has its own)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


class ModelForm:
    """A checkpoint's tensors in the form its transformers model holds them (see the module doc).

    Attributes:
        tensors: the model's tensors the checkpoint gives, as :class:`CheckpointTensor` (``file``:
            the checkpoint file of one of their sources), in the model's names.
        sources: for each model tensor, the checkpoint tensors it is made of.
    """

    def __init__(self, checkpoint: Checkpoint, model: Any, mapping_of: Any) -> None:
        self._checkpoint, self._model, self._mapping_of = checkpoint, model, mapping_of
        meta = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="meta") for t in checkpoint.tensors}
        loaded, sources = self._load(meta, device="meta")
        state = model.state_dict()
        file_of = {t.name: t.file for t in checkpoint.tensors}
        self.sources = sources
        self.tensors = [CheckpointTensor(n, str(state[n].dtype).removeprefix("torch."), tuple(state[n].shape), file_of[sources[n][0]])
                        for n in sorted(loaded)]  # fmt: skip

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> ModelForm | None:
        """The model form of ``checkpoint``, or ``None`` when transformers loads its tensors as they
        are (no converter of the model's matches one of them; no config; no transformers)."""
        if checkpoint.config is None:
            return None
        try:
            import transformers
            from transformers import core_model_loading as cml
            from transformers.conversion_mapping import get_model_conversion_mapping
        except ImportError:
            return None
        try:
            config = transformers.AutoConfig.from_pretrained(checkpoint.dir)
        except (OSError, ValueError, KeyError):
            return None  # not a config transformers knows: the store keeps the checkpoint's names
        archs = getattr(config, "architectures", None) or []
        cls_ = getattr(transformers, archs[0], None) if archs else None
        dtypes = [getattr(torch, t.dtype) for t in checkpoint.tensors if getattr(torch, t.dtype).is_floating_point]
        dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
        try:
            with torch.device("meta"):
                if cls_ is not None:
                    model = cls_._from_config(config, dtype=dtype)
                else:
                    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except (ValueError, TypeError, AttributeError, ImportError):
            return None
        mapping = get_model_conversion_mapping(model)
        converters = [c for c in mapping if isinstance(c, cml.WeightConverter)]
        renamings = [c for c in mapping if isinstance(c, cml.WeightRenaming)]
        if not converters:
            return None
        state = model.state_dict()
        if not any(cml.rename_source_key(t.name, renamings, converters, model.base_model_prefix, state)[1] is not None
                   for t in checkpoint.tensors):  # fmt: skip
            return None
        return cls(checkpoint, model, lambda: get_model_conversion_mapping(model))

    def layer(self, names: list[str], handles: dict[Any, Any]) -> dict[str, torch.Tensor]:
        """The model tensors ``names`` (one group's), made from their checkpoint tensors read through
        ``handles`` (:func:`~gds_offload.weights.store.hf_checkpoint.open_tensors`), on the CPU.

        Raises:
            ConfigError: transformers' loader did not produce them all from those tensors.
        """
        wanted = sorted({s for n in names for s in self.sources[n]})
        file_of = {t.name: t.file for t in self._checkpoint.tensors}
        real = {s: handles[file_of[s]].get_tensor(s) for s in wanted}
        loaded, _ = self._load(real, device="cpu")
        state = self._model.state_dict()
        lost = sorted(set(names) - loaded)
        if lost:
            raise ConfigError(f"transformers' loader did not make {', '.join(lost[:4])} from the checkpoint tensors {', '.join(wanted[:4])}...; "
                              "this checkpoint cannot be stored in its model's form")  # fmt: skip
        out = {n: state[n].detach().clone() for n in names}
        self._model.to("meta")  # the layer's real tensors go: one layer is real at a time
        return out

    def _load(self, tensors: dict[str, torch.Tensor], *, device: str) -> tuple[set[str], dict[str, list[str]]]:
        """Load ``tensors`` into the skeleton with transformers' loader: the model tensors it set,
        and, for each, the checkpoint tensors it came from."""
        from transformers import core_model_loading as cml
        from transformers.modeling_utils import LoadStateDictConfig

        mapping = self._mapping_of()
        renamings = [c for c in mapping if isinstance(c, cml.WeightRenaming)]
        converters = [c for c in mapping if isinstance(c, cml.WeightConverter)]
        before = set(self._model.state_dict())
        sources: dict[str, list[str]] = {}
        state = self._model.state_dict()
        for name in tensors:
            target, _ = cml.rename_source_key(name, renamings, converters, self._model.base_model_prefix, state)
            if target not in state and name in state:  # as the loader does: the name as it is, then
                target = name
            sources.setdefault(target, []).append(name)
        with _quiet():
            result = cml.convert_and_load_state_dict_in_model(self._model, tensors, LoadStateDictConfig(weight_mapping=mapping, device_map={"": device}))
        info = result[0] if isinstance(result, tuple) else result
        errors = getattr(info, "conversion_errors", None)
        if errors:
            raise ConfigError(f"transformers could not convert this checkpoint's tensors: {errors}")
        loaded = (before - set(info.missing_keys)) & set(sources)
        return loaded, {n: sorted(sources[n]) for n in loaded}
