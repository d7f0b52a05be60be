"""Module paths that moved still import for one release, with a DeprecationWarning naming the new
path, and give the very module now at the new path (a monkeypatch through either patches both)."""
from __future__ import annotations

import importlib
import importlib.resources
import importlib.util
import subprocess
import sys

import pytest

from gds_offload._moved import MOVED


def test_every_old_module_path_imports_the_new_module_with_a_warning() -> None:
    # In a fresh interpreter (here an old name may already be in sys.modules from another test),
    # one for all of them: each import of the package costs seconds.
    code = """
import importlib, json, sys, warnings
from gds_offload._moved import MOVED
for old, new in MOVED.items():
    module = importlib.import_module(new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert importlib.import_module(old) is module, f"{old}: not the module at {new}"
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{old} moved to {new}; import it from there (the old path goes in the next release)"], (old, caught)
    assert module.__spec__.name == new, (old, module.__spec__.name)
print(len(MOVED), "ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(len(MOVED)), "ok"]


def test_every_new_path_exists_and_no_old_one_does() -> None:
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        parent, _, leaf = old.rpartition(".")
        spec = importlib.util.find_spec(parent)
        assert spec is not None and spec.submodule_search_locations
        for where in spec.submodule_search_locations:
            assert not (importlib.resources.files(parent) / f"{leaf}.py").is_file(), f"{old} still has a file of its own at {where}"


def test_the_activation_halfs_plan_is_offload_decisions_now() -> None:
    import gds_offload
    from gds_offload.activations.planning import policy

    with pytest.warns(DeprecationWarning, match="OffloadDecisions"):
        assert gds_offload.Plan is gds_offload.OffloadDecisions
    with pytest.warns(DeprecationWarning, match="OffloadDecisions"):
        assert policy.Plan is policy.OffloadDecisions
    assert gds_offload.weights.Plan is not gds_offload.OffloadDecisions
