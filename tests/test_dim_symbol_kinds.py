"""A dim's symbols (size(n), index(n), first(n), last(n), end(n)) are told apart by
fuser_core.dim_symbols.symbol_kind alone (issue 38): no other module of the packages reads a
symbol's kind from its name."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fuser_core", "tuner", "service")
# a name tested for a kind's prefix, or sliced past one ("index(n)"[6:-1])
READS_A_KIND = re.compile(r"""startswith\(\(?\s*["'](size|index|first|last|end)\(["']|\[\s*[56]\s*:\s*-1\s*\]""")


def test_only_dim_symbols_reads_a_symbols_kind_from_its_name() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "fuser_core" / "dim_symbols.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if READS_A_KIND.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_symbol_kind_reads_every_kind_and_nothing_else() -> None:
    from fuser_core import dim_symbol, is_dim_symbol, symbol_kind
    from fuser_core.dim_symbols import DIM_SYMBOLS

    import sympy as sp

    for kind in DIM_SYMBOLS:
        sym = dim_symbol(kind, "n")
        assert symbol_kind(sym) == (kind, "n") and is_dim_symbol(sym, kind)
    assert dim_symbol("size", "n") == sp.Symbol("size(n)", integer=True, positive=True)  # what sympy views make
    assert dim_symbol("index", "n") == sp.Symbol("index(n)", integer=True, nonnegative=True)
    for other in ("x", "mx[old]", "s0", "sizes(n)", "size(n"):
        assert symbol_kind(sp.Symbol(other)) is None
