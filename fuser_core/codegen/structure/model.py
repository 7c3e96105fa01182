"""What a module's structure is made of: states, arguments, grids, kernels, launches.

Data only, decided by :func:`~fuser_core.codegen.structure.build_structure` and read by the
Triton printer, the launcher printer and the tuner's analysis.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fuser_core.codegen.layout import Layout
from fuser_core.codegen.names import safe_name
from fuser_core.codegen.ops import Dot, Fold, Load, Loop, Op, Reduce, walk
from fuser_core.codegen.plan import KernelPlan
from fuser_core.grouping import Grouping


def var_name(name: str) -> str:
    """The generated-code identifier of a spec name."""
    return safe_name(name)


# ---------------------------------------------------------------------- the pieces


@dataclass(frozen=True)
class State:
    """One float32/int32 accumulator carried by a kernel (and, split, handed over in the workspace)."""

    name: str  # identifier in the generated code
    step: str
    dims: tuple[str, ...]
    dtype: str  # "float32" | "int32"


@dataclass(frozen=True)
class Arg:
    """One kernel parameter and the launcher's value for it (``constexpr``: passed by keyword)."""

    name: str  # the parameter's name in the kernel
    value: str  # the launcher's expression
    constexpr: bool = False

    @property
    def launch_arg(self) -> str:
        return f"{self.name}={self.value}" if self.constexpr else self.value


@dataclass(frozen=True)
class Grid:
    """Programs of a launch: one per block of every lane dim (``lanes``, slowest first), times
    SPLIT chunks of the axis as a second grid dim when ``split``."""

    lanes: tuple[tuple[str, int], ...]  # (dim, block)
    split: bool = False


@dataclass(frozen=True)
class Kernel:
    """One ``@triton.jit`` kernel of the module: its operations, in order (:mod:`fuser_core.codegen.ops`)."""

    name: str
    role: str  # "main" | "split_part" | "combine"
    grid: Grid
    doc: str  # its docstring
    layout: Layout  # its tile dims: a lane with block 1 is a scalar offset, in no tile
    ops: tuple[Op, ...]
    states: tuple[State, ...]
    args: tuple[Arg, ...]  # exactly the parameters its operations read
    inputs: tuple[str, ...]  # inputs it loads (spec names)
    outputs: tuple[str, ...]  # output parts it writes
    grouping: Grouping = field(default_factory=Grouping, compare=False)  # the user's sums, printed as written
    # exp(a + b) printed as exp2(a log2(e) + b log2(e)): one FMA before the MUFU instead of an add and
    # a multiply (tutorial 06's form); only where every output is 16-bit (exp_in_base2)
    exp_base2: bool = False
    compute: str = "float32"  # the dtype its values are computed in (fuser_core.problem.compute_dtype)

    def walk(self) -> Iterable[Op]:
        """Every operation, nested ones (a loop's body) after the one that holds them."""
        return walk(self.ops)

    def loops(self) -> tuple[Loop, ...]:
        return tuple(op for op in self.walk() if isinstance(op, Loop))

    @property
    def hoisted(self) -> tuple[Load, ...]:
        return tuple(op for op in self.ops if isinstance(op, Load) and op.hoisted)

    @property
    def dots(self) -> tuple[Dot, ...]:
        return tuple(op.dot for op in self.walk() if isinstance(op, (Reduce, Fold)) and op.dot is not None)

    def helpers(self) -> list[str]:
        """The ``@triton.jit`` helpers its operations call (each once, first use first)."""
        return list(dict.fromkeys(h for op in self.walk() for h in op.helpers()))


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: Grid


@dataclass(frozen=True)
class SplitLaunch:
    """split_fused: the part kernel (grid lanes x SPLIT, each program folds a chunk of ``chunk``
    axis elements into its partial state in ``workspace``) then the combine kernel (grid lanes,
    times SPLIT when outputs keep the axis: each program then writes one chunk of them); ``combine``
    None: the part kernel's last program per lane block merges, in the same launch (``tickets``)."""

    part: Launch
    combine: Launch | None
    split: int
    axis: str
    block: int  # chunk = cdiv(cdiv(size_axis, split), block) * block
    workspace: tuple[State, ...]


@dataclass(frozen=True)
class ModuleStructure:
    plan: KernelPlan
    kernels: tuple[Kernel, ...]
    launches: tuple[Launch | SplitLaunch, ...]
    workspace: tuple[State, ...]  # empty unless split_fused

    def kernel(self, name: str) -> Kernel:
        return next(k for k in self.kernels if k.name == name)

    def helpers(self) -> list[str]:
        """The helpers the module's kernels call."""
        return list(dict.fromkeys(h for k in self.kernels for h in k.helpers()))


# ---------------------------------------------------------------------- small rules
