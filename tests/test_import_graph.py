"""The import graph of fuser_core, tuner and service, read from the source (every ``import``
and ``from ... import``, module-level and inside functions alike): no module imports itself
back through others, and the layers point one way only (service -> tuner -> fuser_core).

A function-level import still runs when the function does, so it counts: two modules that
need each other at run time are one module split in two, whichever of them hides the import.
An import under ``if TYPE_CHECKING:`` never runs (an annotation naming the other module's type)
and is not counted.

``fuser_core`` and ``tuner`` publish their API in ``__init__`` (``__all__``, each name imported
lazily from its module): ``from fuser_core import Spec`` is an edge to the module that defines
``Spec``. Service imports the two packages only through those names, and no ``_private`` name
crosses a package boundary.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("fuser_core", "tuner", "service")  # each may import only those before it (and itself)
PUBLISHED = ("fuser_core", "tuner")  # packages whose __init__ publishes their API (__all__)


def exports(package: str) -> dict[str, str]:
    """A published package's public name -> the module that defines it (its lazy export table)."""
    return {name: module for name, (module, _attr) in importlib.import_module(package)._EXPORTS.items()}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the three packages."""
    found = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports: ``from a.b import c`` is ``a.b.c`` when that is a
    module, else ``a.b``; relative imports are resolved against the module's package."""
    out: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    published = {p: exports(p) for p in PUBLISHED}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {id(n) for block in ast.walk(tree) if _type_checking(block) for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets = [published[base][a.name] if a.name in published.get(base, {}) else
                       f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                out.add(target)
    return out


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_every_kind_of_import():
    graph = import_graph()
    assert {"fuser_core.spec", "tuner.search", "service.store.job_queue", "service.api.ops"} <= set(graph)
    assert "service.bundle" in graph["service.client"]  # module level: from service.bundle import (...)
    assert "tuner.profiles" in graph["service.tuning_request"]  # inside a function: from tuner import PROFILES
    assert "fuser_core.problem" in graph["service.tuning_request"]  # a published name: from fuser_core import bind_shape
    assert "service.api.ops" in graph["service.api.routes_jobs"]  # from service.api import ops


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_layers_never_import_upwards(layer):
    above = LAYERS[LAYERS.index(layer) + 1:]
    upward = sorted(f"{name} -> {target}" for name, targets in import_graph().items() if name.split(".")[0] == layer
                    for target in targets if target.split(".")[0] in above)
    assert upward == []



def cross_package_imports() -> list[tuple[str, int, str, list[str]]]:
    """(module, line, imported module, names) of every import (``import`` or ``from ... import``)
    from one of the three packages into another; ``names`` is empty for a plain ``import``."""
    found = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(name, node.lineno, a.name, []) for a in node.names
                          if a.name.split(".")[0] in LAYERS and a.name.split(".")[0] != name.split(".")[0]]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module.split(".")[0] in LAYERS and node.module.split(".")[0] != name.split(".")[0]:
                    found.append((name, node.lineno, node.module, [a.name for a in node.names]))
    return found


@pytest.mark.parametrize("package", PUBLISHED)
def test_published_packages_list_what_they_export(package):
    module = importlib.import_module(package)
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__)
    assert not [n for n in module.__all__ if n.startswith("_") and not n.startswith("__")]
    assert set(exports(package)) <= set(module.__all__)
    assert all(getattr(module, n) is not None for n in module.__all__)  # every name resolves
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        module.nothing_here  # noqa: B018


def test_service_imports_fuser_core_and_tuner_only_through_their_public_names():
    wrong = []
    for name, line, target, names in cross_package_imports():
        if name.split(".")[0] != "service" or target.split(".")[0] not in PUBLISHED:
            continue
        if target not in PUBLISHED or not names:
            wrong.append(f"{name}:{line} imports {target} (use: from {target.split('.')[0]} import NAME)")
            continue
        public = importlib.import_module(target).__all__
        wrong += [f"{name}:{line} imports {target}.{n}, which is not in {target}.__all__" for n in names
                  if n not in public]
    assert wrong == []


def test_no_private_name_is_imported_across_packages():
    private = [f"{name}:{line} imports {target}.{n}" for name, line, target, names in cross_package_imports()
               for n in names if n.startswith("_") and not n.startswith("__")]
    assert private == []


def test_the_checks_see_a_deep_and_a_private_import(tmp_path, monkeypatch):
    """The two checks above read the real tree; this shows they would catch what they look for."""
    fake = tmp_path / "service"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "bad.py").write_text("from fuser_core.derive import _private_helper\nimport tuner.search\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = cross_package_imports()
    assert ("service.bad", 1, "fuser_core.derive", ["_private_helper"]) in found
    assert ("service.bad", 2, "tuner.search", []) in found


def test_no_private_attribute_of_another_package_is_read():
    """``module._name`` where ``module`` was imported from another package."""
    found = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        foreign = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LAYERS \
                    and node.module.split(".")[0] != name.split(".")[0]:
                foreign.update({a.asname or a.name: node.module for a in node.names})
        found += [f"{name}:{n.lineno} {n.value.id}.{n.attr}" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in foreign
                  and n.attr.startswith("_") and not n.attr.startswith("__")]
    assert found == []
