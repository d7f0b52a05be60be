"""Lint as part of the test run: ``ruff check`` and ``mypy`` (configured in pyproject.toml), and
the package's shape: its layers, no import cycle, its top level, what examples import.

The tools run from this interpreter's environment (``python -m ruff``, ``python -m mypy``), the
one ``scripts/setup.sh`` fills from the ``test`` extra, so the README's test command
(and CI, which runs it) fails on a lint or type error with the tool's own report. The shape is
read from the source with :mod:`helpers.imports` (an AST walk, no import-linter needed).
"""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from helpers.imports import Edge, ImportGraph, find_cycle, in_any

REPO = Path(__file__).resolve().parents[1]


def _run_tool(module: str, *args: str, timeout_s: float) -> None:
    """Run ``python -m module args`` in the repository root; fail with its output unless it exits 0."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]')")
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join([module, *args])} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}", pytrace=False)


def test_ruff_is_clean() -> None:
    # Every Python file of the repository: the package, the tests, examples/ and scripts/
    # (ruff skips what .gitignore lists: .venv, build/, ...).
    _run_tool("ruff", "check", ".", timeout_s=300)


def test_mypy_is_clean() -> None:
    # The files and options are pyproject's [tool.mypy]; .mypy_cache makes a rerun take seconds.
    _run_tool("mypy", timeout_s=900)


# ---------------------------------------------------------------------------- the package's layers
# Read from the source (helpers.imports): every import anywhere in a file counts, function-local
# ones and those under ``if TYPE_CHECKING:`` included (they never run, but they are arrows a reader follows).
PKG = "gds_offload"
#: The library: never imports the benchmarks, the commands, gds-check's CLI or gds-offload's.
LIBRARY = ("activations", "weights", "data", "io", "node", "runtime", "integrations", "models")
ABOVE_LIBRARY = ("bench", "commands", "check", "cli")
#: Each layer and what it may import of the package (itself always).
ALLOWED = {
    "io": ("errors", "units"),
    "node": ("io", "errors", "units"),
    "runtime": ("io", "errors", "units"),
}
#: The two halves stand side by side: what both use lies below them (io/, runtime/).
HALVES = ("activations", "weights")
#: The weight half's rooms, in the order of its data path: each imports only those before it.
ROOMS = ("store", "streaming", "planning", "run", "train")
#: A folder of the package holds at most this many modules (``__init__.py`` not counted).
FOLDER_MODULES = 15
#: Modules that load without torch (``gds-check``, ``gds-offload --help``): they may import
#: heavy modules of the package inside functions, and only those.
LIGHT = ("cli", "commands", "check")
#: What examples/ may import: the public API.
PUBLIC = ("gds_offload", "gds_offload.weights", "gds_offload.data", "gds_offload.integrations", "gds_offload.models",
          "gds_offload.errors", "gds_offload.units")


def _graph() -> ImportGraph:
    return ImportGraph(REPO, PKG)


def _names(prefixes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"{PKG}.{p}" for p in prefixes)


def _show(edges: list[Edge]) -> str:
    return "\n".join(f"  {e.source} imports {e.target} (line {e.line}{', inside a function' if e.local else ''})" for e in edges)


def test_layers_import_only_what_is_below_them() -> None:
    g = _graph()
    bad = [e for e in g.edges_from(_names(LIBRARY)) if in_any(e.target, _names(ABOVE_LIBRARY))]
    assert not bad, "the library imports the benchmarks or the commands:\n" + _show(bad)
    for layer, allowed in ALLOWED.items():
        bad = [e for e in g.edges_from(_names((layer,))) if not in_any(e.target, _names((layer, *allowed)))]
        assert not bad, f"{PKG}.{layer} may import only {', '.join(allowed)} of the package:\n" + _show(bad)
    for half in HALVES:
        others = _names(tuple(h for h in HALVES if h != half))
        bad = [e for e in g.edges_from(_names((half,))) if in_any(e.target, others)]
        assert not bad, f"{PKG}.{half} imports the other half (move what both use into io/ or runtime/):\n" + _show(bad)


def test_the_weight_halfs_rooms_follow_its_data_path() -> None:
    rooms = _names(tuple(f"weights.{r}" for r in ROOMS))
    found = sorted(p.name for p in (REPO / PKG / "weights").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert found == sorted(ROOMS), f"weights/ holds the folders {found}; the rooms are {ROOMS} (add a new one to ROOMS, in its place)"
    bad = []
    for i, room in enumerate(rooms):
        later = rooms[i + 1 :]
        bad += [e for e in _graph().edges_from((room,)) if in_any(e.target, later)]
    assert not bad, f"a room of weights/ imports one after it in {ROOMS}:\n" + _show(bad)


def _collapsed(g: ImportGraph, depth: int) -> dict[str, set[str]]:
    """The import graph with every module named by its first ``depth`` parts below the package
    (``gds_offload.weights.store.convert`` at depth 2: ``gds_offload.weights.store``). An edge to a
    package's own ``__init__`` from inside it is left out: importing ``a.b`` runs ``a`` first anyway."""
    def cut(m: str) -> str:
        return ".".join(m.split(".")[: depth + 1])

    targets: dict[str, set[str]] = {}
    for e in g.edges:
        a, b = cut(e.source), cut(e.target)
        if a != b and not e.source.startswith(e.target + "."):
            targets.setdefault(a, set()).add(b)
    return targets


def test_no_import_cycle_at_any_level() -> None:
    """Module-level, function-local and type-only imports alike, between modules and between the
    folders at every depth (``weights.store`` -> ``weights.streaming`` -> ``weights.store`` is one)."""
    g = _graph()
    targets: dict[str, set[str]] = {}
    for e in g.edges:
        targets.setdefault(e.source, set()).add(e.target)
    cycle = find_cycle(g.files, targets)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
    deepest = max(m.count(".") for m in g.files)
    for depth in range(1, deepest):
        collapsed = _collapsed(g, depth)
        cycle = find_cycle(collapsed, collapsed)
        assert cycle is None, f"import cycle between folders at depth {depth}: " + " -> ".join(cycle or [])


def test_no_folder_holds_more_than_fifteen_modules() -> None:
    big = {str(d.relative_to(REPO)): n for d in (REPO / PKG).rglob("*") if d.is_dir() and d.name != "__pycache__"
           and (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > FOLDER_MODULES}  # fmt: skip
    assert not big, f"folders over {FOLDER_MODULES} modules (split them by what they hold): {big}"


def test_function_local_imports_only_keep_light_modules_light() -> None:
    """An internal import inside a function is there for one reason: a module that loads without
    torch (the commands, gds-check) reaching one that needs it. Anything else goes at the top."""
    g = _graph()
    heavy = g.heavy_modules()
    bad = [e for e in g.edges if e.local and not (in_any(e.source, _names(LIGHT)) and e.target in heavy)]
    assert not bad, "function-local imports of the package's own modules that need not be:\n" + _show(bad)
    light = [m for m in g.files if in_any(m, _names(LIGHT)) and m in heavy]
    assert not light, f"these modules must load without torch, but import it at module level: {light}"


def test_the_top_level_holds_at_most_eight_modules() -> None:
    top = sorted(p.name for p in (REPO / PKG).glob("*.py"))
    assert len(top) <= 8, f"{PKG}/ holds {len(top)} modules ({', '.join(top)}); a new one belongs in a subpackage"


def _public(module: str) -> bool:
    return module in PUBLIC or module.startswith(("gds_offload.integrations.", "gds_offload.models."))


def test_examples_import_only_the_public_api() -> None:
    bad = []
    for path in sorted((REPO / "examples").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            bad += [f"  {path.name}:{node.lineno} imports {m}" for m in modules if m.startswith(PKG) and not _public(m)]
    assert not bad, "examples import internals (use gds_offload, gds_offload.weights/.data/.integrations/.models):\n" + "\n".join(bad)


def test_the_weights_extra_installs_what_import_gds_offload_weights_needs() -> None:
    """``pip install gds_offload[weights]`` then ``import gds_offload.weights``: every third-party
    package imported on the way is a core dependency or in the ``weights`` extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {r.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().replace("-", "_") for r in reqs}

    installed = names(project["dependencies"]) | names(project["optional-dependencies"]["weights"])
    g = _graph()
    needed = set().union(*(g.third_party[m] for m in g.loaded_by(f"{PKG}.weights")))
    missing = sorted(n for n in needed if n not in sys.stdlib_module_names and n not in installed)
    assert not missing, f"import gds_offload.weights needs {missing}, which neither the dependencies nor the weights extra install"
