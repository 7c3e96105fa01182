"""From a plan to its :class:`~fuser_core.codegen.structure.model.ModuleStructure`: each kernel walked,
its arguments, and the launches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from fuser_core.codegen.names import FP8_NATIVE, TMA_LOADS, WIDE_OFFSETS, kernel_arg, scalar_arg
from fuser_core.codegen.ops import Fold, LastPartCombine, Load, Op, Reduce, walk
from fuser_core.codegen.plan import KernelPlan
from fuser_core.codegen.structure.descriptors import descriptor_loads
from fuser_core.codegen.structure.facts import accumulators, axis_outputs, kernel_names, workspace
from fuser_core.codegen.structure.model import Arg, Grid, Kernel, Launch, ModuleStructure, SplitLaunch, State, var_name
from fuser_core.codegen.structure.scales import move_dot_scales
from fuser_core.codegen.structure.walk_passes import PassesWalk
from fuser_core.merged import kernel_dims
from fuser_core.problem import compute_dtype
from fuser_core.paged import COL


class Walk(PassesWalk):
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
    for table, layout in spec.page_tables.items():  # a paged input's pages are read through it (fuser_core.paged)
        t = var_name(table)
        out.append(Arg(f"{t}_ptr", t))
        out += [Arg(f"stride_{t}_{d}", f"{t}.stride({k})") for k, d in enumerate((*layout.by, COL))]
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
    out.append(Arg(FP8_NATIVE, FP8_NATIVE, constexpr=True))
    out.append(Arg(TMA_LOADS, TMA_LOADS, constexpr=True))
    out.append(Arg(WIDE_OFFSETS, WIDE_OFFSETS, constexpr=True))
    read = set().union(*(op.uses() for op in walk(ops)))
    return tuple(a for a in out if a.name in read)


def _kernel(plan: KernelPlan, name: str, role: str, grid: Grid, walker, doc: str, input_dtypes: Mapping[str, str],
            stores: Mapping[str, str], dots: dict, ws: tuple[State, ...], outputs: tuple[str, ...]) -> tuple[Kernel, Walk]:
    """One kernel: walked by ``walker`` (a Walk method), walked again if an input it fills with a fold's
    identity turned out to be read by one of its tl.dots (whose masked lanes must be 0)."""
    no_fill: frozenset[str] = frozenset()
    while True:
        w = Walk(plan, input_dtypes, stores, dots, role, grid, no_fill)
        w.setup()
        walker(w)
        ops = descriptor_loads(move_dot_scales(w.kernel_ops()), plan)
        dotted = {s.name for op in walk(ops) if isinstance(op, (Reduce, Fold)) and op.dot is not None
                  for s in op.dot.p.free_symbols | op.dot.q.free_symbols}
        filled = {op.input for op in walk(ops) if isinstance(op, Load) and op.fill} & dotted
        if not filled - no_fill:
            break
        no_fill = no_fill | filled
    doc = doc.format(name=plan.spec.name, a=plan.axis)
    states = tuple(s for step in plan.axis_reductions() for s in accumulators(plan, step, lanes=w.lanes_states))
    args = _args(plan, w.inputs, outputs, ws, role, input_dtypes, stores, ops)
    return Kernel(name, role, grid, doc, w.layout, ops, states, args, tuple(w.inputs), outputs,
                  plan.derivation.symbols.grouping, exp_in_base2(stores), compute_dtype(input_dtypes)), w


#: output dtypes whose rounding hides exp2's folded argument: the rounding of a log2(e) (about
#: 2^-24 |a| log2(e) in the exponent: 1e-5 relative at logits near 100) is far below their ulp
#: (2^-11 for float16, 2^-8 bfloat16); float32 outputs keep exp's exact form (issue 35: measured
#: in benchmarks/results/exp_base2_accuracy.md)
BASE2_OUTPUT_DTYPES = frozenset({"float16", "bfloat16", "float8_e4m3fn"})


def exp_in_base2(stores: Mapping[str, str]) -> bool:
    """Whether a module whose outputs have the dtypes ``stores`` (part -> dtype) prints exp in base 2."""
    return bool(stores) and all(dtype in BASE2_OUTPUT_DTYPES for dtype in stores.values())


class KernelBuilder:
    """What a strategy's :meth:`~fuser_core.codegen.strategies.base.Strategy.build` builds its module with:
    one kernel, or split_fused's part and combine kernels."""

    def __init__(self, plan: KernelPlan, input_dtypes: Mapping[str, str], stores: Mapping[str, str]) -> None:
        self.plan, self.input_dtypes, self.stores = plan, input_dtypes, stores
        self.dots: dict = {}
        self.lanes = Grid(tuple((d, plan.blocks[d]) for d in plan.lanes))
        self.name, self.combine_name = kernel_names(plan)

    def one_kernel(self, walker, doc: str) -> ModuleStructure:
        """One kernel over the lane blocks, walked by ``walker(walk)``, writing every output."""
        kernel, _ = _kernel(self.plan, self.name, "main", self.lanes, walker, doc, self.input_dtypes, self.stores,
                            self.dots, (), tuple(self.plan.spec.output_parts))
        return ModuleStructure(self.plan, (kernel,), (Launch(self.name, self.lanes),), ())

    def split_kernels(self, part_walker, combine_walker, part_doc: str, combine_doc: str,
                      parallel_combine_doc: str) -> ModuleStructure:
        """A part kernel per (lane block, chunk of the axis) writing partial states to the workspace,
        then a combine kernel merging them and writing the outputs."""
        plan, lanes = self.plan, self.lanes
        ws = workspace(plan)
        part, _ = _kernel(plan, self.name, "split_part", Grid(lanes.lanes, split=True), part_walker, part_doc,
                          self.input_dtypes, self.stores, self.dots, ws, ())
        # outputs along the axis, few lane blocks: SPLIT programs per lane block, each merges the
        # (few) partial states and writes its own chunk (plan.parallel_combine says when)
        parallel = plan.parallel_combine and bool(axis_outputs(plan))
        combine_grid = Grid(lanes.lanes, split=parallel)
        combine, _ = _kernel(plan, self.combine_name, "combine", combine_grid, combine_walker,
                             parallel_combine_doc if parallel else combine_doc, self.input_dtypes, self.stores,
                             self.dots, ws, tuple(plan.spec.output_parts))
        if plan.config.combine == "last_part":  # the combine kernel, a function the part kernel's last program calls
            part = with_last_part_combine(part, combine)
            launch = SplitLaunch(Launch(self.name, part.grid), None, plan.config.split, plan.axis,
                                 plan.blocks[plan.axis], ws)
        else:
            launch = SplitLaunch(Launch(self.name, part.grid), Launch(self.combine_name, combine_grid),
                                 plan.config.split, plan.axis, plan.blocks[plan.axis], ws)
        return ModuleStructure(plan, (part, combine), (launch,), ws)


def with_last_part_combine(part: Kernel, combine: Kernel) -> Kernel:
    """``part`` ending in a :class:`LastPartCombine` that calls ``combine``: it takes the combine
    kernel's parameters as well as its own (positional ones first, then the constexprs, as a launch
    passes them) and the tickets, and writes the outputs."""
    own = {a.name for a in part.args}
    extra = [a for a in combine.args if a.name not in own]
    positional = [a for a in part.args if not a.constexpr] + [a for a in extra if not a.constexpr]
    positional.append(Arg("tickets_ptr", "tickets"))
    constexprs = [a for a in part.args if a.constexpr] + [a for a in extra if a.constexpr]
    call = LastPartCombine(kernel=combine.name, args=tuple(a.name for a in combine.args if not a.constexpr),
                           constexprs=tuple(a.name for a in combine.args if a.constexpr), body=combine.ops)
    return replace(part, ops=(*part.ops, call), args=(*positional, *constexprs),
                   inputs=tuple(dict.fromkeys((*part.inputs, *combine.inputs))), outputs=combine.outputs)


def build_structure(plan: KernelPlan, input_dtypes: Mapping[str, str],
                    store_dtypes: Mapping[str, str] | None = None) -> ModuleStructure:
    """The module's kernels (each an ordered list of operations), states, workspace, arguments and launches,
    as the plan's strategy builds them.

    ``store_dtypes``: each output part's storage dtype (default float32)."""
    stores = dict(store_dtypes or {p: "float32" for p in plan.spec.output_parts})
    return plan.rules.build(KernelBuilder(plan, input_dtypes, stores))
