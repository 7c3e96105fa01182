"""A stage over a kernel's operations: a ``tl.dot``'s positive scale moved into what reads the product.

Attention's scores are ``s = tl.dot(q, k) * scale``: one multiply per score, and then every use of
``s`` multiplies again (``exp(s - mx)`` in base 2 is ``s * LOG2E - mx * LOG2E``). Triton's tutorial 06
keeps the raw product and folds the scale where it is used: the running max of the raw scores times
the scale (once per row), and ``qk * (scale * LOG2E) - m`` (one FMA per score before ``exp2``). This
stage does the same on the operation list: the :class:`~fuser_core.codegen.ops.Reduce` that defines
the product keeps ``tl.dot`` alone, and every later operation that reads it reads ``s * scale``
instead (the scale's symbols, a size or a runtime scalar, joined to its environment). The printer
then takes a positive factor out of a max or min (:meth:`~fuser_core.codegen.emit.KernelPrinter.tile`)
and groups a product's program constants with LOG2E (:meth:`~fuser_core.codegen.tritonize._Printer.exp2`).

Only a scale that is provably finite and positive moves (``1 / sqrt(size(d))``, a runtime scalar
declared positive, which the host checks is a finite number > 0): then ``max(c x) = c max(x)`` bit
for bit, and ``c * -inf`` is ``-inf``, so special values do not change. Only where every operation
that reads the product reads it through an expression (never a stored or copied variable).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields, replace

import sympy as sp

from fuser_core.codegen.ops import Dot, Env, Op, Reduce, walk

Moved = dict[str, tuple[sp.Expr, Env]]  # the product's variable -> (its scale, what the scale's symbols read)


def _movable(op: Op) -> bool:
    dot = op.dot if isinstance(op, Reduce) else None
    return (dot is not None and dot.scale is not None and dot.scale.free_symbols != set()
            and dot.scale.is_finite is True and dot.scale.is_positive is True)


def _read_only_by_expressions(name: str, ops: Iterable[Op]) -> bool:
    """Every operation that reads variable ``name`` reads it through its expressions' environment."""
    for op in walk(ops):
        env = getattr(op, "env", ())
        if name in op.reads() and name not in {ref.name for _, ref in env}:
            return False
    return True


def _scaled(op: Op, moved: Moved) -> Op:
    """``op`` reading each moved product as ``product * scale``."""
    env: Env = getattr(op, "env", ())
    subs = {sym: sym * moved[ref.name][0] for sym, ref in env if ref.name in moved}
    if not subs:
        return op
    extra = [entry for sym, ref in env if ref.name in moved for entry in moved[ref.name][1]]
    known = {sym for sym, _ in env}
    new_env = env + tuple({s: r for s, r in extra if s not in known}.items())
    changes = {}
    for f in fields(op):
        v = getattr(op, f.name)
        if f.name == "env":
            changes[f.name] = new_env
        elif isinstance(v, sp.Basic):
            changes[f.name] = v.xreplace(subs)
        elif isinstance(v, Dot):
            changes[f.name] = replace(v, p=v.p.xreplace(subs), q=v.q.xreplace(subs))
    return replace(op, **changes)


def _rewrite(ops: tuple[Op, ...], moved: Moved, movable: set[str]) -> tuple[tuple[Op, ...], Moved]:
    out = []
    for op in ops:
        nested = {f.name: getattr(op, f.name) for f in fields(op)
                  if isinstance(getattr(op, f.name), tuple) and getattr(op, f.name)
                  and all(isinstance(x, Op) for x in getattr(op, f.name))}
        if nested:  # a loop's body, its lane merge, chunk 0's operations: in order, each from what precedes it
            inner = dict(moved)
            changes = {}
            for name, body in nested.items():
                changes[name], inner = _rewrite(body, inner, movable)
            op = replace(_scaled(op, moved), **changes)
            moved = inner
            out.append(op)
            continue
        op = _scaled(op, moved)
        if op.name in moved:  # defined again: read as it is from here
            moved = {k: v for k, v in moved.items() if k != op.name}
        if op.name in movable and _movable(op):
            scale = op.dot.scale
            moved = {**moved, op.name: (scale, tuple((s, r) for s, r in op.env if s in scale.free_symbols))}
            op = replace(op, dot=replace(op.dot, scale=None))
        out.append(op)
    return tuple(out), moved


def move_dot_scales(ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """``ops`` with each movable dot scale moved into the operations that read the product."""
    names = {op.name for op in walk(ops) if _movable(op)}
    movable = {n for n in names if _read_only_by_expressions(n, ops)}
    if not movable:
        return ops
    return _rewrite(ops, {}, movable)[0]
