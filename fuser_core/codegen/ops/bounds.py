"""Loop bounds as data: a :class:`Bound` is a small expression over the kernel's parameters and
variables (``size_n``, ``BLOCK_n``, ``lo``, ``chunk``, ``pid_m``, ``offs_m``), which the printer
writes (:func:`fuser_core.codegen.emit.bound_source`) and whose names are what a loop reads
(:meth:`Bound.names`: never a hand-kept copy of the text). No Triton text lives here (issue 38).

Kinds, with what the printer writes for them:

- ``name``: a parameter or variable, as is; ``int``: a literal;
- ``min`` / ``max``: the smaller / larger of two bounds;
- ``sum``: terms with signs, ``a + b - c``; ``group``: one bound in parentheses;
- ``product``: bounds joined by `` * ``;
- ``tiles``: a bound rounded down to whole tiles of a dim, ``x // BLOCK_d * BLOCK_d``.

Example:
    >>> b = minimum(plus(name("lo"), name("chunk")), name("size_n"))
    >>> sorted(b.names())
    ['chunk', 'lo', 'size_n']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("name", "int", "min", "max", "sum", "group", "product", "tiles")


@dataclass(frozen=True)
class Bound:
    """One node: ``kind`` (:data:`KINDS`) and its ``args`` (a name, an int, bounds, or for ``sum``
    (sign, bound) pairs, for ``tiles`` (bound, dim))."""

    kind: str
    args: tuple[Any, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"no bound kind {self.kind!r}; one of {', '.join(KINDS)}")

    def names(self) -> frozenset[str]:
        """The parameters and variables the bound reads."""
        if self.kind == "name":
            return frozenset({self.args[0]})
        if self.kind == "int":
            return frozenset()
        if self.kind == "sum":
            return frozenset().union(*(b.names() for _, b in self.args))
        if self.kind == "tiles":
            return self.args[0].names() | {f"BLOCK_{self.args[1]}"}
        return frozenset().union(*(b.names() for b in self.args))

    def is_zero(self) -> bool:
        return self.kind == "int" and self.args[0] == 0


def name(text: str) -> Bound:
    return Bound("name", (text,))


def num(value: int) -> Bound:
    return Bound("int", (int(value),))


ZERO = num(0)


def minimum(a: Bound, b: Bound) -> Bound:
    return Bound("min", (a, b))


def maximum(a: Bound, b: Bound) -> Bound:
    return Bound("max", (a, b))


def plus(*terms: Bound, signs: tuple[int, ...] | None = None) -> Bound:
    """``terms`` added (``signs``: +1 or -1 each, default all +1)."""
    return Bound("sum", tuple(zip(signs or (1,) * len(terms), terms)))


def group(b: Bound) -> Bound:
    return Bound("group", (b,))


def product(*factors: Bound) -> Bound:
    return Bound("product", tuple(factors))


def tiles(b: Bound, dim: str) -> Bound:
    """``b`` rounded down to whole tiles of ``dim``."""
    return Bound("tiles", (b, dim))


def bound_names(*bounds: Bound | None) -> frozenset[str]:
    """What these bounds read together (None: none)."""
    return frozenset().union(*(b.names() for b in bounds if b is not None))


__all__ = ["KINDS", "ZERO", "Bound", "bound_names", "group", "maximum", "minimum", "name", "num", "plus", "product",
           "tiles"]
