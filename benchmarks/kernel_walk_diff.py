"""Before/after oracle for changes to the code generator that must not change the kernels.

Generates the module source of every catalog spec x valid strategy x (default and sampled
configs from the tuner's search space) x float16/bfloat16/float32 (the fp8 inputs the spec
needs) x a small ragged shape and the paper shapes, plus the unfused chain's modules, plus
every valid strategy of the first fuzz specs (tests/support/fuzz_strategies.py); records the tuner's
analysis (kernel sketches) and cost-model predictions for each; then diffs two such folders.

    # the code under test is whatever PYTHONPATH puts first (an old checkout: git archive)
    PYTHONPATH=/tmp/before python benchmarks/kernel_walk_diff.py generate /tmp/kw/before
    PYTHONPATH=.           python benchmarks/kernel_walk_diff.py generate /tmp/kw/after --cases /tmp/kw/before
    python benchmarks/kernel_walk_diff.py diff /tmp/kw/before /tmp/kw/after
    # registers (sm_90, Triton's compiler, no GPU) of the modules whose text differs, each side
    PYTHONPATH=/tmp/before python benchmarks/kernel_walk_diff.py registers /tmp/kw/before --ids /tmp/kw/differ.txt
    PYTHONPATH=.           python benchmarks/kernel_walk_diff.py registers /tmp/kw/after --ids /tmp/kw/differ.txt
    python benchmarks/kernel_walk_diff.py diff /tmp/kw/before /tmp/kw/after   # now with registers

``--cases`` replays the cases of an earlier run (its sampled configs and fuzz specs), so both
sides generate exactly the same requests. The diff normalises the generator version in each
module's docstring and allows only these differences: kernel parameters removed that the
kernel never read (with their launcher arguments) and imports removed that nothing used.
Everything else (a changed line, an added parameter, a changed sketch or prediction) is
reported as a difference, and the exit code is 1; so is a kernel whose sm_90 registers or spills
went up, or that no longer compiles.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # tests/support (catalog_shapes, fuzz_strategies); fuser_core from PYTHONPATH
os.environ.setdefault("TRITON_INTERPRET", "1")

FLOATS = ("float16", "bfloat16", "float32")
FP8_INPUTS = {"fp8_quant_gemm": {"w": "float8_e4m3fn", "w_scale": "float32"}}  # as suites.json has it
SAMPLED = 2  # configs per (spec, shape, dtype, strategy) drawn from the search space
SEED = 22
FUZZ_SPECS = 200
FUZZ_DTYPES = ("float32", "bfloat16")
VERSION = re.compile(r"\(generator [0-9a-f]{12}\)")


# ---------------------------------------------------------------- generating


def _catalog_cases(rng: random.Random) -> list[dict]:
    from tests.support.catalog_shapes import small_shape

    from fuser_core.catalog import PACKAGED_DIR, catalog_entries, load_suites
    from fuser_core.codegen.plan import valid_strategies
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from fuser_core.reference import bind_shape
    from fuser_core.runner import bind_dtypes
    from fuser_core.spec import load_spec
    from tuner.profiles import get_profile
    from tuner.space import SearchSpace

    suites = load_suites([PACKAGED_DIR])
    profile = get_profile("h100")
    cases = []
    for entry in sorted(catalog_entries([PACKAGED_DIR]), key=lambda e: e.name):
        raw = json.loads(entry.path.read_bytes())
        spec = load_spec(raw)
        derivation = derive_cascade(spec)
        paper = [bind_shape(spec, c["shape"]) for c in suites["paper"] if c["spec"] == entry.name]
        for k, shape in enumerate([small_shape(spec), *paper]):
            valid = [s for s, why in valid_strategies(spec, derivation, shape).items() if why is None]
            for floating in FLOATS:
                dtypes = bind_dtypes(spec, {**{i.name: floating for i in spec.inputs if i.kind == "float"},
                                            **FP8_INPUTS.get(entry.name, {})})
                base = {"source": "catalog", "name": entry.name, "spec": raw, "shape": shape, "dtypes": dtypes}
                cases.append({**base, "strategy": "unfused_chain", "config": None,
                              "id": f"{entry.name}-s{k}-{floating}-unfused_chain-default"})
                space = SearchSpace(make_problem(spec, shape, dtypes), derivation, profile)
                for strategy in valid:
                    cases.append({**base, "strategy": strategy, "config": None,
                                  "id": f"{entry.name}-s{k}-{floating}-{strategy}-default"})
                    if strategy not in space.strategies():
                        continue
                    params = space.params(strategy)
                    seen: list[dict] = []
                    for _ in range(200):
                        c = space.candidate(strategy, {p: rng.choice(ch) for p, ch in params.items()})
                        if space.check(c) is None and c.config.to_dict() not in seen:
                            seen.append(c.config.to_dict())
                            if len(seen) == SAMPLED:
                                break
                    for j, config in enumerate(seen):
                        cases.append({**base, "strategy": strategy, "config": config,
                                      "id": f"{entry.name}-s{k}-{floating}-{strategy}-c{j}"})
    return cases


def _fuzz_raws(n: int) -> list[dict]:
    from tests.support.fuzz_strategies import cascade_specs
    from hypothesis import HealthCheck, Phase, given, settings

    raws: list[dict] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.reuse, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(cascade_specs())
    def draw(raw):
        raws.append(raw)

    draw()
    return raws[:n]


def _fuzz_cases(raws: list[dict]) -> list[dict]:
    from tests.support.fuzz_strategies import kernel_configs, ragged_shape

    from fuser_core.derive import derive_cascade
    from fuser_core.reference import bind_shape
    from fuser_core.runner import bind_dtypes
    from fuser_core.spec import load_spec

    cases = []
    for k, raw in enumerate(raws):
        try:
            spec = load_spec(raw)
            derivation = derive_cascade(spec)
            shape = bind_shape(spec, ragged_shape(spec))
            configs, _ = kernel_configs(spec, derivation, shape)
        except Exception:  # noqa: BLE001 - refused or limit-stopped specs have no kernels
            continue
        for dtype in FUZZ_DTYPES:
            dtypes = bind_dtypes(spec, dtype)
            base = {"source": "fuzz", "name": f"fuzz{k}", "spec": raw, "shape": shape, "dtypes": dtypes}
            for strategy, config in configs:
                if strategy is None:
                    continue
                cases.append({**base, "strategy": strategy, "config": config.to_dict(),
                              "id": f"fuzz{k:03d}-{dtype}-{strategy}-blocks"})
                cases.append({**base, "strategy": strategy, "config": None, "id": f"fuzz{k:03d}-{dtype}-{strategy}-default"})
            cases.append({**base, "strategy": "unfused_chain", "config": None,
                          "id": f"fuzz{k:03d}-{dtype}-unfused_chain-default"})
    return cases


def _sketch_json(sketches) -> list:
    def dims(x):
        return sorted(x)

    out = []
    for k in sketches:
        passes = []
        for p in k.passes:
            passes.append({
                "loop": p.loop, "loads": sorted(p.loads),  # their order changes no number
                "ops": sorted([dims(d), v] for d, v in p.ops.items()),
                "dots": [[d.over, d.i, d.j, str(d.p), str(d.q), str(d.scale), d.precision, list(d.direct)] for d in p.dots],
                "tensors": sorted(dims(t) for t in p.tensors), "ws_loads": sorted(dims(t) for t in p.ws_loads),
                "stores": sorted([n, dims(d)] for n, d in p.stores),
            })
        out.append({"name": k.name, "grid": k.grid, "passes": passes, "state": [dims(s) for s in k.state],
                    "ws_stores": [dims(s) for s in k.ws_stores]})
    return out


_DERIVED: dict[str, object] = {}


def _generate_one(case: dict) -> dict:
    """Module source(s), sketch and prediction of one case (or why it was refused)."""
    from fuser_core.codegen.module import module_source
    from fuser_core.codegen.plan import KernelConfig, NotValid, default_config, make_plan
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem, output_dtypes
    from fuser_core.spec import load_spec
    from tuner.analysis import Anatomy
    from tuner.chain_cost import predict_chain
    from tuner.cost_model import predict
    from tuner.profiles import get_profile
    from tuner.space import Candidate

    key = json.dumps(case["spec"], sort_keys=True)
    if key not in _DERIVED:
        spec = load_spec(case["spec"])
        _DERIVED[key] = (spec, derive_cascade(spec))
    spec, derivation = _DERIVED[key]
    shape, dtypes, strategy = case["shape"], case["dtypes"], case["strategy"]
    out: dict = {"id": case["id"]}
    if strategy == "unfused_chain":
        from fuser_core.codegen.chain import chain_modules

        modules = chain_modules(spec, shape, dtypes)
        out["modules"] = {f"{j}-{m.name}": m.source for j, m in enumerate(modules)}
        if case["source"] == "catalog":
            try:
                out["prediction"] = predict_chain(make_problem(spec, shape, dtypes), derivation,
                                                  get_profile("h100")).to_dict()
            except Exception as err:  # noqa: BLE001 - recorded
                out["prediction"] = f"error: {type(err).__name__}: {err}"
        return out
    config = (KernelConfig.from_dict(case["config"]) if case["config"] is not None
              else default_config(spec, derivation, strategy, shape))
    try:
        plan = make_plan(spec, derivation, strategy, shape, config)
    except NotValid as why:
        out["refused"] = str(why)
        return out
    out["modules"] = {"module": module_source(plan, output_dtypes(spec, dtypes), dtypes)}
    try:
        out["sketch"] = _sketch_json(Anatomy(spec, derivation, dtypes).kernels(strategy, plan.blocks, plan.parallel_combine))
        if case["source"] == "catalog":
            problem = make_problem(spec, shape, dtypes)
            out["prediction"] = predict(problem, derivation, Candidate(strategy, config), get_profile("h100")).to_dict()
    except Exception as err:  # noqa: BLE001 - recorded: the tuner's view of a module that generated
        out["sketch"] = f"error: {type(err).__name__}: {err}"
    return out


def generate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    (out / "modules").mkdir(parents=True, exist_ok=True)
    os.environ["FOLDWISE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel-walk-cache-")
    if args.cases:
        cases = json.loads((Path(args.cases) / "cases.json").read_text())
    else:
        cases = _catalog_cases(random.Random(SEED)) + _fuzz_cases(_fuzz_raws(args.fuzz))
    (out / "cases.json").write_text(json.dumps(cases))
    results = {}
    for k, case in enumerate(cases):
        try:
            r = _generate_one(case)
        except Exception as err:  # noqa: BLE001 - recorded: a generator failure is a difference
            tb = traceback.format_exc(limit=-3)
            r = {"id": case["id"], "error": f"{type(err).__name__}: {err}\n{tb}"}
        for name, source in r.pop("modules", {}).items():
            (out / "modules" / f"{case['id']}--{name}.py").write_text(source)
        results[case["id"]] = r
        if args.progress and k % 100 == 0:
            print(f"{k}/{len(cases)}", file=sys.stderr, flush=True)
    (out / "results.json").write_text(json.dumps(results, sort_keys=True, default=str))
    modules = len(list((out / "modules").glob("*.py")))
    errors = sum(1 for r in results.values() if "error" in r)
    print(f"{len(cases)} cases, {modules} modules, {errors} generator errors -> {out}")
    return 0


# ---------------------------------------------------------------- comparing


def _kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.endswith("_kernel")}


def _names_read(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _regions(lines: list[str]) -> list[str]:
    """The lines outside kernel signatures, launcher calls and imports (those are compared by AST);
    the blank lines around the imports as one (an import group removed takes its blank line)."""
    out, inside = [], None
    first = next((i for i, line in enumerate(lines) if line.startswith(("@", "def ", "#", "INTERPRETED"))), len(lines))
    head = [line for line in lines[:first] if not re.fullmatch(r"(import|from) [\w.]+.*", line)]
    lines = [line for i, line in enumerate(head) if line or not (i and not head[i - 1])] + lines[first:]
    for line in lines:
        if inside == "sig":
            if line == "):":
                inside = None
            continue
        if inside == "call":
            if line == "    )":
                inside = None
            continue
        if line.startswith("def ") and line.endswith("(") and not line.startswith("def launch"):
            inside = "sig"
            out.append(line)
            continue
        if re.fullmatch(r"    \w+\[.*\]\(", line):
            inside = "call"
            out.append(line)
            continue
        if re.fullmatch(r"(import|from) [\w.]+.*", line):
            continue
        out.append(line)
    return out


def _signature_lines(text: str, kernel: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(f"def {kernel}(")
    end = lines.index("):", start)
    return lines[start + 1:end]


def explain(before: str, after: str) -> tuple[str, str]:
    """('identical' | 'allowed' | 'different', detail) for two module texts."""
    before, after = VERSION.sub("(generator X)", before), VERSION.sub("(generator X)", after)
    if before == after:
        return "identical", ""
    if _regions(before.splitlines()) != _regions(after.splitlines()):
        import difflib

        diff = difflib.unified_diff(_regions(before.splitlines()), _regions(after.splitlines()), lineterm="", n=1)
        return "different", "\n".join(list(diff)[:40])
    tb, ta = ast.parse(before), ast.parse(after)
    notes = []
    # imports: after's are before's minus names nothing used
    imports_b = [ast.dump(n) for n in tb.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    imports_a = [ast.dump(n) for n in ta.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    rest_b = [n for n in tb.body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    used = set().union(*(_names_read(n) | {a.value.id for a in ast.walk(n) if isinstance(a, ast.Attribute)
                                          and isinstance(a.value, ast.Name)} for n in rest_b))
    for n in tb.body:
        if isinstance(n, (ast.Import, ast.ImportFrom)) and ast.dump(n) not in imports_a:
            names = [a.asname or a.name.split(".")[0] for a in n.names]
            if any(x in used for x in names):
                return "different", f"removed import {ast.unparse(n)} is used"
            notes.append(f"import {','.join(names)}")
    if [i for i in imports_a if i not in imports_b]:
        return "different", "added import"
    kb, ka = _kernels(tb), _kernels(ta)
    if list(kb) != list(ka):
        return "different", "kernels differ"
    removed: dict[str, list[str]] = {}
    for name in kb:
        pb = [a.arg for a in kb[name].args.args]
        pa = [a.arg for a in ka[name].args.args]
        it = iter(pb)
        if not all(p in it for p in pa):
            return "different", f"{name}: parameters {pa} are not a subsequence of {pb}"
        gone = [p for p in pb if p not in pa]
        read = set().union(*(_names_read(s) for s in kb[name].body))
        if any(p in read for p in gone):
            return "different", f"{name}: removed parameters {[p for p in gone if p in read]} were read"
        if ast.dump(ast.Module(kb[name].body, [])) != ast.dump(ast.Module(ka[name].body, [])):
            return "different", f"{name}: body differs"
        # the signature printed as before, each group without the removed parameters
        want = []
        for line in _signature_lines(before, name):
            kept = [p.strip() for p in line.strip().rstrip(",").split(",") if p.split(":")[0].strip() not in gone]
            if kept:
                want.append("    " + " ".join(f"{p}," for p in kept))
        if want != _signature_lines(after, name):
            return "different", f"{name}: signature lines differ"
        if gone:
            removed[name] = gone
            notes.append(f"{name}({', '.join(gone)})")
    # the launcher: each launch's arguments as before, less the removed parameters'
    lb = next(n for n in tb.body if isinstance(n, ast.FunctionDef) and n.name == "launch")
    la = next(n for n in ta.body if isinstance(n, ast.FunctionDef) and n.name == "launch")
    calls_b = [c for c in ast.walk(lb) if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)]
    calls_a = [c for c in ast.walk(la) if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)]
    for cb, ca in zip(calls_b, calls_a, strict=True):
        kernel = cb.func.value.id
        params = [a.arg for a in kb[kernel].args.args if not (a.annotation is not None and "constexpr" in ast.unparse(a.annotation))]
        gone = removed.get(kernel, [])
        args = [ast.dump(a) for p, a in zip(params, cb.args, strict=True) if p not in gone]
        kws = [ast.dump(k) for k in cb.keywords if k.arg not in gone]
        if args != [ast.dump(a) for a in ca.args] or kws != [ast.dump(k) for k in ca.keywords]:
            return "different", f"launch of {kernel}: arguments differ beyond the removed parameters"
    strip_calls = ast.dump(ast.Module([s for s in lb.body], []))
    for c in calls_b:
        c.args, c.keywords = [], []
    for c in calls_a:
        c.args, c.keywords = [], []
    if ast.dump(ast.Module(lb.body, [])) != ast.dump(ast.Module(la.body, [])):
        return "different", "launcher differs"
    del strip_calls
    if not notes:
        return "different", "texts differ in a way the checks above do not explain"
    return "allowed", "; ".join(notes)


def diff(args: argparse.Namespace) -> int:
    from collections import Counter

    before, after = Path(args.before), Path(args.after)
    rb = json.loads((before / "results.json").read_text())
    ra = json.loads((after / "results.json").read_text())
    files_b = {p.name for p in (before / "modules").glob("*.py")}
    files_a = {p.name for p in (after / "modules").glob("*.py")}
    counts: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    bad: list[str] = []
    differ: list[str] = []
    for name in sorted(files_b | files_a):
        if name not in files_a or name not in files_b:
            counts["missing"] += 1
            bad.append(f"{name}: only {'before' if name in files_b else 'after'}")
            continue
        verdict, detail = explain((before / "modules" / name).read_text(), (after / "modules" / name).read_text())
        counts[verdict] += 1
        if verdict == "different":
            bad.append(f"{name}: {detail}")
        elif verdict == "allowed":
            if any(not note.startswith("import ") for note in detail.split("; ")):
                differ.append(name.split("--")[0])  # a kernel's parameters changed (not only an import)
            for note in detail.split("; "):
                kinds[re.sub(r"^\w+?_(\w*kernel)\(", r"*_\1(", note)] += 1
    for cid in sorted(set(rb) | set(ra)):
        b, a = rb.get(cid, {}), ra.get(cid, {})
        for field in ("error", "refused", "sketch", "prediction"):
            if field == "error":  # its message, not the traceback's paths
                if (b.get(field) or "").split("\n")[0] != (a.get(field) or "").split("\n")[0]:
                    counts["error differs"] += 1
                    bad.append(f"{cid}: error differs: {b.get(field)} -> {a.get(field)}")
                continue
            if b.get(field) != a.get(field):
                counts[f"{field} differs"] += 1
                bad.append(f"{cid}: {field} differs: {str(b.get(field))[:300]} -> {str(a.get(field))[:300]}")
    print(f"modules compared: {len(files_b | files_a)} ({len(rb)} cases)")
    print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    for k, v in kinds.most_common():
        print(f"  removed {k}: {v} modules")
    regs, worse = _registers_diff(before, after)
    if regs:
        print(regs)
    if args.differ_out:
        Path(args.differ_out).write_text("\n".join(sorted(set(differ))) + "\n")
    for line in bad[:args.show]:
        print("DIFFERENT", line)
    return 1 if bad or worse else 0


# ---------------------------------------------------------------- registers


def registers(args: argparse.Namespace) -> int:
    """Compile the cases (all, or those named in --ids) for sm_90 with the code under test."""
    from fuser_core.codegen.gpu_compile import CompilePool, CompileRequest
    from fuser_core.spec import load_spec

    out = Path(args.out)
    cases = json.loads((out / "cases.json").read_text())
    if args.ids:
        wanted = set(Path(args.ids).read_text().split())
        cases = [c for c in cases if c["id"] in wanted]
    os.environ.setdefault("FOLDWISE_CACHE_DIR", tempfile.mkdtemp(prefix="kernel-walk-cache-"))
    requests = [CompileRequest(load_spec(c["spec"]), c["shape"], c["dtypes"], c["strategy"], c["config"])
                for c in cases]
    found = {}
    path = out / "registers.json"
    if path.exists():
        found = json.loads(path.read_text())
    todo = [(c, r) for c, r in zip(cases, requests) if c["id"] not in found]
    with CompilePool(args.workers) as pool:
        for k in range(0, len(todo), 20):
            chunk = todo[k:k + 20]
            for (c, _), build in zip(chunk, pool.compile([r for _, r in chunk])):
                found[c["id"]] = {"refused": build.refused, "kernels": [
                    {"kernel": b.kernel, "ok": b.ok, "registers": b.registers, "spill_bytes": b.spill_bytes,
                     "shared_bytes": b.shared_bytes, "error": (b.error or "")[:300]} for b in build.kernels]}
            path.write_text(json.dumps(found, sort_keys=True))
            print(f"{min(k + 20, len(todo))}/{len(todo)} compiled", file=sys.stderr, flush=True)
    failed = sum(1 for v in found.values() for b in v["kernels"] if not b["ok"])
    print(f"{len(found)} cases compiled for sm_90, {failed} kernels failed -> {path}")
    return 0


def _registers_diff(before: Path, after: Path) -> str:
    pb, pa = before / "registers.json", after / "registers.json"
    if not (pb.exists() and pa.exists()):
        return "", False
    rb, ra = json.loads(pb.read_text()), json.loads(pa.read_text())
    both = sorted(set(rb) & set(ra))
    lower = equal = higher = failed = 0
    worse = []
    for cid in both:
        for kb, ka in zip(rb[cid]["kernels"], ra[cid]["kernels"], strict=True):
            if not (kb["ok"] and ka["ok"]):
                failed += 1
                worse.append(f"{cid} {ka['kernel']}: compile ok before {kb['ok']}, after {ka['ok']}")
                continue
            r = (ka["registers"], ka["spill_bytes"]) , (kb["registers"], kb["spill_bytes"])
            if r[0] == r[1]:
                equal += 1
            elif ka["registers"] <= kb["registers"] and ka["spill_bytes"] <= kb["spill_bytes"]:
                lower += 1
            else:
                higher += 1
                worse.append(f"{cid} {ka['kernel']}: registers {kb['registers']} -> {ka['registers']}, "
                             f"spills {kb['spill_bytes']} -> {ka['spill_bytes']}")
    lines = [f"registers (sm_90) of {len(both)} compiled cases: {equal} kernels equal, {lower} lower, "
             f"{higher} higher, {failed} failed"]
    return "\n".join(lines + [f"  WORSE {w}" for w in worse[:20]]), bool(worse)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write every case's modules, sketches and predictions to OUT")
    g.add_argument("out")
    g.add_argument("--cases", help="a folder of an earlier run: replay its cases")
    g.add_argument("--fuzz", type=int, default=FUZZ_SPECS, help=f"fuzz specs to draw (default {FUZZ_SPECS})")
    g.add_argument("--progress", action="store_true")
    d = sub.add_parser("diff", help="compare two folders; exit 1 on any difference not allowed")
    d.add_argument("before")
    d.add_argument("after")
    d.add_argument("--show", type=int, default=30, help="differences to print (default 30)")
    d.add_argument("--differ-out", help="write the ids of cases whose kernels lost parameters to this file (the "
                                        "kernels of the others are the same text: the same compile)")
    r = sub.add_parser("registers", help="compile OUT's cases for sm_90 with the code under test")
    r.add_argument("out")
    r.add_argument("--ids", help="a file of case ids to compile (default: all)")
    r.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    return {"generate": generate, "diff": diff, "registers": registers}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
