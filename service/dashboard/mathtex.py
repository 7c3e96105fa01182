"""A derivation as LaTeX, for the dashboard's spec page (rendered in the browser by KaTeX).

The JSON report (:mod:`fuser_core.present`) gives every formula as sympy's plain text; the
page wants real math, so this module prints the :class:`~fuser_core.derive.Derivation`'s
sympy objects directly with a LaTeX printer. Nothing here parses text: every formula comes
from the derivation's own expressions, never from sympifying a string.

Names are printed so that they read as in the spec: multi-letter names upright-italic
(``\\mathit{mx}``), ``mx[old]``/``mx[new]`` as ``mx_{old}``/``mx_{new}``, ``size(d)`` and
``index(v)`` as operators, casts as ``cast_{dtype}``. User names are spec identifiers
(letters, digits, underscores: :mod:`fuser_core.spec` rejects anything else), so they
cannot smuggle LaTeX commands; underscores are escaped anyway.

For each reduction it returns the integrand F, the separated terms G/H, what one tile adds to
each accumulator, the update with its correction, how the final value is formed and the
merge rule for two partial states (split reductions); plus the certificate from the report.
"""

from __future__ import annotations

import re
from typing import Any

import sympy as sp
from sympy.printing.latex import LatexPrinter

from fuser_core import (
    REALISATIONS, Derivation, Realisation, ReductionForm, Rescale, ShiftTerm, accumulator_names, correction_text,
    merge_text, new_anchor, part_acc, unguarded,
)

_TAGGED = re.compile(r"^(?P<base>[A-Za-z_][A-Za-z0-9_]*)\[(?P<tag>old|new|a|b|\d+)\]$")
_CALL = re.compile(r"^(?P<fn>size|index)\((?P<arg>[A-Za-z_][A-Za-z0-9_]*)\)$")
_PART = re.compile(r"^(?P<base>[A-Za-z_][A-Za-z0-9_]*)@(?P<part>[ab])$")

_OPS_TEX = {"sum": "+", "max": r"\max", "min": r"\min", "topk": r"\operatorname{topk}",
            "bottomk": r"\operatorname{bottomk}", "argmax": r"\operatorname{argmax}",
            "argmin": r"\operatorname{argmin}"}


def name_tex(name: str) -> str:
    """A spec identifier in math: one letter stays italic, longer names are \\mathit{...}."""
    safe = name.replace("_", r"\_")
    return safe if len(name) == 1 else rf"\mathit{{{safe}}}"


def symbol_tex(name: str) -> str:
    m = _TAGGED.match(name)
    if m:
        tag = m["tag"]
        base = r"\mathrm{" + m["base"] + "}" if m["base"] in ("acc", "count") else name_tex(m["base"])
        sub = tag if tag in ("a", "b") or tag.isdigit() else r"\mathrm{" + tag + "}"
        return base + "_{" + sub + "}"
    m = _CALL.match(name)
    if m:
        return rf"\operatorname{{{m['fn']}}}({name_tex(m['arg'])})"
    m = re.fullmatch(r"T(\d*)(@([ab]))?", name)  # an accumulator (of part a or b): before any user name
    if m:
        sub = ",".join(x for x in (m[1], m[3]) if x)
        return f"T_{{{sub}}}" if sub else "T"
    m = _PART.match(name)
    if m:
        return rf"{name_tex(m['base'])}_{{{m['part']}}}"
    return name_tex(name)


class _MathTexPrinter(LatexPrinter):
    """sympy's LaTeX printer with the dashboard's names for symbols, casts and round()."""

    def _print_Symbol(self, expr: sp.Symbol, style: str = "plain") -> str:
        return symbol_tex(expr.name)

    def _print_Function(self, expr: sp.Function, exp: str | None = None) -> str:
        fname = type(expr).__name__
        if expr.func == Rescale:  # acc * c with the empty-accumulator guard: shown as the product
            acc, c = expr.args
            out = rf"{_paren(c)}\, {self._print(acc)}"
            return rf"\left({out}\right)^{{{exp}}}" if exp else out
        if expr.func == ShiftTerm:  # a Taylor shift's term acc * c (0 for a zero shift): shown as the product
            acc, c = expr.args
            out = rf"{self._print(acc)}\, {_paren(c)}"
            return rf"\left({out}\right)^{{{exp}}}" if exp else out
        if fname == "nan_of":  # v - v kept as IEEE computes it (NaN for an infinite v): shown as written
            out = rf"\left({self._print(expr.args[0])} - {self._print(expr.args[0])}\right)"
            return rf"{out}^{{{exp}}}" if exp else out
        if fname.startswith("cast_") or fname == "round":
            dtype = fname[5:].replace("_", r"\_")
            label = r"\operatorname{round}" if fname == "round" else r"\operatorname{cast}_{\texttt{" + dtype + "}}"
            out = rf"{label}\left({', '.join(self._print(a) for a in expr.args)}\right)"
            return f"{out}^{{{exp}}}" if exp else out
        return super()._print_Function(expr, exp)


_PRINTER = _MathTexPrinter({"mul_symbol": None, "order": "none"})


def tex(e: sp.Expr | int) -> str:
    return _PRINTER.doprint(sp.sympify(e) if isinstance(e, int) else e)


def derivation_math(derivation: Derivation, report: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every reduction of ``derivation`` as LaTeX; ``report`` (the JSON report) supplies the certificate."""
    reductions = [reduction_math(f) for f in derivation.forms.values()]
    out: dict[str, Any] = {
        "name": derivation.spec.name,
        "fusible": derivation.fusible,
        "exact": derivation.exact,
        "reductions": reductions,
        "epilogue": [
            {"name": e.name, "reads": list(e.reads), "second_pass": e.second_pass} for e in derivation.epilogue
        ],
        "axes": [{"axis": g.axis, "reductions": list(g.members)} for g in derivation.groups],
    }
    if report is not None:
        out["certificate"] = report.get("certificate")
        out["spec_hash"] = report.get("spec_hash")
    return out


def _tile_sum(op: str, axis: str, body: str, *, tile: bool = True) -> str:
    over = rf"{name_tex(axis)} \in \text{{tile}}" if tile else name_tex(axis)
    if op == "sum":
        return rf"\sum_{{{over}}} {body}"
    return rf"{_OPS_TEX.get(op, op)}_{{{over}}} {body}"


def _combine(op: str, a: str, b: str) -> str:
    if op == "sum":
        return f"{a} + {b}"
    return rf"{_OPS_TEX.get(op, op)}\left({a},\ {b}\right)"


def reduction_math(f: ReductionForm) -> dict[str, Any]:
    """One reduction: F, terms, accumulators, update with correction, final value, merge rule."""
    out: dict[str, Any] = {
        "name": f.name,
        "name_tex": name_tex(f.name),
        "op": f.op,
        "over": f.axis,
        "fused": f.fused,
        "realisation": f.kind,
        "realisation_doc": REALISATIONS[f.kind],
        "depends_on": list(f.deps),
        "reason": f.reason,
        "exact": f.exact,
        "contraction": f.contraction,
        "integrand": rf"F = {tex(f.integrand)}",
        "definition": rf"{name_tex(f.name)} = {_tile_sum(f.op, f.axis, tex(f.integrand), tile=False)}",
        "correction_text": correction_text(f),
        "terms": [], "accumulators": [], "update": [], "correction": [], "finalize": None, "merge": [],
        "merge_text": None, "guards": list(f.guards), "anchors": dict(f.anchors),
    }
    real = f.realisation
    if real is None:
        return out
    out["terms"] = [{"G": tex(t.g), "H": tex(t.h)} for t in f.terms]
    out["merge_text"] = merge_text(f)
    out.update(realisation_math(real))
    return out


def realisation_math(real: Realisation) -> dict[str, Any]:
    """The realisation's accumulators, corrections, tile update, final value and merge rule as LaTeX,
    printed from its own expressions (the ones the certificate evaluates and the kernels run)."""
    names = accumulator_names(real)
    show = dict(zip(real.symbols, names))
    at_new = {s: new_anchor(s) for s in real.dep_symbols}  # a tile's contribution reads the (new) anchors
    joint = real.moves_jointly  # a Taylor shift: each moved accumulator reads all, shown as T^moved
    out: dict[str, Any] = {"accumulators": [], "update": [], "correction": [], "merge": []}
    for acc, name, rule in zip(real.accumulators, names, real.step()):
        entry = {"T": tex(name), "contribution": tex(acc.contribution)}
        for key, e in (("anchored_factor", acc.anchored_factor), ("correction", acc.correction),
                       ("final_factor", acc.final_factor)):
            if e is not None:
                entry[key] = tex(e)
        out["accumulators"].append(entry)
        moved = rule.left.xreplace(show)
        if rule.left != acc.symbol:
            out["correction"].append(rf"{tex(name)} \leftarrow {tex(moved)}")
        before = rf"{tex(name)}^{{\text{{moved}}}}" if joint else tex(moved)
        tile = _tile_sum(real.op, real.axis, _paren(rule.right.xreplace(at_new)))
        out["update"].append(rf"{tex(name)} \leftarrow {_combine(real.op, before, tile)}")
    parts = {part_acc(j, side): sp.Symbol(f"{n.name}@{side}") for j, n in enumerate(names) for side in "ab"}
    plain = {new_anchor(s): s for s in real.dep_symbols}  # in a merge the new anchors are the merged values
    for name, rule in zip(names, real.merge()):
        if joint:
            left, right = (rf"{tex(sp.Symbol(f'{name.name}@{side}'))}^{{\text{{moved}}}}" for side in "ab")
        else:
            left, right = (tex(e.xreplace(parts).xreplace(plain)) for e in (rule.left, rule.right))
        out["merge"].append(rf"{tex(name)} = {_combine(rule.op, left, right)}")
    out["finalize"] = rf"{name_tex(real.name)} = {tex(unguarded(real.value).xreplace(show))}"
    return out


def _paren(e: sp.Expr) -> str:
    s = tex(e)
    return rf"\left({s}\right)" if isinstance(e, sp.Add) else s
