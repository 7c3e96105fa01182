"""What every operation shares: the :class:`Op` base, the environment an expression reads, a
``tl.dot`` contraction, what an operation reads and calls, and walking or substituting operations.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import sympy as sp

from fuser_core.codegen.names import FP8_HELPERS, FP8_NATIVE
from fuser_core.codegen.tritonize import VarRef, helpers_of
from fuser_core.reduce_ops import REDUCE_OPS

Env = tuple[tuple[sp.Basic, "VarRef"], ...]  # each free symbol of an operation's expressions -> what it reads


# a tl.dot whose operands are e4m3 values: fp8 tensor cores on sm_89+, exact float16 elsewhere
FP8_DOT = "fp8"


@dataclass(frozen=True)
class Dot:
    """sum over ``over`` of P * Q computed as ``tl.dot(P[i, over], Q[over, j])`` (times ``scale``,
    the factors that vary over no blocked dim, applied after the product)."""

    over: str
    i: str
    j: str
    p: sp.Expr
    q: sp.Expr
    scale: sp.Expr | None
    precision: str  # FP8_DOT | "float16" | "bfloat16" | "ieee": the operands' precision
    direct: tuple[str, ...] = ()  # inputs that are a factor as loaded (staged in shared memory once)

    @property
    def dims(self) -> frozenset[str]:
        return frozenset({self.i, self.j, self.over})

    @property
    def p_dims(self) -> frozenset[str]:
        return frozenset({self.i, self.over})

    @property
    def q_dims(self) -> frozenset[str]:
        return frozenset({self.over, self.j})

    @property
    def n_p_factors(self) -> int:
        return len(sp.Mul.make_args(self.p))

    @property
    def n_q_factors(self) -> int:
        return len(sp.Mul.make_args(self.q))


def env_refs(env: Env) -> Iterator[VarRef]:
    return (ref for _, ref in env)


def env_reads(env: Env) -> set[str]:
    return {ref.name for ref in env_refs(env)}


def expr_helpers(*exprs: sp.Expr | None) -> list[str]:
    out: list[str] = []
    for e in exprs:
        if e is not None:
            out += helpers_of(e)
    return out


def max_min_helpers(op: str) -> list[str]:
    """The NaN-propagating helper a max/min fold or reduction prints (fuser_core.reduce_ops)."""
    helper = REDUCE_OPS[op].nan_helper if op in REDUCE_OPS else None
    return [helper] if helper else []


def block_params(dims: Iterable[str]) -> set[str]:
    return {f"BLOCK_{d}" for d in dims}


def tile_reads(dims: Iterable[str], tile: Iterable[str]) -> set[str]:
    """Offsets of every dim of a pointer tile, masks of those in a tile (a scalar lane needs none)."""
    return {f"offs_{d}" for d in dims} | {f"mask_{d}" for d in tile}


class Op:
    """An operation of a kernel. ``name``/``dims``: the value it defines and its tile dims."""

    name: str = ""
    dims: tuple[str, ...] = ()

    def reads(self) -> set[str]:
        """Kernel parameters and variables its printed code reads, but for FP8_NATIVE (:meth:`uses`)."""
        return set()

    def uses(self) -> set[str]:
        """Everything its printed code reads: :meth:`reads`, and the FP8_NATIVE constexpr its fp8
        helpers take (one rule for every operation that converts fp8)."""
        return self.reads() | ({FP8_NATIVE} if FP8_HELPERS.intersection(self.helpers()) else set())

    def helpers(self) -> list[str]:
        """The ``@triton.jit`` helpers (fuser_core/codegen/helpers.py) its printed code calls."""
        return []

    def children(self) -> tuple[Op, ...]:
        """Operations nested in it (a loop's body and lane merge, chunk 0's stores)."""
        return ()


def walk(ops: Iterable[Op]) -> Iterator[Op]:
    """Every operation of ``ops`` and, depth first, those nested in it."""
    for op in ops:
        yield op
        yield from walk(op.children())


def assuming(op: Op, subs: Mapping[sp.Basic, sp.Basic]) -> Op:
    """``op`` with ``subs`` applied to every expression it and the operations inside it hold (a
    loop's mask condition replaced by true where every lane satisfies it)."""
    changes: dict[str, Any] = {}
    for f in fields(op):
        v = getattr(op, f.name)
        if isinstance(v, sp.Basic):
            changes[f.name] = v.xreplace(subs)
        elif isinstance(v, Dot):
            changes[f.name] = replace(v, p=v.p.xreplace(subs), q=v.q.xreplace(subs))
        elif isinstance(v, tuple) and v and all(isinstance(x, Op) for x in v):
            changes[f.name] = tuple(assuming(x, subs) for x in v)
    return replace(op, **changes) if changes else op
