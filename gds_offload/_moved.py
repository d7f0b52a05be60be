"""Module paths that moved, kept importable for one release: ``import gds_offload.weights.stream``
gives the module now at ``gds_offload.weights.run.model`` (the same module object, so a
``monkeypatch`` of the old path patches the new module) and a :class:`DeprecationWarning`
naming the new path.

One table and one finder on ``sys.meta_path`` rather than a stub file per old path: the stubs
would fill the folders they left, and the old ``weights/stream.py`` could not sit beside the
new rooms' packages.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

_W = "gds_offload.weights"
#: Old module path -> where the module lives now.
MOVED: dict[str, str] = {
    **{f"{_W}.{old}": f"{_W}.{new}" for old, new in {
        "advice": "store.advice", "checkpoint": "store.hf_checkpoint", "convert": "store.convert",
        "manifest": "store.manifest", "store_config": "store.config", "storefile": "store.files",
        "outdir": "store.outdir", "export": "store.export", "generations": "store.steps", "trust": "store.trust",
        "ring": "streaming.ring", "prefetch": "streaming.prefetch", "bind": "streaming.bind",
        "layer_hooks": "streaming.hooks", "turn": "streaming.turn", "schedule": "streaming.team",
        "stream_stats": "streaming.stats", "backward": "streaming.backward", "recompute": "streaming.recompute",
        "adapters": "streaming.adapters", "load": "streaming.resident",
        "workload": "planning.workload", "cost": "planning.cost", "planner": "planning.planner",
        "options": "planning.options", "budget": "planning.residency",
        "stream": "run.model", "generation": "run.generation", "kv": "run.kv", "accumulate": "run.accumulate",
        "pretrained": "run.pretrained", "reference": "run.reference", "skeleton": "run.skeleton",
        "progress": "run.progress", "measure": "run.measure",
        "trainer": "train.trainer",
    }.items()},
    f"{_W}.interrupts": "gds_offload.runtime.interrupts",
    f"{_W}.malloc": "gds_offload.runtime.malloc",
    "gds_offload.activations.spill.store": "gds_offload.io.spill",
    "gds_offload.io.kvikio_engine": "gds_offload.io.kvikio.engine",
    "gds_offload.io.cufile_config": "gds_offload.io.kvikio.cufile_config",
    "gds_offload.io.cufile_params": "gds_offload.io.kvikio.cufile_params",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED`; loading one imports the new module and returns it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes in the next release)",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        module = importlib.import_module(new)
        self._spec = module.__spec__  # the import system sets __spec__ to the alias's next: put it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
