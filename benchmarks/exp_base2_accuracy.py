"""exp in base 2 against exp's exact form, per output dtype (issue 35, 1): the accuracy bar's errors.

Every catalog spec whose kernels call exp, at fp16, bf16 and fp32, each fused strategy, on every value
family of the accuracy bar (fuser_core.accuracy: offsets, scales, peaked rows, near-ties), run under
Triton's interpreter twice: with ``exp(a - b)`` printed as ``tl.exp2(a * LOG2E - b * LOG2E)`` and with
``tl.exp(a - b)``. Prints the error over the spec's formula in the same dtype (the bar: <= 2) of each,
the worst per (spec, dtype). The generator prints base 2 where every output is 16-bit
(fuser_core.codegen.structure.build.BASE2_OUTPUT_DTYPES); this table is why.

    TRITON_INTERPRET=1 python benchmarks/exp_base2_accuracy.py [--only safe_softmax,attention] [--dtypes float16]
        [--strategies streaming_fused] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPECS = ("safe_softmax", "attention", "attention_causal", "logsumexp", "cross_entropy", "moe_routing")
DTYPES = ("float16", "bfloat16", "float32")


def worst(spec, dtype: str, strategy: str, derivation) -> tuple[float, str, bool]:
    from fuser_core.accuracy import VALUE_FAMILIES, accuracy_check
    from fuser_core.catalog import load_catalog_spec  # noqa: F401

    bar = accuracy_check(spec, dict(_shape(spec)), dtype, families=VALUE_FAMILIES, strategy=strategy,
                         derivation=derivation)
    rows = [r for r in bar["families"] if r.get("ratio") is not None]
    if not rows:
        return float("nan"), "-", bool(bar["passed"])
    top = max(rows, key=lambda r: r["ratio"])
    return float(top["ratio"]), top["family"], bool(bar["passed"])


def _shape(spec):
    from fuser_core.catalog import load_suites

    for case in load_suites().get("paper", []):
        if case["spec"] == spec.name:
            return case["shape"]
    raise KeyError(spec.name)


def main(argv: list[str] | None = None) -> int:
    import fuser_core.codegen.module as module
    import fuser_core.codegen.structure.build as build
    from fuser_core.catalog import load_catalog_spec
    from fuser_core.codegen.plan import valid_strategies
    from fuser_core.codegen.strategies import is_fused
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import output_dtypes
    from fuser_core.reference import bind_shape
    from fuser_core.runner import bind_dtypes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--strategies", default=None, help="comma-separated (default: every fused strategy)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    chosen = build.exp_in_base2
    cache = tempfile.mkdtemp(prefix="foldwise-exp2-")
    lines = ["| spec | dtype | strategy | base 2: worst ratio (family) | exact exp: worst ratio (family) | printed |",
             "|---|---|---|---|---|---|"]
    for name in SPECS:
        if args.only and name not in args.only.split(","):
            continue
        spec = load_catalog_spec(name)
        derivation = derive_cascade(spec)
        shape = bind_shape(spec, _shape(spec))
        for dtype in args.dtypes.split(","):
            for strategy, why in valid_strategies(spec, derivation, shape).items():
                if why is not None or not is_fused(strategy):
                    continue
                if args.strategies and strategy not in args.strategies.split(","):
                    continue
                out = {}
                for form, fold in (("base2", True), ("exact", False)):
                    # the module cache's key does not hold the choice (exp_in_base2 decides it from
                    # the dtypes, which are in the key): one cache folder per form
                    os.environ["FOLDWISE_CACHE_DIR"] = str(Path(cache) / form)
                    module._MODULES.clear()  # and the modules loaded from the other folder
                    build.exp_in_base2 = lambda stores, fold=fold: fold
                    try:
                        out[form] = worst(spec, dtype, strategy, derivation)
                    finally:
                        build.exp_in_base2 = chosen
                printed = "base 2" if chosen(output_dtypes(spec, bind_dtypes(spec, dtype))) else "exact"
                cell = {f: (f"{r:.2f} ({fam})" + ("" if ok else " **fails**")) for f, (r, fam, ok) in out.items()}
                lines.append(f"| {name} | {dtype} | {strategy} | {cell['base2']} | {cell['exact']} | {printed} |")
                print(lines[-1], flush=True)
    text = ("# exp in base 2 vs exact, per output dtype (interpreter, the accuracy bar's value families; "
            "not measured on GPU)\n\n" + "\n".join(lines) + "\n")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
