"""The one-call GPU check (issue 21): probes, correctness, the client path and speed, in one run.

Run through ``bash benchmarks/gpu/check.sh`` (it checks for a GPU, installs the carried wheels,
prints the versions and calls this). Stages, each bounded by its share of ``--budget-s`` and
saved as soon as it ends, so a run cut short still leaves what it measured:

1. **probes**: ``index_select`` on float8 tensors on CUDA; whether the cuda measurer's L2
   flush evicts (a buffer inside L2 read hot, then after the flush);
2. **correctness**: every catalog spec x valid strategy (and the unfused chain) at a moderate
   shape whose loop axis is not a multiple of any block, in the suite's dtype and in float32,
   checked against the float64 reference in the measurement worker (:mod:`tuner.device`); split
   ones also with their combine in the part kernel's launch where it is valid (``/last_part``: the
   atomic tickets on a real GPU), and attention's K and V by TMA on sm_90+ (the launchers choose it);
3. **client**: a bundle built from the cubin the worker launched (as a cuda-measured job stores
   it) is loaded in a fresh process with an empty Triton cache: it must run without compiling
   and match float64;
4. **decoder**: ``examples/tiny_decoder.py --bench`` against a local ``foldwise serve`` (SQLite, one
   worker tuning on this GPU): the model against plain torch in float32, decode tokens per second
   against plain torch and ``torch.compile``, and a CUDA-graph capture of the Foldwise ops (GPU only:
   its CPU run is the CI test ``tests/e2e/test_example_decoder.py``);
5. **speed**: the paper suite in priority order with the cuda measurer, a few trials per case,
   against torch eager, ``torch.compile``, torch's own kernel and the experts of
   :mod:`tuner.experts` (Liger-Kernel, SDPA per backend, a split-KV decoder,
   ``torch._scaled_mm``), all timed side by side in one worker; the copy bandwidth is the ceiling.

Writes to ``--out``: ``check.json`` (everything), ``summary.md`` (the tables), ``correctness.md``,
``speed.md`` (the bench's own tables). ``check.sh`` adds ``env.txt`` and ``check.log``.

``--device cpu --tiny`` is the dry run: the same stages through Triton's interpreter at tiny
shapes (no probes, no binaries), so the script cannot rot on machines without a GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The speed stage's order: what issue 22 names first, then the rest of the paper suite.
PRIORITY = ("cross_entropy", "safe_softmax", "attention_causal", "attention", "rmsnorm", "layernorm", "moe_routing",
            "fp8_quant_per_token", "logsumexp", "fp8_quant_gemm")
# The stages in the order they run; each one's share of the budget (speed takes what the others leave).
STAGES = ("probes", "correctness", "specials", "accuracy", "client", "decoder", "speed")
SHARES = {"probes": 0.05, "correctness": 0.3, "specials": 0.08, "accuracy": 0.08, "client": 0.08, "decoder": 0.25}
DECODER_TRIALS = 2  # tuning trials per kernel of the example (6 kernels: two model sizes x three specs)
CLIENT_SPEC = "safe_softmax"


def versions() -> dict[str, str]:
    import numpy
    import torch
    import triton

    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "numpy": numpy.__version__, "cuda": str(torch.version.cuda)}


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------- shapes and dtypes


def check_shape(spec: Any, tiny: bool) -> dict[str, int]:
    """A shape for the correctness check: the loop axis ragged against every block (1000, or
    300 when the spec also has an inner axis; tiny: 37 / 19), inner axes 72 (tiny: 5), the last
    lane dim 37 (tiny: 3) and the others 3 (tiny: 2, still more than one index each: the
    interpreter runs the lane rows one by one), a topk's ``as`` dim its k."""
    from fuser_core.codegen.plan import loop_axis
    from fuser_core.reference import bind_shape

    axis, inner = loop_axis(spec)
    as_dims = {s.as_dim: s.k for s in spec.steps if s.as_dim}
    lanes = [d for d in spec.dims if d != axis and d not in inner and d not in as_dims]
    shape = {}
    for d in spec.dims:
        if d in as_dims:
            shape[d] = as_dims[d]
        elif d == axis:
            shape[d] = (19 if inner else 37) if tiny else (300 if inner else 1000)
        elif d in inner:
            shape[d] = 5 if tiny else 72
        else:
            shape[d] = (3 if tiny else 37) if d == lanes[-1] else (2 if tiny else 3)
    return bind_shape(spec, shape)


def suite_dtypes(spec_name: str) -> list[Any]:
    """The paper suite's dtype for this spec (or float16), and the same in float32 (fp8 and
    index inputs keep their dtypes)."""
    from fuser_core.catalog import load_suites

    paper = [c for c in load_suites().get("paper", []) if c["spec"] == spec_name]
    dtype = paper[0].get("dtype", "float16") if paper else "float16"
    if isinstance(dtype, str):
        wide: Any = "float32"
    else:
        wide = {k: ("float32" if v in ("float16", "bfloat16") else v) for k, v in dtype.items()}
    return [dtype] if dtype == wide else [dtype, wide]


def dtype_label(dtype: Any) -> str:
    return dtype if isinstance(dtype, str) else "/".join(sorted(set(dtype.values())))


# ---------------------------------------------------------------------------- stages


def probes(args: argparse.Namespace, budget_s: float) -> dict[str, Any]:
    """float8 index_select on CUDA, the hardware's fp8 conversions against the exact path
    (benchmarks/gpu/fp8_native.py), and whether zeroing the flush buffer evicts L2."""
    if args.device != "cuda":
        return {"skipped": "no GPU: probes need CUDA"}
    import torch

    out: dict[str, Any] = {}
    x = torch.randn(64, 64, device="cuda").to(torch.float8_e4m3fn)
    idx = torch.tensor([0, 5, 63], device="cuda")
    try:
        got = x.index_select(0, idx)
        want = x.view(torch.uint8).index_select(0, idx).view(torch.float8_e4m3fn)
        out["fp8_index_select"] = {"works": bool(torch.equal(got.view(torch.uint8), want.view(torch.uint8)))}
    except Exception as err:  # noqa: BLE001 (the probe's answer)
        out["fp8_index_select"] = {"works": False, "error": f"{type(err).__name__}: {err}"[:300]}

    if torch.cuda.get_device_capability(0) >= (8, 9):  # the hardware's e4m3 conversions against the exact path
        try:
            from benchmarks.gpu.fp8_native import compare

            out["fp8_native"] = compare("cuda")
        except Exception as err:  # noqa: BLE001 (the probe's answer)
            out["fp8_native"] = {"error": f"{type(err).__name__}: {err}"[:300]}

    props = torch.cuda.get_device_properties(0)
    l2 = int(props.L2_cache_size)
    small = torch.randn(max(1, l2 // 4 // 4), device="cuda")  # a quarter of L2: fits
    flush = torch.empty(max(256 << 20, 2 * l2) // 4, dtype=torch.int32, device="cuda")

    def timed(before: Callable[[], Any], reps: int = 50) -> float:
        times = []
        for _ in range(reps):
            before()  # keeps the GPU busy while the timed launch is queued: no launch gap is timed
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            small.sum()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return sorted(times)[len(times) // 2]

    small.sum()
    hot = timed(lambda: (torch.cuda._sleep(200_000), small.sum()))  # the sum just before: small is in L2
    flushed = timed(lambda: (torch.cuda._sleep(200_000), flush.zero_()))
    out["l2_flush"] = {"buffer_bytes": small.numel() * 4, "l2_bytes": l2, "hot_read_ms": hot, "after_flush_ms": flushed,
                       "ratio": flushed / hot if hot else None, "evicts": bool(flushed > 1.3 * hot),
                       "how": ("median of 50 timed sums of a buffer of a quarter of L2, each queued behind a GPU sleep "
                               "and either a sum of the same buffer (hot) or the flush")}
    return out


def correctness(args: argparse.Namespace, budget_s: float) -> dict[str, Any]:
    """Every catalog spec x valid strategy (+ the unfused chain) x dtype against float64."""
    from fuser_core.catalog import catalog_names, load_catalog_spec
    from dataclasses import replace

    from fuser_core.codegen.plan import BASELINE, NotValid, default_config, make_plan, valid_strategies
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from tuner.device.inputs import problem_payload
    from tuner.device.timing import TimingSettings
    from tuner.device.worker import WorkerProcess

    deadline = time.monotonic() + budget_s
    per_spec = []  # each spec's (problem, derivation, strategy or chain, config, refused reason)
    chains = []  # the unfused chains last: they compile one kernel per reduction, serially
    for name in sorted(catalog_names()):
        spec = load_catalog_spec(name)
        derivation = derive_cascade(spec)
        shape = check_shape(spec, args.tiny)
        mine = []
        for dtype in suite_dtypes(name):
            problem = make_problem(spec, shape, dtype)
            for strategy, why_not in valid_strategies(spec, derivation, problem.shape).items():
                config = None if why_not else default_config(spec, derivation, strategy, problem.shape)
                mine.append((problem, derivation, strategy, config, why_not))
                if config is not None and config.split > 1:  # the combine in the part's launch too (atomic tickets)
                    in_launch = replace(config, combine="last_part")
                    try:
                        make_plan(spec, derivation, strategy, problem.shape, in_launch)
                        mine.append((problem, derivation, strategy, in_launch, None))
                    except NotValid:
                        pass
            chains.append((problem, derivation, BASELINE, None, None))
        per_spec.append(mine)
    # the specs take turns (each one's first kernel, then each one's second, ...): a budget that
    # runs out leaves every spec checked in part, not the last ones in alphabetical order unchecked
    plan = [entry for turn in itertools.zip_longest(*per_spec) for entry in turn if entry is not None] + chains
    pre = precompile(plan, args) if args.device == "cuda" else {"skipped": "interpreter: nothing to compile"}
    rows = []
    timing = TimingSettings(seed=args.seed).to_dict()
    with WorkerProcess(args.device) as worker:
        for problem, derivation, strategy, config, why_not in plan:
            row = {"spec": problem.spec.name, "shape": problem.shape, "dtype": dtype_label(problem.dtype),
                   "strategy": strategy + ("/last_part" if config is not None and config.combine == "last_part" else "")}
            if why_not:
                rows.append({**row, "status": "not valid", "reason": why_not})
                continue
            if time.monotonic() > deadline:
                rows.append({**row, "status": "not run", "reason": "time budget"})
                continue
            variant = ({"kind": "chain"} if strategy == BASELINE else
                       {"kind": "fused", "strategy": strategy, "config": config.to_dict()})
            r = worker.call("variant", {"problem": problem_payload(problem, derivation), "variant": variant,
                                        "timing": timing, "time": False}, timeout_s=args.timeout_s)
            if not r.ok:
                rows.append({**row, "status": "failed", "error": (r.error or "")[:1500], "failure": r.kind,
                             "phase": r.phase})
                continue
            check = r.value["check"]
            rows.append({**row, "status": "passed" if check.get("passed") else "wrong",
                         "max_rel_err": check.get("max_rel_err"), "tolerances": check.get("tolerances"),
                         "error": check.get("error"), "rows_checked": check.get("rows_checked")})
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return {"rows": rows, "counts": counts, "precompile": pre}


def accuracy(args: argparse.Namespace, budget_s: float) -> dict[str, Any]:
    """The accuracy bar (fuser_core.accuracy) on this device: every catalog spec and the user cascades
    of issue 23 (benchmarks/accuracy_families.py: KL, entropy with a temperature, a softmax-weighted
    variance, skewness, z-loss) x valid strategy, float32, on the gate families (x + 100, x + 1000,
    peaked rows) and masked rows: each error at most 2x the formula's in float32 (the interpreter's
    verdicts are in benchmarks/results/accuracy_families_*.md; here the GPU's exp, rsqrt and tl.sum)."""
    sys.path.insert(0, str(REPO / "benchmarks"))  # accuracy_families: the user cascades of issue 23
    from accuracy_families import specs as accuracy_specs

    from fuser_core.accuracy import GATE_FAMILIES, accuracy_check
    from fuser_core.codegen.plan import valid_strategies
    from fuser_core.derive import derive_cascade

    deadline = time.monotonic() + budget_s
    rows = []
    for name, spec in accuracy_specs(None).items():
        derivation = derive_cascade(spec)
        shape = check_shape(spec, True)
        valid = [s for s, why in valid_strategies(spec, derivation, shape).items() if why is None]
        for strategy in valid:
            row: dict[str, Any] = {"spec": name, "strategy": strategy}
            if time.monotonic() > deadline:
                rows.append({**row, "status": "not run", "reason": "time budget"})
                continue
            try:
                verdict = accuracy_check(spec, shape, "float32", families=(*GATE_FAMILIES, "masked"), strategy=strategy,
                                         derivation=derivation)
            except Exception as err:  # noqa: BLE001 (recorded per kernel; the others still run)
                rows.append({**row, "status": "failed", "error": f"{type(err).__name__}: {str(err)[:600]}"})
                continue
            worst = max((r["ratio"] for r in verdict["families"]), default=0.0)
            bad = [f"{r['family']}: {r['ratio']:.3g}x ({r['error']:.2e} vs formula {r['formula_error']:.2e})"
                   + (f" specials {r['specials']}" if r.get("specials") else "") + (f" {r['note']}" if r.get("note") else "")
                   for r in verdict["families"] if not r["passed"]]
            rows.append({**row, "status": "passed" if verdict["passed"] else "wrong", "worst_ratio": worst,
                         "error": "; ".join(bad)[:600] or None})
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return {"rows": rows, "counts": counts}


def specials(args: argparse.Namespace, budget_s: float) -> dict[str, Any]:
    """Every catalog spec x valid strategy and the unfused chain, float32, on the edge rows of
    fuser_core.edge_rows (-inf, +inf and NaN rows) on this device: their NaN/inf pattern against
    the float64 reference's, as tests/fuser_core/test_special_values.py checks it in the interpreter. Here
    the GPU's own max.NaN, ex2 and comparisons compute it. Top-k indices are left out (a fused
    top-k may order an all-NaN row differently: docs/SPEC.md)."""
    import numpy as np

    from fuser_core.catalog import catalog_names, load_catalog_spec
    from fuser_core.codegen.plan import BASELINE, valid_strategies
    from fuser_core.derive import derive_cascade
    from fuser_core.edge_rows import edge_inputs, special_mismatches
    from fuser_core.reference import evaluate
    from fuser_core.runner import run

    deadline = time.monotonic() + budget_s
    rows = []
    for name in sorted(catalog_names()):
        spec = load_catalog_spec(name)
        derivation = derive_cascade(spec)
        shape = check_shape(spec, True)
        inputs = edge_inputs(spec, shape, args.seed)
        with np.errstate(all="ignore"):
            reference = evaluate(spec, shape, inputs)
        valid = [s for s, why in valid_strategies(spec, derivation, shape).items() if why is None]
        for strategy in [*valid, BASELINE]:
            row: dict[str, Any] = {"spec": name, "strategy": strategy}
            if time.monotonic() > deadline:
                rows.append({**row, "status": "not run", "reason": "time budget"})
                continue
            try:
                outputs = run(spec, shape, "float32", inputs, strategy=strategy, derivation=derivation).outputs
            except Exception as err:  # noqa: BLE001 (recorded per kernel; the others still run)
                rows.append({**row, "status": "failed", "error": f"{type(err).__name__}: {str(err)[:600]}"})
                continue
            wrong = []
            for part, want in reference.items():
                if part.endswith(".indices"):
                    continue
                got = outputs[part]
                got = (got.float() if got.dtype.is_floating_point else got).cpu().numpy()
                wrong += [f"{part}: {m}" for m in special_mismatches(got, want)]
            rows.append({**row, "status": "wrong" if wrong else "passed", "error": "; ".join(wrong)[:600] or None})
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return {"rows": rows, "counts": counts}


def precompile(plan: list[tuple], args: argparse.Namespace) -> dict[str, Any]:
    """Compile every fused module of the plan in parallel (Triton's compiler, this GPU's arch)
    before the worker launches them one by one: ``triton.compile`` keys its cache as the JIT
    does, so the worker's first launch of each finds its cubin there."""
    import torch

    from fuser_core.codegen.gpu_compile import CompilePool, CompileRequest
    from fuser_core.codegen.plan import BASELINE
    from fuser_core.targets import Target

    major, minor = torch.cuda.get_device_capability()
    requests = [CompileRequest(p.spec, dict(p.shape), dict(p.dtypes), s, c.to_dict(),
                               Target("cuda", major * 10 + minor, 32))
                for p, _d, s, c, why in plan if not why and s != BASELINE]
    t0 = time.monotonic()
    with CompilePool(workers=args.compile_workers) as pool:
        builds = pool.compile(requests)
    failed = [f"{r.spec.name} {dtype_label(r.dtypes)} {r.strategy}: {b.first_error}" for r, b in zip(requests, builds)
              if not b.ok]
    return {"modules": len(requests), "seconds": time.monotonic() - t0, "failed": failed[:20],
            "workers": args.compile_workers}


def client(args: argparse.Namespace, budget_s: float) -> dict[str, Any]:
    """A bundle with the worker's own cubin, loaded in a fresh process with an empty Triton cache."""
    from fuser_core.catalog import load_catalog_spec
    from fuser_core.codegen.plan import default_config
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from service.bundle import bundle_v2, canonical_spec, make_variant
    from service.bundle_maker import make_bundle
    from tuner.device.inputs import problem_payload
    from tuner.device.timing import TimingSettings
    from tuner.device.worker import WorkerProcess

    spec = load_catalog_spec(CLIENT_SPEC)
    user = make_problem(spec, check_shape(spec, args.tiny), suite_dtypes(CLIENT_SPEC)[0])
    canon = canonical_spec(spec)  # what a job measures and stores: the bundle's own module
    problem = make_problem(canon, user.canonical_shape, user.dtype)
    derivation = derive_cascade(canon)
    strategy = "row_resident"
    config = default_config(canon, derivation, strategy, problem.shape).to_dict()
    target = args.target or "h100"
    bundle = make_bundle(problem, target=target, strategy=strategy, config=config,
                         measured={"measurer": "gpu-check", "note": "built by benchmarks/gpu/check.py"})
    out: dict[str, Any] = {"spec": CLIENT_SPEC, "shape": user.shape, "dtype": dtype_label(user.dtype)}
    if args.device == "cuda":
        with WorkerProcess("cuda") as worker:
            r = worker.call("binary", {"problem": problem_payload(problem, derivation),
                                       "variant": {"kind": "fused", "strategy": strategy, "config": config},
                                       "timing": TimingSettings(seed=args.seed).to_dict()}, timeout_s=args.timeout_s)
        if not r.ok:
            return {**out, "error": f"the worker gave no binary: {r.error}"}
        variant = make_variant(r.value)
        bundle = bundle_v2(bundle, {variant["arch"]: variant})
        out.update(arch=variant["arch"], binary_triton=variant["triton_version"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bundle.json"
        path.write_text(json.dumps(bundle))
        env = {**os.environ, "TRITON_CACHE_DIR": str(Path(tmp) / "triton-cache"),
               "FOLDWISE_CACHE_DIR": str(Path(tmp) / "foldwise-cache")}
        if args.device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        proc = subprocess.run([sys.executable, __file__, "--client-load", str(path), "--seed", str(args.seed)],
                              capture_output=True, text=True, env=env, timeout=max(30.0, budget_s))
    if proc.returncode != 0:
        return {**out, "error": f"the client process failed (rc {proc.returncode}): {proc.stderr[-2000:]}"}
    out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def client_load(path: str, seed: int) -> dict[str, Any]:
    """In a fresh process: load the bundle as service.client does, run it once, compare with
    float64, and count what Triton's (empty) cache holds beyond the installed binaries."""
    import numpy as np
    import torch

    from fuser_core.reference import evaluate, random_inputs
    from fuser_core.runner import interpreter_quiet, judge, rounding_noise
    from fuser_core.spec import load_spec
    from fuser_core.tensors import to_torch
    from service.bundle import load_bundle
    from service.client.binary import prepare_binary

    bundle = json.loads(Path(path).read_text())
    t0 = time.perf_counter()
    kernel = load_bundle(bundle)
    info = prepare_binary(bundle, kernel)
    load_ms = (time.perf_counter() - t0) * 1e3
    spec = load_spec(bundle["spec"], printed=True)
    shape = dict(bundle["shape"])
    dtypes = {n: i["dtype"] for n, i in bundle["inputs"].items()}
    inputs = random_inputs(spec, shape, np.random.default_rng(seed), dtypes)
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    tensors = to_torch(inputs, dtypes, dev)
    t0 = time.perf_counter()
    with interpreter_quiet():
        outputs = kernel(tensors)
    if dev == "cuda":
        torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    reference = evaluate(spec, shape, inputs)
    noise = rounding_noise(lambda arrays: evaluate(spec, shape, arrays), inputs, reference, seed)
    stores = {p: o["dtype"] for p, o in bundle["outputs"].items()}
    verdict = judge(spec, outputs, reference, stores, exact=True, noise=noise)
    cache = Path(os.environ.get("TRITON_CACHE_DIR", ""))
    # a compile leaves its intermediate stages in the cache; an installed binary has none
    stages = sorted(p.name for p in cache.rglob("*") if p.suffix in (".ttir", ".ttgir", ".llir", ".source")) \
        if cache.is_dir() else []
    return {"info": info, "load_ms": load_ms, "first_call_ms": first_ms, "device": dev,
            "passed": verdict["passed"], "max_rel_err": verdict["max_rel_err"],
            "triton_cache_files": sum(1 for p in cache.rglob("*") if p.is_file()) if cache.is_dir() else 0,
            "compiled_stages": stages, "no_compile": info.get("loaded") == "cubin" and not stages}


def decoder(args: argparse.Namespace, budget_s: float) -> dict[str, Any]:
    """The end-to-end example on the GPU (issue 24): a real ``foldwise serve`` tunes its kernels with
    the cuda measurer, then the example's own command line runs and writes its JSON."""
    if args.device != "cuda":
        return {"skipped": "no GPU: the example's CPU run is tests/e2e/test_example_decoder.py"}
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + budget_s
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "serve.log"
        with open(log_path, "wb") as log:
            server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--db", f"sqlite:///{tmp}/fw.db",
                                       "--port", str(port), "--workers", "1", "--measurer", "cuda",
                                       "--target", args.target], stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        up_by = min(deadline, time.monotonic() + 90)
        try:
            while True:  # up when /healthz answers
                try:
                    with urllib.request.urlopen(base + "/healthz", timeout=2):
                        break
                except OSError:
                    if server.poll() is not None or time.monotonic() > up_by:
                        return {"error": f"foldwise serve did not start: {log_path.read_text()[-2000:]}"}
                    time.sleep(0.3)
            out_json = Path(tmp) / "decoder.json"
            left = max(10.0, deadline - time.monotonic())
            proc = subprocess.run([sys.executable, str(REPO / "examples" / "tiny_decoder.py"), "--server", base,
                                   "--target", args.target, "--trials", str(DECODER_TRIALS), "--bench",
                                   "--json", str(out_json)], capture_output=True, text=True, timeout=left)
            if not out_json.exists():
                return {"error": f"the example wrote no results (rc {proc.returncode}): {proc.stderr[-3000:]}",
                        "serve_log": log_path.read_text()[-2000:]}
            return {**json.loads(out_json.read_text()), "rc": proc.returncode}
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()


def speed(args: argparse.Namespace, budget_s: float, save_partial: Callable[[dict], None]) -> dict[str, Any]:
    """The paper suite (tiny: the smoke suite) in priority order through ``foldwise bench``'s
    pipeline, with the experts, inside the budget."""
    from tuner.bench.run import run_bench
    from tuner.bench.suites import case_id, load_suite
    from tuner.device.timing import TimingSettings

    suite = speed_suite(args)
    cases = []
    for name in suite.split("+"):  # each suite in priority order; the next suite after it
        cases += sorted(load_suite(name), key=lambda c: PRIORITY.index(c["spec"]) if c["spec"] in PRIORITY else len(PRIORITY))
    left_out = []
    if args.only:
        keep = set(args.only.split(","))
        left_out = [c for c in cases if c["spec"] not in keep]
        cases = [c for c in cases if c["spec"] in keep]
    # shorter than the bench's defaults: many variants share one call's minutes
    timing = TimingSettings(warmup_ms=10.0, rep_ms=40.0, min_reps=5, max_reps=400, seed=args.seed)
    baselines = ("eager", "compile", "handwritten") if args.device == "cuda" else ("eager", "handwritten")
    results = run_bench(suite, None, trials=args.trials, device=args.device, baselines=baselines, target=args.target,
                        timing=timing, seed=args.seed, experts=True, budget_s=budget_s, cases=cases,
                        timeout_s=args.timeout_s, compile_timeout_s=min(120.0, max(10.0, budget_s / 3)),
                        progress=lambda msg: print(f"  speed: {msg}", flush=True), on_case=save_partial)
    # the suite's other cases stay in the results, as not run (the bench's tables list them so)
    results["cases"] += [{"id": case_id(c), "spec": c["spec"], "dtype": c.get("dtype", "float32"),
                          "skipped": "not asked for (--only)"} for c in left_out]
    return results


def speed_suite(args: argparse.Namespace) -> str:
    """The suites the speed stage runs, joined by "+": the paper suite, then issue 22's expert
    shapes that it lacks (tiny: the smoke suite)."""
    return "smoke" if args.tiny else "paper+experts"


# ---------------------------------------------------------------------------- reports


def run_facts(results: Mapping[str, Any]) -> list[str]:
    """Date, device, driver and versions: the head of every Markdown result file."""
    dev = results.get("device_facts", {})
    return [f"- date: {results['started']}; device: {dev.get('name', results['device'])} (capability "
            f"{dev.get('capability')}, {dev.get('sm_count')} SMs, L2 {dev.get('l2_bytes')} B); "
            f"driver {dev.get('driver')}",
            "- versions: " + ", ".join(f"{k} {val}" for k, val in results["versions"].items())]


def correctness_markdown(results: Mapping[str, Any]) -> str:
    stage = results["stages"]["correctness"]
    lines = ["# Correctness: every catalog spec x strategy against float64", "", *run_facts(results), ""]
    if "skipped" in stage:
        return "\n".join([*lines, f"Not run: {stage['skipped']}"]) + "\n"
    lines += [
             "Max relative error as the project's error measure computes it (elementwise, with the rounding-noise "
             "allowance), against the tolerance of the output's dtype.", "",
             "| spec | dtype | shape | strategy | status | max rel err | tolerance | note |", "|---|---|---|---|---|---|---|---|"]
    for r in stage.get("rows", []):
        tol = r.get("tolerances") or {}
        err = r.get("max_rel_err")
        note = r.get("reason") or r.get("error") or ""
        lines.append(f"| {r['spec']} | {r['dtype']} | {','.join(f'{k}={v}' for k, v in r['shape'].items())} | "
                     f"{r['strategy']} | {r['status']} | {'' if err is None else f'{err:.2e}'} | "
                     f"{'' if not tol else f'{max(tol.values()):.0e}'} | {str(note)[:160].replace('|', '/')} |")
    lines += ["", "Counts: " + ", ".join(f"{k} {v}" for k, v in sorted(stage.get("counts", {}).items()))]
    return "\n".join(lines) + "\n"


def decoder_markdown(stage: Mapping[str, Any]) -> list[str]:
    """The example's section: its error against plain torch, tokens/s, the CUDA-graph capture."""
    if not stage or "skipped" in stage:
        return []
    lines = ["## End-to-end example (examples/tiny_decoder.py through a local foldwise serve)", ""]
    if "error" in stage:
        lines.append(f"- stage error: {str(stage['error'])[-800:]}")
    rows = stage.get("compare", [])
    if rows:
        worst = max(r["logits_err"] for r in rows)
        lines.append(f"- float32 against plain torch: worst logits error {worst:.1e} (normwise), tokens "
                     + ("identical" if all(r["tokens_equal"] is not False for r in rows) else "DIFFER"))
    if stage.get("bench_table"):
        lines += ["", stage["bench_table"], ""]
    if stage.get("graph_capture"):
        lines.append(f"- CUDA graph capture of a decode step's Foldwise ops: {stage['graph_capture']}")
    return [*lines, ""]


def summary_markdown(results: Mapping[str, Any]) -> str:
    st = results["stages"]
    dev = results.get("device_facts", {})
    lines = [f"# GPU check: {dev.get('name', results['device'])}", "", *run_facts(results),
             f"- budget {results['budget_s']:g} s; stages took " + ", ".join(
                 f"{k} {s.get('seconds', 0):.0f} s" for k, s in st.items() if "skipped" not in s),
             *(f"- {k}: not run ({s['skipped']})" for k, s in st.items() if "skipped" in s), ""]
    c = st.get("correctness", {})
    if c:
        lines += ["## Correctness", "", "Counts: " + ", ".join(f"{k} {n}" for k, n in sorted(c.get("counts", {}).items())),
                  ""]
        bad = [r for r in c.get("rows", []) if r["status"] in ("wrong", "failed")]
        for r in bad:
            lines.append(f"- {r['spec']} {r['dtype']} {r['strategy']}: {r['status']}: {str(r.get('error'))[:300]}")
        if "error" in c:
            lines.append(f"- stage error: {c['error'][-600:]}")
        lines.append("")
    sv = st.get("specials", {})
    if sv.get("counts") or sv.get("error"):
        lines += ["## Special values (edge rows, float32)", "",
                  "Counts: " + ", ".join(f"{k} {n}" for k, n in sorted(sv.get("counts", {}).items())), ""]
        lines += [f"- {r['spec']} {r['strategy']}: {r['status']}: {str(r.get('error'))[:300]}"
                  for r in sv.get("rows", []) if r["status"] in ("wrong", "failed")]
        if "error" in sv:
            lines.append(f"- stage error: {sv['error'][-600:]}")
        lines.append("")
    ac = st.get("accuracy", {})
    if ac.get("counts") or ac.get("error"):
        lines += ["## Accuracy bar (float32: offsets, peaked, masked; error over the formula's in float32)", "",
                  "Counts: " + ", ".join(f"{k} {n}" for k, n in sorted(ac.get("counts", {}).items())), ""]
        lines += [f"- {r['spec']} {r['strategy']}: {r['status']}: {str(r.get('error'))[:300]}"
                  for r in ac.get("rows", []) if r["status"] in ("wrong", "failed")]
        worst = max((r for r in ac.get("rows", []) if r.get("worst_ratio") is not None), key=lambda r: r["worst_ratio"],
                    default=None)
        if worst:
            lines.append(f"- worst ratio {worst['worst_ratio']:.2f} ({worst['spec']} {worst['strategy']})")
        if "error" in ac:
            lines.append(f"- stage error: {ac['error'][-600:]}")
        lines.append("")
    lines += decoder_markdown(st.get("decoder", {}))
    cl = st.get("client", {})
    if cl:
        lines += ["## Client path", "", "```", json.dumps({k: val for k, val in cl.items() if k != "seconds"}, indent=1,
                                                          default=str)[:2500], "```", ""]
    sp = st.get("speed", {})
    if sp.get("cases"):
        copy = (sp.get("copy_bandwidth") or {}).get("bytes_per_s")
        lines += ["## Speed: Foldwise time / baseline time (below 1: Foldwise is faster)", "",
                  f"Copy bandwidth (read + write): {copy / 1e9:.0f} GB/s" if copy else "Copy bandwidth: not measured", "",
                  "| case | dtype | Foldwise (strategy) ms | baseline | baseline ms | Foldwise / baseline | BW / copy |",
                  "|---|---|---|---|---|---|---|"]
        from tuner.bench.variants import label_of

        for case in sp["cases"]:
            if "skipped" in case:
                lines.append(f"| {case['id']} | {dtype_label(case['dtype'])} | not run: {case['skipped']} | | | | |")
                continue
            fused = case["variants"].get("fused", {})
            strategy = case.get("tuning", {}).get("strategy")
            f_ms = fused.get("time_ms")
            bw = case.get("bandwidth") or {}
            bw_text = f"{100 * bw['fraction_of_copy']:.0f}%" if bw else "-"
            fused_text = f"{f_ms:.4g} ({strategy})" if f_ms else fused.get("status", "-")
            first = True
            for kind, val in case["variants"].items():
                if kind == "fused":
                    continue
                t = val.get("time_ms")
                shown = (f"{t:.4g}" if t is not None else val.get("status", "-") + (
                    f" ({str(val.get('error') or val.get('reason') or '')[:80]})" if val.get("status") != "ok" else ""))
                ratio = f"{f_ms / t:.3g}" if (t and f_ms) else "-"
                head = [case["id"], dtype_label(case["dtype"]), fused_text] if first else ["", "", ""]
                lines.append(f"| {' | '.join(head)} | {label_of(kind)} | {shown} | {ratio} | {bw_text if first else ''} |")
                first = False
            if fused.get("status") not in (None, "ok"):
                lines.append(f"|  |  | fused: {fused.get('status')}: {str(fused.get('error'))[:200]} | | | | |")
        lines.append("")
    elif sp.get("error"):
        lines += ["## Speed", "", f"stage error: {sp['error'][-800:]}", ""]
    pr = st.get("probes", {})
    if pr:
        lines += ["## Probes", "", "```", json.dumps({k: val for k, val in pr.items() if k != "seconds"}, indent=1,
                                                     default=str), "```", ""]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main


def device_facts(device: str) -> dict[str, Any]:
    if device != "cuda":
        return {"name": f"CPU ({platform.machine()}), Triton interpreter"}
    import torch

    p = torch.cuda.get_device_properties(0)
    facts: dict[str, Any] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
                             "l2_bytes": int(p.L2_cache_size), "memory_bytes": int(p.total_memory)}
    try:
        facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        facts["driver"] = None
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for the results (created)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and the smoke suite (the dry run)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock seconds for all stages")
    ap.add_argument("--trials", type=int, default=3, help="tuning trials per speed case")
    ap.add_argument("--only", default=None, help="speed: comma-separated spec names")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--target", default=None, help="the GPU profile when the device name has none")
    ap.add_argument("--timeout-s", type=float, default=90.0, help="one measurement job")
    ap.add_argument("--compile-workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-load", default=None, help=argparse.SUPPRESS)  # the client stage's fresh process
    args = ap.parse_args(argv)
    if args.client_load:
        print(json.dumps(client_load(args.client_load, args.seed), default=str))
        return 0
    if args.out is None:
        ap.error("--out is required")
    stages = args.stages.split(",")
    if any(name not in STAGES for name in stages):
        unknown = next(n for n in stages if n not in STAGES)
        ap.error(f"--stages: unknown stage {unknown!r}; choose from {', '.join(STAGES)}")
    if args.only:
        from tuner.bench.suites import load_suite

        specs = {c["spec"] for name in speed_suite(args).split("+") for c in load_suite(name)}
        unknown = sorted(set(args.only.split(",")) - specs)
        if unknown:
            ap.error(f"--only: the {speed_suite(args)} suite has no case of spec {unknown[0]!r}; "
                     f"it has {', '.join(sorted(specs))}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu check: torch sees no CUDA GPU (torch.cuda.is_available() is false); nothing was measured",
                  file=sys.stderr)
            return 3
        from tuner.profiles import profile_for_device_name

        args.target = args.target or profile_for_device_name(torch.cuda.get_device_name(0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {"format": 1, "started": now(), "device": args.device, "tiny": args.tiny,
                               "budget_s": args.budget_s, "versions": versions(), "device_facts": device_facts(args.device),
                               "argv": sys.argv[1:], "stages": {}}

    def save() -> None:
        (out / "check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        (out / "summary.md").write_text(summary_markdown(results))
        if "correctness" in results["stages"]:
            (out / "correctness.md").write_text(correctness_markdown(results))

    def save_speed(partial: dict) -> None:
        results["stages"]["speed"] = {**partial, "partial": True}
        save()

    for name in STAGES:
        if name not in stages:
            results["stages"][name] = {"skipped": "not asked for (--stages)"}
            continue
        left = args.budget_s - (time.monotonic() - started)
        budget = left if name == "speed" else min(left, SHARES[name] * args.budget_s)
        if budget <= 0:
            results["stages"][name] = {"skipped": "time budget used up"}
            continue
        print(f"== {name} (budget {budget:.0f} s)", flush=True)
        t0 = time.monotonic()
        try:
            if name == "speed":
                stage = speed(args, budget, save_speed)
                from tuner.bench.report import markdown

                (out / "speed.md").write_text(markdown(stage))
            else:
                stage = {"probes": probes, "correctness": correctness, "specials": specials, "accuracy": accuracy,
                         "client": client, "decoder": decoder}[name](args, budget)
        except Exception:  # noqa: BLE001 (one stage's failure is recorded; the others still run)
            stage = {**results["stages"].get(name, {}), "error": traceback.format_exc()[-4000:]}
        stage["seconds"] = time.monotonic() - t0
        results["stages"][name] = stage
        save()
        print(f"   {name}: {time.monotonic() - t0:.0f} s", flush=True)
    results["finished"] = now()
    save()
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
