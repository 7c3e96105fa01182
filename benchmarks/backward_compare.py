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

    python benchmarks/backward_compare.py [--target h100] [--only rmsnorm,layernorm]
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

from expert_compare import Case, best_foldwise, summarize  # noqa: E402

CASES = {  # name -> (catalog spec, shape, dtype)
    "rmsnorm": ("rmsnorm", {"t": 4096, "c": 8192}, "float16"),
    "layernorm": ("layernorm", {"t": 4096, "c": 8192}, "float16"),
    "softmax_4k": ("safe_softmax", {"m": 4096, "n": 4096}, "float16"),
    "cross_entropy": ("cross_entropy", {"t": 4096, "v": 128256}, "bfloat16"),
}


def foldwise_rows(name: str, profile: Any) -> tuple[list[tuple[str, dict[str, Any]]], Any]:
    """Foldwise's backward kernels, and the spec among them that moves the most (Liger's yardstick)."""
    from fuser_core import derive_backward, gradient_in_forward
    from fuser_core.catalog import load_catalog_spec

    catalog, shape, dtype = CASES[name]
    spec = load_catalog_spec(catalog)
    cascade = derive_backward(spec)
    fused = gradient_in_forward(spec, cascade)
    specs = [fused] if fused is not None else list(cascade.specs)
    out = []
    for s in specs:
        sub = {d: n for d, n in shape.items() if d in s.dims}
        elements = math.prod(sub.values())
        case = Case(s.name, s, sub, dtype, None, lambda _s, e=elements: e)
        strategy, config, row = best_foldwise(case, profile, None)
        out.append((f"{s.name}: {strategy} {config.to_dict()['blocks']} w{config.num_warps}", row))
    return out, specs[0]


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


def total(rows: list[tuple[str, dict[str, Any]]]) -> dict[str, float]:
    return {"issued": sum(r["warp_instructions"] for _, r in rows), "time": sum(r["time_s"] for _, r in rows)}


def main(argv: list[str] | None = None) -> int:
    from tuner.profiles import get_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--only", default=None, help="comma-separated: " + ",".join(CASES))
    args = ap.parse_args(argv)
    profile = get_profile(args.target)
    print(f"# Foldwise's derived backward against Liger's, static (sm_90, {profile.name}'s rates; not measured on GPU)\n")
    print("| case | kernel | regs | spill B | issued M | input reads/elt | bound | static bound us |")
    print("|---|---|---|---|---|---|---|---|")
    for name in [c for c in CASES if not args.only or c in args.only.split(",")]:
        fw, main_spec = foldwise_rows(name, profile)
        lg = liger_rows(name, profile, main_spec)
        for label, r in fw + lg:
            if "error" in r:
                print(f"| {name} | {label} | error: {r['error'][:80]} |||||")
                continue
            print(f"| {name} | {label} | {'/'.join(str(x) for x in r['registers'])} | {r['spill_bytes']} | "
                  f"{r['warp_instructions'] / 1e6:.1f} | {r['reads']:.2f} | {r['bound']} | {1e6 * r['time_s']:.0f} |")
        f, g = total(fw), total(lg)
        print(f"| {name} | **Foldwise / Liger** | | | {f['issued'] / g['issued']:.2f}x | | | {f['time'] / g['time']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
