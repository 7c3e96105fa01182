"""The spec grammar of inputs stored in pages (``"paged"``: a paged KV cache, docs/SPEC.md), checked
as the spec loads (:mod:`fuser_core.spec`). Light: no sympy, no numpy."""

from __future__ import annotations

from typing import Any

from fuser_core.errors import SpecError, shown
from fuser_core.spec_model import Input, Paged

MAX_PAGE_SIZE = 4096  # slots per page (vLLM's blocks hold 16 to 256 keys)
PAGED_KEYS = {"dim", "by", "table", "page_size"}


def load_paged(loader: Any, raw: Any, dims: tuple[str, ...], kind: str, earlier: list[Input],
               loc: tuple[str | int, ...]) -> Paged:
    """``"paged": {"dim": "n", "by": ["b"], "table": "block_table", "page_size": 16}``: the input is
    stored in pages (a paged KV cache, :class:`~fuser_core.spec_model.Paged`). Inputs paged
    through one table agree on its layout. ``loader``: the spec loader (its ``keys``, ``ident``)."""
    loader.keys(raw, PAGED_KEYS, loc)
    for required in sorted(PAGED_KEYS):
        if required not in raw:
            raise SpecError("this field is required", loc=(*loc, required))
    if kind != "float":
        raise SpecError("only a float input is stored in pages", loc=loc)
    dim = loader.ident(raw["dim"], (*loc, "dim"), "dim name")
    if dim not in dims:
        raise SpecError(f"{dim!r} is not a dim of this input ({', '.join(dims)})", loc=(*loc, "dim"))
    by = raw["by"]
    if not isinstance(by, list) or not by:
        raise SpecError("expected a non-empty list of the dims the table is indexed by, such as [\"b\"]",
                        loc=(*loc, "by"))
    for i, d in enumerate(by):
        loader.ident(d, (*loc, "by", i), "dim name")
        if d not in dims or d == dim:
            raise SpecError(f"{d!r} is not a dim of this input other than {dim!r}", loc=(*loc, "by", i))
    if len(set(by)) != len(by):
        raise SpecError("names a dim twice", loc=(*loc, "by"))
    table = loader.ident(raw["table"], (*loc, "table"), "table name")
    size = raw["page_size"]
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_PAGE_SIZE:
        raise SpecError(f"must be an integer from 1 to {MAX_PAGE_SIZE}, got {shown(size, 40)}",
                        loc=(*loc, "page_size"))
    paged = Paged(dim, tuple(by), table, size)
    other = next((i for i in earlier if i.paged is not None and i.paged.table == table), None)
    if other is not None and other.paged != paged:
        raise SpecError(f"table {table!r} pages input {other.name!r} by dim {other.paged.dim!r}, by "
                        f"{list(other.paged.by)}, page_size {other.paged.page_size}: the inputs it pages must "
                        "agree", loc=loc)
    return paged

def check_page_tables(loader: Any, inputs: tuple[Input, ...]) -> None:
    """A page table's name is its own (the call passes it by name), and a paged input holds no
    dims reduced together (its tensor is pages, not a view with a merged dim)."""
    for inp in inputs:
        if inp.paged is None:
            continue
        loc = ("inputs", inp.name, "paged")
        if inp.storage_dims:
            raise SpecError("holds dims reduced together: a paged input's dims are not merged", loc=loc)
        if inp.paged.table in loader.by_name or inp.paged.table in loader.dims:
            raise SpecError(f"table name {inp.paged.table!r} is already an input, param, step or dim name",
                            loc=(*loc, "table"))


__all__ = ["MAX_PAGE_SIZE", "PAGED_KEYS", "check_page_tables", "load_paged"]
