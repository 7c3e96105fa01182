"""A dim's symbols in the sympy view: ``size(n)``, ``index(n)``, and the bounds' ``first(n)``,
``last(n)``, ``end(n)``: made by :func:`dim_symbol`, told apart by :func:`symbol_kind` (issue 38:
no module reads a symbol's kind from its name but this one). Light: sympy only.

Example:
    >>> symbol_kind(dim_symbol("size", "n")), symbol_kind(dim_symbol("index", "t"))
    (('size', 'n'), ('index', 't'))
    >>> import sympy as sp; symbol_kind(sp.Symbol("x")) is None
    True
"""

from __future__ import annotations

import sympy as sp

# A dim's symbols, by kind: its size, a lane's position on it, and a tile's first and last position
# and a loop's end (fuser_core.codegen.bounds), each with the assumptions every module gives it
DIM_SYMBOLS: dict[str, dict[str, bool]] = {
    "size": {"integer": True, "positive": True}, "index": {"integer": True, "nonnegative": True},
    "first": {"integer": True}, "last": {"integer": True}, "end": {"integer": True},
}


def dim_symbol(kind: str, dim: str) -> sp.Symbol:
    """The symbol of ``kind`` (a key of :data:`DIM_SYMBOLS`) for ``dim``: ``size(n)``, ``index(n)``..."""
    return sp.Symbol(f"{kind}({dim})", **DIM_SYMBOLS[kind])


def symbol_kind(sym: sp.Basic) -> tuple[str, str] | None:
    """``(kind, dim)`` of a dim's symbol (:func:`dim_symbol`: ``size(n)`` is ``("size", "n")``), None
    for any other symbol (an input, a step, a param). The one place that reads a kind from a name."""
    name = getattr(sym, "name", "")
    head, paren, rest = name.partition("(")
    if paren and head in DIM_SYMBOLS and rest.endswith(")"):
        return head, rest[:-1]
    return None


def is_dim_symbol(sym: sp.Basic, *kinds: str) -> bool:
    """Whether ``sym`` is a dim's symbol of one of ``kinds``."""
    found = symbol_kind(sym)
    return found is not None and found[0] in kinds


__all__ = ["DIM_SYMBOLS", "dim_symbol", "is_dim_symbol", "symbol_kind"]
