"""The operations of a generated kernel, in order: what the Triton printer prints and the tuner counts.

:func:`fuser_core.codegen.structure.build_structure` decides every kernel as an ordered list of
these operations (:attr:`~fuser_core.codegen.structure.Kernel.ops`); the printer
(:mod:`fuser_core.codegen.emit`) prints each with one method per type, and the tuner's analysis
(:mod:`tuner.analysis`) counts the same list. Every operation names the value it defines
(``name``, ``""`` when it defines none) and the tile dims that value lives on (``dims``, in the
kernel's dim order: attention's ``q`` is on ``("m", "d")``, a row's max in a one-row program on
``()``), so nothing downstream infers a value's dims from printed text. An expression an
operation prints is a sympy expression with its ``env``: every free symbol mapped to the
:class:`VarRef` it reads (a variable on its dims, a size, a negated selection).

What each operation reads (:meth:`Op.reads`: kernel parameters and variables) comes from its
fields; a kernel's arguments are exactly the parameters its operations read, and the offsets
and masks of a dim are set up only where some operation reads them. The ``@triton.jit``
helpers a kernel calls (:meth:`Op.helpers`) come from the operations too, never from the
printed text.

The operations:

- :class:`Program`: the program ids of the lane dims (a lane with block 1 is a scalar offset);
- :class:`Offsets`: ``offs_d`` (and ``mask_d``) of one dim's tile;
- :class:`Chunk`: a split program's chunk of the loop axis (``lo``);
- :class:`Load`: an input loaded as float32 (int32 for index inputs), hoisted or not;
- :class:`Descriptor`: an input's tensor descriptor, once per program, for the loads a tl.dot reads
  as loaded (TMA on sm_90+, where the launcher chooses it);
- :class:`Gather`: a reduction that is one term, ``sum of where(index(axis) == at, X, 0)``: X loaded at ``at``;
- :class:`Loop`: a loop over the axis (its tiles, a split chunk of them, or the SPLIT partial
  states), its body and, after a per-lane loop, the merge of its lanes; one resident tile is a
  loop with one iteration, printed without ``for``;
- :class:`InitState`, :class:`Count`, :class:`Copy`: the empty states, the count of values seen,
  an anchor kept before it moves;
- :class:`Value`: an elementwise value other operations read by name;
- :class:`Reduce`: a reduction of a whole tile into a new value (an inner reduction, or a
  resident row's), a ``tl.dot`` where the structure decided one;
- :class:`Fold`: one tile folded into an accumulator, per tile (reduced over the axis) or per lane
  (elementwise); :class:`Select`: a tile merged into a running arg-max or top-k;
- :class:`AnchorUpdate`: a dependency's anchor moved to its running (or merged) value;
- :class:`LaneMerge`: the lanes of a per-lane state folded over the axis with the merge rule;
- :class:`WorkspaceLoad`, :class:`PartMerge`: a split's partial state read and merged;
- :class:`Finalise`: a reduction's final value;
- :class:`WorkspaceStore`, :class:`OutputStore`: the partial state or an output part written;
- :class:`FallbackFlag`: 1 where a dependency of a fused reduction ended at a value its fused form
  does not hold (an infinity, a NaN), the gate of the fallback passes (a ``fallback`` loop) and of
  their results;
- :class:`FirstChunk`: operations only the program of chunk 0 runs; :class:`Comment`;
- :class:`LastPartCombine`: split_fused's combine run by the last part program of a lane block to
  finish, in the part kernel's launch (an atomic ticket; the combine kernel called as a function).

The package, by job: :mod:`.base` (the :class:`Op` base, environments, ``tl.dot``, walking),
:mod:`.setup` (set-up, loads and loops), :mod:`.folds` (reductions, folds, selections, anchor
updates, lane merges) and :mod:`.stores` (part merges, final values, workspace and output stores).
"""

from fuser_core.codegen.ops.base import FP8_DOT, Dot, Env, Op, assuming, env_refs, walk
from fuser_core.codegen.ops.folds import AnchorUpdate, Fold, LaneMerge, Reduce, Select
from fuser_core.codegen.ops.setup import (
    Chunk,
    Comment,
    Copy,
    Count,
    Descriptor,
    Gather,
    InitState,
    Load,
    Loop,
    Offsets,
    Program,
    Value,
)
from fuser_core.codegen.ops.stores import (
    FallbackFlag,
    Finalise,
    FirstChunk,
    LastPartCombine,
    OutputStore,
    PartMerge,
    WorkspaceLoad,
    WorkspaceStore,
)

__all__ = [
    "FP8_DOT", "AnchorUpdate", "Chunk", "Comment", "Copy", "Count", "Descriptor", "Dot", "Env", "FallbackFlag", "Finalise",
    "FirstChunk",
    "Fold", "Gather", "InitState", "LaneMerge", "LastPartCombine", "Load", "Loop", "Offsets", "Op", "OutputStore",
    "PartMerge",
    "Program", "Reduce", "Select", "Value", "WorkspaceLoad", "WorkspaceStore", "assuming", "env_refs", "walk",
]
