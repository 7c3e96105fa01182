"""A loaded spec as data: its inputs, params and steps, immutable (:func:`fuser_core.spec.load_spec`
makes them; every other module reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fuser_core import expr as ex
from fuser_core.reduce_ops import has_slots, returns_indices

INPUT_KINDS = {"float": False, "index": True}  # input kind -> integer valued (positions, lengths)


@dataclass(frozen=True)
class Paged:
    """An input stored in pages, as a paged KV cache (vLLM's and FlashAttention's layout): the
    tensor is ``[pages, page_size, *rest]``, ``rest`` the input's dims but ``by`` and ``dim`` in its
    order, and element ``[*by, i, *rest]`` of the logical input lies at page ``table[*by, i //
    page_size]``, slot ``i % page_size`` (:mod:`fuser_core.paged`). ``table`` is an integer tensor
    ``[*by, cols]``, cols >= cdiv(size(dim), page_size), passed by that name."""

    dim: str
    by: tuple[str, ...]
    table: str
    page_size: int

    def rest(self, dims: tuple[str, ...]) -> tuple[str, ...]:
        """The dims after the page and the slot in storage: ``dims`` but ``by`` and ``dim``."""
        return tuple(d for d in dims if d != self.dim and d not in self.by)


@dataclass(frozen=True)
class Input:
    name: str
    dims: tuple[str, ...]  # logical: dims reduced together (a list ``over``) appear as their merged dim
    kind: str = "float"  # "float" or "index"
    storage_dims: tuple[str, ...] = ()  # the dims the user declared (the tensor's own), when they differ
    paged: Paged | None = None  # stored in pages through a table (a paged KV cache)

    @property
    def is_index(self) -> bool:
        """An integer input (positions, lengths): loaded as int32, compared, never rescaled."""
        return INPUT_KINDS[self.kind]

    @property
    def is_float(self) -> bool:
        return not self.is_index


@dataclass(frozen=True)
class Param:
    """A constant of the cascade (``expr``: numbers and size(dim) only), or, with ``runtime``, a
    scalar the caller passes at each call (eps, a softmax scale, a softcap): a kernel argument, not
    part of the spec's identity; ``expr`` is then its default (None: the caller must pass it) and
    ``positive`` the sign the derivation may assume (docs/SPEC.md, "Runtime scalars")."""

    name: str
    expr: ex.Expr | None
    runtime: bool = False
    positive: bool = False


@dataclass(frozen=True)
class Step:
    name: str
    expr: ex.Expr
    dims: tuple[str, ...]  # inferred, in the spec's dim order
    reduce: str | None = None
    over: str | None = None
    k: int | None = None
    as_dim: str | None = None

    @property
    def is_reduction(self) -> bool:
        return self.reduce is not None

    @property
    def parts(self) -> tuple[str, ...]:
        """Names of the arrays this step produces (a topk step has two)."""
        if has_slots(self.reduce):
            return (f"{self.name}.values", f"{self.name}.indices")
        return (self.name,)

    @property
    def is_integer(self) -> bool:
        return returns_indices(self.reduce)


@dataclass(frozen=True)
class Spec:
    name: str
    doc: str
    inputs: tuple[Input, ...]
    params: tuple[Param, ...]
    steps: tuple[Step, ...]
    outputs: tuple[str, ...]
    dims: tuple[str, ...]  # every dim: inputs' dims by first appearance, then topk `as` dims
    # merged dim -> the dims it merges, outer to inner: a reduction "over": ["c", "p"] runs one loop over
    # the merged dim "c_p" (docs/SPEC.md "Reducing over several dims"); c and p are its parts
    merges: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False)  # hashed through dims
    # shapes the spec's doc excludes, refused by name: (dim, relation, dim), "m <= n" (docs/SPEC.md)
    constraints: tuple[tuple[str, str, str], ...] = ()
    # output step -> its storage dtype, where it is not the inputs' (docs/SPEC.md "output_dtypes"): a
    # statistic a backward reads, kept in float32 beside 16-bit data as FlashAttention keeps its lse
    output_dtypes: tuple[tuple[str, str], ...] = ()
    # a shape the spec runs at (dim -> size as a user writes it: a merged dim's parts), its sizes checked when
    # loaded and the whole bound where a command uses it (`foldwise run NAME` without --shape). Not part of the
    # spec's identity
    example: dict[str, int] = field(default_factory=dict, hash=False, compare=False)
    _by_name: dict[str, Input | Param | Step] = field(default_factory=dict, repr=False, compare=False)

    def step(self, name: str) -> Step:
        obj = self._by_name.get(name)
        if not isinstance(obj, Step):
            raise KeyError(name)
        return obj

    def input(self, name: str) -> Input:
        obj = self._by_name.get(name)
        if not isinstance(obj, Input):
            raise KeyError(name)
        return obj

    def lookup(self, name: str) -> Input | Param | Step | None:
        return self._by_name.get(name)

    def ref_dims(self, ref: ex.Ref) -> tuple[str, ...]:
        obj = self._by_name[ref.name]
        if isinstance(obj, Param):
            return ()
        if isinstance(obj, Input | Step):
            return obj.dims
        raise KeyError(ref.name)

    @property
    def page_tables(self) -> dict[str, Paged]:
        """Each page table by name -> its layout (the inputs paged through it agree on it)."""
        return {i.paged.table: i.paged for i in self.inputs if i.paged is not None}

    def paged_by(self, table: str) -> tuple[Input, ...]:
        """The inputs stored in pages through ``table``, in the spec's order."""
        return tuple(i for i in self.inputs if i.paged is not None and i.paged.table == table)

    @property
    def part_dims(self) -> tuple[str, ...]:
        """The dims merged into another (sizes of their own: size(c) may be used; no axis of their own)."""
        return tuple(d for parts in self.merges.values() for d in parts)

    @property
    def sized_dims(self) -> tuple[str, ...]:
        """Every dim with a size of its own: the dims, then the merged dims' parts (kernel arguments)."""
        return self.dims + self.part_dims

    def storage_dims(self, dims: tuple[str, ...]) -> tuple[str, ...]:
        """``dims`` with each merged dim written as its parts: the user's tensor's dims."""
        return tuple(part for d in dims for part in self.merges.get(d, (d,)))

    def over_text(self, step: Step) -> str | list[str]:
        """A reduction's ``over`` as the user writes it: a dim, or the list of dims merged."""
        assert step.over is not None
        return list(self.merges[step.over]) if step.over in self.merges else step.over

    def order_dims(self, dims: set[str] | tuple[str, ...]) -> tuple[str, ...]:
        """Dims in the spec's order (the output dim order rule of docs/API.md)."""
        return tuple(d for d in self.dims if d in dims)

    def expr_dims(self, e: ex.Expr) -> tuple[str, ...]:
        found: set[str] = set()
        for node in ex.walk(e):
            if isinstance(node, ex.Ref):
                found.update(self.ref_dims(node))
            elif isinstance(node, ex.Index):
                found.add(node.dim)
        return self.order_dims(found)

    @property
    def runtime_params(self) -> tuple[Param, ...]:
        """The params passed at call time (kernel arguments), in the spec's order."""
        return tuple(p for p in self.params if p.runtime)

    @property
    def output_parts(self) -> tuple[str, ...]:
        """Every array written: output step names, with a topk step's two parts."""
        return tuple(part for name in self.outputs for part in self.step(name).parts)


def raw_param(p: Param) -> Any:
    """``p`` as a spec's JSON writes it (for specs built from another: sub-specs, a cast-free copy)."""
    if not p.runtime:
        assert p.expr is not None
        return ex.to_text(p.expr)
    out: dict[str, Any] = {"runtime": "float"}
    if p.expr is not None:
        out["default"] = ex.to_text(p.expr)
    if p.positive:
        out["positive"] = True
    return out
