"""The package's import graph, read from its source (``ast``): what ``tests/test_lint.py`` checks.

Every ``import``/``from ... import`` anywhere in a file counts, at module level or inside a
function; those under ``if TYPE_CHECKING:`` are marked ``type_only`` (they never run, but a
reader follows them as arrows all the same). ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``. Relative imports are resolved.
"""
from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Edge", "ImportGraph", "find_cycle", "imports_of"]


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line``; ``local``: inside a function (runs when it is called);
    ``type_only``: under ``if TYPE_CHECKING:`` (never runs)."""

    source: str
    target: str
    line: int
    local: bool
    type_only: bool = False


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` blocks."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                out.update(id(n) for n in ast.walk(stmt))
    return out


def _function_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out.update(id(n) for n in ast.walk(node) if n is not node)
    return out


#: Third-party packages a module is heavy with (slow to import, or optional): torch and what builds on it, rich.
HEAVY = frozenset({"torch", "transformers", "peft", "accelerate", "safetensors", "kvikio", "cupy", "nvidia", "matplotlib",
                   "deepspeed", "lightning", "numpy", "rich", "xxhash"})


def imports_of(path: Path, module: str, *, is_package: bool) -> Iterator[tuple[str, int, bool, bool]]:
    """``(imported name, line, local, type_only)`` for each name ``path`` imports (``from a import b`` gives ``a.b``)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only, local = _type_checking_nodes(tree), _function_nodes(tree)
    for node in ast.walk(tree):
        type_only = id(node) in typing_only
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in local, type_only
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts if is_package else parts[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                yield f"{mod}.{alias.name}", node.lineno, id(node) in local, type_only


class ImportGraph:
    """The modules of the package at ``root/package`` and the imports between them."""

    def __init__(self, root: Path, package: str = "gds_offload") -> None:
        self.root = root
        self.files: dict[str, Path] = {}
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            self.files[".".join(parts)] = path
        self.edges: list[Edge] = []
        #: Third-party top-level packages each module imports at module level.
        self.third_party: dict[str, set[str]] = {m: set() for m in self.files}
        for module, path in self.files.items():
            for name, line, local, type_only in imports_of(path, module, is_package=path.name == "__init__.py"):
                target = self.resolve(name)
                if target is not None and target != module:
                    self.edges.append(Edge(module, target, line, local, type_only))
                elif target is None and not local and not type_only and not name.startswith(package):
                    self.third_party[module].add(name.split(".")[0])

    def resolve(self, name: str) -> str | None:
        """The package module ``name`` refers to (its longest module prefix), or None when outside the package."""
        parts = name.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in self.files:
                return candidate
            parts.pop()
        return None

    def load_deps(self) -> dict[str, set[str]]:
        """For each module, the package's modules importing it runs: its module-level imports
        (not type-only ones), and its parent packages (which run first)."""
        deps: dict[str, set[str]] = {m: set() for m in self.files}
        for e in self.edges:
            if not e.local and not e.type_only:
                deps[e.source].add(e.target)
        for m in self.files:
            parts = m.split(".")
            deps[m].update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in self.files)
        return deps

    def loaded_by(self, module: str) -> set[str]:
        """Every module of the package that ``import module`` runs, itself included."""
        deps = self.load_deps()
        seen: set[str] = set()
        todo = [module]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += deps[m]
        return seen

    def heavy_modules(self) -> set[str]:
        """The modules whose import loads a :data:`HEAVY` package: themselves at module level, or
        through what they import at module level (a module's parent packages run first)."""
        deps = self.load_deps()
        heavy = {m for m, names in self.third_party.items() if names & HEAVY}
        changed = True
        while changed:
            more = {m for m, ds in deps.items() if m not in heavy and ds & heavy}
            changed = bool(more)
            heavy |= more
        return heavy

    def targets(self, source: str) -> set[str]:
        return {e.target for e in self.edges if e.source == source}

    def edges_from(self, prefixes: Iterable[str]) -> list[Edge]:
        wanted = tuple(prefixes)
        return [e for e in self.edges if in_any(e.source, wanted)]


def in_any(module: str, prefixes: tuple[str, ...]) -> bool:
    """``module`` is one of ``prefixes`` or inside one of them (``a.b`` is inside ``a``)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def find_cycle(nodes: Iterable[str], targets: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``) among ``nodes``, or None when the graph is acyclic."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(nodes, WHITE)
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = GREY
        stack.append(n)
        for m in sorted(targets.get(n, ())):
            if color.get(m, BLACK) == GREY:
                return stack[stack.index(m):] + [m]
            if color.get(m) == WHITE:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        color[n] = BLACK
        return None

    for n in sorted(color):
        if color[n] == WHITE:
            found = visit(n)
            if found:
                return found
    return None
