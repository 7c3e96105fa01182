"""Foldwise's kernels against the experts', read from the compiled code (issue 22, 6).

With no GPU: compile Foldwise's kernel and the expert's at the same shape for sm_90 (Triton's
compiler and ptxas, in the triton wheel), read both cubins' SASS (fuser_core.codegen.sass) and
print, per case: registers, spills, thread-instructions and exps per element, the widest global
load, how many times the inputs are read, the tensor-core kind and the static bound
(tuner.static_bound: the largest of bytes / bandwidth, instruction issue, SFU and tensor work
at the target's rates).

- Experts that are a package: Liger-Kernel's softmax, RMSNorm, LayerNorm and cross-entropy
  (imported, never copied; a dev dependency), launched on tensors with their launches
  intercepted, as gpu_compile does for Foldwise's own.
- Attention, whose experts are not a package here: the issued tensor work over the minimum
  (4 b h m n d FLOPs, halved when causal) and exps per score.
- Decode (one query, 8192 keys): against the split-KV decoder; K and V read once.

Foldwise's kernel is, per case, the one the tuner serves: ``foldwise tune --measurer model
--trials 40`` on the target's profile (the model measurer with the compile gate), compiled here;
``--pick default`` takes instead the best by static bound among every valid strategy's default
configuration (``--strategy`` to fix one). Decode's expert is the project's split-KV decoder
(tuner/_decode_kernels.py). Per kernel: issued warp instructions per launch (the issue tables'
unit), per element counts, input reads. Run:

    python benchmarks/expert_compare.py [--target h100] [--only softmax_4k,attention] [--trials 40] [--json OUT.json]

On a GPU, the GPU check (benchmarks/gpu/check.py) times Foldwise against the same experts side
by side; this script is the static half.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # the compiler, not the interpreter
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Case:
    name: str
    spec: Any  # a catalog name, or a Spec (a derived backward spec: benchmarks/backward_compare.py)
    shape: dict[str, int]
    dtype: str | dict[str, str]  # one dtype for every float input, or one per input
    expert: str | None  # a Liger function name, or None (attention, the fp8 GEMM: judged against their minimum work)
    elements: Callable[[Mapping[str, int]], int]  # what "per element" counts
    # the multiply-adds the product needs (no expert: tensor work is judged against it)
    minimum_macs: Callable[[Mapping[str, int]], float] | None = None


def case_spec(case: Case) -> Any:
    """The case's spec: a catalog name's, or the Spec it holds."""
    from fuser_core.catalog import load_catalog_spec

    return load_catalog_spec(case.spec) if isinstance(case.spec, str) else case.spec


def rows_cols(a: str, b: str) -> Callable[[Mapping[str, int]], int]:
    return lambda s: s[a] * s[b]


def scores(s: Mapping[str, int]) -> int:
    return s["b"] * s["h"] * s["m"] * s["n"]


def attention_macs(s: Mapping[str, int]) -> float:
    return 2.0 * s["b"] * s["h"] * s["m"] * s["n"] * s["d"]  # q.k and p.v (d = e)


ATT = {"b": 4, "h": 32, "m": 4096, "n": 4096, "d": 128, "e": 128}
CASES = [
    Case("softmax_4k", "safe_softmax", {"m": 4096, "n": 4096}, "float16", "liger_softmax", rows_cols("m", "n")),
    Case("softmax_32k", "safe_softmax", {"m": 4096, "n": 32768}, "float16", "liger_softmax", rows_cols("m", "n")),
    Case("layernorm", "layernorm", {"t": 4096, "c": 8192}, "float16", "liger_layer_norm", rows_cols("t", "c")),
    Case("rmsnorm", "rmsnorm", {"t": 4096, "c": 8192}, "float16", "liger_rms_norm", rows_cols("t", "c")),
    Case("cross_entropy", "cross_entropy", {"t": 4096, "v": 128256}, "bfloat16", "liger_cross_entropy",
         rows_cols("t", "v")),
    Case("attention", "attention", ATT, "float16", None, scores, minimum_macs=attention_macs),
    Case("attention_causal", "attention_causal", ATT, "bfloat16", None, scores,
         minimum_macs=lambda s: attention_macs(s) / 2),  # causal: half the scores,
    # per-token fp8 quantisation of a (fp16) fused into the GEMM with fp8 weights: the tensor-core
    # kind is the point (QGMMA ... E4M3 on sm_90, issue 35 item 3); per element of the output
    Case("fp8_gemm", "fp8_quant_gemm", {"m": 4096, "n": 4096, "k": 4096},
         {"a": "float16", "w": "float8_e4m3fn", "w_scale": "float32"}, None, rows_cols("m", "n"),
         minimum_macs=lambda s: float(s["m"] * s["n"] * s["k"])),
    # per element of K and V (each score reads d of K and e of V)
    Case("decode", "attention", {"b": 32, "h": 32, "m": 1, "n": 8192, "d": 128, "e": 128}, "float16", None,
         lambda s: s["b"] * s["h"] * s["n"] * (s["d"] + s["e"])),
]


# ---------------------------------------------------------------------------- Foldwise


def foldwise_kernels(case: Case, strategy: str, config: Any) -> list[dict[str, Any]]:
    """Compile one strategy's module; per kernel its build, programs, warps and loop trips."""
    from fuser_core.codegen.gpu_compile import CompileRequest, compile_request
    from fuser_core.codegen.plan import make_plan
    from fuser_core.codegen.structure import build_structure
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from tuner.static_bound import descriptor_bytes, innermost_trips

    spec = case_spec(case)
    derivation = derive_cascade(spec)
    problem = make_problem(spec, case.shape, case.dtype)
    plan = make_plan(spec, derivation, strategy, problem.shape, config)
    structure = build_structure(plan, problem.dtypes, problem.output_dtypes)
    built = compile_request(CompileRequest(spec, problem.shape, problem.dtypes, strategy, config.to_dict(), sass=True))
    out = []
    for kernel, build in zip(structure.kernels, built.kernels):
        programs = math.prod(-(-problem.shape[d] // b) for d, b in kernel.grid.lanes) * (
            plan.config.split if kernel.grid.split else 1)
        trips = innermost_trips(plan, kernel, problem.shape)
        out.append({"build": build, "programs": programs, "num_warps": config.num_warps, "trips": trips,
                    "tma_bytes": descriptor_bytes(plan, kernel, problem.shape)})
    return out


# ---------------------------------------------------------------------------- Liger


def liger_kernels(case: Case) -> list[dict[str, Any]]:
    """The Liger kernels one call launches at the case's shape, compiled (launches intercepted)."""
    import torch
    from liger_kernel.transformers import functional as liger

    from fuser_core.codegen.gpu_compile import compile_launch
    from fuser_core.codegen.launches import intercepted_launches

    dt = getattr(torch, case.dtype)
    s = case.shape
    # CPU tensors: nothing runs (the launch is intercepted), but Liger reads values on the host
    # for cross-entropy (the count of non-ignored targets), which meta tensors cannot give
    if case.expert == "liger_softmax":
        args, rows, cols = (torch.empty(s["m"], s["n"], dtype=dt),), s["m"], s["n"]
    elif case.expert == "liger_rms_norm":
        args, rows, cols = (torch.empty(s["t"], s["c"], dtype=dt), torch.empty(s["c"], dtype=dt), 1e-6), s["t"], s["c"]
    elif case.expert == "liger_layer_norm":
        args = (torch.empty(s["t"], s["c"], dtype=dt), torch.empty(s["c"], dtype=dt), torch.empty(s["c"], dtype=dt), 1e-5)
        rows, cols = s["t"], s["c"]
    else:
        args, rows, cols = (torch.empty(s["t"], s["v"], dtype=dt), torch.zeros(s["t"], dtype=torch.long)), s["t"], s["v"]
    fn = getattr(liger, case.expert)
    kwargs = {"reduction": "none"} if case.expert == "liger_cross_entropy" else (
        {"in_place": False} if case.expert == "liger_rms_norm" else {})
    with intercepted_launches() as launches:
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 (a launcher's host code after the intercepted launch may fail on no result)
            pass
    out = []
    for launch in launches:
        build = compile_launch(launch)  # sm_90, with its SASS facts
        block = next((v for k, v in launch.kwargs.items() if k.startswith("BLOCK")), cols)
        loops = (build.sass or {}).get("loops") or []
        # a loop that loads nothing only stores: Liger's cross-entropy zeroes an ignored row's
        # gradient there (a runtime branch, not taken for real targets): it runs 0 times
        trips = [0 if not lp["load_bits"] and lp["store_bits"] else -(-cols // block) for lp in loops] or [1]
        out.append({"build": build, "programs": rows, "num_warps": launch.kwargs.get("num_warps", 4),
                    "trips": trips, "name": launch.fn.__name__})
    return out


def decoder_kernels(case: Case, profile: Any) -> list[dict[str, Any]]:
    """The split-KV decoder's two kernels (tuner.experts.split_kv_decode) at the case's shape,
    with the chunks it picks on ``profile``'s SMs, compiled (launches intercepted)."""
    import torch

    from fuser_core.codegen.gpu_compile import compile_launch
    from fuser_core.codegen.launches import intercepted_launches
    from tuner.experts import decoder_parts, split_kv_decode, triton_cdiv

    s, dt, block_n = case.shape, getattr(torch, case.dtype), 64
    q = torch.empty(s["b"], s["h"], 1, s["d"], dtype=dt)
    k = torch.empty(s["b"], s["h"], s["n"], s["d"], dtype=dt)
    v = torch.empty(s["b"], s["h"], s["n"], s["e"], dtype=dt)
    rows = s["b"] * s["h"]
    chunks = decoder_parts(s["n"], rows, profile.sm_count, block_n)  # as on the GPU
    with intercepted_launches() as launches:
        split_kv_decode(q, k, v, block_n=block_n, chunks=chunks)
    chunk = triton_cdiv(triton_cdiv(s["n"], chunks), block_n) * block_n
    out = []
    for launch in launches:
        build = compile_launch(launch)
        grid = launch.grid if isinstance(launch.grid, tuple) else (1,)
        loops = (build.sass or {}).get("loops") or []
        trips = [chunk // block_n for _ in loops] or [1]
        out.append({"build": build, "programs": math.prod(grid), "num_warps": launch.kwargs.get("num_warps", 4),
                    "trips": trips, "name": launch.fn.__name__})
    return out


# ---------------------------------------------------------------------------- facts


def summarize(kernels: list[dict[str, Any]], case: Case, profile: Any) -> dict[str, Any]:
    """One row: the kernels' facts and static bounds, summed over kernels."""
    from tuner.static_bound import load_width, static_bound

    elements = case.elements(case.shape)
    input_bytes = _input_bytes(case)
    row: dict[str, Any] = {"registers": [], "spill_bytes": 0, "time_s": 0.0, "instructions": 0.0, "exp": 0.0, "sfu": 0.0,
                           "warp_instructions": 0.0,
                           "reads": 0.0, "tensor": set(), "load_bits": None, "terms": {}, "tensor_macs": 0.0}
    for k in kernels:
        b = k["build"]
        if not b.ok or not b.sass:
            row["error"] = b.error or "no SASS"
            return row
        sb = static_bound(b.sass, programs=k["programs"], num_warps=k["num_warps"], trips=k["trips"], profile=profile,
                          elements=elements, input_bytes=input_bytes, unique_bytes=_min_bytes(case),
                          tma_bytes=k.get("tma_bytes", 0.0))
        row["registers"].append(b.registers)
        row["spill_bytes"] = max(row["spill_bytes"], b.spill_bytes or 0)
        row["time_s"] += sb["time_s"]
        row["instructions"] += sb["per_element"]["instructions"]
        row["warp_instructions"] += sb["warp_instructions"]  # issued per launch: every loop body x its trips
        row["exp"] += sb["per_element"]["exp"]
        row["sfu"] += sb["per_element"]["sfu"]
        row["reads"] += sb["per_element"].get("input_reads", 0.0)
        row["tensor_macs"] += sb["per_element"]["tensor_macs"] * elements
        row["tensor"] |= set((b.sass["total"].get("tensor") or {}).keys())
        width = load_width(b.sass)
        row["load_bits"] = max(row["load_bits"] or 0, width or 0) or None
        for t, v in sb["terms_s"].items():
            row["terms"][t] = row["terms"].get(t, 0.0) + v
    row["bound"] = max(row["terms"], key=row["terms"].get) if row["terms"] else None
    row["tensor"] = ",".join(sorted(row["tensor"])) or "none"
    return row


def _min_bytes(case: Case) -> int:
    """Every input read once, every output written once (tuner.static_bound.min_bytes)."""
    from fuser_core.problem import make_problem
    from tuner.static_bound import min_bytes

    spec = case_spec(case)
    p = make_problem(spec, case.shape, case.dtype)
    return min_bytes(spec, p.shape, p.dtypes)


def _input_bytes(case: Case) -> int:
    from fuser_core.problem import make_problem

    spec = case_spec(case)
    p = make_problem(spec, case.shape, case.dtype)
    size = {"float16": 2, "bfloat16": 2, "float32": 4, "int64": 8, "int32": 4, "float8_e4m3fn": 1}
    return sum(math.prod(p.shape[d] for d in i.dims) * size[p.dtypes.get(i.name, "int64")] for i in spec.inputs)


def best_foldwise(case: Case, profile: Any, strategy: str | None) -> tuple[str, Any, dict[str, Any]]:
    """(strategy, config, row) of the valid strategy whose default configuration has the lowest static bound."""
    from fuser_core.codegen.plan import default_config, valid_strategies
    from fuser_core.derive import derive_cascade
    from fuser_core.reference import bind_shape

    spec = case_spec(case)
    derivation = derive_cascade(spec)
    shape = bind_shape(spec, case.shape)
    best = None
    for s, why in valid_strategies(spec, derivation, shape).items():
        if why is not None or (strategy and s != strategy):
            continue
        config = default_config(spec, derivation, s, shape)
        row = summarize(foldwise_kernels(case, s, config), case, profile)
        if "error" in row:
            continue
        if best is None or row["time_s"] < best[2]["time_s"]:
            best = (s, config, row)
    if best is None:
        raise RuntimeError(f"{case.name}: no strategy compiled")
    return best


def tuned_foldwise(case: Case, profile: Any, trials: int, seed: int = 0) -> tuple[str, Any, dict[str, Any]]:
    """(strategy, config, row) of the kernel ``foldwise tune --measurer model --trials N`` serves:
    the tuner with the model measurer and the compile gate on ``profile``, its pick compiled here."""
    from fuser_core.codegen.plan import KernelConfig
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from tuner.compile_gate import CompileGate
    from tuner.measure import ModelMeasurer
    from tuner.search.tuner import Tuner
    from tuner.space import SearchSpace

    spec = case_spec(case)
    derivation = derive_cascade(spec)
    problem = make_problem(spec, case.shape, case.dtype)
    space = SearchSpace(problem, derivation, profile)
    gate = CompileGate.for_space(space)
    # verify=False: the interpreter check needs TRITON_INTERPRET=1 at import, this script compiles
    # Liger's kernels with it off; the same strategies pass that check in the tests
    measurer = ModelMeasurer(problem, derivation, profile, gate=gate, verify=False)
    result = Tuner(space, measurer, seed=seed, gate=gate).run(trials)
    config = KernelConfig.from_dict(result.config)
    return result.strategy, config, summarize(foldwise_kernels(case, result.strategy, config), case, profile)


def main(argv: list[str] | None = None) -> int:
    from tuner.profiles import get_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--only", default=None, help="comma-separated case names: " + ",".join(c.name for c in CASES))
    ap.add_argument("--strategy", default=None, help="with --pick default: fix Foldwise's strategy")
    ap.add_argument("--pick", choices=("tuned", "default"), default="tuned",
                    help="Foldwise's kernel: the tuner's pick (model measurer, compile gate), or the best "
                         "strategy default by static bound")
    ap.add_argument("--trials", type=int, default=40, help="tuning trials per case (--pick tuned)")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    profile = get_profile(args.target)
    cases = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    rows = []
    what = (f"the tuner's pick ({args.trials} trials, model measurer, compile gate)" if args.pick == "tuned"
            else "the best strategy default by static bound")
    print(f"# Foldwise against the experts, static (compiled for sm_90, rates of {profile.name}; not measured on GPU)\n")
    print(f"Foldwise's kernel: {what}; the interpreter's correctness check is off here (the tests run it). Issued: warp instructions per launch (every loop body x its trips), "
          "all kernels of the call.\n")
    print("| case | kernel | regs | spill B | issued M | instr/elt | exp/elt | sfu/elt | load bits | input reads "
          "| tensor cores | bound | static bound us | Foldwise / expert |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        if args.pick == "tuned":
            strategy, config, fw = tuned_foldwise(case, profile, args.trials)
        else:
            strategy, config, fw = best_foldwise(case, profile, args.strategy)
        entries = [(f"Foldwise {strategy} {json.dumps(config.to_dict()['blocks'])} w{config.num_warps} "
                    f"s{config.num_stages}" + (f" split {config.split}" if config.split > 1 else ""), fw)]
        expert = None
        if case.expert:
            expert = summarize(liger_kernels(case), case, profile)
            entries.append((f"Liger {case.expert.removeprefix('liger_')}", expert))
        elif case.name == "decode":
            expert = summarize(decoder_kernels(case, profile), case, profile)
            entries.append(("split-KV decoder (tuner/_decode_kernels.py)", expert))
        for label, r in entries:
            if "error" in r:
                print(f"| {case.name} | {label} | error: {r['error'][:80]} ||||||||||")
                continue
            ratio = ""
            if r is fw and expert and "error" not in expert:
                ratio = (f"issued {fw['warp_instructions'] / expert['warp_instructions']:.2f}x, "
                         f"bound {fw['time_s'] / expert['time_s']:.2f}x")
            elif r is fw and case.minimum_macs is not None:
                ratio = f"tensor work {fw['tensor_macs'] / case.minimum_macs(case.shape):.2f}x the minimum"
            print(f"| {case.name} | {label} | {'/'.join(str(x) for x in r['registers'])} | {r['spill_bytes']} | "
                  f"{r['warp_instructions'] / 1e6:.1f} | "
                  f"{r['instructions']:.1f} | {r['exp']:.2f} | {r['sfu']:.2f} | {r['load_bits']} | {r['reads']:.2f} | {r['tensor']} | "
                  f"{r['bound']} | {1e6 * r['time_s']:.0f} | {ratio} |")
        rows.append({"case": case.name, "strategy": strategy, "config": config.to_dict(), "foldwise": fw,
                     "expert": expert})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
