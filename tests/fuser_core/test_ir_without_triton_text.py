"""The kernel IR is data (issue 38): no string literal under fuser_core/codegen/structure/ or
fuser_core/codegen/ops/ holds Triton text (docstrings aside, which describe it); loop bounds are
:class:`~fuser_core.codegen.ops.bounds.Bound` nodes that the printer writes and whose names are
what a loop reads."""

from __future__ import annotations

import ast
from pathlib import Path

from fuser_core.codegen.emit import bound_source
from fuser_core.codegen.ops import bounds as bound

IR = Path(__file__).resolve().parents[2] / "fuser_core" / "codegen"


def docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_no_string_literal_of_the_ir_holds_triton_text() -> None:
    found = []
    for folder in ("structure", "ops"):
        for path in sorted((IR / folder).glob("*.py")):
            tree = ast.parse(path.read_text())
            docs = docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                        and "tl." in node.value:
                    found.append(f"{path.relative_to(IR)}:{node.lineno}: {node.value[:80]!r}")
    assert not found, "\n".join(found)


def test_bounds_print_as_the_tutorials_write_them_and_read_their_names() -> None:
    a = "n"
    chunk_end = bound.minimum(bound.plus(bound.name("lo"), bound.name("chunk")), bound.name(f"size_{a}"))
    assert bound_source(chunk_end) == "tl.minimum(lo + chunk, size_n)"
    assert chunk_end.names() == {"lo", "chunk", "size_n"}
    causal = bound.tiles(bound.maximum(bound.minimum(bound.name("size_n"), bound.group(bound.plus(
        bound.product(bound.name("pid_m"), bound.name("BLOCK_m")), bound.num(1), signs=(1, -1)))), bound.ZERO), a)
    assert bound_source(causal) == "tl.maximum(tl.minimum(size_n, (pid_m * BLOCK_m - 1)), 0) // BLOCK_n * BLOCK_n"
    assert causal.names() == {"size_n", "pid_m", "BLOCK_m", "BLOCK_n"}
    gated = bound.product(bound.group(chunk_end), bound.name("fallback"))
    assert bound_source(gated) == "(tl.minimum(lo + chunk, size_n)) * fallback"
    assert bound.ZERO.is_zero() and not bound.num(1).is_zero() and bound.bound_names(None, gated) == {
        "lo", "chunk", "size_n", "fallback"}
