"""Finding the repeated blocks of any model: the units the scheduler plans and prefetches by."""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from gds_offload.errors import ConfigError

__all__ = ["find_layers", "resolve_layers"]


def _num_params(m: nn.Module) -> int:
    # DeepSpeed ZeRO-3 partitions parameters in place: numel() is 0 outside its forward, ds_numel the full size.
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in m.parameters())


def find_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, in order: ``[(qualified_name, module), ...]``.

    The largest (by parameters) ``nn.ModuleList``/``nn.Sequential`` of two or more
    children of one type that hold parameters: the decoder layers of GPT, Llama, BERT
    or T5 implementations, with no class names hard-coded. Falls back to the root's
    children that hold parameters (at least two), else an empty list.
    """
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.children())
        if len(children) < 2 or any(type(c) is not type(children[0]) for c in children):
            continue
        size = _num_params(mod)
        if size and (best is None or size > best[0]):
            best = (size, name, children)
    if best is not None:
        _, name, children = best
        prefix = f"{name}." if name else ""
        return [(f"{prefix}{i}", c) for i, c in enumerate(children)]
    named = [(n, c) for n, c in model.named_children() if _num_params(c)]
    return named if len(named) >= 2 else []


def resolve_layers(model: nn.Module, layers: Sequence[nn.Module | str] | None) -> list[tuple[str, nn.Module]]:
    """``layers=`` as given by the user (modules or qualified names), else :func:`find_layers`.

    Raises:
        ConfigError: a name that is not a submodule, a module that is not part of ``model``,
            or a layer given twice (by name or as a module).
    """
    if layers is None:
        return find_layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for i, item in enumerate(layers):
        if isinstance(item, str):
            try:
                out.append((item, model.get_submodule(item)))
            except AttributeError:
                raise ConfigError(f"layers[{i}]={item!r} is not a submodule of the model; see model.named_modules()") from None
        elif isinstance(item, nn.Module):
            if id(item) not in names:
                raise ConfigError(f"layers[{i}] ({type(item).__name__}) is not a submodule of the model passed to attach()")
            out.append((names[id(item)], item))
        else:
            raise ConfigError(f"layers[{i}] is a {type(item).__name__}; pass nn.Module objects or qualified names")
        first = next((j for j, (_, m) in enumerate(out[:-1]) if m is out[-1][1]), None)
        if first is not None:
            raise ConfigError(
                f"layers[{i}]={out[-1][0]!r} repeats layers[{first}]; each layer may be given once "
                f"(its hooks would run twice per call)"
            )
    return out
