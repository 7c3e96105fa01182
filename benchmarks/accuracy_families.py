"""Accuracy on the inputs real models produce, against the spec's own formula in float32 (issue 23).

For the catalog and the user cascades of issue 23 (KL between two softmaxes, softmax entropy with
a temperature, a softmax-weighted variance, skewness, z-loss), every strategy runs (float32, the
Triton interpreter without a GPU) on input families beyond standard normal: offsets (+100, +1000),
a scale (x30), peaked rows and near-ties. Each error is measured against the float64 reference
(:func:`fuser_core.runner.rel_err`, the kernel check's measure) and set against the error of the
spec's formula as written, evaluated step by step in float32 (every operation's result rounded
to float32, a sum by pairwise float32 additions: the accuracy bar's formula, fuser_core.accuracy). The
unfused chain (one kernel per step through memory, printed in the user's grouping) is shown too.
The goal is every ratio <= 2 (the formula's error floored at 4 float32 ulps).

Usage:
    TRITON_INTERPRET=1 python benchmarks/accuracy_families.py [--only kl,entropy_t] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fuser_core.accuracy import VALUE_FAMILIES, ulp_floor  # noqa: E402 (after the path is set)

NAIVE_FLOOR = ulp_floor("float32")  # a few units in the last place: below it, both are exact
SHAPE_ROWS, SHAPE_COLS = 8, 300  # 300: no tile divides it

MX = {"name": "mx", "reduce": "max", "over": "n", "expr": "x"}
DEN = {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}
USER_CASCADES: dict[str, dict[str, Any]] = {
    "kl": {"inputs": {"a": {"dims": ["m", "n"]}, "b": {"dims": ["m", "n"]}}, "steps": [
        {"name": "ma", "reduce": "max", "over": "n", "expr": "a"},
        {"name": "da", "reduce": "sum", "over": "n", "expr": "exp(a - ma)"},
        {"name": "mb", "reduce": "max", "over": "n", "expr": "b"},
        {"name": "db", "reduce": "sum", "over": "n", "expr": "exp(b - mb)"},
        {"name": "kl", "reduce": "sum", "over": "n",
         "expr": "exp(a - ma) / da * ((a - ma - log(da)) - (b - mb - log(db)))"}], "outputs": ["kl"]},
    "entropy_t": {"inputs": {"x": {"dims": ["m", "n"]}}, "params": {"t": "0.7"}, "steps": [
        {"name": "mx", "reduce": "max", "over": "n", "expr": "x / t"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x / t - mx)"},
        {"name": "h", "reduce": "sum", "over": "n", "expr": "-(exp(x / t - mx) / den) * (x / t - mx - log(den))"}],
        "outputs": ["h"]},
    "softmax_weighted_variance": {"inputs": {"x": {"dims": ["m", "n"]}, "v": {"dims": ["m", "n"]}}, "steps": [
        MX, DEN,
        {"name": "mu", "reduce": "sum", "over": "n", "expr": "exp(x - mx) * v / den"},
        {"name": "var", "reduce": "sum", "over": "n", "expr": "exp(x - mx) * (v - mu) ** 2 / den"}], "outputs": ["var"]},
    "skewness": {"inputs": {"x": {"dims": ["m", "n"]}}, "steps": [
        {"name": "mean", "reduce": "sum", "over": "n", "expr": "x / size(n)"},
        {"name": "m2", "reduce": "sum", "over": "n", "expr": "(x - mean) ** 2 / size(n)"},
        {"name": "m3", "reduce": "sum", "over": "n", "expr": "(x - mean) ** 3 / size(n)"},
        {"name": "skew", "expr": "m3 / (m2 * sqrt(m2))"}], "outputs": ["skew"]},
    "z_loss": {"inputs": {"x": {"dims": ["m", "n"]}}, "steps": [
        MX, DEN, {"name": "z", "expr": "0.0001 * (mx + log(den)) ** 2"}], "outputs": ["z"]},
}


def family(name: str, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One input family applied to a standard-normal float input (rows along the last axis):
    fuser_core.accuracy's, the families the kernel checks draw."""
    from fuser_core.accuracy import apply_family

    return apply_family(name, x, rng)


FAMILIES = VALUE_FAMILIES  # the value families; the special ones are checked by the kernel checks


def specs(only: set[str] | None) -> dict[str, Any]:
    from fuser_core.catalog import catalog_entries, load_catalog_spec
    from fuser_core.spec import load_spec

    out = {}
    for e in catalog_entries():
        if e.packaged and e.name not in ("attention", "attention_causal", "attention_sink", "fp8_quant_gemm"):  # 4-D / GEMM: own tests
            out[e.name] = load_catalog_spec(e.name)
    for name, raw in USER_CASCADES.items():
        out[name] = load_spec({"foldwise": 1, "name": name, **raw})
    return {k: v for k, v in out.items() if not only or k in only}


def shape_of(spec) -> dict[str, int]:
    from fuser_core.codegen.plan import loop_axis

    axis, _ = loop_axis(spec)
    shape = {d: SHAPE_ROWS for d in spec.dims}
    shape[axis] = SHAPE_COLS
    for s in spec.steps:
        if s.reduce == "topk":
            shape[s.as_dim] = s.k
    return shape


def formula_error(spec, shape, inputs, reference) -> float:
    """The error of the spec as written, evaluated step by step in float32: the accuracy bar's
    formula (fuser_core.accuracy.formula_outputs: every rounding operation's result rounded to
    float32, a sum by pairwise float32 additions; the largest of round-to-nearest and random roundings)."""
    from fuser_core.accuracy import formula_outputs
    from fuser_core.problem import output_dtypes
    from fuser_core.runner import FLOOR, rel_err

    floor = FLOOR[output_dtypes(spec, {i.name: "float32" for i in spec.inputs if i.is_float})[spec.output_parts[0]]]
    return max((rel_err(got[p], ref, floor) for got in formula_outputs(spec, shape, inputs, "float32")
                for p, ref in reference.items() if not p.endswith(".indices")), default=0.0)


def errors(spec, shape, inputs, strategies) -> dict[str, float]:
    from fuser_core.problem import output_dtypes
    from fuser_core.reference import evaluate
    from fuser_core.runner import FLOOR, interpreter_quiet, rel_err, run

    reference = evaluate(spec, shape, inputs)
    out: dict[str, Any] = {"formula": formula_error(spec, shape, inputs, reference)}
    floor = FLOOR[output_dtypes(spec, {i.name: "float32" for i in spec.inputs if i.is_float})[spec.output_parts[0]]]
    for strategy in strategies:
        try:
            with interpreter_quiet():
                got = run(spec, shape, "float32", inputs, strategy=strategy).outputs
        except Exception as err:  # noqa: BLE001 (a strategy that does not apply: reported, not fatal)
            out[strategy] = f"n/a: {str(err)[:60]}"
            continue
        worst = 0.0
        for part, ref in reference.items():
            if part.endswith(".indices"):
                continue
            g = got[part]
            g = (g.float() if g.dtype.is_floating_point else g).cpu().numpy().astype(np.float64)
            worst = max(worst, rel_err(g, ref, floor))
        out[strategy] = worst
    return out


def main(argv: list[str] | None = None) -> int:
    from fuser_core.codegen.plan import BASELINE, STRATEGIES
    from fuser_core.merged import consistent
    from fuser_core.problem import bind_shape
    from fuser_core.reference import random_inputs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated spec names")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    rows = []
    print("# Error vs float64 over the naive float32 error (the formula as written), per input family\n")
    print("Not measured on GPU: Triton's interpreter, float32. Cells: error (ratio to the formula's error, "
          f"floored at {NAIVE_FLOOR:.1e}).\n")
    print("| spec | family | formula f32 | unfused chain | " + " | ".join(STRATEGIES) + " | worst ratio |")
    print("|---|---|---|---|" + "---|" * len(STRATEGIES) + "---|")
    for name, spec in specs(set(args.only.split(",")) if args.only else None).items():
        shape = shape_of(spec)
        for fam in FAMILIES:
            rng = np.random.default_rng(0)
            inputs = random_inputs(spec, shape, rng, "float32")
            inputs = {k: (family(fam, v, rng).astype(np.float32) if v.dtype.kind == "f" else v) for k, v in inputs.items()}
            if name == "kl":  # b close to a, as two models' logits are
                inputs["b"] = (inputs["a"] + 0.05 * rng.standard_normal(inputs["a"].shape)).astype(np.float32)
            if name == "softmax_weighted_variance":  # v ~ 100 regardless of the family of x
                inputs["v"] = (100.0 + rng.standard_normal(inputs["v"].shape)).astype(np.float32)
            # as a user's tensors are: a per-channel weight of a merged dim repeats along its other parts
            bound = bind_shape(spec, shape)
            inputs = {k: consistent(spec, k, v, bound) for k, v in inputs.items()}
            errs = errors(spec, shape, inputs, (BASELINE, *STRATEGIES))
            naive = errs.pop("formula")
            chain = errs.pop(BASELINE)
            cells, ratios = [], []
            for s in STRATEGIES:
                e = errs[s]
                if isinstance(e, str) or isinstance(naive, str):
                    cells.append("n/a")
                    continue
                r = e / max(naive, NAIVE_FLOOR)
                ratios.append(r)
                cells.append(f"{e:.1e} ({r:.1f})")
            worst = max(ratios, default=float("nan"))
            chain_text = chain if isinstance(chain, str) else f"{chain:.1e}"
            print(f"| {name} | {fam} | {naive:.1e} | {chain_text} | " + " | ".join(cells)
                  + f" | {worst:.1f}{' **' if worst > 2 else ''} |")
            rows.append({"spec": name, "family": fam, "formula": naive, "chain": chain, "errors": errs,
                         "worst_ratio": worst})
            sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
