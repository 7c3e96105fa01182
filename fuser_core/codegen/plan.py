"""Which strategy can run a (spec, shape), and how its kernel is laid out.

A kernel's tiles span the spec's dims in the spec's order, each value only those it varies over
(:mod:`fuser_core.codegen.layout`). Each dim has a block size:

- the **loop axis** (the axis of the cascade the kernel fuses) is walked in tiles of
  ``BLOCK_<axis>`` (one tile holding the whole axis for row-resident);
- **inner axes** (reductions that keep the loop axis, like attention's ``s = q.k`` over
  ``d``) are held whole, in one block, or, for a sum over a dim no value keeps and whose inputs
  only that sum reads (a producer GEMM's hidden size: ``logits = sum over d of h * w`` before a
  cross-entropy), summed ``BLOCK_<d>`` at a time in a loop of their own inside each tile (a GEMM's
  K loop: :func:`contraction_loop_dims`);
- **lane dims** (everything else, e.g. rows) are split over programs, ``BLOCK_<dim>`` at a
  time (1 by default: one row per program); a topk ``as`` dim is held whole.

Strategies (docs/THEORY.md section 6), one module each under :mod:`fuser_core.codegen.strategies`,
say when each is valid (decided before anything runs), its default configuration and how it builds;
this module holds the rules every strategy shares.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fuser_core.codegen.config import MAX_TILE_ELEMENTS, KernelConfig, NotValid, next_pow2
from fuser_core.codegen.strategies import STRATEGIES, DefaultTiling, Strategy, strategy_named
from fuser_core.codegen.strategies import BASELINE  # noqa: F401  (tests and benchmarks import it from here)
from fuser_core.codegen.strategies.base import DOT_BLOCK_N, MAX_DOT_INNER
from fuser_core.derive import Derivation
from fuser_core.derive.gathers import gather_form
from fuser_core.problem import fill_parts, meeting_constraints
from fuser_core.reduce_ops import in_tile
from fuser_core.spec import Spec, Step
from fuser_core.dim_symbols import is_dim_symbol

MAX_INNER_BLOCK = 1024  # an inner axis is held whole; beyond this a tile no longer fits
# a K loop's tile (an inner sum summed a block at a time) when the axis does not fit one block:
# Triton's matmul tutorial's BLOCK_SIZE_K for 16-bit operands; the tuner searches around it
CONTRACTION_BLOCK = 64
MIN_CONTRACTION_BLOCK = 16  # tl.dot's least K
MAX_KERNEL_NODES = 2000  # a step's expression once inlined (nodes with repetition): kernels print it whole


# split_fused's combine kernel writes the outputs along the axis with SPLIT programs per lane block
# (each re-merges the SPLIT partial states, then writes its own chunk) when the lane blocks alone
# are fewer than about one wave of programs (an H100 holds 132 SMs x 8 of them): below that one
# program per lane block leaves the GPU idle while it writes the whole axis. The cost model puts
# the crossover between 512 and 1024 lane blocks (benchmarks/results/parallel_combine_model.md).
PARALLEL_COMBINE_BELOW = 1024


def parallel_combine(strategy: str, lanes: tuple[str, ...], shape: Mapping[str, int], blocks: Mapping[str, int]) -> bool:
    """Does split_fused's combine kernel run SPLIT programs per lane block (see PARALLEL_COMBINE_BELOW)?"""
    if not strategy_named(strategy).splits_axis:
        return False
    return math.prod(-(-shape[d] // blocks[d]) for d in lanes) < PARALLEL_COMBINE_BELOW


@dataclass(frozen=True)
class KernelPlan:
    spec: Spec
    derivation: Derivation
    strategy: str
    axis: str
    inner: tuple[str, ...]  # inner reduction axes, held whole
    blocks: dict[str, int]  # every dim -> block size
    lanes: tuple[str, ...]  # dims split over programs
    config: KernelConfig
    parallel_combine: bool = False  # split_fused: see parallel_combine()
    # inner dims summed BLOCK_<d> at a time in a K loop of their own (contraction_loop_dims)
    contraction_loops: tuple[str, ...] = ()

    @property
    def rules(self) -> Strategy:
        """The strategy named :attr:`strategy`: what it holds whole, whether it is fused, how it builds."""
        return strategy_named(self.strategy)

    @property
    def dims(self) -> tuple[str, ...]:
        return self.spec.dims

    def axis_reductions(self) -> list[Step]:
        """The reductions over the loop axis that a pass over it computes (a gather is one load: :attr:`gathers`)."""
        gathers = self.gathers
        return [s for s in self.spec.steps if s.is_reduction and s.over == self.axis and s.name not in gathers]

    @functools.cached_property
    def gathers(self) -> dict[str, tuple[Any, Any]]:
        """Reductions over the axis that are one term: step name -> (X, at) for ``sum over axis of
        where(index(axis) == at, X, 0)`` (:func:`gather_form`): computed by loading X at index
        ``at``, as Liger-Kernel's cross-entropy loads the target's logit, not by a pass."""
        out = {}
        for s in self.spec.steps:
            if s.is_reduction and s.over == self.axis:
                form = gather_form(self.derivation.symbols, s, self.axis)
                if form is not None:
                    out[s.name] = form
        return out


def loop_axis(spec: Spec) -> tuple[str, tuple[str, ...]]:
    """The axis one kernel loops over, and the other reduced axes (held whole in each tile).

    Every reduction over another axis must keep the loop axis (it is computed inside each tile),
    except one over a selection's output dim (a top-k's ``as``): it reads the selection's final
    values, so it runs in the epilogue, after the loop, over the k slots the kernel already
    holds (renormalising a router's top-k gate weights over ``j``, say)."""
    axes = list(dict.fromkeys(s.over for s in spec.steps if s.is_reduction))
    if not axes:
        raise NotValid("the spec has no reduction")
    selected = {s.as_dim for s in spec.steps if s.as_dim}
    valid = []
    for a in axes:
        if a in selected:
            continue
        others = [s for s in spec.steps if s.is_reduction and s.over != a and s.over not in selected]
        if all(a in s.dims for s in others):
            valid.append(a)
    if not valid:
        raise NotValid(f"reductions over {', '.join(axes)} do not nest: no single loop axis")
    # where two axes would do, the one no inner reduction waits for: a backward's d_h = sum over v of
    # d_logits * w, whose d_logits reads logits = sum over d, loops over v (logits per tile, inside);
    # looping over d would hold every v whole and pass over d twice. Only where its inner reductions
    # can run inside a tile (sum, max, min: not an argmax)
    reads = _reductions_read(spec)
    inner_of = {a: [s for s in spec.steps if s.is_reduction and s.over != a and s.over not in selected] for a in valid}
    ahead = [a for a in valid if all(in_tile(s.reduce) for s in inner_of[a])
             and not any(any(spec.step(r).over == a for r in reads[s.name]) for s in inner_of[a])]
    a = (ahead or valid)[0]
    return a, tuple(x for x in axes if x != a)


def _reductions_read(spec: Spec) -> dict[str, set[str]]:
    """Step name -> the reductions its expression reads, through elementwise steps."""
    from fuser_core import expr as ex

    out: dict[str, set[str]] = {}
    for s in spec.steps:
        found: set[str] = set()
        for n in ex.walk(s.expr):
            if isinstance(n, ex.Ref) and n.name in out:
                found |= {n.name} if spec.step(n.name).is_reduction else out[n.name]
        out[s.name] = found
    return out


def loopable_inner_dims(spec: Spec, inner: tuple[str, ...]) -> frozenset[str]:
    """Inner dims a K loop may sum a block at a time: reduced by one step, a sum, that no other step
    keeps (no value carries the dim: each tile's sum is complete when its loop ends), and whose inputs
    carrying the dim no other step reads (their tiles live only inside that loop)."""
    from fuser_core import expr as ex

    out = set()
    for d in inner:
        reducers = [s for s in spec.steps if s.is_reduction and s.over == d]
        if len(reducers) != 1 or reducers[0].reduce != "sum" or any(d in s.dims for s in spec.steps):
            continue
        carrying = {i.name for i in spec.inputs if d in i.dims}
        if any(n.name in carrying for s in spec.steps if s is not reducers[0]
               for n in ex.walk(s.expr) if isinstance(n, ex.Ref)):
            continue
        out.add(d)
    return frozenset(out)


def contraction_loop_dims(inner: tuple[str, ...], blocks: Mapping[str, int],
                          shape: Mapping[str, int]) -> tuple[str, ...]:
    """The inner dims whose block is smaller than the dim (next power of two): summed in a K loop."""
    return tuple(d for d in inner if blocks[d] < next_pow2(shape[d]))


def default_inner_block(d: str, loopable: frozenset[str], shape: Mapping[str, int]) -> int:
    """An inner dim's block unless a configuration gives one: whole, or :data:`CONTRACTION_BLOCK` for a
    dim a K loop may sum (:func:`loopable_inner_dims`) that does not fit one block."""
    whole = next_pow2(shape[d])
    return CONTRACTION_BLOCK if d in loopable and whole > MAX_INNER_BLOCK else whole


def k_tile_pinned(spec: Spec, derivation: Derivation) -> bool:
    """Whether the kernel is a GEMM whose K is summed as a K loop sums it: the spec's one reduction
    is a contraction's sum over the loop axis, and its value reaches an output through an exp (a
    softmax's numerator, read against a row's max and denominator that another kernel computed from
    the same product: packing rule 8's ``d_logits`` stage of an LM head's backward). Such a loop
    takes tiles of :data:`CONTRACTION_BLOCK`, in order (default_config; the tuner neither changes the
    tile nor splits the axis), so the product sums to the value the forward's K loop summed: with a
    tile of 128 against the forward's 64 (logits near 30, float32), d_h's error was 11x torch's and
    d_w's 24x; with 64, d_h's is torch's own and d_w's 1.2x."""
    reductions = [s for s in spec.steps if s.is_reduction]  # one: the loop runs over its axis
    if len(reductions) != 1 or reductions[0].reduce != "sum":
        return False
    free, _batch = contraction_dims(spec, derivation)
    if not free or reductions[0].over in free:  # no contraction, or the axis is not its K
        return False
    from fuser_core import expr as ex

    through = {reductions[0].name}  # the elementwise steps whose value carries the sum's
    exp_of_sum = False
    for step in spec.steps[spec.steps.index(reductions[0]) + 1:]:
        refs = {n.name for n in ex.walk(step.expr) if isinstance(n, ex.Ref)}
        if refs & through:
            through.add(step.name)
            exp_of_sum |= any(isinstance(n, ex.Call) and n.func == "exp" and any(
                isinstance(m, ex.Ref) and m.name in through for m in ex.walk(n)) for n in ex.walk(step.expr))
    return exp_of_sum


def pinned_k_block(n: int) -> int:
    """A pinned K's tile (:func:`k_tile_pinned`) for an axis ``n`` long: the K loop's."""
    return min(CONTRACTION_BLOCK, next_pow2(n))


def _check_pinned_k(rules: Strategy, axis: str) -> None:
    """A pinned K (:func:`k_tile_pinned`) is summed in tiles, in order: not whole, not split. (Its tile
    is the defaults' and the tuner's choice; a configuration given by hand, or the tuner's check at a
    reduced shape, may take another.)"""
    if rules.holds_axis_whole or rules.splits_axis:
        raise NotValid(f"{axis} is a GEMM's K summed in tiles of {CONTRACTION_BLOCK} in order, as the forward's K "
                       f"loop sums it ({rules.name} {'holds it whole' if rules.holds_axis_whole else 'splits it'})")


def inner_block(d: str, loopable: frozenset[str], shape: Mapping[str, int], config: KernelConfig) -> int:
    """An inner dim's block: whole (a configuration's block for it is not read: an inner axis is held
    whole), or for a dim a K loop may sum (:func:`loopable_inner_dims`) the configuration's block, by
    default :func:`default_inner_block`'s."""
    whole = next_pow2(shape[d])
    if d not in loopable:  # held whole, whatever the configuration says
        if whole > MAX_INNER_BLOCK:
            raise NotValid(f"inner axis {d} ({shape[d]}) does not fit one block (max {MAX_INNER_BLOCK})")
        return whole
    block = min(config.blocks.get(d, default_inner_block(d, loopable, shape)), whole)
    if block < whole and block < MIN_CONTRACTION_BLOCK:
        raise NotValid(f"config.blocks.{d}: a K loop's tile over {d} is at least {MIN_CONTRACTION_BLOCK} (tl.dot's K)")
    if block > MAX_INNER_BLOCK:
        raise NotValid(f"config.blocks.{d}: {block} is more than one block holds (max {MAX_INNER_BLOCK})")
    return block


def capped_shape(spec: Spec, derivation: Derivation | None, shape: Mapping[str, int], *, axis: int, inner: int,
                 free: int, batch: int, lane: int) -> dict[str, int]:
    """``shape`` with each dim capped by its role, for a check at a small shape of the same structure: the
    loop axis at ``axis`` (at least a top-k's k), other reduced axes at ``inner``, a contraction's free
    dims at ``free`` and batch dims at ``batch`` (:func:`contraction_dims`; none without a derivation),
    every other dim at ``lane``; a top-k's ``as`` dim stays k."""
    loop, inner_axes = loop_axis(spec)
    free_dims, batch_dims = contraction_dims(spec, derivation) if derivation is not None else (set(), set())
    as_dims = {s.as_dim: s.k for s in spec.steps if s.as_dim}
    out: dict[str, int] = {}
    for d in spec.dims:
        n = shape[d]
        if d in as_dims:
            out[d] = as_dims[d]
        elif d == loop:
            out[d] = min(n, max(axis, max(as_dims.values(), default=0)))
        elif d in inner_axes:
            out[d] = min(n, inner)
        elif d in free_dims:
            out[d] = min(n, free)
        elif d in batch_dims:
            out[d] = min(n, batch)
        else:
            out[d] = min(n, lane)
    # a merged dim's parts, kept as far as the capped size allows (c=5, p=7 stay; capped to 20: c=2, p=7)
    return meeting_constraints(spec, fill_parts(spec, {**out, **{d: shape[d] for d in spec.part_dims if d in shape}}))


def contraction_dims(spec: Spec, derivation: Derivation) -> tuple[set[str], set[str]]:
    """(free dims, batch dims) of every contraction (:func:`contractions`), together."""
    free: set[str] = set()
    batch: set[str] = set()
    for f, b in contractions(spec, derivation):
        free |= f
        batch |= b
    return free, batch - free


def contractions(spec: Spec, derivation: Derivation) -> list[tuple[set[str], set[str]]]:
    """(free dims, batch dims) of each contraction: sums of products whose factors carry
    other dims (inner reductions such as q.k, and reductions the derivation marks as
    contractions such as p.v and the fp8 GEMM). Free dims are carried by some factors but not
    all (they become tl.dot's rows and columns); batch dims by every factor but masks of indices
    alone (a backward's causal mask), which multiply one operand and carry no batch."""
    import sympy as sp

    conv = derivation.symbols
    axis, inner = loop_axis(spec)
    out = []
    for step in spec.steps:
        if step.reduce != "sum":
            continue
        form = derivation.forms.get(step.name)
        if not (step.over in inner or (form is not None and form.contraction)):
            continue
        carried = []
        for f in sp.Mul.make_args(conv.integrand(step)):
            if all(is_dim_symbol(s, "index", "size") for s in f.free_symbols):
                continue  # a mask of indices (causal's where(index(n) <= index(m), 1, 0)): no operand's dims
            dims: set[str] = set()
            for s in f.free_symbols:
                dims |= set(conv.leaf_dims.get(s, ()))
            dims.discard(step.over)
            if dims:
                carried.append(dims)
        if len(carried) < 2:
            continue
        everywhere = set.intersection(*carried)
        out.append((set.union(*carried) - everywhere, everywhere))
    return out


def default_config(spec: Spec, derivation: Derivation, strategy: str, shape: dict[str, int]) -> KernelConfig:
    """The configuration a Triton engineer would start from (the tuner searches from here): each
    strategy's :meth:`~fuser_core.codegen.strategies.base.Strategy.default_config`, after the tiles
    every strategy shares: a contraction's free dims other than its row dim whole (a head dim, up to
    ``MAX_DOT_INNER``), else a GEMM's column tile ``DOT_BLOCK_N``."""
    axis, inner = loop_axis(spec)
    blocks: dict[str, int] = {}
    free, _batch = contraction_dims(spec, derivation)
    dot_lanes = tuple(d for d in spec.dims if d in free and d != axis and d not in inner)
    loopable = loopable_inner_dims(spec, inner)
    # inner axes ride along in every tile (a K loop's tile of them)
    held = math.prod(default_inner_block(d, loopable, shape) for d in inner)
    for d in dot_lanes[1:]:  # the contraction's other free dims: whole (a head dim), else a GEMM's column tile
        whole = next_pow2(shape[d])
        blocks[d] = whole if whole <= MAX_DOT_INNER and axis not in free else min(DOT_BLOCK_N, whole)
    tiling = DefaultTiling(spec, derivation, shape, axis, inner, free, dot_lanes, held, blocks)
    config = strategy_named(strategy).default_config(tiling)
    if k_tile_pinned(spec, derivation):
        config = replace(config, blocks={**config.blocks, axis: pinned_k_block(shape[axis])})
    return config


def make_plan(spec: Spec, derivation: Derivation, strategy: str, shape: dict[str, int], config: KernelConfig) -> KernelPlan:
    """Check validity and lay the kernel out; raises :class:`NotValid` with the reason."""
    rules = strategy_named(strategy)
    axis, inner = loop_axis(spec)
    conv = derivation.symbols
    for s in spec.steps:  # the generated source holds every inlined expression, uncommoned
        n = conv.size(conv.integrand(s) if s.is_reduction else conv.value(s.name))
        if n > MAX_KERNEL_NODES:
            raise NotValid(f"{s.name}: its expression has {n} nodes once earlier steps are inlined; kernels are "
                           f"generated for at most {MAX_KERNEL_NODES}")
    for s in spec.steps:  # an inner reduction is computed whole inside each tile: sum, max and min only
        if s.is_reduction and s.over in inner and not in_tile(s.reduce):
            raise NotValid(f"{s.name}: {s.reduce} over {s.over} inside the loop over {axis} is not supported "
                           "(inner reductions are sum, max or min)")
    for name, b in config.blocks.items():
        if name not in spec.dims:
            raise NotValid(f"config.blocks names unknown dim {name!r}")
    blocks: dict[str, int] = {}
    loopable = loopable_inner_dims(spec, inner)
    for d in spec.dims:
        if d in inner:
            blocks[d] = inner_block(d, loopable, shape, config)
        elif any(s.as_dim == d for s in spec.steps):
            blocks[d] = next_pow2(shape[d])
        elif d == axis:
            blocks[d] = config.blocks.get(d, min(next_pow2(shape[d]), 64))
            if k_tile_pinned(spec, derivation):
                _check_pinned_k(rules, d)
        else:
            blocks[d] = config.blocks.get(d, 1)
    lanes = tuple(d for d in spec.dims if d != axis and d not in inner and not any(s.as_dim == d for s in spec.steps))
    rules.check(derivation, axis, blocks, shape, config)
    if config.split != 1 and not rules.splits_axis:
        splitting = ", ".join(n for n, other in STRATEGIES.items() if other.splits_axis)
        raise NotValid(f"split = {config.split} is only for {splitting}")
    parallel = parallel_combine(strategy, lanes, shape, blocks)
    if config.combine != "kernel":
        if not rules.splits_axis:
            raise NotValid(f"combine = {config.combine} merges a split's partial states: it is for split strategies")
        if parallel and any(axis in spec.step(p.split(".")[0]).dims for p in spec.output_parts):
            raise NotValid(f"combine = {config.combine}: the outputs keep {axis} and the lane blocks are few, so the "
                           "combine writes them with SPLIT programs per lane block, in a launch of its own")
    dots = {f.name for f in derivation.forms.values() if f.contraction}
    tile = max(_tile_elements(spec, s, blocks, s.name in dots) for s in spec.steps)
    if tile > MAX_TILE_ELEMENTS:
        raise NotValid(f"a tile of {tile} elements is too large (max {MAX_TILE_ELEMENTS}); use smaller blocks")
    return KernelPlan(spec, derivation, strategy, axis, inner, blocks, lanes, config, parallel,
                      contraction_loop_dims(inner, blocks, shape))


def valid_strategies(spec: Spec, derivation: Derivation, shape: dict[str, int]) -> dict[str, str | None]:
    """strategy -> None when valid with its default config, else the reason it is not."""
    out: dict[str, str | None] = {}
    for strategy in STRATEGIES:
        try:
            make_plan(spec, derivation, strategy, shape, default_config(spec, derivation, strategy, shape))
            out[strategy] = None
        except NotValid as err:
            out[strategy] = str(err)
    return out


def _tile_elements(spec: Spec, step: Step, blocks: dict[str, int], contraction: bool = False) -> int:
    """Elements of the largest tensor computing ``step`` holds: its expression over one tile.

    A contraction done by tl.dot never holds the full [I, over, J] product, only its operands
    and its [I, J] result.
    """

    def size(dims) -> int:
        n = 1
        for d in dims:
            n *= blocks[d]
        return n

    if not contraction:
        return size(spec.expr_dims(step.expr))
    from fuser_core import expr as ex

    operands = [spec.ref_dims(n) for n in ex.walk(step.expr) if isinstance(n, ex.Ref)]
    return max([size(step.dims), *(size(d) for d in operands)])
