"""From a plan to its :class:`~fuser_core.codegen.structure.model.ModuleStructure`: each kernel walked,
its arguments, and the launches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fuser_core.codegen.names import kernel_arg, scalar_arg
from fuser_core.codegen.ops import Fold, Load, Op, Reduce, walk
from fuser_core.codegen.plan import KernelPlan
from fuser_core.codegen.structure.facts import accumulators, axis_outputs, kernel_names, workspace
from fuser_core.codegen.structure.model import Arg, Grid, Kernel, Launch, ModuleStructure, SplitLaunch, State, var_name
from fuser_core.codegen.structure.walk_strategies import StrategiesWalk
from fuser_core.merged import kernel_dims


class Walk(StrategiesWalk):
    """One kernel's operations, in the order they run (and are printed): every part of the walk."""


def _args(plan: KernelPlan, inputs: Iterable[str], outputs: Iterable[str], ws: tuple[State, ...], role: str,
          input_dtypes: Mapping[str, str], store_dtypes: Mapping[str, str], ops: Iterable[Op]) -> tuple[Arg, ...]:
    """The kernel's parameters, in the order hand-written kernels have them (pointers, sizes, each
    tensor's strides, the split's numbers, the blocks): exactly those its operations read."""
    spec = plan.spec
    used = [i for i in spec.inputs if i.name in set(inputs)]
    parts = [p for p in spec.output_parts if p in set(outputs)]
    out = [Arg(f"{var_name(i.name)}_ptr", kernel_arg(var_name(i.name), input_dtypes.get(i.name))) for i in used]
    out += [Arg(f"{var_name(p)}_ptr", kernel_arg(var_name(p), store_dtypes[p])) for p in parts]
    out += [Arg(f"size_{d}", f"size_{d}") for d in spec.sized_dims]
    out += [Arg(scalar_arg(p.name), scalar_arg(p.name)) for p in spec.runtime_params]
    for i in used:
        out += [Arg(f"stride_{var_name(i.name)}_{d}", f"{var_name(i.name)}.stride({k})")
                for k, d in enumerate(kernel_dims(spec, i.name))]
    for p in parts:
        dims = spec.step(p.split(".")[0]).dims
        out += [Arg(f"stride_{var_name(p)}_{d}", f"{var_name(p)}.stride({k})") for k, d in enumerate(dims)]
    out += [Arg(f"ws_{s.name}_ptr", f"ws_{s.name}") for s in ws]
    for s in ws:
        out.append(Arg(f"stride_ws_{s.name}_split", f"ws_{s.name}.stride(0)"))
        out += [Arg(f"stride_ws_{s.name}_{d}", f"ws_{s.name}.stride({k + 1})") for k, d in enumerate(s.dims)]
    if role == "combine":
        out.append(Arg("SPLIT", "SPLIT"))
    if role in ("split_part", "combine"):
        out.append(Arg("chunk", "chunk"))
    out += [Arg(f"BLOCK_{d}", str(plan.blocks[d]), constexpr=True) for d in spec.dims]
    read = set().union(*(op.reads() for op in walk(ops)))
    return tuple(a for a in out if a.name in read)


_DOCS = {
    "row_resident": "{name}, row-resident: the whole {a} axis of a row in one tile; one read, one write.",
    "multi_pass": "{name}, multi-pass: one loop over {a} per reduction, re-reading the inputs.",
    "streaming_fused": "{name}, streaming-fused: one pass over {a}; later reductions are kept with running values of "
                       "earlier ones and corrected when those move (derived by foldwise).",
    "split_part": "{name}, split-fused part 1: program (lanes, s) folds chunk s of {a} with the derived incremental form "
                  "and writes its partial state.",
    "combine": "{name}, split-fused part 2: merge the SPLIT partial states (each re-anchored to the merged dependencies "
               "with the derived corrections), then write the outputs.",
    "parallel_combine": "{name}, split-fused part 2: program (lanes, s) merges the SPLIT partial states (each re-anchored "
                        "to the merged dependencies with the derived corrections), then writes chunk s of the outputs.",
}


def _kernel(plan: KernelPlan, name: str, role: str, grid: Grid, walker, input_dtypes: Mapping[str, str],
            stores: Mapping[str, str], dots: dict, ws: tuple[State, ...], outputs: tuple[str, ...]) -> tuple[Kernel, Walk]:
    """One kernel: walked by ``walker`` (a Walk method), walked again if an input it fills with a fold's
    identity turned out to be read by one of its tl.dots (whose masked lanes must be 0)."""
    no_fill: frozenset[str] = frozenset()
    while True:
        w = Walk(plan, input_dtypes, stores, dots, role, grid, no_fill)
        w.setup()
        walker(w)
        ops = w.kernel_ops()
        dotted = {s.name for op in walk(ops) if isinstance(op, (Reduce, Fold)) and op.dot is not None
                  for s in op.dot.p.free_symbols | op.dot.q.free_symbols}
        filled = {op.input for op in walk(ops) if isinstance(op, Load) and op.fill} & dotted
        if not filled - no_fill:
            break
        no_fill = no_fill | filled
    key = "parallel_combine" if role == "combine" and grid.split else plan.strategy if role == "main" else role
    doc = _DOCS[key].format(name=plan.spec.name, a=plan.axis)
    states = tuple(s for step in plan.axis_reductions() for s in accumulators(plan, step, lanes=w.lanes_states))
    args = _args(plan, w.inputs, outputs, ws, role, input_dtypes, stores, ops)
    return Kernel(name, role, grid, doc, w.layout, ops, states, args, tuple(w.inputs), outputs,
                  plan.derivation.symbols.grouping), w


def build_structure(plan: KernelPlan, input_dtypes: Mapping[str, str],
                    store_dtypes: Mapping[str, str] | None = None) -> ModuleStructure:
    """The module's kernels (each an ordered list of operations), states, workspace, arguments and launches.

    ``store_dtypes``: each output part's storage dtype (default float32)."""
    stores = dict(store_dtypes or {p: "float32" for p in plan.spec.output_parts})
    dots: dict = {}
    a = plan.axis
    lanes = Grid(tuple((d, plan.blocks[d]) for d in plan.lanes))
    name, combine_name = kernel_names(plan)
    parts = tuple(plan.spec.output_parts)
    if plan.strategy != "split_fused":
        walker = {"row_resident": Walk.row_resident, "multi_pass": Walk.multi_pass,
                  "streaming_fused": Walk.streaming_fused}[plan.strategy]
        kernel, _ = _kernel(plan, name, "main", lanes, walker, input_dtypes, stores, dots, (), parts)
        return ModuleStructure(plan, (kernel,), (Launch(name, lanes),), ())
    ws = workspace(plan)
    part, _ = _kernel(plan, name, "split_part", Grid(lanes.lanes, split=True), Walk.split_part, input_dtypes, stores,
                      dots, ws, ())
    # outputs along the axis, few lane blocks: SPLIT programs per lane block, each merges the
    # (few) partial states and writes its own chunk (plan.parallel_combine says when)
    parallel = plan.parallel_combine and bool(axis_outputs(plan))
    combine_grid = Grid(lanes.lanes, split=parallel)
    combine, _ = _kernel(plan, combine_name, "combine", combine_grid, Walk.combine_kernel, input_dtypes, stores, dots,
                         ws, parts)
    launch = SplitLaunch(Launch(name, part.grid), Launch(combine_name, combine_grid), plan.config.split, a,
                         plan.blocks[a], ws)
    return ModuleStructure(plan, (part, combine), (launch,), ws)
