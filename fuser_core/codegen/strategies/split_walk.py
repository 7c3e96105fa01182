"""split_fused's kernels, walked with the structure's primitives: the part kernel (each program
streams its chunk of the axis and stores its partial state) and the combine kernel (the partial
states merged with the realisations' merge rules, then as streaming_fused ends). Imported by
:meth:`fuser_core.codegen.strategies.split_fused.SplitFused.build` when it builds: the strategy
registry stays light (the CLI checks a strategy's name without sympy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy as sp

from fuser_core.codegen.names import safe_name
from fuser_core.codegen.ops import (
    Chunk, Comment, Copy, Count, InitState, PartMerge, Value, WorkspaceLoad, WorkspaceStore,
)
from fuser_core.codegen.ops import bounds as bound
from fuser_core.codegen.tritonize import VarRef
from fuser_core.realisation import COUNT_OLD, new, part_acc, part_anchor, part_count
from fuser_core.reduce_ops import has_slots, is_selection
from fuser_core.spec import Step

if TYPE_CHECKING:
    from fuser_core.codegen.structure.build import Walk

def split_part(w: Walk) -> None:
    """The part kernel: program (lanes, s) streams chunk s of the axis and stores its partial state."""
    w.add(Chunk(part=True))
    a = w.axis
    end = bound.minimum(bound.plus(bound.name("lo"), bound.name("chunk")), bound.name(f"size_{a}"))
    w.streaming_loop("chunk", bound.name("lo"), end)
    for entry in w.workspace():
        w.add(WorkspaceStore(entry=entry.name, entry_dims=entry.dims, dims=w.order(entry.dims),
                             value_dims=w.var_dims[entry.name]))


def combine_kernel(w: Walk) -> None:
    """The combine kernel: the partial states merged (:func:`combine`), then as streaming_fused's end."""
    if w.grid.split:
        w.add(Chunk(part=False))
    combine(w)
    w.finalize()
    w.outputs()
    w.fallback()


def combine(w: Walk) -> None:
    """A loop over the SPLIT partial states, each merged into the running one (:func:`merge_part`)."""
    a = w.axis
    steps = w.axis_steps()
    accs = {s.name: w.init_state(s, len(w.realisation(s).accumulators)) for s in steps}
    anchors = w.anchored_deps()
    for dep in anchors:
        dims = w.order(w.spec.step(dep).dims)
        w.add(InitState(name=f"{safe_name(dep)}_anchor", dims=dims, dtype="float32", fill=None))
        w.let(f"{safe_name(dep)}_anchor", dims)
    counts = w.reads_count()
    if counts:
        w.add(Count(mode="init", axis=a))
    ws = {entry.name: entry.dims for entry in w.workspace()}

    def body():
        w.depth += 1
        if counts:
            w.add(Count(mode="part", axis=a))
        for dep in anchors:
            var = safe_name(dep)
            w.add(Copy(name=f"{var}_anchor_old", dims=w.var_dims[f"{var}_anchor"], source=f"{var}_anchor"))
            w.let(f"{var}_anchor_old", w.var_dims[f"{var}_anchor"])
            load_part(w, f"{var}_anchor", ws[f"{var}_anchor"], other="0.0")
        for step in steps:
            merge_part(w, step, accs[step.name], ws)
            if step.name in anchors:
                w.update_anchor(step)
        w.depth -= 1

    w.loop("split", "split", bound.ZERO, bound.name("SPLIT"), None, body)
    w.accs = accs


def load_part(w: Walk, name: str, dims: tuple[str, ...], other: str = "0") -> str:
    """Workspace entry ``name`` of part ``split``, loaded as ``{name}_part``."""
    tile = w.order(dims)
    w.add(WorkspaceLoad(entry=name, dims=tile, entry_dims=dims, other=other))
    w.let(f"{name}_part", tile)
    return f"{name}_part"


def merge_part(w: Walk, step: Step, accs: list[str], ws: dict[str, tuple[str, ...]]) -> None:
    """Fold part `split` into the merged state with the realisation's merge rule:
    acc_k = op(moved_k(merged so far), moved_k(part)), both moved to the merged anchors."""
    real = w.realisation(step)
    w.add(Comment(text=f"# {step.name}: merge part `split` ({real.kind})"))
    parts = []
    for a, acc in zip(real.accumulators, accs):
        if a.selection:
            # the padding slots of a top-k list (BLOCK_as > k) must never win a merge: -inf, not 0
            # (lists are kept largest-first: a bottomk accumulates negated values)
            parts.append(load_part(w, f"{acc}_values", ws[f"{acc}_values"], other='float("-inf")'))
            load_part(w, f"{acc}_indices", ws[f"{acc}_indices"], other="2147483647")
        else:
            parts.append(load_part(w, acc, ws[acc]))
    rules = real.merge()
    w.need([r.left for r in rules] + [r.right for r in rules])
    names: dict = {COUNT_OLD: VarRef("count_old"), part_count("a"): VarRef("count_old"), part_count("b"): VarRef("count_part")}
    for j, (merged, part) in enumerate(zip(w.state_names(real, accs), parts)):
        names[part_acc(j, "a")] = w.var(merged)
        names[part_acc(j, "b")] = w.var(part)
    for dep in w.anchored_deps():
        sym = w.conv.symbols[dep]
        names[part_anchor(sym, "a")] = w.var(f"{safe_name(dep)}_anchor_old")
        names[part_anchor(sym, "b")] = w.var(f"{safe_name(dep)}_anchor_part")
        names[new(sym)] = w.var(f"{safe_name(dep)}_anchor")
    lefts: list[sp.Expr] = [r.left for r in rules]
    extra = dict(names)
    if real.moves_jointly:  # a Taylor shift reads every merged accumulator: none may be updated first
        held = []
        for acc, left in zip(accs, lefts):
            env = w.env(left, extra=names)
            w.add(Value(name=f"{acc}_moved", dims=w.dims_of(left, env), expr=left, env=env))
            holder = w.placeholder(f"{acc}_moved")
            extra[holder] = w.let(f"{acc}_moved", w.dims_of(left, env))
            held.append(holder)
        lefts = held
    for acc, rule, left in zip(accs, rules, lefts):
        env = w.env(left, rule.right, extra=extra)
        state = w.var_dims[f"{acc}_values"] if is_selection(rule.op) else w.var_dims[acc]
        w.add(PartMerge(step=step.name, name=acc, dims=state, op=rule.op, left=left, right=rule.right, env=env,
                           slots=step.as_dim if has_slots(rule.op) else None,
                           k=step.k if has_slots(rule.op) else None))
    if w.read_in_loop(step):
        w.running_value(step, accs)
    elif not real.selection and real.value not in real.symbols:
        w.hoist([real.value])


__all__ = ["combine", "combine_kernel", "load_part", "merge_part", "split_part"]
