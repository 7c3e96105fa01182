"""PyTorch implementations of a spec: the eager and ``torch.compile`` baselines, and the
hand-written kernels torch ships for some catalog cascades.

:func:`build` turns **any** spec into a plain function of torch tensors, derived from the
spec's steps the way :mod:`fuser_core.reference` evaluates them in NumPy: every value in the
*aligned layout* (one axis per dim of the spec, size 1 where a value lacks the dim, so
broadcasting by name is torch broadcasting), steps run in order, each one materialised, as
op-by-op PyTorch code does. The same function is the eager baseline and, wrapped in
``torch.compile``, the Inductor baseline (it is traceable: the spec is interpreted once, when
the function is built, into closures of torch ops; numbers-only subexpressions are folded
then, in float64).

Precision (decided here; the docs are silent):

- elementwise math and reductions run in float32 (16-bit and fp8 inputs are upcast on use;
  index inputs stay int64), as Inductor does internally and as careful eager code does;
- a ``sum`` whose expression is a product of factors carrying different dims (q.k, p.v, a
  GEMM) is a **contraction** and goes through ``torch.einsum``, never through the broadcast
  product (attention's [b, h, m, n, d] product would not fit in memory). Its operands are
  float16 when the spec has float16 inputs (tensor cores, float32 accumulation, as the fused
  kernel does), else float32 (bf16 values are exact in float32); float32 matmuls use TF32 for
  bf16 inputs and IEEE float32 for float32 inputs, as the fused kernels do
  (:func:`matmul_precision`, set by the worker before each baseline and recorded);
  factors that do not carry the reduced dim are applied after the contraction, in float32;
- outputs are stored in the dtypes the kernels store
  (:func:`fuser_core.codegen.module.output_dtypes`), indices as int32;
- ``cast(x, "float8_e4m3fn")`` clamps to +-448 before converting, like the reference.

Semantics that differ from the reference only in corner cases: ``topk`` ties may come in any
order (the checks accept tied indices in either order), and NaN ranks as the largest value
in torch's ``topk`` (the reference ranks it smallest).

:func:`handwritten` maps a spec to the kernel torch ships for it (``scaled_dot_product_attention``
for attention, ``softmax``, ``logsumexp``, ``layer_norm``, ``rms_norm``, ``cross_entropy``),
**only** when the spec has the exact structure of the catalog spec of that name (same
``spec_hash`` as the template kept here): a user spec called ``safe_softmax`` that computes
something else never gets ``torch.softmax``.

Example:
    >>> import torch
    >>> from fuser_core.problem import make_problem
    >>> from fuser_core.spec import load_spec
    >>> spec = load_spec(HANDWRITTEN_TEMPLATES["safe_softmax"])
    >>> fn = build(make_problem(spec, {"m": 2, "n": 5}, {"x": "float32"}))
    >>> x = torch.randn(2, 5)
    >>> torch.allclose(fn({"x": x})["y"], torch.softmax(x, -1))
    True
    >>> hand = handwritten(spec)
    >>> hand.name, torch.allclose(hand.fn({"x": x}, {"m": 2, "n": 5})["y"], torch.softmax(x, -1))
    ('torch.softmax', True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuser_core import expr as ex
from fuser_core.problem import Problem
from fuser_core.problem import tuning_scalars
from fuser_core.reference import param_values
from fuser_core.spec import Spec, Step, load_spec

Value = Any  # a torch.Tensor or a Python number
Env = dict[str, Any]
Thunk = Callable[[Env], Value]

FP8_MAX = 448.0


def contraction_dtype(dtypes: Mapping[str, str]) -> str:
    """Operand dtype of contractions: float16 when the spec has float16 inputs, else float32."""
    return "float16" if "float16" in dtypes.values() else "float32"


def matmul_precision(dtypes: Mapping[str, str]) -> str:
    """``torch.set_float32_matmul_precision`` for the baselines, as the fused kernels choose:
    TF32 (``"high"``) for float32 contractions of bf16 inputs, IEEE float32 (``"highest"``)
    otherwise (float32 inputs are held to float32 tolerances)."""
    if contraction_dtype(dtypes) == "float32" and "bfloat16" in dtypes.values():
        return "high"
    return "highest"


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


# ---------------------------------------------------------------------------- contractions


def factors(e: ex.Expr, out: list[tuple[ex.Expr, bool]], inverse: bool = False) -> list[tuple[ex.Expr, bool]]:
    """Multiplicative factors of ``e``: (factor, is a divisor)."""
    if isinstance(e, ex.BinOp) and e.op == "*":
        factors(e.left, out, inverse)
        factors(e.right, out, inverse)
    elif isinstance(e, ex.BinOp) and e.op == "/" and not inverse:
        factors(e.left, out, False)
        factors(e.right, out, True)
    else:
        out.append((e, inverse))
    return out


def contraction_factors(spec: Spec, step: Step) -> tuple[list[tuple[ex.Expr, bool]], list[tuple[ex.Expr, bool]]] | None:
    """For a ``sum`` that is a contraction, (factors carrying the reduced dim, the others);
    None when the step is not one: at least two factors must carry the reduced dim, and they
    must not all carry the same dims (else the product is no larger than a factor)."""
    if step.reduce != "sum":
        return None
    parts = factors(step.expr, [])
    inside = [(f, inv) for f, inv in parts if step.over in spec.expr_dims(f)]
    outside = [(f, inv) for f, inv in parts if step.over not in spec.expr_dims(f)]
    dim_sets = [set(spec.expr_dims(f)) for f, _ in inside]
    if len(inside) < 2 or all(s == dim_sets[0] for s in dim_sets):
        return None
    return inside, outside


def contraction_flops(spec: Spec, shape: Mapping[str, int]) -> int:
    """2 x multiply-adds of every contraction (the FLOPs tensor cores do; elementwise math not counted)."""
    total = 0
    for step in spec.steps:
        split = contraction_factors(spec, step)
        if split is not None:
            dims = set().union(*(set(spec.expr_dims(f)) for f, _ in split[0]))
            total += 2 * int(np.prod([shape[d] for d in dims], dtype=np.float64))
    return total


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


# ---------------------------------------------------------------------------- hand-written kernels


@dataclass(frozen=True)
class Handwritten:
    """A kernel torch ships for one catalog cascade: ``fn(inputs, shape) -> outputs``."""

    name: str  # what the table shows, e.g. "F.scaled_dot_product_attention"
    fn: Callable[[Mapping[str, Any], Mapping[str, int]], dict[str, Any]]


def _spec(name: str, inputs: dict, steps: list, outputs: list, params: dict | None = None) -> dict:
    return {"foldwise": 1, "name": name, "inputs": inputs, "params": params or {}, "steps": steps, "outputs": outputs}


_ATTENTION_INPUTS = {"q": {"dims": ["b", "h", "m", "d"]}, "k": {"dims": ["b", "h", "n", "d"]},
                     "v": {"dims": ["b", "h", "n", "e"]}}
_SOFTMAX_STEPS = [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                  {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}]

def _runtime_eps(default: float) -> dict:
    """The norms' eps, a runtime scalar since issue 24. Its default is no part of the spec_hash; the
    hand-written baselines run at it, as tuning launches do (fuser_core.problem.tuning_scalars)."""
    return {"runtime": "float", "default": default, "positive": True}


# The structure each hand-written kernel computes: the catalog specs (fuser_core/catalog) as of
# issue 4 (issue 24: eps at call time). A spec gets the kernel only when its spec_hash equals its template's.
HANDWRITTEN_TEMPLATES: dict[str, dict] = {
    "attention": _spec("attention", _ATTENTION_INPUTS, [
        {"name": "s", "reduce": "sum", "over": "d", "expr": "q * k * scale"},
        {"name": "mx", "reduce": "max", "over": "n", "expr": "s"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(s - mx)"},
        {"name": "o", "reduce": "sum", "over": "n", "expr": "exp(s - mx) * v / den"}], ["o"],
        {"scale": "1 / sqrt(size(d))"}),
    "attention_causal": _spec("attention_causal", _ATTENTION_INPUTS, [
        {"name": "s0", "reduce": "sum", "over": "d", "expr": "q * k * scale"},
        {"name": "s", "expr": "where(index(n) <= index(m), s0, -inf)"},
        {"name": "mx", "reduce": "max", "over": "n", "expr": "s"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(s - mx)"},
        {"name": "o", "reduce": "sum", "over": "n", "expr": "exp(s - mx) * v / den"}], ["o"],
        {"scale": "1 / sqrt(size(d))"}),
    "safe_softmax": _spec("safe_softmax", {"x": {"dims": ["m", "n"]}},
                          [*_SOFTMAX_STEPS, {"name": "y", "expr": "exp(x - mx) / den"}], ["y"]),
    "logsumexp": _spec("logsumexp", {"x": {"dims": ["m", "n"]}}, [  # torch's own guard of an infinite max
        {"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - where(abs(mx) == inf, 0, mx))"},
        {"name": "lse", "expr": "where(abs(mx) == inf, 0, mx) + log(den)"}], ["lse"]),
    "layernorm": _spec("layernorm", {"x": {"dims": ["t", "c"]}, "gamma": {"dims": ["c"]}, "beta": {"dims": ["c"]}}, [
        {"name": "mean", "reduce": "sum", "over": "c", "expr": "x / size(c)"},
        {"name": "var", "reduce": "sum", "over": "c", "expr": "(x - mean) ** 2 / size(c)"},
        {"name": "y", "expr": "(x - mean) * rsqrt(var + eps) * gamma + beta"}], ["y"], {"eps": _runtime_eps(1e-05)}),
    "rmsnorm": _spec("rmsnorm", {"x": {"dims": ["t", "c"]}, "w": {"dims": ["c"]}}, [
        {"name": "ms", "reduce": "sum", "over": "c", "expr": "x * x / size(c)"},
        {"name": "y", "expr": "x * rsqrt(ms + eps) * w"}], ["y"], {"eps": _runtime_eps(1e-06)}),
    "cross_entropy": _spec("cross_entropy", {"logits": {"dims": ["t", "v"]}, "target": {"dims": ["t"], "kind": "index"}}, [
        {"name": "mx", "reduce": "max", "over": "v", "expr": "logits"},
        {"name": "den", "reduce": "sum", "over": "v", "expr": "exp(logits - mx)"},
        {"name": "picked", "reduce": "sum", "over": "v", "expr": "where(index(v) == target, logits, 0)"},
        {"name": "loss", "expr": "mx + log(den) - picked"}], ["loss"]),
}


def _sdpa(causal: bool):
    def fn(t: Mapping[str, Any], shape: Mapping[str, int]) -> dict[str, Any]:
        import torch.nn.functional as F

        return {"o": F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=causal)}

    return fn


def _softmax(t, shape):
    return {"y": _torch().softmax(t["x"], dim=-1)}


def _logsumexp(t, shape):
    return {"lse": _torch().logsumexp(t["x"], dim=-1)}


def _layer_norm(t, shape):
    import torch.nn.functional as F

    x = t["x"]
    return {"y": F.layer_norm(x, (x.shape[-1],), t["gamma"], t["beta"], eps=1e-05)}


def _rms_norm(t, shape):
    import torch.nn.functional as F

    x = t["x"]
    return {"y": F.rms_norm(x, (x.shape[-1],), t["w"], eps=1e-06)}


def _cross_entropy(t, shape):
    import torch.nn.functional as F

    return {"loss": F.cross_entropy(t["logits"], t["target"].long(), reduction="none")}


_HANDWRITTEN: dict[str, Handwritten] = {
    "attention": Handwritten("F.scaled_dot_product_attention", _sdpa(False)),
    "attention_causal": Handwritten("F.scaled_dot_product_attention(is_causal=True)", _sdpa(True)),
    "safe_softmax": Handwritten("torch.softmax", _softmax),
    "logsumexp": Handwritten("torch.logsumexp", _logsumexp),
    "layernorm": Handwritten("F.layer_norm", _layer_norm),
    "rmsnorm": Handwritten("F.rms_norm", _rms_norm),
    "cross_entropy": Handwritten("F.cross_entropy(reduction='none')", _cross_entropy),
}
_TEMPLATE_HASHES: dict[str, str] = {}


def template_hash(name: str) -> str:
    from fuser_core.canonical import spec_hash

    if name not in _TEMPLATE_HASHES:
        _TEMPLATE_HASHES[name] = spec_hash(load_spec(HANDWRITTEN_TEMPLATES[name]))
    return _TEMPLATE_HASHES[name]


def handwritten_reason(spec: Spec) -> str | None:
    """None when torch has a hand-written kernel for ``spec``, else why not."""
    from fuser_core.canonical import spec_hash

    if spec.name not in _HANDWRITTEN:
        return f"torch has no hand-written kernel for {spec.name!r}"
    if spec_hash(spec) != template_hash(spec.name):
        return (f"{spec.name!r} does not have the structure of the catalog spec of that name "
                f"(its spec_hash differs), so {_HANDWRITTEN[spec.name].name} does not compute it")
    return None


def handwritten(spec: Spec) -> Handwritten | None:
    """The hand-written torch kernel for ``spec``, or None (see :func:`handwritten_reason`)."""
    return _HANDWRITTEN[spec.name] if handwritten_reason(spec) is None else None


__all__ = ["HANDWRITTEN_TEMPLATES", "Handwritten", "build", "contraction_dtype", "contraction_factors",
           "contraction_flops", "factors", "handwritten", "handwritten_reason", "matmul_precision", "template_hash"]

