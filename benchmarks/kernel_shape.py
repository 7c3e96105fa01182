"""What the generated kernels look like, per catalog spec and strategy: source lines, registers,
spills and the cost model's predicted time, at every "paper" suite size with the default
configuration and float16 inputs, compiled for h100 (sm_90) by Triton's GPU compiler (no GPU).

    python benchmarks/kernel_shape.py --json OUT.json            # measure this checkout
    python benchmarks/kernel_shape.py --compare BEFORE.json AFTER.json [--out TABLE.md]

``kernel lines``: non-blank lines of the module's ``*_kernel`` functions (a split strategy has
two); ``module lines``: the whole generated module (helpers and launcher included). The compare
mode prints the before/after table and exits 1 when a kernel got longer or spills more.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # this checkout's packages, whatever is installed


def kernel_lines(source: str) -> int:
    """Non-blank source lines of the module's kernels (functions named ``*_kernel``)."""
    lines = source.splitlines()
    total = 0
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            total += sum(1 for line in lines[first - 1 : node.end_lineno] if line.strip())
    return total


def measure() -> list[dict]:
    from fuser_core.catalog import load_catalog_spec, load_suites
    from fuser_core.codegen.gpu_compile import CompilePool, CompileRequest
    from fuser_core.codegen.module import generate
    from fuser_core.codegen.plan import STRATEGIES, default_config, valid_strategies
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from tuner.cost_model import predict
    from tuner.profiles import get_profile
    from tuner.space import Candidate

    profile = get_profile("h100")
    rows, requests = [], []
    for case in load_suites()["paper"]:
        name = case["spec"]
        spec = load_catalog_spec(name)
        derivation = derive_cascade(spec)
        dtype = "float16" if isinstance(case["dtype"], str) else case["dtype"]
        problem = make_problem(spec, case["shape"], dtype)
        shape, dtypes = problem.shape, problem.dtypes
        for strategy in STRATEGIES:
            if valid_strategies(spec, derivation, shape).get(strategy):
                continue
            config = default_config(spec, derivation, strategy, shape)
            source = generate(spec, derivation, strategy, shape, config, dtypes).source
            model = predict(problem, derivation, Candidate(strategy, config), profile)
            rows.append({
                "spec": name, "shape": ",".join(f"{d}={n}" for d, n in shape.items()), "strategy": strategy,
                "kernel_lines": kernel_lines(source), "module_lines": sum(1 for x in source.splitlines() if x.strip()),
                "model_us": model.time_s * 1e6,
            })
            requests.append(CompileRequest(spec, shape, dtypes, strategy, None, profile.target))
    with CompilePool() as pool:
        builds = pool.compile(requests)
    for row, build in zip(rows, builds):
        row["ok"] = all(k.ok for k in build.kernels)
        row["registers"] = [k.registers for k in build.kernels]
        row["spill_bytes"] = [k.spill_bytes for k in build.kernels]
        row["errors"] = [k.error for k in build.kernels if not k.ok]
    return rows


def compare(before: list[dict], after: list[dict]) -> tuple[str, bool]:
    key = lambda r: (r["spec"], r["shape"], r["strategy"])  # noqa: E731
    old = {key(r): r for r in before}
    lines = [
        "| spec | shape | strategy | kernel lines | module lines | registers | spill B | model us |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    worse = False
    for r in after:
        b = old.get(key(r))
        if b is None:
            continue
        longer = r["kernel_lines"] > b["kernel_lines"]
        spills = sum(x or 0 for x in r["spill_bytes"]) > sum(x or 0 for x in b["spill_bytes"])
        worse |= longer or spills or not r["ok"]
        regs = lambda x: "+".join(str(v) for v in x["registers"])  # noqa: E731
        spill = lambda x: "+".join(str(v) for v in x["spill_bytes"])  # noqa: E731
        cut = 100.0 * (b["kernel_lines"] - r["kernel_lines"]) / b["kernel_lines"]
        lines.append(
            f"| {r['spec']} | {r['shape']} | {r['strategy']} | {b['kernel_lines']} -> {r['kernel_lines']} ({cut:+.0f}% shorter) | "
            f"{b['module_lines']} -> {r['module_lines']} | {regs(b)} -> {regs(r)} | {spill(b)} -> {spill(r)} | "
            f"{b['model_us']:.2f} -> {r['model_us']:.2f} |"
        )
    return "\n".join(lines) + "\n", worse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="measure this checkout and write the rows here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--out", type=Path, help="also write the comparison table to this Markdown file")
    args = parser.parse_args(argv)
    if args.json:
        rows = measure()
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "rows": rows}, indent=1))
        for r in rows:
            print(r["spec"], r["shape"], r["strategy"], r["kernel_lines"], r["registers"], r["spill_bytes"], f"{r['model_us']:.2f}")
        return 0 if all(r["ok"] for r in rows) else 1
    if args.compare:
        before, after = (json.loads(p.read_text())["rows"] for p in args.compare)
        table, worse = compare(before, after)
        print(table)
        if args.out:
            args.out.write_text(table)
        return 1 if worse else 0
    parser.error("give --json or --compare")
    return 2


if __name__ == "__main__":
    sys.exit(main())
