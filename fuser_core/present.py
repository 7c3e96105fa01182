"""Render a :class:`~fuser_core.derive.Derivation` and its certificate as plain JSON data.

Field names follow docs/API.md (``spec_hash``, ``fusible``, ``reductions`` with ``name``,
``op``, ``over``, ``fused``, ``correction``, ``reason``; ``certificate`` with
``max_rel_err``, ``trials``, ``exact``); everything else is extra detail for people and
for the code generator: the terms G/H, each accumulator's tile contribution and
correction, how the final value is formed, the merge rule, the guards.
"""

from __future__ import annotations

from typing import Any

import sympy as sp

from fuser_core.certificate import Certificate
from fuser_core.derive import Derivation, ReductionForm

REALISATIONS = {
    "first": "plain partial reduction (no dependency)",
    "scaled": "one accumulator per term, anchored at running max/min values and rescaled by the correction",
    "shifted": "shifted accumulator (Welford/Chan style): anchored at running estimates, corrected additively",
    "taylor": "Taylor-shifted accumulators: centred at the anchors, moved by an exact binomial shift (Pebay style)",
    "not_fused": "not fused: computed by a separate pass after its dependencies are final",
}

_FIRST_MERGE = {
    "sum": "a + b",
    "max": "max(a, b)",
    "min": "min(a, b)",
    "topk": "the k largest of both candidate lists (lower index first on ties)",
    "argmax": "the larger (value, index) pair, lower index on ties",
    "argmin": "the smaller (value, index) pair, lower index on ties",
}
_COMBINE = {
    "sum": "+", "max": "max", "min": "min", "topk": "top-k", "bottomk": "bottom-k",
    "argmax": "argmax", "argmin": "argmin",
}


def text(e: sp.Expr) -> str:
    return sp.sstr(e, order="none")


def present(derivation: Derivation, certificate: Certificate) -> dict[str, Any]:
    return {
        "fusible": derivation.fusible,
        "reductions": [_reduction(f) for f in derivation.forms.values()],
        "axes": [
            {
                "axis": g.axis,
                "reductions": list(g.members),
                "dependencies": [list(e) for e in g.edges],
                "horizontal": list(g.horizontal),
            }
            for g in derivation.groups
        ],
        "epilogue": [
            {"name": e.name, "reads": list(e.reads), "second_pass": e.second_pass} for e in derivation.epilogue
        ],
        "certificate": certificate.to_dict(),
    }


def _reduction(f: ReductionForm) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": f.name,
        "op": f.op,
        "over": f.axis,
        "fused": f.fused,
        "correction": _correction(f),
        "reason": f.reason,
        "depends_on": list(f.deps),
        "realisation": f.kind,
        "realisation_doc": REALISATIONS[f.kind],
        "integrand": text(f.integrand),
        "exact": f.exact,
        "contraction": f.contraction,
    }
    if not f.fused:
        return out
    out["terms"] = [{"G": text(t.g), "H": text(t.h)} for t in f.terms]
    out["merge"] = _merge(f)
    out["guards"] = list(f.guards)
    if f.kind == "shifted":
        out["anchors"] = dict(f.anchors)
        out["accumulator"] = f"acc = sum over seen {f.axis} of {text(f.integrand)}, at the anchors"
        out["finalize"] = f"{f.name} = acc (at the final anchors)"
        return out
    if f.kind == "taylor":
        out["anchors"] = dict(f.anchors)
        out["accumulators"] = [{"contribution": text(c)} for c in f.contributions]
        out["finalize"] = f"{f.name} = {text(f.deferred[0])} * acc[0] (at the final anchors)"
        return out
    out["effective_op"] = f.effective_op
    out["anchors"] = dict(f.anchors)
    out["accumulators"] = [
        {"contribution": text(c), "anchored_factor": text(a), "correction": text(k), "final_factor": text(d)}
        for c, a, k, d in zip(f.contributions, f.scales, f.corrections, f.deferred)
    ]
    out["finalize"] = _finalize(f)
    return out


def _correction(f: ReductionForm) -> str | None:
    if f.kind in ("first", "not_fused"):
        return None
    if f.kind == "shifted":
        return f"add {text(f.delta)}"  # type: ignore[arg-type]
    if f.kind == "taylor":
        return "move accumulator k to: " + "; ".join(f"acc[{k}] <- {text(e)}" for k, e in enumerate(f.reanchor))
    factors = list(dict.fromkeys(text(c) for c in f.corrections if c != 1))
    if not factors:
        return "none: the dependence enters only through a factor or offset applied at the end"
    return "multiply by " + "; ".join(factors) if len(factors) == 1 else "multiply term j by: " + "; ".join(factors)


def _finalize(f: ReductionForm) -> str:
    if len(f.contributions) == 1:
        acc = [sp.Symbol("T")]
    else:
        acc = [sp.Symbol(f"T{j + 1}") for j in range(len(f.contributions))]
    value = sum((d * t for d, t in zip(f.deferred, acc)), f.offset)
    tail = " (indices: those of T)" if f.effective_op in ("topk", "bottomk", "argmax", "argmin") else ""
    return f"{f.name} = {text(value)}{tail}"


def _merge(f: ReductionForm) -> str:
    if f.kind == "first":
        return _FIRST_MERGE[f.op]
    if f.kind == "shifted":
        return (
            "acc = acc_a + acc_b + the correction from each part's anchors to the merged ones "
            "(count[old] = that part's count)"
        )
    if f.kind == "taylor":
        return "move both parts' accumulators to the merged anchors (the shift above), then add them"
    op = _COMBINE[f.effective_op]
    return (
        f"re-anchor both parts to the merged dependencies (multiply each T by its correction "
        f"with [old] = the part's anchor, [new] = the merged one), then combine with {op}"
    )
