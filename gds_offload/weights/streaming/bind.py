"""Matching a model skeleton's tensors to a store's, and putting real tensors in their place.

:func:`bind` compares every parameter and persistent buffer of the model (on the meta
device, or anywhere) with the manifest, tied weights included: names that hold the same
tensor object (``lm_head.weight`` and ``model.embed_tokens.weight`` under
``tie_word_embeddings``) form one *alias group*, satisfied by any one of its names in the
store, and get one shared tensor, so the tie survives. As ``from_pretrained`` does, a tie
whose names the store holds with different values (a config that says tie over a checkpoint
with its own ``lm_head``) is broken: each name gets its own tensor. Any difference is reported at
once, all of it: :class:`~gds_offload.weights.errors.WeightsMismatchError`.

:meth:`Binding.place` swaps a tensor into every place its alias group occupies
(parameters as ``nn.Parameter(requires_grad=False)``, buffers as they are), without
``__setattr__`` or copies, so it is cheap enough for a forward pre-hook.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gds_offload.errors import ConfigError
from gds_offload.weights.errors import WeightsMismatchError
from gds_offload.weights.store.advice import reconvert_command
from gds_offload.weights.store.files import view_of
from gds_offload.weights.store.fused import MODEL_FORM
from gds_offload.weights.store.manifest import RESIDENT, GroupEntry, Manifest, TensorEntry

__all__ = ["Target", "Binding", "bind", "rebuild_meta_buffers"]

_SHOWN = 8


@dataclass(frozen=True)
class Target:
    """One place a tensor lives in the model: ``module._parameters[leaf]`` or ``module._buffers[leaf]``."""

    name: str
    module: nn.Module
    leaf: str
    is_param: bool
    #: What was there before binding (a meta tensor, usually): put back by :meth:`Binding.restore`.
    placeholder: torch.Tensor


@dataclass
class Binding:
    """For each store tensor the model uses: its entry and every place it goes."""

    entries: dict[str, TensorEntry] = field(default_factory=dict)
    targets: dict[str, list[Target]] = field(default_factory=dict)
    #: group name -> the store names bound in it, in manifest order.
    by_group: dict[str, list[str]] = field(default_factory=dict)

    def place(self, name: str, tensor: torch.Tensor | nn.Parameter) -> None:
        """Put ``tensor`` (as one shared ``nn.Parameter`` for parameters) in every place of ``name``."""
        for t in self.targets[name]:
            _slots(t)[t.leaf] = tensor

    def as_parameter(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as it should be placed for ``name``: an ``nn.Parameter`` if ``name`` is a parameter."""
        return nn.Parameter(tensor, requires_grad=False) if self.targets[name][0].is_param else tensor

    def restore(self, name: str) -> None:
        """Put the placeholders back in every place of ``name``."""
        for t in self.targets[name]:
            _slots(t)[t.leaf] = t.placeholder

    def views_of(self, group: GroupEntry, buf: torch.Tensor,
                 on_grad: Callable[[str, torch.Tensor], None] | None = None) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
        """``(name, tensor)`` for each tensor of ``group`` bound here, as views of ``buf`` (the group's
        bytes), each as :meth:`as_parameter` makes it; with ``on_grad``, parameters are trainable
        and, once autograd accumulates a gradient into one, ``on_grad(name, grad)`` takes it
        (``.grad`` is reset)."""
        views = []
        for n in self.by_group.get(group.name, []):
            t = self.as_parameter(n, view_of(buf, self.entries[n], group.offset))
            if on_grad is not None and isinstance(t, nn.Parameter):
                t.requires_grad_(True)
                t.register_post_accumulate_grad_hook(functools.partial(_hand_over, on_grad, n))
            views.append((n, t))
        return views


def _hand_over(on_grad: Callable[[str, torch.Tensor], None], name: str, param: torch.Tensor) -> None:
    grad, param.grad = param.grad, None
    assert grad is not None
    on_grad(name, grad)


def _slots(t: Target) -> dict[str, Any]:
    """The module dict that holds ``t``: its ``_parameters`` or its ``_buffers``.

    Written directly, not through ``Module.__setattr__``: the name is already registered there, and
    what goes in is whatever :meth:`Binding.as_parameter` made for it (a Parameter or a Tensor), hence ``Any``.
    """
    return t.module._parameters if t.is_param else t.module._buffers


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _model_tensors(model: nn.Module) -> dict[int, list[Target]]:
    """Every parameter and persistent buffer of ``model``, grouped by tensor identity and declared ties."""
    groups: dict[int, list[Target]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for leaf, p in mod._parameters.items():
            if p is not None:
                groups.setdefault(id(p), []).append(Target(prefix + leaf, mod, leaf, True, p))
        for leaf, b in mod._buffers.items():
            if b is not None and leaf not in mod._non_persistent_buffers_set:
                groups.setdefault(id(b), []).append(Target(prefix + leaf, mod, leaf, False, b))
    # Ties a Hugging Face model declares but the skeleton lost (accelerate.init_empty_weights
    # gives each name its own meta parameter): {"lm_head.weight": "model.embed_tokens.weight"}.
    declared = getattr(model, "all_tied_weights_keys", None) or {}
    key_of = {t.name: k for k, ts in groups.items() for t in ts}
    for target, source in declared.items() if isinstance(declared, dict) else ():
        a, b = key_of.get(target), key_of.get(source)
        if a is not None and b is not None and a != b:
            for t in groups[a]:
                key_of[t.name] = b
            groups[b].extend(groups.pop(a))
    return groups


def _listing(title: str, items: list[str]) -> str:
    shown = "; ".join(items[:_SHOWN]) + (f"; ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")
    return f"\n  {title} ({len(items)}): {shown}"


def bind(model: nn.Module, manifest: Manifest, *, where: str, rename: Callable[[str], str | None] | None = None) -> Binding:
    """Match ``model`` to ``manifest``. ``rename(model_name)``: the store's name for a model
    tensor, or ``None`` for one no store holds (LoRA adapters, :mod:`gds_offload.weights.streaming.adapters`).

    Raises:
        WeightsMismatchError: some model tensors are not in the store (missing), some store
            tensors are not in the model (extra), or shapes or dtypes differ; lists them all.
        ConfigError: a tied group spans a layer and something outside it (cannot be streamed).
    """
    entries = {t.name: t for t in manifest.tensors}
    # A store in the model's form (store/fused.py) holds the model's names already.
    redo = reconvert_command([where], manifest.source.get("checkpoint"))
    to_model = (lambda name: name) if manifest.source.get("form") == MODEL_FORM else checkpoint_renames(model, redo=redo)
    store_of = {to_model(n): n for n in entries}  # the model's name for each store tensor -> the store's
    used: set[str] = set()
    missing: list[str] = []
    misshaped: list[str] = []
    binding = Binding()
    for targets in _model_tensors(model).values():
        renamed = [rename(t.name) if rename else t.name for t in targets]
        if any(n is None for n in renamed):
            continue
        names = [store_of.get(n, n) for n in renamed if n is not None]
        stored = list(dict.fromkeys(n for n in names if n in entries))
        used.update(stored)
        if not stored:
            missing.append(names[0] + (f" (tied with {', '.join(names[1:])})" if len(names) > 1 else ""))
            continue
        if len(stored) > 1 and _tie_breaks(names, stored, entries, redo=redo):
            # transformers' rule (PreTrainedModel.tie_weights in from_pretrained): tied names the checkpoint
            # holds with different values are untied, each getting its own; so here.
            for name in stored:
                _bind_one(binding, entries[name], [t for n, t in zip(names, targets) if n == name], [name], misshaped)
            continue
        _bind_one(binding, entries[stored[0]], targets, names, misshaped)
    extra = sorted(set(entries) - used)
    if missing or extra or misshaped:
        msg = f"the model does not match the weight store at {where}:"
        if missing:
            msg += _listing("in the model but not in the store", missing)
        if extra:
            msg += _listing("in the store but not in the model", extra)
        if misshaped:
            msg += _listing("different shape or dtype", misshaped)
        raise WeightsMismatchError(
            msg + f"\nBuild the model from the config the store was converted from ({where}/config.json), "
            f"with the checkpoint's dtype, or convert this model's own checkpoint"
        )
    for t in manifest.tensors:
        if t.name in binding.entries:
            binding.by_group.setdefault(t.group, []).append(t.name)
    return binding


def _bind_one(binding: Binding, e: TensorEntry, targets: list[Target], names: list[str], misshaped: list[str]) -> None:
    """Bind the store tensor ``e`` to ``targets`` (the places of ``names``, one tensor in the model)."""
    model_t = targets[0].placeholder
    if tuple(model_t.shape) != e.shape or _dtype_name(model_t) != e.dtype:
        misshaped.append(f"{e.name}: model {_dtype_name(model_t)} {tuple(model_t.shape)}, store {e.dtype} {e.shape}")
        return
    if e.group != RESIDENT and any(not n.startswith(e.group + ".") for n in names):
        raise ConfigError(
            f"{', '.join(names)} are one tied tensor, stored with layer {e.group} but used outside it; "
            f"a streamed layer cannot share weights with other modules. Keep that layer resident (resident_layers=)"
        )
    binding.entries[e.name] = e
    binding.targets[e.name] = targets


def _tie_breaks(names: list[str], stored: list[str], entries: dict[str, TensorEntry], *, redo: str) -> bool:
    """Whether a tied tensor whose names the store holds several of must be untied: transformers
    ties them only when the checkpoint's tensors are equal (here: the same dtype, shape and
    xxh3-64 of the bytes), and otherwise gives each name its own.

    Raises:
        ConfigError: the store cannot tell (a format 1 store records no tensor checksums), or some
            of the names are not stored, so one of the differing tensors would have to stand in for them.
    """
    es = [entries[n] for n in stored]
    alike = all((e.dtype, e.shape) == (es[0].dtype, es[0].shape) for e in es)
    if alike and any(e.xxh3_64 is None for e in es):
        raise ConfigError(
            f"the model ties {', '.join(names)} (e.g. tie_word_embeddings=True in its config), and the store holds "
            f"{' and '.join(stored)}; transformers ties them only if the checkpoint's tensors are equal, and this store "
            f"(format 1) records no tensor checksums to tell. Convert the checkpoint again: {redo}"
        )
    if alike and len({e.xxh3_64 for e in es}) == 1:
        return False
    if len(stored) != len(set(names)):
        raise ConfigError(
            f"the model ties {', '.join(names)}, and the store holds {' and '.join(stored)} with different values, but "
            f"not {', '.join(sorted(set(names) - set(stored)))}: which of them it takes is ambiguous. Set the config's "
            f"tie_word_embeddings to match the checkpoint, or convert a checkpoint that holds one of them"
        )
    return True


def checkpoint_renames(model: nn.Module, *, redo: str) -> Callable[[str], str]:
    """The model's name for a checkpoint (store) tensor: the renamings ``from_pretrained`` applies
    (transformers >= 5: GPT-NeoX's ``embed_out`` is ``lm_head``); the name itself without them.

    Raises (from the returned function):
        ConfigError: a checkpoint tensor that transformers would merge or split at load (its
            ``WeightConverter``s, e.g. MoE experts fused into one tensor) in a store that holds the
            checkpoint's form: converted before stores took the model's form (:mod:`~gds_offload.weights.store.fused`);
            ``redo`` is the command that converts it again.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # transformers 4, or none: names are used as they are
        return lambda name: name
    try:
        transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    except (AttributeError, TypeError, ValueError):  # not a transformers model
        return lambda name: name
    renames = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]

    def to_model(name: str) -> str:
        for r in renames:
            name, _ = r.rename_source_key(name)
        for c in converters:
            if c.rename_source_key(name)[1] is not None:
                raise ConfigError(
                    f"{name}: transformers merges or splits this checkpoint tensor at load ({type(c).__name__}: e.g. MoE "
                    f"experts fused into one tensor), and this store holds the checkpoint's tensors as they are (it was "
                    f"converted before stores held the model's form). Convert the checkpoint again: {redo}"
                )
        return name

    return to_model


def rebuild_meta_buffers(model: nn.Module, device: torch.device) -> list[str]:
    """Give non-persistent buffers still on the meta device (``inv_freq`` of rotary embeddings,
    when the skeleton was built under ``torch.device("meta")``) real values; returns their names.

    They are not in any checkpoint. Each is allocated on ``device`` (floats filled with NaN)
    and its module re-initialised with the model's ``_init_weights`` (Hugging Face models
    compute such buffers there); modules that also own parameters are never re-initialised.

    Raises:
        ConfigError: a buffer could not be rebuilt (still NaN, not a float, or no ``_init_weights``);
            build the skeleton with ``accelerate.init_empty_weights()``, which keeps buffers real.
    """
    found: list[tuple[str, nn.Module, str, torch.Tensor]] = []
    for mod_name, mod in model.named_modules():
        for leaf, b in mod._buffers.items():
            if b is not None and b.is_meta and leaf in mod._non_persistent_buffers_set:
                found.append((f"{mod_name}.{leaf}" if mod_name else leaf, mod, leaf, b))
    if not found:
        return []
    init = getattr(model, "_init_weights", None)
    owners = {id(m): m for _, m, _, _ in found}
    failed = []
    for name, mod, leaf, b in found:
        fill = math.nan if b.dtype.is_floating_point else 0
        mod._buffers[leaf] = torch.full(b.shape, fill, dtype=b.dtype, device=device)
        if not b.dtype.is_floating_point or init is None or next(mod.parameters(recurse=False), None) is not None:
            failed.append(name)
    if not failed:
        for mod in owners.values():
            init(mod)  # type: ignore[misc]
        # _init_weights refilled the buffer it knows; one still NaN (or one it removed) it did not rebuild.
        failed = [n for n, m, leaf, _ in found if (buf := m._buffers[leaf]) is None or torch.isnan(buf).any()]
    if failed:
        raise ConfigError(
            f"buffers {', '.join(failed)} are on the meta device and not in the store, and could not be rebuilt; "
            f"build the model skeleton with accelerate.init_empty_weights() (it keeps buffers real) instead of torch.device('meta')"
        )
    return [n for n, _, _, _ in found]
