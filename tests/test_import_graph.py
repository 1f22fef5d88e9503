"""The import graph: no cycle between top-level packages, subpackages or modules, and the router side imported by
the library's stack entry points only (docs/architecture.md, "Where each process's code lives";
docs/decisions/process-code-layout.md).

Every import statement counts, also one inside a function or under ``if TYPE_CHECKING:``: a lazy import still ties
two modules together (it only hides the cycle until the function runs). Generated protobuf stubs are left out, and
an import of a module's own parent package is no edge.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.source import parse_source

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "llmd_timeslice"
ROUTER_SIDE = "epp_plugin"
LEVELS = {"packages": 1, "subpackages": 2, "modules": None}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module (the nearest one that exists in the tree), dotted
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line} imports {self.target}"


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under each package (``pkg/__init__.py`` is ``pkg``)."""
    mods: dict[str, Path] = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" in f.parts or f.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = f.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def find_imports(mods: dict[str, Path]) -> list[Import]:
    """Every import statement of every module whose target is in ``mods`` (anywhere in the file: module level,
    functions, ``TYPE_CHECKING`` blocks). ``from X import Y`` counts X, and X.Y where Y is a module."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out: list[Import] = []
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(parse_source(path)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                    base = f"{anchor}.{base}" if base else anchor
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            for target in {t for t in map(resolve, names) if t}:
                if target != mod and not mod.startswith(target + "."):  # a module's own package is no edge
                    out.append(Import(mod, target, path, node.lineno))
    return out


def graph_at(imports: Iterable[Import], depth: int | None) -> dict[str, set[str]]:
    """The import graph with module names cut to ``depth`` dotted parts (None: whole names); no self-edges."""
    cut = (lambda n: n) if depth is None else (lambda n: ".".join(n.split(".")[:depth]))
    g: dict[str, set[str]] = {}
    for imp in imports:
        a, b = cut(imp.source), cut(imp.target)
        if a != b:
            g.setdefault(a, set()).add(b)
    return g


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def explain(cycle: frozenset[str], imports: Iterable[Import], depth: int | None) -> str:
    """A cycle with one import statement per edge inside it, so the failure says which lines to change."""
    cut = (lambda n: n) if depth is None else (lambda n: ".".join(n.split(".")[:depth]))
    lines, seen = [], set()
    for imp in imports:
        edge = (cut(imp.source), cut(imp.target))
        if edge[0] != edge[1] and set(edge) <= cycle and edge not in seen:
            seen.add(edge)
            lines.append(f"    {edge[0]} -> {edge[1]}: {imp}")
    return " <-> ".join(sorted(cycle)) + "\n" + "\n".join(sorted(lines))


def _is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.fixture(scope="module")
def library_imports() -> list[Import]:
    return find_imports(find_modules(ROOT, (LIBRARY, ROUTER_SIDE)))


@pytest.fixture(scope="module")
def suite_imports() -> list[Import]:
    return find_imports(find_modules(ROOT, ("tests",)))


def test_the_library_never_imports_the_router_side(library_imports) -> None:
    """``epp_plugin`` imports the library, never the reverse: the gate's and picker's commands join ``llmd-timeslice``
    through the entry point group ``llmd_timeslice.commands``, the local stack starts them by command line, Envoy's
    configuration is ``llmd_timeslice/router/``; what clients need of the wire lives in ``llmd_timeslice/protocol.py``."""
    bad = [imp for imp in library_imports if _is_under(imp.source, LIBRARY) and _is_under(imp.target, ROUTER_SIDE)]
    assert [str(i) for i in bad] == []


@pytest.mark.parametrize("level", LEVELS)
def test_no_import_cycle_in_the_library_and_router_side(library_imports, level) -> None:
    found = cycles(graph_at(library_imports, LEVELS[level]))
    assert not found, "\n".join(explain(c, library_imports, LEVELS[level]) for c in found)


def test_sidecar_does_not_import_trainer_side(library_imports) -> None:
    """The sidecar (``snapshot/``) runs without the trainer side (``client/``): the dependency goes one way only."""
    bad = [
        str(i) for i in library_imports if _is_under(i.source, f"{LIBRARY}.snapshot") and _is_under(i.target, f"{LIBRARY}.client")
    ]
    assert bad == []


@pytest.mark.parametrize("level", LEVELS)
def test_no_import_cycle_in_tests(suite_imports, level) -> None:
    """E.g. ``tests/conftest.py`` and ``tests/support/vllm.py`` importing each other (the shared paths are in
    ``tests/support/artifacts.py``)."""
    found = cycles(graph_at(suite_imports, LEVELS[level]))
    assert not found, "\n".join(explain(c, suite_imports, LEVELS[level]) for c in found)


def test_the_walk_counts_lazy_type_checking_and_relative_imports(tmp_path) -> None:
    """The checks above can fail: a cycle made only of a lazy import, a ``TYPE_CHECKING`` import and a relative
    import is found, at every level, and named by its lines."""
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    for d in (pkg, pkg / "a", pkg / "b"):
        (d / "__init__.py").write_text("")
    (pkg / "a" / "one.py").write_text("def f():\n    from pkg.b import two\n")
    (pkg / "a" / "three.py").write_text("X = 1\n")
    (pkg / "b" / "two.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a.three import X\nfrom . import four\n"
    )
    (pkg / "b" / "four.py").write_text("import pkg.a.one\n")
    imports = find_imports(find_modules(tmp_path, ("pkg",)))
    edges = {(i.source, i.target, i.line) for i in imports}
    assert ("pkg.a.one", "pkg.b.two", 2) in edges  # lazy, inside a function
    assert ("pkg.b.two", "pkg.a.three", 3) in edges  # TYPE_CHECKING, relative
    assert ("pkg.b.two", "pkg.b.four", 4) in edges  # `from . import module`
    assert cycles(graph_at(imports, 2)) == [frozenset({"pkg.a", "pkg.b"})]
    assert cycles(graph_at(imports, None)) == [frozenset({"pkg.a.one", "pkg.b.two", "pkg.b.four"})]
    assert cycles(graph_at(imports, 1)) == []  # one top-level package
    message = explain(frozenset({"pkg.a.one", "pkg.b.two", "pkg.b.four"}), imports, None)
    assert "pkg/b/four.py:1 imports pkg.a.one" in message
