"""The user's grouping of each sum, for printers that must not re-associate it.

sympy keeps a sum flat and in its own order: the spec's ``(a - ma - log(da)) - (b - mb - log(db))``
becomes ``a - b - ma + mb - log(da) + log(db)``. Printed in that order, float32 adds the large
terms before the cancelling ones: with logits near 1000 the KL divergence of two close
softmaxes loses four digits (issue 23: 249x the error of the formula as written), where the
user's ``a - ma`` is exact (two floats within a factor of 2 subtract exactly).

:class:`Grouping` records, while a spec is converted to sympy (:mod:`fuser_core.symbolic`),
each ``+``/``-`` the user wrote: the sympy sum it gave and its two operands. A printer asks it
how to print a sum (:meth:`Grouping.arrange`):

- a sum the user wrote, exactly: its two operands, each printed the same way (the user's tree);
- a sum the derivation built (a contribution, a centred Taylor coefficient): the user's sums
  found inside it (``c * (a - ma)`` for a term set ``c*a, -c*ma``), largest first, then the rest
  in sympy's order.

Only the order of additions changes: what is printed is equal to the sum in exact arithmetic.

Example:
    >>> import sympy as sp
    >>> a, b, ma, mb = sp.symbols("a b ma mb", real=True)
    >>> g = Grouping()
    >>> g.record(a - ma, a, ma, -1)
    >>> g.record(b - mb, b, mb, -1)
    >>> [str(p) for p in g.arrange(a - b - ma + mb)]
    ['(1, a - ma)', '(-1, b - mb)']
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import sympy as sp

MAX_GROUPS = 2000  # recorded sums per spec: spec size limits keep it far below; beyond it, sympy's order


@dataclass(frozen=True)
class Split:
    """A sum the user wrote: ``left + sign * right``."""

    left: sp.Expr
    right: sp.Expr
    sign: int  # +1 or -1


@dataclass(frozen=True)
class Part:
    """One printed part of a sum: ``coeff * group`` (a user sum, parenthesised) or a plain term."""

    coeff: sp.Expr
    expr: sp.Expr
    grouped: bool

    def __str__(self) -> str:
        return f"({self.coeff}, {self.expr})" if self.grouped else str(self.expr)


class Grouping:
    """The user's sums, keyed by their sympy form (module docstring)."""

    def __init__(self) -> None:
        self.splits: dict[sp.Expr, Split] = {}

    def record(self, total: sp.Expr, left: sp.Expr, right: sp.Expr, sign: int) -> None:
        """``total`` = ``left + sign * right``, as the spec wrote it (the first spelling wins)."""
        if total.is_Add and total not in self.splits and len(self.splits) < MAX_GROUPS and left + sign * right == total:
            self.splits[total] = Split(left, right, sign)

    def split(self, e: sp.Expr) -> Split | None:
        """The user's two operands of the sum ``e``, when the spec wrote exactly ``e``."""
        return self.splits.get(e)

    def arrange(self, e: sp.Expr) -> list[Part]:
        """The parts of the sum ``e`` to print in order: user sums found in it (largest first, each once
        per occurrence, with a numeric coefficient), then the remaining terms in sympy's order."""
        left = Counter(e.args)
        parts: list[Part] = []
        for key in sorted(self.splits, key=lambda k: -len(k.args)):
            if len(key.args) > sum(left.values()) or key == e:
                continue
            while True:
                coeff = _coefficient(key, left)
                if coeff is None:
                    break
                for t in key.args:
                    left[coeff * t] -= 1
                parts.append(Part(coeff, key, True))
            left = +left
        rest = [t for t in e.args for _ in range(left.pop(t, 0))]
        return parts + [Part(sp.Integer(1), t, False) for t in rest]


def _coefficient(key: sp.Expr, terms: Counter) -> sp.Expr | None:
    """A number c with ``c * t`` among ``terms`` for every term t of the sum ``key``, else None."""
    first = key.args[0]
    for candidate in list(terms):
        if terms[candidate] <= 0:
            continue
        c = candidate / first
        if not c.is_Number or c == 0:
            continue
        need = Counter(c * t for t in key.args)
        if all(terms[t] >= n for t, n in need.items()):
            return c
    return None
