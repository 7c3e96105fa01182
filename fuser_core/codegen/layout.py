"""Where a kernel's values live: each on the fewest tile dims it needs, in the kernel's dim order.

A kernel's tiles span its tile dims (:func:`~fuser_core.codegen.structure.tile_dims`), but a
value spans only those it varies over, as in Triton's tutorials: attention's ``q`` is a
``[BLOCK_m, BLOCK_d]`` tile, its running max a ``[BLOCK_m]`` vector, a row's max in a one-row
program a scalar. Two values on different dims meet on the union of them, each placed there
with ``None`` for the dims it lacks (``mx[:, None]``), as a person writes it.

Example:
    >>> lay = Layout(("m", "d", "n", "e"))
    >>> lay.shape({"e", "m"})
    '[BLOCK_m, BLOCK_e]'
    >>> lay.expand("mx", {"m"}, {"m", "n"})
    'mx[:, None]'
    >>> lay.expand("tl.exp(s - mx)", {"m", "n"}, {"m", "n", "e"})
    'tl.exp(s - mx)[:, :, None]'
    >>> lay.expand("s - mx", {"m", "n"}, {"m", "d", "n"})
    '(s - mx)[:, None, :]'
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def is_atom(text: str) -> bool:
    """Can ``text`` be indexed as it is: a name, or a name called with one bracketed argument list?"""
    if _NAME.fullmatch(text):
        return True
    head = _NAME.match(text.replace(".", "_"))
    if not head or not text.endswith(")") or text[head.end()] != "(":
        return False
    depth = 0
    for i, ch in enumerate(text[head.end():], head.end()):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return i == len(text) - 1
    return False


@dataclass(frozen=True)
class Layout:
    """The tile dims of a kernel, in order; every value lives on an ordered subset of them."""

    dims: tuple[str, ...]

    def order(self, dims: Iterable[str]) -> tuple[str, ...]:
        """``dims`` that are tile dims, in the kernel's order (a scalar lane is in no tile)."""
        dims = set(dims)
        return tuple(d for d in self.dims if d in dims)

    def union(self, *dims: Iterable[str]) -> tuple[str, ...]:
        return self.order(set().union(*map(set, dims)))

    def shape(self, dims: Iterable[str]) -> str:
        """The shape of a value on ``dims``: ``[BLOCK_m, BLOCK_e]``; ``[]`` for a scalar."""
        return "[" + ", ".join(f"BLOCK_{d}" for d in self.order(dims)) + "]"

    def axis(self, dims: Iterable[str], dim: str) -> int:
        """The position of ``dim`` in a value on ``dims``."""
        return self.order(dims).index(dim)

    def expand(self, text: str, have: Iterable[str], want: Iterable[str]) -> str:
        """``text``, a value on ``have``, placed on ``want`` (a superset): ``None`` for each dim it
        lacks. A scalar broadcasts as it is."""
        have, want = self.order(have), self.order(want)
        if not set(have) <= set(want):
            raise AssertionError(f"a value on {have} cannot be placed on {want}")
        if have == want or not have:
            return text
        index = ", ".join(":" if d in have else "None" for d in want)
        return f"{text if is_atom(text) else f'({text})'}[{index}]"

    def whole(self, text: str, have: Iterable[str], want: Iterable[str]) -> str:
        """``text`` (a tensor on ``have``) as a whole tile over ``want``, to be stored."""
        want = self.order(want)
        if self.order(have) != want:  # it varies over fewer dims than it is stored over
            return f"tl.broadcast_to({self.expand(text, have, want)}, {self.shape(want)})"
        return text if is_atom(text) else f"({text})"
