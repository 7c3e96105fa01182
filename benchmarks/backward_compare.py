"""Foldwise's derived backward against Liger-Kernel's hand-written backward, read from the compiled
code (issue 39; the static half: no GPU).

Per case, at the same shape and dtype, compiled for sm_90 (Triton's compiler and ptxas) and read
with :mod:`fuser_core.codegen.sass` as ``benchmarks/expert_compare.py`` reads forwards: Foldwise's
backward is every kernel of every backward spec (stages included), each spec at the valid
strategy whose default configuration has the lowest static bound (not a tuned pick); cross-entropy's
is the forward that writes the gradient, against Liger's forward, which writes it too. Liger's is
every kernel its ``backward()`` launches (launches intercepted; its row loop runs rows / programs
times). Printed: issued warp instructions per launch, registers, spills, the static bound and its
limiting term, and the bytes moved against the minimum (each input read once, each output written
once, of the backward alone; Liger's are taken as those of Foldwise's main backward spec, which
holds the same tensors but its weight gradient).

Causal attention is compared with the backward of Triton's tutorial 06 (``_attn_bwd_preprocess`` and
``_attn_bwd``, at the tutorial's own benchmark shape: batch 4, 32 heads, head dim 64, fp16), read from
a copy of ``python/tutorials/06-fused-attention.py`` the caller names with ``--tutorial06`` (Triton's
repository; not shipped here): its ``_attention.backward`` runs on meta tensors with its launches
intercepted, so its own launcher picks the tiles (BLOCK_M1 32, BLOCK_N1 128, BLOCK_M2 128, BLOCK_N2
32, 4 warps, 5 stages). Its K pre-scaled by ``sm_scale / ln 2`` is a torch multiply outside the
kernels, not counted. Each of ``_attn_bwd``'s four loops (dK/dV on the diagonal, then below it; dQ on
the diagonal, then left of it) runs its trips averaged over the programs.

    python benchmarks/backward_compare.py [--target h100] [--only rmsnorm,layernorm] [--trials N] [--tutorial06 PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # the compiler, not the interpreter
REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from expert_compare import Case, best_foldwise, summarize, tuned_foldwise  # noqa: E402

CASES = {  # name -> (catalog spec, shape, dtype)
    "rmsnorm": ("rmsnorm", {"t": 4096, "c": 8192}, "float16"),
    "layernorm": ("layernorm", {"t": 4096, "c": 8192}, "float16"),
    "softmax_4k": ("safe_softmax", {"m": 4096, "n": 4096}, "float16"),
    "cross_entropy": ("cross_entropy", {"t": 4096, "v": 128256}, "bfloat16"),
    "attention_causal": ("attention_causal", {"b": 4, "h": 32, "m": 4096, "n": 4096, "d": 64, "e": 64}, "float16"),
}


def elements_of(shape: dict[str, int]) -> int:
    """What "per element" counts: attention's scores (b h m n), else every element of the spec's dims."""
    if {"m", "n", "d"} <= set(shape):
        return shape.get("b", 1) * shape.get("h", 1) * shape["m"] * shape["n"]
    return math.prod(shape.values())


def foldwise_rows(name: str, profile: Any, trials: int = 0) -> tuple[list[tuple[str, dict[str, Any]]], Any]:
    """Foldwise's backward kernels at the dtypes a trainable op asks for (each input's own; a saved
    statistic's and a stage's float32), each spec's best default or with ``trials`` the tuner's pick
    on the static model, and the spec among them that moves the most (the expert's yardstick)."""
    from fuser_core import derive_backward, gradient_in_forward, load_spec
    from fuser_core.catalog import load_catalog_spec
    from service.client.autograd import fetch_trainable

    catalog, shape, dtype = CASES[name]
    spec = load_catalog_spec(catalog)
    fused = gradient_in_forward(spec, derive_backward(spec)) is not None
    requests: list[tuple[dict[str, Any], dict[str, int], Any]] = []

    def asked(batch):  # the trainable op's requests, each (spec JSON, shape, dtypes), and nothing fetched
        requests.extend(batch)
        raise StopIteration

    try:
        fetch_trainable(asked, spec, shape, dtype)
    except StopIteration:
        pass
    out, specs = [], []
    for raw, sub, dtypes in requests[:1] if fused else requests[1:]:
        s = load_spec(raw, printed=True)
        specs.append(s)
        case = Case(s.name, s, dict(sub), dtypes, None, lambda _s, e=elements_of(dict(sub)): e)
        strategy, config, row = tuned_foldwise(case, profile, trials) if trials else best_foldwise(case, profile, None)
        out.append((f"{s.name}: {'tuned ' if trials else ''}{strategy} {config.to_dict()['blocks']} w{config.num_warps}", row))
    return out, max(specs, key=lambda s: len(s.inputs) + len(s.outputs))  # the first of the largest


def liger_rows(name: str, profile: Any, moves_like: Any) -> list[tuple[str, dict[str, Any]]]:
    """Liger's backward kernels; ``moves_like``: the Foldwise spec whose tensors they read and write
    (the static bound's minimum bytes: a norm's d_x spec holds x, w, dy, the statistic and dx)."""
    import torch
    from liger_kernel.transformers import functional as liger

    from fuser_core.codegen.gpu_compile import compile_launch
    from fuser_core.codegen.launches import intercepted_launches

    _, shape, dtype = CASES[name]
    dt = getattr(torch, dtype)
    rows, cols = next(iter(shape.values())), list(shape.values())[1]
    x = torch.empty(rows, cols, dtype=dt, requires_grad=True)
    weight = lambda: torch.empty(cols, dtype=dt, requires_grad=True)  # noqa: E731
    with intercepted_launches() as forward:
        if name == "rmsnorm":
            y = liger.liger_rms_norm(x, weight(), 1e-6, in_place=False)
        elif name == "layernorm":
            y = liger.liger_layer_norm(x, weight(), weight(), 1e-5)
        elif name == "softmax_4k":
            y = liger.liger_softmax(x)
        else:
            y = liger.liger_cross_entropy(x, torch.zeros(rows, dtype=torch.long), reduction="none")
    launches = forward
    if name != "cross_entropy":  # Liger's cross-entropy writes the gradient in its forward
        with intercepted_launches() as backward:
            y.backward(torch.empty_like(y))
        launches = backward
    out = []
    for launch in launches:
        build = compile_launch(launch)
        grid = launch.grid if isinstance(launch.grid, tuple) else (rows,)
        programs = math.prod(grid)
        block = next((v for k, v in launch.kwargs.items() if k.startswith("BLOCK")), cols)
        loops = (build.sass or {}).get("loops") or []
        per_row = -(-cols // block)
        trips = [(-(-rows // programs) if programs < rows else per_row) if lp["load_bits"] else 0 for lp in loops] or [1]
        case = Case(name, moves_like, shape, dtype, None, lambda s: rows * cols)
        out.append((f"Liger {launch.fn.__name__}", summarize(
            [{"build": build, "programs": programs, "num_warps": launch.kwargs.get("num_warps", 4), "trips": trips}],
            case, profile)))
    return out


def tutorial06_rows(path: Path, profile: Any, moves_like: Any) -> list[tuple[str, dict[str, Any]]]:
    """Tutorial 06's backward kernels at the case's shape: its ``_attention.backward`` on meta tensors,
    launches intercepted and compiled (module docstring)."""
    import importlib.util
    from types import SimpleNamespace
    from unittest import mock

    import torch

    from fuser_core.codegen.gpu_compile import compile_launch
    from fuser_core.codegen.launches import TargetOnlyDriver, intercepted_launches, target_driver

    _, shape, dtype = CASES["attention_causal"]
    b, h, n, d = shape["b"], shape["h"], shape["m"], shape["d"]
    # the tutorial asks the driver for its device and torch for the capability at import
    TargetOnlyDriver.get_active_torch_device = lambda self: torch.device("meta")
    with target_driver(90), mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        module_spec = importlib.util.spec_from_file_location("tutorial06", path)
        tutorial = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(tutorial)
        q, k, v, o, do = (torch.empty(b, h, n, d, dtype=getattr(torch, dtype), device="meta") for _ in range(5))
        lse = torch.empty(b, h, n, dtype=torch.float32, device="meta")
        ctx = SimpleNamespace(saved_tensors=(q, k, v, o, lse), sm_scale=d ** -0.5, HEAD_DIM=d, causal=True)
        with intercepted_launches() as launches:
            tutorial._attention.backward(ctx, do)
    out = []
    case = Case("attention_causal", moves_like, {x: shape[x] for x in moves_like.dims}, dtype, None,
                lambda _s: elements_of(shape))
    for launch in launches:
        build = compile_launch(launch)
        kw = launch.kwargs
        programs = math.prod(launch.grid)
        trips = [1]
        if "BLOCK_N1" in kw:  # _attn_bwd: the diagonal's steps, then the rest averaged over the programs
            slice_m, slice_n = kw["BLOCK_M1"] // kw["BLK_SLICE_FACTOR"], kw["BLOCK_N2"] // kw["BLK_SLICE_FACTOR"]
            starts = range(0, n, kw["BLOCK_N1"])
            below = sum((n - s - kw["BLOCK_N1"]) // kw["BLOCK_M1"] for s in starts) / len(starts)
            left = sum(s // kw["BLOCK_N2"] for s in range(0, n, kw["BLOCK_M2"])) / len(starts)
            trips = [kw["BLOCK_N1"] // slice_m, below, kw["BLOCK_M2"] // slice_n, left]
            loops = [lp for lp in (build.sass or {}).get("loops") or [] if lp["load_bits"]]
            if build.ok and len(loops) != len(trips):
                raise RuntimeError(f"tutorial 06's _attn_bwd: {len(loops)} loops with loads in its SASS, not 4")
        out.append((f"tutorial 06 {launch.fn.__name__}", summarize(
            [{"build": build, "programs": programs, "num_warps": kw.get("num_warps", 4), "trips": trips}], case, profile)))
    return out


def total(rows: list[tuple[str, dict[str, Any]]]) -> dict[str, float]:
    return {"issued": sum(r["warp_instructions"] for _, r in rows), "time": sum(r["time_s"] for _, r in rows)}


def main(argv: list[str] | None = None) -> int:
    from tuner.profiles import get_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--only", default=None, help="comma-separated: " + ",".join(CASES))
    ap.add_argument("--trials", type=int, default=0,
                    help="tune each backward spec (model measurer, this many trials) instead of its best default")
    ap.add_argument("--tutorial06", type=Path, default=None,
                    help="a copy of Triton's python/tutorials/06-fused-attention.py (attention's expert)")
    args = ap.parse_args(argv)
    profile = get_profile(args.target)
    print(f"# Foldwise's derived backward against Liger's and tutorial 06's, static (sm_90, {profile.name}'s rates; "
          "not measured on GPU)\n")
    print("| case | kernel | regs | spill B | issued M | input reads/elt | bound | static bound us |")
    print("|---|---|---|---|---|---|---|---|")
    for name in [c for c in CASES if not args.only or c in args.only.split(",")]:
        fw, main_spec = foldwise_rows(name, profile, args.trials)
        if name == "attention_causal":
            lg = tutorial06_rows(args.tutorial06, profile, main_spec) if args.tutorial06 else []
        else:
            lg = liger_rows(name, profile, main_spec)
        for label, r in fw + lg:
            if "error" in r:
                print(f"| {name} | {label} | error: {r['error'][:80]} |||||")
                continue
            print(f"| {name} | {label} | {'/'.join(str(x) for x in r['registers'])} | {r['spill_bytes']} | "
                  f"{r['warp_instructions'] / 1e6:.1f} | {r['reads']:.2f} | {r['bound']} | {1e6 * r['time_s']:.0f} |")
        if not lg:
            print(f"| {name} | tutorial 06 not given (--tutorial06): no ratio |||||||")
            continue
        f, g = total(fw), total(lg)
        expert = "tutorial 06" if name == "attention_causal" else "Liger"
        print(f"| {name} | **Foldwise / {expert}** | | | {f['issued'] / g['issued']:.2f}x | | | {f['time'] / g['time']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
