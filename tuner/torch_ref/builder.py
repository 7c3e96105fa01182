"""Any spec as a plain function of torch tensors: :func:`build`, the eager baseline, and
wrapped in ``torch.compile`` the Inductor baseline.

The function is derived from the spec's steps the way :mod:`fuser_core.reference` evaluates
them in NumPy: every value in the *aligned layout* (one axis per dim of the spec, size 1 where a
value lacks the dim, so broadcasting by name is torch broadcasting), steps run in order, each
one materialised, as op-by-op PyTorch code does. It is traceable: the spec is interpreted once,
when the function is built, into closures of torch ops; numbers-only subexpressions are folded
then, in float64.

Precision (decided here; the docs are silent):

- elementwise math and reductions run in float32 (16-bit and fp8 inputs are upcast on use;
  index inputs stay int64), as Inductor does internally and as careful eager code does;
- a ``sum`` that is a contraction (:mod:`tuner.torch_ref.contractions`, which also decides its
  operand dtype and matmul precision) goes through ``torch.einsum``; factors that do not carry
  the reduced dim are applied after the contraction, in float32;
- outputs are stored in the dtypes the kernels store
  (:func:`fuser_core.codegen.module.output_dtypes`), indices as int32;
- ``cast(x, "float8_e4m3fn")`` clamps to +-448 before converting, like the reference.

Semantics that differ from the reference only in corner cases: ``topk`` ties may come in any
order (the checks accept tied indices in either order), and NaN ranks as the largest value
in torch's ``topk`` (the reference ranks it smallest).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fuser_core import expr as ex
from fuser_core.problem import Problem
from fuser_core.problem import tuning_scalars
from fuser_core.reference import param_values
from fuser_core.spec import Step
from tuner.torch_ref.contractions import contraction_dtype, contraction_factors

Value = Any  # a torch.Tensor or a Python number
Env = dict[str, Any]
Thunk = Callable[[Env], Value]

FP8_MAX = 448.0


def _torch():
    import torch

    return torch


# ---------------------------------------------------------------------------- numbers


def _fold(e: ex.Expr, shape: Mapping[str, int], params: Mapping[str, float]) -> float | None:
    """The value of a numbers-only expression (float64, IEEE: no exceptions), else None."""
    with np.errstate(all="ignore"):
        if isinstance(e, ex.Num):
            return float(e.value)
        if isinstance(e, ex.Size):
            return float(shape[e.dim])
        if isinstance(e, ex.Ref) and e.name in params:
            return float(params[e.name])
        if isinstance(e, ex.Neg):
            v = _fold(e.operand, shape, params)
            return None if v is None else -v
        if isinstance(e, ex.BinOp):
            a, b = _fold(e.left, shape, params), _fold(e.right, shape, params)
            if a is None or b is None:
                return None
            from fuser_core.reference import BINARY

            return float(BINARY[e.op](np.float64(a), np.float64(b)))
        if isinstance(e, ex.Call):
            args = [_fold(a, shape, params) for a in e.args]
            if any(a is None for a in args):
                return None
            from fuser_core.reference import FUNCTIONS

            return float(FUNCTIONS[e.func](*(np.float64(a) for a in args)))
        if isinstance(e, ex.Cast):
            v = _fold(e.operand, shape, params)
            if v is None:
                return None
            from fuser_core.reference import cast_to

            return float(cast_to(np.float64(v), e.dtype))
    return None  # Ref to an input or step, Index, Compare


# ---------------------------------------------------------------------------- the builder


class _Builder:
    """Interprets a spec once into closures of torch ops (see the module docstring)."""

    def __init__(self, problem: Problem):
        spec = problem.spec
        self.spec = spec
        self.shape = problem.shape
        self.dtypes = problem.dtypes
        self.stores = problem.output_dtypes
        self.params = param_values(spec, self.shape, scalars=tuning_scalars(spec, self.shape))
        self.rank = len(spec.dims)
        self.axis = {d: i for i, d in enumerate(spec.dims)}
        self.dot_dtype = contraction_dtype(self.dtypes)
        self.letters = {d: chr(ord("a") + i) for i, d in enumerate(spec.dims)}  # at most 16 dims

    # -- layout
    def aligned_shape(self, dims) -> tuple[int, ...]:
        return tuple(self.shape[d] if d in dims else 1 for d in self.spec.dims)

    def align(self, t, dims: tuple[str, ...]):
        """A tensor over ``dims`` (its own order) as an aligned view."""
        order = sorted(range(len(dims)), key=lambda i: self.axis[dims[i]])
        t = t.permute(order) if order != list(range(len(dims))) else t
        own = [dims[i] for i in order]
        for pos, d in enumerate(self.spec.dims):
            if d not in own:
                t = t.unsqueeze(pos)
        return t

    def own(self, t, dims: tuple[str, ...]):
        """An aligned value as a tensor over ``dims`` (in ``dims`` order); broadcast where needed."""
        torch = _torch()
        if not isinstance(t, torch.Tensor):
            raise TypeError("a constant output")  # callers expand constants first
        t = t.expand(self.aligned_shape(dims)) if t.dim() == self.rank else t
        others = [i for i, d in enumerate(self.spec.dims) if d not in dims]
        if others:
            t = t.squeeze(tuple(others))
        own = [d for d in self.spec.dims if d in dims]
        perm = [own.index(d) for d in dims]
        return t.permute(perm) if perm != list(range(len(dims))) else t

    # -- expressions
    def compile(self, e: ex.Expr) -> Thunk:
        """A closure computing ``e`` (float32 tensors, or a folded Python float)."""
        torch = _torch()
        folded = _fold(e, self.shape, self.params)
        if folded is not None:
            return lambda env, v=folded: v
        if isinstance(e, ex.Ref):
            key = e.name if e.part is None else f"{e.name}.{e.part}"
            if key in self.params:
                return lambda env, v=self.params[key]: v
            return lambda env, k=key: _float(env, k)
        if isinstance(e, ex.Index):
            n, dims = self.shape[e.dim], (e.dim,)
            return lambda env, n=n, dims=dims: self.align(torch.arange(n, device=env["@device"]), dims)
        if isinstance(e, ex.Neg):
            f = self.compile(e.operand)
            return lambda env: -f(env)
        if isinstance(e, ex.BinOp):
            a, b = self.compile(e.left), self.compile(e.right)
            op = {"+": _add, "-": _sub, "*": _mul, "/": _div, "**": _pow}[e.op]
            return lambda env: op(a(env), b(env))
        if isinstance(e, ex.Compare):
            a, b = self.compile(e.left), self.compile(e.right)
            cmp = {"<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge, "==": torch.eq, "!=": torch.ne}[e.op]
            return lambda env: _compare(cmp, a(env), b(env))
        if isinstance(e, ex.Logic):
            args = [self.compile(a) for a in e.args]
            if e.op == "not":
                return lambda env: torch.logical_not(args[0](env))
            fn = torch.logical_and if e.op == "and" else torch.logical_or
            return lambda env: fn(args[0](env), args[1](env))
        if isinstance(e, ex.Call):
            args = [self.compile(a) for a in e.args]
            fn = _FUNCTIONS[e.func]
            return lambda env: fn(*(a(env) for a in args))
        if isinstance(e, ex.Cast):
            f, dt = self.compile(e.operand), e.dtype
            return lambda env: _cast(f(env), dt)
        raise TypeError(f"cannot compile {e!r}")

    # -- steps
    def contraction(self, step: Step) -> Thunk | None:
        """``sum`` of a product whose factors carry different dims: einsum over the factors
        that carry the reduced dim, the others applied after, in float32. None otherwise."""
        torch = _torch()
        split = contraction_factors(self.spec, step)
        if split is None:
            return None
        inside, outside = split
        over = step.over
        dim_sets = [set(self.spec.expr_dims(f)) for f, _ in inside]
        union = self.spec.order_dims(set().union(*dim_sets))
        result_dims = tuple(d for d in union if d != over)
        ops = []
        for (f, inv), dims in zip(inside, dim_sets):
            own = self.spec.order_dims(dims)
            ops.append((self.compile(f), inv, own))
        rest = [(self.compile(f), inv) for f, inv in outside]
        equation = ",".join("".join(self.letters[d] for d in own) for _, _, own in ops)
        equation += "->" + "".join(self.letters[d] for d in result_dims)
        dot = getattr(torch, self.dot_dtype)

        def run(env: Env):
            operands = []
            for f, inv, own in ops:
                v = f(env)
                v = 1.0 / v if inv else v
                operands.append(self.own(v, own).to(dot))
            value = self.align(torch.einsum(equation, *operands).float(), result_dims)
            for f, inv in rest:
                v = f(env)
                value = value / v if inv else value * v
            return value

        return run

    def reduction(self, step: Step) -> Callable[[Env], dict[str, Any]]:
        torch = _torch()
        ax = self.axis[step.over]
        full = self.aligned_shape(self.spec.expr_dims(step.expr))
        if step.reduce == "sum":
            dot = self.contraction(step)
            if dot is not None:
                return lambda env: {step.name: dot(env)}
        f = self.compile(step.expr)

        def value(env: Env):
            v = f(env)
            if not isinstance(v, torch.Tensor):
                v = torch.full((1,) * self.rank, v, device=env["@device"], dtype=torch.float32)
            return v.expand(full)

        if step.reduce == "sum":
            return lambda env: {step.name: torch.sum(value(env), dim=ax, keepdim=True, dtype=torch.float32)}
        if step.reduce == "max":
            return lambda env: {step.name: torch.amax(value(env), dim=ax, keepdim=True)}
        if step.reduce == "min":
            return lambda env: {step.name: torch.amin(value(env), dim=ax, keepdim=True)}
        if step.reduce == "argmax":
            return lambda env: {step.name: torch.argmax(value(env), dim=ax, keepdim=True)}
        if step.reduce == "argmin":
            return lambda env: {step.name: torch.argmin(value(env), dim=ax, keepdim=True)}
        assert step.reduce == "topk" and step.as_dim is not None and step.k is not None
        as_ax, k = self.axis[step.as_dim], step.k

        def topk(env: Env) -> dict[str, Any]:
            vals, idx = torch.topk(value(env), k, dim=ax, largest=True, sorted=True)
            return {f"{step.name}.values": vals.transpose(ax, as_ax), f"{step.name}.indices": idx.transpose(ax, as_ax)}

        return topk

    def build(self) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
        torch = _torch()
        spec = self.spec
        program: list[tuple[str, Callable[[Env], dict[str, Any]]]] = []
        for step in spec.steps:
            if step.is_reduction:
                program.append((step.name, self.reduction(step)))
            else:
                f = self.compile(step.expr)
                program.append((step.name, lambda env, f=f, name=step.name: {name: f(env)}))
        inputs = [(i.name, i.dims, i.kind) for i in spec.inputs]
        outputs = []
        for part in spec.output_parts:
            step = spec.step(part.split(".")[0])
            outputs.append((part, step.dims, getattr(torch, self.stores[part])))
        first = inputs[0][0]

        def run(tensors: Mapping[str, Any]) -> dict[str, Any]:
            env: Env = {"@device": tensors[first].device}
            for name, dims, _kind in inputs:
                env[name] = self.align(tensors[name], dims)
            for _name, fn in program:
                env.update(fn(env))
            out = {}
            for part, dims, dtype in outputs:
                v = env[part]
                if not isinstance(v, torch.Tensor):
                    v = torch.full((1,) * self.rank, v, device=env["@device"], dtype=torch.float32)
                out[part] = self.own(v, dims).to(dtype).contiguous()
            return out

        return run


def _float(env: Env, key: str):
    """The aligned value of ``key``: float inputs and float results upcast to float32 once."""
    cached = env.get("@f32:" + key)
    if cached is not None:
        return cached
    v = env[key]
    if v.dtype.is_floating_point and v.dtype != _torch().float32:
        v = v.float()
    env["@f32:" + key] = v
    return v


def _is_tensor(v: Any) -> bool:
    return isinstance(v, _torch().Tensor)


def _add(a, b):
    return a + b


def _sub(a, b):
    return a - b


def _mul(a, b):
    return a * b


def _div(a, b):
    torch = _torch()
    if not _is_tensor(b):
        # a Python divisor of 0 would raise; the reference's IEEE division gives +-inf/nan
        return a / torch.tensor(b, dtype=torch.float32, device=a.device) if b == 0 else a / b
    if not b.dtype.is_floating_point and (not _is_tensor(a) or not a.dtype.is_floating_point):
        b = b.float()
    return a / b


def _pow(a, b):
    torch = _torch()
    if _is_tensor(a) and not a.dtype.is_floating_point:
        a = a.float()
    return torch.pow(a, b)


def _compare(cmp, a, b):
    torch = _torch()
    if not _is_tensor(a):
        a = torch.tensor(a, dtype=torch.float32, device=b.device)
    return cmp(a, b)


def _tensor_like(v, ref):
    torch = _torch()
    if _is_tensor(v):
        return v if v.dtype.is_floating_point else v.float()
    return torch.tensor(float(v), dtype=torch.float32, device=ref.device)


def _binary_tensor(fn):
    def call(a, b):
        ref = a if _is_tensor(a) else b
        return fn(_tensor_like(a, ref), _tensor_like(b, ref))

    return call


def _unary(name: str):
    def call(a):
        torch = _torch()
        if not a.dtype.is_floating_point:
            a = a.float()
        return getattr(torch, name)(a)

    return call


def _where(c, a, b):
    torch = _torch()
    if not _is_tensor(c):
        c = bool(c)
        return a if c else b
    if c.dtype != torch.bool:
        c = c != 0
    ref = c
    return torch.where(c, _tensor_like(a, ref), _tensor_like(b, ref))


def _clamp(x, lo, hi):
    return _FUNCTIONS["minimum"](_FUNCTIONS["maximum"](x, lo), hi)


def _cast(v, dtype: str):
    torch = _torch()
    if not v.dtype.is_floating_point:
        v = v.float()
    if dtype == "float8_e4m3fn":
        v = torch.clamp(v, -FP8_MAX, FP8_MAX)
    return v.to(getattr(torch, dtype)).to(torch.float32)


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    **{f: _unary(f) for f in ("exp", "exp2", "log", "log2", "log1p", "sqrt", "rsqrt", "abs", "tanh", "sigmoid",
                              "erf", "sin", "cos", "round")},
    "maximum": _binary_tensor(lambda a, b: _torch().maximum(a, b)),
    "minimum": _binary_tensor(lambda a, b: _torch().minimum(a, b)),
    "where": _where,
    "clamp": _clamp,
}
assert set(_FUNCTIONS) == set(ex.FUNCTIONS)


def build(problem: Problem) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The spec as a function of torch tensors (inputs by name, each in its own dims order
    and dtype) returning the outputs by part (each over its step's dims, in the kernels'
    storage dtypes). Eager PyTorch; ``torch.compile(build(...))`` is the Inductor baseline."""
    return _Builder(problem).build()


__all__ = ["build"]
