"""Contractions: a ``sum`` whose expression is a product of factors carrying different dims
(q.k, p.v, a GEMM), which the baselines compute with ``torch.einsum`` (never the broadcast
product: attention's [b, h, m, n, d] product would not fit in memory) and the tensor cores do.

Precision (decided here; the docs are silent): the operands are float16 when the spec has
float16 inputs (tensor cores, float32 accumulation, as the fused kernel does), else float32
(bf16 values are exact in float32) (:func:`contraction_dtype`); float32 matmuls use TF32 for
bf16 inputs and IEEE float32 for float32 inputs, as the fused kernels do
(:func:`matmul_precision`, set by the worker before each baseline and recorded).
:func:`contraction_flops` counts their FLOPs (the bench's roofline).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fuser_core import expr as ex
from fuser_core.spec import Spec, Step


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


__all__ = ["contraction_dtype", "contraction_factors", "contraction_flops", "factors", "matmul_precision"]
