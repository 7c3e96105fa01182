"""Every catalog spec through Triton's GPU compiler, on a machine without a GPU: each valid
strategy and the unfused chain, default configs, at a small ragged size and at every "paper"
suite size (the suite's dtype; float16 at the small size), for the fleet's targets (GPU profiles
or arch names; default every profile: NVIDIA cubins and AMD hsaco).

    python benchmarks/compile_catalog.py [--sizes small|paper|all] [--small-dtypes float16,float32]
                                         [--dtype-turns N] [--targets all|h100,a100,gfx942]
                                         [--target-turns N]
                                         [--out benchmarks/results/compile_catalog_fleet.md]

Prints a Markdown table: registers (per thread; VGPRs per lane on AMD), spilled bytes per
thread (scratch per lane) and shared memory (LDS) per program of every kernel, and the
strategies refused at each size. Exit 1 when a kernel fails. The facts are the installed
Triton's (named in the table): CI runs ``--sizes small`` with the targets and dtypes taking
turns under Triton 3.6 (``.ci/triton36``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # this checkout's packages (and tests/support), whatever is installed


def main(argv: list[str] | None = None) -> int:
    import triton
    from tests.support.catalog_shapes import distinct_targets, small_shape, targets_in_turn

    from fuser_core.catalog import catalog_names, load_catalog_spec, load_suites
    from fuser_core.codegen.gpu_compile import CompilePool, CompileRequest
    from fuser_core.codegen.plan import BASELINE, STRATEGIES, valid_strategies
    from fuser_core.derive import derive_cascade
    from fuser_core.reference import bind_shape
    from fuser_core.runner import bind_dtypes
    from tuner.profiles import FLEET

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("--targets", default="all",
                        help="comma-separated GPU profiles or arch names (sm_90, gfx942), or all (default: "
                             f"{','.join(FLEET)}); profiles of one arch compile once")
    parser.add_argument("--target-turns", type=int, metavar="START",
                        help="each (spec, size, strategy) compiles for the first target and one other target of "
                             "each vendor, taking turns from the START-th, instead of for every target (CI's time)")
    parser.add_argument("--sizes", choices=("small", "paper", "all"), default="all",
                        help="the small ragged size, the paper suite's sizes, or both (default)")
    parser.add_argument("--small-dtypes", default="float16",
                        help="comma-separated dtypes of every float input at the small size (default float16)")
    parser.add_argument("--dtype-turns", type=int, metavar="START",
                        help="the --small-dtypes take turns over strategies and targets, starting from the "
                             "START-th, instead of each compiling them all (CI's Triton 3.6 job: its time)")
    args = parser.parse_args(argv)
    small_dtypes = args.small_dtypes.split(",")
    targets = distinct_targets(FLEET if args.targets == "all" else args.targets.split(","))

    paper = load_suites()["paper"]
    cases, refused = [], []
    for k, name in enumerate(catalog_names()):
        spec = load_catalog_spec(name)
        derivation = derive_cascade(spec)
        small = bind_shape(spec, small_shape(spec))
        turns = args.dtype_turns is not None
        sizes = ([(small, None if turns else d, "small") for d in (small_dtypes[:1] if turns else small_dtypes)]
                 if args.sizes != "paper" else [])
        if args.sizes != "small":
            sizes += [(bind_shape(spec, c["shape"]), c["dtype"], "paper") for c in paper if c["spec"] == name]
        for shape, dtype, label in sizes:
            valid = valid_strategies(spec, derivation, shape)
            refused += [(name, label, s, why) for s, why in valid.items() if why]
            for j, strategy in enumerate([s for s in STRATEGIES if not valid.get(s)] + [BASELINE]):
                turn = None if args.target_turns is None else args.target_turns + k + j
                for target_name, target in (targets if turn is None else targets_in_turn(targets, turn)):
                    this = dtype if dtype is not None else small_dtypes[(args.dtype_turns + len(cases)) % len(small_dtypes)]
                    request = CompileRequest(spec, shape, bind_dtypes(spec, this), strategy, None, target)
                    cases.append((name, label, shape, this, target_name, request))
    start = time.perf_counter()
    with CompilePool() as pool:
        builds = pool.compile([c[-1] for c in cases])
    elapsed = time.perf_counter() - start

    kernels = [(c, k) for c, b in zip(cases, builds) for k in b.kernels]
    failed = [(c, k) for c, k in kernels if not k.ok]
    lines = [
        "# The catalog through Triton's GPU compiler (no GPU)",
        "",
        f"{datetime.date.today().isoformat()}, Triton {triton.__version__}, on a CPU-only machine: "
        f"{len(cases)} modules, {len(kernels)} kernels, {len(kernels) - len(failed)} compile, "
        f"{len(failed)} fail ({elapsed:.0f} s with {pool.workers} workers). Default configurations. "
        "Registers per thread, spilled bytes per thread (stack + local) and shared memory per program "
        "from `cuobjdump -res-usage` and Triton's metadata; on AMD (hsaco) VGPRs per lane, scratch bytes per "
        "lane and LDS per program from the code object's metadata note.",
        f"Targets: {', '.join(f'{n} ({t.binary_arch} {t.binary_kind})' for n, t in targets)}"
        + ("" if args.target_turns is None else f"; each strategy for {targets[0][0]} and one other of each "
           f"vendor in turn (from {args.target_turns})") + ".",
        "",
        "| spec | size | shape | dtype | target | strategy | kernel | ok | regs | spill B | shared B |",
        "|---|---|---|---|---|---|---|---|---:|---:|---:|",
    ]
    for (name, label, shape, dtype, target, request), k in kernels:
        text = ",".join(f"{d}={n}" for d, n in shape.items())
        kernel = k.kernel.removeprefix(f"{name}_")
        lines.append(f"| {name} | {label} | {text} | {dtype if isinstance(dtype, str) else 'map'} | {target} | "
                     f"{request.strategy} | {kernel} | {'yes' if k.ok else 'NO'} | {k.registers or ''} | "
                     f"{'' if k.spill_bytes is None else k.spill_bytes} | {'' if k.shared_bytes is None else k.shared_bytes} |")
    lines += ["", "Refused strategies (not valid at that size):", ""]
    lines += sorted({f"- {name} ({label}): {s}: {why}" for name, label, s, why in refused})
    if failed:
        lines += ["", "Failures:", ""] + [f"- {c[0]} {c[-1].strategy} {c[4]}: {k.error}" for c, k in failed]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
