"""The accuracy check: every family of a spec run and judged, and the verdict's table and refusal text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fuser_core.accuracy.families import FAMILIES, RUN_FAMILIES, accuracy_shape, family_inputs, family_shape
from fuser_core.accuracy.formula import FLOOR_ULPS, formula_dtype, formula_outputs
from fuser_core.accuracy.torch_ops import torch_op_name, torch_outputs
from fuser_core.accuracy.verdict import BAR, bar_verdict, cancellation
from fuser_core.codegen.strategies import is_fused
from fuser_core.spec import Spec


def check_family(spec: Spec, shape: Mapping[str, int], dtypes: Mapping[str, str], name: str, *,
                 strategy: str | None = None, config: Any = None, derivation: Any = None,
                 seed: int = 0) -> dict[str, Any]:
    """Run the strategy on the family's inputs (at each of its shapes) and judge it by the bar:
    ``{"family", "passed", "error", "formula_error", "ratio", "torch_error", "torch_ratio",
    "specials", "shape", "note"}`` (the worst of its shapes)."""
    from fuser_core.problem import ShapeError, output_dtypes
    from fuser_core.reference import evaluate
    from fuser_core.runner import interpreter_quiet, run

    fam = FAMILIES[name]
    shapes = family_shape(name, spec, shape)
    fdtype = formula_dtype(dtypes)
    stores = output_dtypes(spec, dtypes)
    if not shapes:
        return _refused(name, shape, fdtype, "does not apply (a top-k needs k values along its axis)")
    verdicts = []
    for sh in shapes:
        try:
            inputs = family_inputs(spec, sh, name, dtypes, seed)
            with np.errstate(all="ignore"):
                reference = evaluate(spec, sh, inputs)
        except ShapeError as err:  # torch refuses it too (an argmax over nothing): so must the run
            inputs = {i.name: np.zeros([sh[d] for d in i.dims], np.int64 if i.is_index else np.float64)
                      for i in spec.inputs}
            try:
                run(spec, sh, dtypes, inputs, strategy=strategy, config=config, derivation=derivation)
            except ShapeError as run_err:
                verdicts.append(_refused(name, sh, fdtype, f"refused as the reference is: {run_err}"))
                continue
            except Exception as run_err:  # noqa: BLE001 (a crash: the family fails)
                verdicts.append(_crashed(name, sh, fdtype, run_err))
                continue
            verdicts.append({**_refused(name, sh, fdtype, f"ran although the reference refuses: {err}"), "passed": False})
            continue
        try:
            with interpreter_quiet():
                got = run(spec, sh, dtypes, inputs, strategy=strategy, config=config, derivation=derivation).outputs
        except Exception as err:  # noqa: BLE001 (a crash: the family fails, with the exception named)
            verdicts.append(_crashed(name, sh, fdtype, err))
            continue
        formula = formula_outputs(spec, sh, inputs, fdtype, seed)
        torch_ref = torch_outputs(spec, sh, inputs, dtypes) if not fam.special else None
        v = bar_verdict(spec, got, reference, formula, stores, torch_ref, special=fam.special,
                        cancel=cancellation(spec, sh, inputs, reference))
        v.pop("parts")
        verdicts.append({"family": name, **v, "shape": sh, "formula_dtype": fdtype, "note": ""})
    worst = max(verdicts, key=lambda v: (not v["passed"], v["ratio"]))
    notes = [v["note"] for v in verdicts if v["note"]]
    return {**worst, "note": "; ".join(dict.fromkeys(notes))}


def _refused(name: str, shape: Mapping[str, int], fdtype: str, note: str) -> dict[str, Any]:
    return {"family": name, "passed": True, "error": 0.0, "formula_error": 0.0, "ratio": 0.0, "torch_error": None,
            "torch_ratio": None, "spec_torch_ratio": None, "specials": [], "spec_warning": None, "shape": dict(shape),
            "formula_dtype": fdtype, "note": note}


def _crashed(name: str, shape: Mapping[str, int], fdtype: str, err: BaseException) -> dict[str, Any]:
    return {**_refused(name, shape, fdtype, f"crashed: {type(err).__name__}: {str(err)[:300]}"), "passed": False,
            "error": float("inf"), "ratio": float("inf")}


def accuracy_check(spec: Spec, shape: Mapping[str, int], dtype: str | Mapping[str, str] = "float32", *,
                   families: Iterable[str] = RUN_FAMILIES, strategy: str | None = None, config: Any = None,
                   derivation: Any = None, seed: int = 0, reduce_shape: bool = True) -> dict[str, Any]:
    """The bar on each family: ``{"passed", "bar", "floor_ulps", "shape", "formula_dtype",
    "families": [check_family's verdicts], "failed": [names]}``. ``reduce_shape`` caps the shape
    with :func:`accuracy_shape` first (the interpreter's cost)."""
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import bind_dtypes, bind_shape

    bound = bind_shape(spec, shape, allow_empty=True)
    dtypes = bind_dtypes(spec, dtype)
    small = accuracy_shape(spec, bound) if reduce_shape else dict(bound)
    derivation = derivation or derive_cascade(spec)
    if strategy is None:
        from fuser_core.runner import choose_strategy

        strategy = choose_strategy(spec, derivation, small)
    if is_fused(strategy) and not derivation.exact:
        # a cast inside a fused reduction rounds with running values (docs/THEORY.md 5): the kernel does not compute
        # the formula as written, so it has no formula to be held to; the float64 check judges it normwise
        rows = [_refused(f, small, formula_dtype(dtypes), "not applicable: the fused form rounds its casts with "
                         "running values (judged normwise by the float64 check)") for f in families]
    else:
        rows = [check_family(spec, small, dtypes, f, strategy=strategy, config=config, derivation=derivation,
                             seed=seed) for f in families]
    failed = [r["family"] for r in rows if not r["passed"]]
    warnings = {r["family"]: r["spec_warning"] for r in rows if r.get("spec_warning")}
    return {"passed": not failed, "strategy": strategy, "bar": BAR, "floor_ulps": FLOOR_ULPS, "shape": small,
            "formula_dtype": formula_dtype(dtypes), "torch_op": torch_op_name(spec), "families": rows,
            "failed": failed, "spec_warnings": warnings}


def refusal(strategy: str, verdict: Mapping[str, Any]) -> str:
    """One line naming the first failing family, its ratio and what it was measured against."""
    row = next(r for r in verdict["families"] if not r["passed"])
    return f"{strategy} fails the accuracy bar on the {row['family']} family: " + describe(row)


def describe(row: Mapping[str, Any]) -> str:
    """A family's verdict in words."""
    if row.get("note") and row["ratio"] in (0.0, float("inf")) and not row["specials"]:
        return row["note"]
    text = (f"error {row['error']:.3g} is {row['ratio']:.3g}x the formula's in {row['formula_dtype']} "
            f"({row['formula_error']:.3g})")
    if row.get("torch_ratio") is not None:
        text += f" and {row['torch_ratio']:.3g}x torch's ({row['torch_error']:.3g})"
    text += f"; the bar is {BAR:g}x, floored at {FLOOR_ULPS} ulps"
    if row["specials"]:
        text += "; special values differ from the reference's: " + ", ".join(row["specials"])
    return text


def table(verdict: Mapping[str, Any]) -> str:
    """The per-family lines ``foldwise run`` prints."""
    lines = [f"accuracy bar ({verdict['strategy']}, shape {verdict['shape']}, formula in {verdict['formula_dtype']}"
             + (f", torch op {verdict['torch_op']}" if verdict.get("torch_op") else "") + f"): error <= {BAR:g} x "
             f"max(formula error, {FLOOR_ULPS} ulps)" + (" and <= 2 x torch's" if verdict.get("torch_op") else ""),
             f"  {'family':<11} {'error':>9} {'formula':>9} {'ratio':>8} {'torch':>9} {'ratio':>8}  verdict"]
    for r in verdict["families"]:
        t = "" if r["torch_error"] is None else f"{r['torch_error']:.2e}"
        tr = "" if r["torch_ratio"] is None else f"{r['torch_ratio']:.2f}"
        word = "pass" if r["passed"] else "FAIL"
        extra = r["note"] or ("special values differ: " + ", ".join(r["specials"]) if r["specials"] else "")
        lines.append(f"  {r['family']:<11} {r['error']:>9.2e} {r['formula_error']:>9.2e} {r['ratio']:>8.2f} "
                     f"{t:>9} {tr:>8}  {word}" + (f"  ({extra})" if extra else ""))
    for fam, text in verdict.get("spec_warnings", {}).items():
        lines.append(f"  note ({fam}): {text}")
    lines.append("accuracy: " + ("passed" if verdict["passed"] else "FAILED on " + ", ".join(verdict["failed"])))
    return "\n".join(lines)
