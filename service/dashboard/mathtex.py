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

from fuser_core.derive import COUNT_OLD, Derivation, ReductionForm
from fuser_core.present import REALISATIONS, _correction, _merge

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
    m = _PART.match(name)
    if m:
        return rf"{name_tex(m['base'])}_{{{m['part']}}}"
    m = re.fullmatch(r"T(\d*)(@([ab]))?", name)
    if m:
        sub = ",".join(x for x in (m[1], m[3]) if x)
        return f"T_{{{sub}}}" if sub else "T"
    return name_tex(name)


class _Printer(LatexPrinter):
    """sympy's LaTeX printer with the dashboard's names for symbols, casts and round()."""

    def _print_Symbol(self, expr: sp.Symbol, style: str = "plain") -> str:
        return symbol_tex(expr.name)

    def _print_Function(self, expr: sp.Function, exp: str | None = None) -> str:
        fname = type(expr).__name__
        if fname.startswith("cast_") or fname == "round":
            dtype = fname[5:].replace("_", r"\_")
            label = r"\operatorname{round}" if fname == "round" else r"\operatorname{cast}_{\texttt{" + dtype + "}}"
            out = rf"{label}\left({', '.join(self._print(a) for a in expr.args)}\right)"
            return f"{out}^{{{exp}}}" if exp else out
        return super()._print_Function(expr, exp)


_PRINTER = _Printer({"mul_symbol": None, "order": "none"})


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
        "correction_text": _correction(f),
        "terms": [], "accumulators": [], "update": [], "correction": [], "finalize": None, "merge": [],
        "merge_text": None, "guards": list(f.guards), "anchors": dict(f.anchors),
    }
    if not f.fused:
        return out
    out["terms"] = [{"G": tex(t.g), "H": tex(t.h)} for t in f.terms]
    out["merge_text"] = _merge(f)
    if f.kind == "first":
        out["accumulators"] = [{"T": "T", "contribution": tex(f.contributions[0])}]
        out["update"] = [rf"T \leftarrow {_combine(f.op, 'T', _tile_sum(f.op, f.axis, tex(f.contributions[0])))}"]
        out["finalize"] = rf"{name_tex(f.name)} = T"
        out["merge"] = [rf"T = {_combine(f.op, 'T_{a}', 'T_{b}')}"]
        return out
    if f.kind == "shifted":
        assert f.delta is not None
        out["correction"] = [rf"\delta = {tex(f.delta)}"]
        out["update"] = [
            r"\mathrm{acc} \leftarrow \mathrm{acc} + \delta + "
            + _tile_sum("sum", f.axis, tex(_at_new(f.integrand, f.deps)))
        ]
        out["finalize"] = rf"{name_tex(f.name)} = \mathrm{{acc}}\ \text{{(at the final anchors)}}"
        da, db = (tex(_at_part(f.delta, f.deps, p, count=True)) for p in "ab")
        out["merge"] = [rf"\mathrm{{acc}} = \mathrm{{acc}}_{{a}} + \mathrm{{acc}}_{{b}} + {da} + {db}"]
        return out
    if f.kind == "taylor":
        accs = [sp.Symbol(f"acc[{k}]") for k in range(len(f.contributions))]
        out["accumulators"] = [{"T": tex(a), "contribution": tex(c)} for a, c in zip(accs, f.contributions)]
        out["correction"] = [rf"{tex(a)} \leftarrow {tex(r)}" for a, r in zip(accs, f.reanchor)]
        out["update"] = [
            rf"{tex(a)} \leftarrow {tex(a)}^{{\text{{moved}}}} + {_tile_sum('sum', f.axis, tex(_at_new(c, f.deps)))}"
            for a, c in zip(accs, f.contributions)
        ]
        out["finalize"] = rf"{name_tex(f.name)} = {tex(f.deferred[0])} \cdot {tex(accs[0])}"
        out["merge"] = [r"\mathrm{acc}_k = \mathrm{acc}_{k,a}^{\text{moved}} + \mathrm{acc}_{k,b}^{\text{moved}}"]
        return out
    # scaled: one accumulator per term, anchored, rescaled by its correction when the anchors move
    many = len(f.contributions) > 1
    accs = [sp.Symbol(f"T{j + 1}" if many else "T") for j in range(len(f.contributions))]
    op = f.effective_op or f.op
    for acc, c, a, k, d in zip(accs, f.contributions, f.scales, f.corrections, f.deferred):
        out["accumulators"].append({
            "T": tex(acc), "contribution": tex(c), "anchored_factor": tex(a), "correction": tex(k),
            "final_factor": tex(d),
        })
        scaled = tex(acc) if k == 1 else rf"{_paren(k)}\, {tex(acc)}"
        tile = _tile_sum(op, f.axis, tex(_at_new(c, f.deps)))
        out["update"].append(rf"{tex(acc)} \leftarrow {_combine(op, scaled, tile)}")
        if k != 1:
            out["correction"].append(rf"{tex(acc)} \leftarrow {_paren(k)}\, {tex(acc)}")
        ka, kb = (_at_part(k, f.deps, p) for p in "ab")
        ta, tb = (sp.Symbol(f"{acc.name}@{p}") for p in "ab")
        left = tex(ta) if ka == 1 else rf"{_paren(ka)}\, {tex(ta)}"
        right = tex(tb) if kb == 1 else rf"{_paren(kb)}\, {tex(tb)}"
        out["merge"].append(rf"{tex(acc)} = {_combine(op, left, right)}")
    value = sum((d * t for d, t in zip(f.deferred, accs)), f.offset)
    out["finalize"] = rf"{name_tex(f.name)} = {tex(value)}"
    return out


def _at_new(e: sp.Expr, deps: tuple[str, ...]) -> sp.Expr:
    """``e`` with each dependency at its new (current) anchor: what a tile adds after the anchors moved."""
    repl = {sym: sp.Symbol(f"{sym.name}[new]", **sym.assumptions0) for sym in e.free_symbols
            if isinstance(sym, sp.Symbol) and sym.name in deps}
    return e.xreplace(repl)


def _paren(e: sp.Expr) -> str:
    s = tex(e)
    return rf"\left({s}\right)" if isinstance(e, sp.Add) else s


def _at_part(e: sp.Expr, deps: tuple[str, ...], part: str, *, count: bool = False) -> sp.Expr:
    """A correction between one part's anchors (``[old]`` -> part a or b) and the merged ones (``[new]`` -> plain)."""
    repl: dict[sp.Symbol, sp.Symbol] = {}
    for sym in e.free_symbols:
        m = _TAGGED.match(sym.name)  # type: ignore[attr-defined]
        if m and m["base"] in deps and m["tag"] == "old":
            repl[sym] = sp.Symbol(f"{m['base']}@{part}", **sym.assumptions0)  # type: ignore[attr-defined]
        elif m and m["base"] in deps and m["tag"] == "new":
            repl[sym] = sp.Symbol(m["base"], **sym.assumptions0)  # type: ignore[attr-defined]
    if count:
        repl[COUNT_OLD] = sp.Symbol(f"count[{part}]", integer=True, nonnegative=True)
    return e.xreplace(repl)


