"""A spec's formula in torch, float64, differentiable: the backward certificate's reference.

The spec is evaluated step by step as written (no fusion, no rewriting), like the NumPy reference
(:mod:`fuser_core.reference`, whose aligned layout it uses: every array over ``spec.dims`` with
size 1 on the dims it lacks), so torch's autograd gives the vector-Jacobian product of the
formula itself. It is independent of :mod:`fuser_core.backward.derive`: torch differentiates
through every max (``amax`` splits the gradient among ties) and every ``where``; a cast passes
the gradient unchanged (straight through, in float64).

Covers what :func:`fuser_core.backward.derive_backward` accepts: no topk, merged dims or pages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fuser_core import expr as ex
from fuser_core.problem import bind_scalars, bind_shape
from fuser_core.spec_model import Spec


def _functions(torch: Any) -> dict[str, Any]:
    return {
        "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2, "log1p": torch.log1p,
        "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "abs": torch.abs, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
        "erf": torch.erf, "sin": torch.sin, "cos": torch.cos, "round": torch.round,
        "maximum": torch.maximum, "minimum": torch.minimum, "where": torch.where,
        "clamp": lambda x, lo, hi: torch.clamp(x, min=lo, max=hi),
    }


class TorchFormula:
    """``spec`` at one bound shape, in torch float64 (module doc)."""

    def __init__(self, spec: Spec, shape: Mapping[str, int]):
        import torch

        self.torch = torch
        self.spec = spec
        self.shape = bind_shape(spec, shape, allow_empty=True)
        self.functions = _functions(torch)

    def aligned(self, tensor: Any, dims: tuple[str, ...]) -> Any:
        order = sorted(range(len(dims)), key=lambda i: self.spec.dims.index(dims[i]))
        return tensor.permute(order).reshape([self.shape[d] if d in dims else 1 for d in self.spec.dims])

    def unaligned(self, tensor: Any, dims: tuple[str, ...]) -> Any:
        own = [d for d in self.spec.dims if d in dims]
        return tensor.reshape([self.shape[d] for d in own]).permute([own.index(d) for d in dims])

    def outputs(self, inputs: Mapping[str, Any], scalars: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The spec's outputs (over each step's dims) from ``inputs`` (torch tensors in each input's
        own dims order; float ones float64, index ones int64)."""
        torch, spec = self.torch, self.spec
        env: dict[str, Any] = {i.name: self.aligned(inputs[i.name], i.dims) for i in spec.inputs}
        bound = bind_scalars(spec, self.shape, dict(scalars or {}))
        ones = [1] * len(spec.dims)
        for p in spec.params:
            value = bound[p.name] if p.runtime else self.eval(p.expr, env)
            env[p.name] = torch.as_tensor(value, dtype=torch.float64).reshape(ones)
        for step in spec.steps:
            value = self.eval(step.expr, env)
            if step.is_reduction:
                ax = spec.dims.index(step.over)
                full = [self.shape[d] if d in spec.expr_dims(step.expr) else 1 for d in spec.dims]
                value = value.expand(full)
                if step.reduce == "sum":
                    value = value.sum(ax, keepdim=True)
                elif step.reduce in ("max", "min"):
                    value = (value.amax if step.reduce == "max" else value.amin)(ax, keepdim=True)
                else:  # argmax/argmin: positions, read in conditions
                    value = (value.argmax if step.reduce == "argmax" else value.argmin)(ax, keepdim=True)
            env[step.name] = value
        out = {}
        for name in spec.outputs:
            step = spec.step(name)
            full = [self.shape[d] if d in step.dims else 1 for d in spec.dims]
            out[name] = self.unaligned(env[name].expand(full), step.dims)
        return out

    def eval(self, e: ex.Expr, env: Mapping[str, Any]) -> Any:
        torch = self.torch
        if isinstance(e, ex.Num):
            return torch.tensor(e.value, dtype=torch.float64)
        if isinstance(e, ex.Ref):
            return env[e.name]
        if isinstance(e, ex.Size):
            return torch.tensor(float(self.shape[e.dim]), dtype=torch.float64)
        if isinstance(e, ex.Index):
            shape = [self.shape[d] if d == e.dim else 1 for d in self.spec.dims]
            return torch.arange(self.shape[e.dim], dtype=torch.float64).reshape(shape)
        if isinstance(e, ex.Neg):
            return -self.eval(e.operand, env)
        if isinstance(e, ex.BinOp):
            a, b = self.eval(e.left, env), self.eval(e.right, env)
            return {"+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.div, "**": torch.pow}[e.op](a, b)
        if isinstance(e, ex.Compare):
            a, b = self.eval(e.left, env), self.eval(e.right, env)
            return {"<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge, "==": torch.eq, "!=": torch.ne}[e.op](a, b)
        if isinstance(e, ex.Logic):
            args = [self.eval(a, env) for a in e.args]
            return torch.logical_not(args[0]) if e.op == "not" else \
                (torch.logical_and if e.op == "and" else torch.logical_or)(*args)
        if isinstance(e, ex.Call):
            return self.functions[e.func](*(self.eval(a, env) for a in e.args))
        if isinstance(e, ex.Cast):
            value = self.eval(e.operand, env)
            # the rounded value, the gradient passed through in float64: torch's own cast would
            # round the gradient to the cast's dtype on its way back (float8: 3 bits)
            rounded = value.detach().to(getattr(torch, e.dtype)).to(torch.float64)  # the dtype names are torch's
            return value + (rounded - value.detach())
        raise TypeError(f"cannot evaluate {e!r}")
