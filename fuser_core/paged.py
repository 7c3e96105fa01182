"""Inputs stored in pages (a paged KV cache): the one place that knows the layout.

An input declared ``"paged": {"dim": "n", "by": ["b"], "table": "block_table", "page_size": 16}``
(:class:`~fuser_core.spec_model.Paged`) is, logically, ``k[b, g, n, d]`` as every step, the
reference and the certificate read it. Its tensor is stored as vLLM's and FlashAttention's paged
caches are: ``k_cache[pages, page_size, g, d]`` (the input's dims but ``by`` and ``dim``, in its
order, after the page and the slot) with a table ``block_table[b, cols]`` (cols >= cdiv(n,
page_size), int32 or int64): key ``i`` of sequence ``b`` is ``k_cache[block_table[b, i // 16], i % 16]``.

- The fused kernels read the pages where they lie (:func:`address`): the table at each key's
  page (one small load per key, from cache), the page's offset in 64 bits (a cache of more than
  2**31 elements is ordinary), the rest in 32 as every tensor. No copy; no TMA (a tile crosses
  pages).
- A generated launcher takes either the pages and the table, as a server calls it, or the logical
  tensor, as Foldwise's own runs, tests and tuner make them (:func:`to_pages` pages it there, in
  a scrambled page order, so the kernels always read through a table).
- The unfused chain gathers the pages into the logical tensor first (:func:`from_pages`: a copy).

Example:
    >>> import torch
    >>> from fuser_core.catalog import load_catalog_spec
    >>> spec = load_catalog_spec("attention_paged")
    >>> shape = {"b": 2, "g": 1, "r": 1, "m": 1, "n": 20, "d": 4, "e": 4}
    >>> k = torch.randn(2, 1, 20, 4)
    >>> pages, table = to_pages(spec, {"k": k}, shape)
    >>> pages["k"].shape, table["block_table"].shape
    (torch.Size([4, 16, 1, 4]), torch.Size([2, 2]))
    >>> bool((from_pages(spec, "k", pages["k"], table["block_table"], shape) == k).all())
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fuser_core.codegen.names import safe_name
from fuser_core.spec import Spec
from fuser_core.spec_model import Input, Paged

PAGE, SLOT, COL = "_page", "_slot", "_col"  # stride names of a page, a slot and a table column (no dim's name)


def columns(paged: Paged, shape: Mapping[str, int]) -> int:
    """The table columns a shape reads: cdiv(size(dim), page_size)."""
    return -(-int(shape[paged.dim]) // paged.page_size)


def kernel_dims(inp: Input) -> tuple[str, ...]:
    """The stored tensor's dims as kernel stride names: the page, the slot, then the rest."""
    assert inp.paged is not None
    return (PAGE, SLOT, *inp.paged.rest(inp.dims))


def address(inp: Input, var: str) -> tuple[tuple[str, str, str, tuple[str, ...]], ...]:
    """:func:`fuser_core.merged.address` of a paged input: its dim ``n`` is two entries, the page
    (the table read at ``n // page_size`` beside the ``by`` dims' offsets, masked past the dim,
    widened to 64 bits before its stride multiplies it) and the slot ``n % page_size``; the ``by``
    dims have no entry of their own (the table holds them)."""
    p = inp.paged
    assert p is not None
    t = safe_name(p.table)
    # a lane past a by dim reads the last row (its loads are masked anyway): never a row past the table
    by = "".join(f"tl.minimum({{offs_{d}}}, size_{d} - 1) * stride_{t}_{d} + " for d in p.by)
    page = (f"tl.load({t}_ptr + {by}({{0}} // {p.page_size}) * stride_{t}_{COL}, mask={{0}} < size_{p.dim}, "
            "other=0).to(tl.int64)")
    reads = (f"{t}_ptr", *(f"stride_{t}_{d}" for d in p.by), f"stride_{t}_{COL}", *(f"size_{d}" for d in (p.dim, *p.by)))
    out = []
    for d in inp.dims:
        if d in p.by:
            continue
        if d == p.dim:
            out += [(d, page, f"stride_{var}_{PAGE}", reads), (d, f"({{}} % {p.page_size})", f"stride_{var}_{SLOT}", ())]
        else:
            out.append((d, "{}", f"stride_{var}_{d}", ()))
    return tuple(out)


# ---------------------------------------------------------------- tensors: logical <-> pages


def page_table(paged: Paged, shape: Mapping[str, int], device: Any = None) -> Any:
    """An int32 table ``[*by, cols]`` over ``prod(by) * cols`` pages in a scrambled order
    (helpers.page_order), as a generated launcher makes for logical tensors."""
    import torch

    from fuser_core.codegen.helpers import page_order

    by = [int(shape[d]) for d in paged.by]
    cols = columns(paged, shape)
    return page_order(cols * math.prod(by), device).to(torch.int32).reshape(*by, cols)


def page_axes(inp: Input) -> tuple[int, ...]:
    """The permutation of the input's axes that puts the table's (``by``), the paged one, then the rest."""
    assert inp.paged is not None
    p = inp.paged
    return tuple(inp.dims.index(d) for d in (*p.by, p.dim, *p.rest(inp.dims)))


def to_pages(spec: Spec, tensors: Mapping[str, Any], shape: Mapping[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The paged inputs among logical ``tensors`` (torch) stored in pages through one
    :func:`page_table` per table: (inputs by name -> their pages, tables by name -> the table).
    Slots past the dim's size hold NaN, which no kernel may read."""
    from fuser_core.codegen.helpers import to_page_layout

    pages: dict[str, Any] = {}
    tables: dict[str, Any] = {}
    for name, x in tensors.items():
        inp = spec.input(name)
        if inp.paged is None:
            continue
        if inp.paged.table not in tables:
            tables[inp.paged.table] = page_table(inp.paged, shape, x.device)
        pages[name] = to_page_layout(x, tables[inp.paged.table], page_axes(inp), inp.paged.page_size)
    return pages, tables


def from_pages(spec: Spec, name: str, stored: Any, table: Any, shape: Mapping[str, int]) -> Any:
    """Paged input ``name`` gathered from its pages through ``table``: the logical tensor (a copy)."""
    inp = spec.input(name)
    p = inp.paged
    assert p is not None
    rest = p.rest(inp.dims)
    n = int(shape[p.dim])
    cols = columns(p, shape)
    seq = stored[table[..., :cols].reshape(-1).long()]  # [prod(by) * cols, page_size, *rest]
    seq = seq.reshape(-1, cols * p.page_size, *seq.shape[2:])[:, :n]
    walked = (*p.by, p.dim, *rest)
    seq = seq.reshape(*(int(shape[d]) for d in walked))
    return seq.permute([walked.index(d) for d in inp.dims])


def storage_shape(inp: Input, shape: Mapping[str, int], pages: int) -> tuple[int, ...]:
    """The shape of paged input ``inp``'s tensor holding ``pages`` pages."""
    assert inp.paged is not None
    return (pages, inp.paged.page_size, *(int(shape[d]) for d in inp.paged.rest(inp.dims)))


# ---------------------------------------------------------------- a generated launcher's lines


def _sizes(dims) -> str:
    return "(" + "".join(f"size_{d}, " for d in dims) + ")"


def launcher_lines(spec: Spec) -> list[str]:
    """Lines of a generated launcher, after it has read its inputs, that bring each page table and
    the inputs paged through it to what the kernels read: the caller's pages and table, checked
    (helpers.page_table_checked), or logical tensors paged here (helpers.to_page_layout)."""
    lines: list[str] = []
    for table, p in spec.page_tables.items():
        t = safe_name(table)
        paged = spec.paged_by(table)
        names = ", ".join(i.name for i in paged)
        cols = f"triton.cdiv(size_{p.dim}, {p.page_size})"
        by = _sizes(p.by)
        count = " * ".join([*(f"size_{d}" for d in p.by), cols])
        first = safe_name(paged[0].name)
        logical = " and ".join(f"tuple({safe_name(i.name)}.shape) == {_sizes(i.dims)}" for i in paged)
        lines += [f"    # {names}: pages [pages, {p.page_size}, ...] read through {table} [{', '.join(p.by)}, "
                  f">= cdiv({p.dim}, {p.page_size})] (fuser_core.paged)",
                  f'    {t} = inputs.get("{table}")',
                  f"    if {t} is None and {logical}:  # logical tensors (runs, tests, tuning): paged here",
                  f"        {t} = page_order({count}, {first}.device).to(torch.int32).reshape(*{by}, {cols})"]
        lines += [f"        {safe_name(i.name)} = to_page_layout({safe_name(i.name)}, {t}, {page_axes(i)}, {p.page_size})"
                  for i in paged]
        stored = ", ".join(f"{safe_name(i.name)}=({safe_name(i.name)}, ({p.page_size}, {_sizes(p.rest(i.dims))[1:]})"
                           for i in paged)
        lines.append(f'    {t} = page_table_checked("{table}", {t}, {by}, {cols}, {stored})')
    return lines


def offsets_checked(spec: Spec) -> list[str]:
    """The launcher's ``int32_offsets`` arguments for the paged inputs and their tables: a paged
    input's first page only (a page's offset is 64-bit: a cache may hold more than 2**31 elements)."""
    pages = [f"{safe_name(i.name)}={safe_name(i.name)}[:1]" for i in spec.inputs if i.paged is not None]
    return pages + [f"{safe_name(t)}={safe_name(t)}" for t in spec.page_tables]


def gathered(spec: Spec, tensors: Mapping[str, Any], shape: Mapping[str, int]) -> dict[str, Any]:
    """``tensors`` (torch, by input name, tables among them) with every paged input given as pages
    gathered into its logical tensor through its table (the unfused chain reads logical tensors);
    the tables left out. A paged input given logical is kept as it is."""
    out = {}
    for name, t in tensors.items():
        if name in spec.page_tables:
            continue
        inp = spec.input(name)
        if inp.paged is not None and tuple(t.shape) != tuple(int(shape[d]) for d in inp.dims):
            from fuser_core.codegen.helpers import page_table_checked

            p = inp.paged
            tail = storage_shape(inp, shape, 0)[1:]
            table = page_table_checked(p.table, tensors.get(p.table), [int(shape[d]) for d in p.by], columns(p, shape),
                                       **{name: (t, tail)})
            t = from_pages(spec, name, t, table, shape)
        out[name] = t
    return out


# ---------------------------------------------------------------- a caller's tensors (service.bundle)


def call_dims(spec: Spec, name: str) -> tuple[str, ...]:
    """The dims of the tensor a caller passes as input or table ``name``: a paged input's are its
    table's pages and slots (``block_table.pages``, ``block_table.slot``: names no dim can have)
    then the rest; a table's its ``by`` dims and its columns (``block_table.cols``)."""
    if name in spec.page_tables:
        return (*spec.page_tables[name].by, f"{name}.cols")
    inp = spec.input(name)
    if inp.paged is None:
        return inp.storage_dims or inp.dims
    return (f"{inp.paged.table}.pages", f"{inp.paged.table}.slot", *inp.paged.rest(inp.dims))


def call_sizes(spec: Spec, sizes: Mapping[str, int]) -> dict[str, int]:
    """The spec's sizes from those a caller's tensors give (:func:`call_dims`): a page holds
    ``page_size`` slots (ValueError naming the table otherwise), and the paged dim, where no other
    input gives it, is the table's width in keys, cols * page_size, as FlashAttention reads a
    paged cache (the keys past a sequence's length are masked by its spec, never read)."""
    out = {d: n for d, n in sizes.items() if "." not in d}
    for table, p in spec.page_tables.items():
        slot, cols = sizes.get(f"{table}.slot"), sizes[f"{table}.cols"]
        if slot is not None and slot != p.page_size:
            raise ValueError(f"{table}: its pages hold {slot} slots, but the spec's page_size is {p.page_size}")
        out.setdefault(p.dim, cols * p.page_size)
    return out
