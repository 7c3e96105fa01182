"""The kernels of a generated module, decided once from a plan, before anything is printed.

:func:`build_structure` turns a :class:`~fuser_core.codegen.plan.KernelPlan` (and the input and
output storage dtypes) into a :class:`ModuleStructure`: the kernels a strategy launches, each an
ordered list of typed operations (:mod:`fuser_core.codegen.ops`: program ids, offsets, loads,
loops, folds, anchor updates, lane and part merges, final values, workspace and output stores),
each naming the value it defines and the tile dims it lives on; the states a kernel carries, the
workspace a split kernel hands to its combine kernel, the argument list of each kernel (exactly
the parameters its operations read) and the launches with their grids (a split part kernel and
its combine kernel as one :class:`SplitLaunch`).

This is the one walk of each strategy: it decides the loads (loop-invariant ones hoisted:
attention's ``q`` does not vary along ``n``, so it is loaded once per program, before the loop),
the inner reductions and which sums are ``tl.dot`` contractions, per-lane or per-tile states,
each value's name and dims, the helpers each kernel calls. Three readers share it: the Triton
printer (:mod:`fuser_core.codegen.emit`, one method per operation type, no strategy branch), the
launcher printer (:mod:`fuser_core.codegen.module`) and the tuner's analysis
(:mod:`tuner.analysis`), which counts the same operations.

The package, by job: :mod:`.model` (the data), :mod:`.facts` (plan-level decisions every kernel
shares), the walk of one kernel in parts, its primitives (:mod:`.walk_base`: values, loops and
loads; :mod:`.walk_folds`: reductions over the loop axis and output stores; :mod:`.walk_streaming`:
the streaming loop; :mod:`.walk_passes`: a pass per reduction, the fallback passes and the
finished kernel) and :mod:`.build` (the walks put together into a module's kernels and launches).
Each strategy's own walk, made of those primitives, is in its module
(:mod:`fuser_core.codegen.strategies`: ``Strategy.walk``, or ``build`` for split_fused's two kernels).
"""

from fuser_core.codegen.structure.build import build_structure
from fuser_core.codegen.structure.facts import (
    accumulators,
    anchored_deps,
    effective_op,
    kernel_names,
    per_lane,
    reads_count,
    realisation,
    workspace,
)
from fuser_core.codegen.structure.model import (
    Arg,
    Grid,
    Kernel,
    Launch,
    ModuleStructure,
    SplitLaunch,
    State,
    var_name,
)

__all__ = [
    "Arg", "Grid", "Kernel", "Launch", "ModuleStructure", "SplitLaunch", "State", "accumulators",
    "anchored_deps", "build_structure", "effective_op", "kernel_names", "per_lane", "reads_count", "realisation",
    "var_name", "workspace",
]
