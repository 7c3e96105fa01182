"""The ``@triton.jit`` helpers a generated module copies by name: fuser_core/codegen/helpers.py read
as blocks (a helper's definition with the comments and statements just above it), and the source of
the helpers a module calls together with those they call, in helpers.py's order."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path


@functools.cache
def _helper_blocks() -> tuple[tuple[frozenset[str], frozenset[str], str], ...]:
    """fuser_core/codegen/helpers.py as blocks, in its order: (the helpers a block defines, the
    names it reads, its source). A block is the top-level statements that define a helper, with
    the comments and statements just above them."""
    text = (Path(__file__).with_name("helpers.py")).read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    body = [s for s in tree.body if not isinstance(s, (ast.Import, ast.ImportFrom))]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the module's docstring
    imports = max(s.end_lineno for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom)))
    out = []
    start, pending = imports, []
    for stmt in body:
        pending.append(stmt)
        defined = frozenset(n.name for n in ast.walk(stmt) if isinstance(n, ast.FunctionDef))
        if not defined:
            continue  # part of the next helper's block (bf16_round's INTERPRETED)
        read = frozenset(n.id for s in pending for n in ast.walk(s) if isinstance(n, ast.Name)) - defined
        out.append((defined, read, "\n".join(lines[start:stmt.end_lineno]).strip("\n")))
        start, pending = stmt.end_lineno, []
    return tuple(out)


def helper_names() -> tuple[str, ...]:
    """Every helper of fuser_core/codegen/helpers.py, in order."""
    return tuple(n for defined, _, _ in _helper_blocks() for n in sorted(defined))


def helper_source(names: Iterable[str]) -> tuple[str, set[str]]:
    """(the source of the helpers ``names``, and of those they call, in helpers.py's order; the
    modules that source reads, such as ``os``)."""
    blocks = _helper_blocks()
    known = {n for defined, _, _ in blocks for n in defined}
    wanted = set(names)
    if wanted - known:
        raise KeyError(f"no helper {min(wanted - known)!r} in fuser_core/codegen/helpers.py")
    grown = True
    while grown:  # the helpers a chosen helper calls
        grown = False
        for defined, read, _ in blocks:
            if defined & wanted and not (read & known) <= wanted:
                wanted |= read & known
                grown = True
    chosen = [(read, src) for defined, read, src in blocks if defined & wanted]
    modules = {n for read, _ in chosen for n in read} & {"os", "math"}
    return ("\n" + "\n\n\n".join(src for _, src in chosen) + "\n" if chosen else ""), modules


__all__ = ["helper_names", "helper_source"]
