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
from fuser_core.realisation import DOCS, Realisation, unguarded

REALISATIONS = DOCS  # realisation kind -> one line of explanation
SHORT_NAMES = "T"  # accumulators are shown as T (one) or T1, T2, ... (several)


def text(e: sp.Expr) -> str:
    return sp.sstr(e, order="none")


def present(derivation: Derivation, certificate: Certificate) -> dict[str, Any]:
    return {
        "fusible": derivation.fusible,
        "reductions": [_reduction(f) for f in derivation.forms.values()],
        "axes": [
            {
                "axis": g.axis,
                "dims": list(derivation.spec.merges.get(g.axis, (g.axis,))),  # a merged axis: the dims it loops over
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


def accumulator_names(real: Realisation) -> list[sp.Symbol]:
    """How people see a realisation's accumulators: T, or T1, T2, ... (the dashboard too)."""
    n = len(real.accumulators)
    return [sp.Symbol("T" if n == 1 else f"T{j + 1}") for j in range(n)]


def correction_text(f: ReductionForm) -> str | None:
    """The re-anchoring correction in words (None: nothing moves, or not fused)."""
    return f.realisation.correction_text(text) if f.realisation is not None else None


def merge_text(f: ReductionForm) -> str | None:
    """The merge rule of two partial states in words (the expressions: Realisation.merge)."""
    return f.realisation.merge_text() if f.realisation is not None else None


def _reduction(f: ReductionForm) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": f.name,
        "op": f.op,
        "over": f.axis,
        "fused": f.fused,
        "correction": correction_text(f),
        "reason": f.reason,
        "depends_on": list(f.deps),
        "realisation": f.kind,
        "realisation_doc": REALISATIONS[f.kind],
        "integrand": text(f.integrand),
        "exact": f.exact,
        "contraction": f.contraction,
    }
    real = f.realisation
    if real is None:
        return out
    out["terms"] = [{"G": text(t.g), "H": text(t.h)} for t in f.terms]
    out["merge"] = real.merge_text()
    out["guards"] = list(f.guards)
    out["effective_op"] = real.op
    out["anchors"] = dict(real.anchors)
    out["accumulators"] = [_accumulator(a) for a in real.accumulators]
    out["finalize"] = _finalize(real)
    return out


def _accumulator(a) -> dict[str, str]:
    out = {"contribution": text(a.contribution)}
    for key, e in (("anchored_factor", a.anchored_factor), ("correction", a.correction), ("final_factor", a.final_factor)):
        if e is not None:
            out[key] = text(e)
    return out


def _finalize(real: Realisation) -> str:
    names = accumulator_names(real)
    value = unguarded(real.value).xreplace(dict(zip(real.symbols, names)))
    tail = " (indices: those of T)" if real.selection else ""
    return f"{real.name} = {text(value)}{tail}"
