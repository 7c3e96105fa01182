"""Time from a downloaded bundle to a kernel ready to launch: from the stored cubin, and from
source, for every catalog spec (issue 15).

    python benchmarks/kernel_startup.py [--reps 5] [--out benchmarks/results/kernel_startup_cpu.md]

For each catalog spec: a bundle at a small ragged size (float16, the first valid strategy,
its default config) for h100, compiled for sm_90 (sm_90a) as a worker stores it. Then, in a
compile-pool worker (interpreter off), median over ``--reps`` of:

- **source**: parse + verify the format-1 bundle, then ``triton.compile`` of every kernel launch
  into an empty Triton cache: the sm_90 compile an inference server does at its first launch;
- **cubin**: parse + verify the format-2 bundle (every cubin's sha256), install its variant
  into an empty Triton cache (:func:`service.bundle.install_variant`), then ``triton.compile``
  of every launch, which finds the cubin there (the compiler is not run).

Both stop where a GPU would load the module (``cuModuleLoadData``) and launch: that part, and
any GPU time, is **not measured** (this machine has no GPU). Generating and importing the
module's Python is common to both paths and left out.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def time_paths(request, bundle1: bytes, bundle2: bytes, reps: int) -> dict[str, list[float]]:
    """In a compile worker: seconds of the source and the cubin path, ``reps`` each."""
    import json
    import os
    import tempfile

    import triton
    from triton.compiler import ASTSource

    from fuser_core.codegen.gpu_compile import _bound, request_launches
    from service.bundle import install_variant, verify_bundle

    _, launches = request_launches(request)
    bound = [_bound(launch, request.capability) for launch in launches]
    saved = os.environ.pop("TRITON_DEFAULT_FP_FUSION", None)  # as an inference server runs
    out: dict[str, list[float]] = {"source": [], "cubin": []}
    try:
        for _ in range(reps):
            for path, content in (("source", bundle1), ("cubin", bundle2)):
                with tempfile.TemporaryDirectory() as cache:
                    os.environ["TRITON_CACHE_DIR"] = cache
                    t0 = time.perf_counter()
                    bundle = json.loads(content)
                    verify_bundle(bundle)
                    if path == "cubin":
                        install_variant(bundle["binaries"]["sm_90a"])
                    for launch, (target, (options, signature, constexprs, attrs)) in zip(launches, bound):
                        triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target,
                                       options=options.__dict__)
                    out[path].append(time.perf_counter() - t0)
    finally:
        os.environ.pop("TRITON_CACHE_DIR", None)
        if saved is not None:
            os.environ["TRITON_DEFAULT_FP_FUSION"] = saved
    return out


def main(argv: list[str] | None = None) -> int:
    import triton

    from benchmarks.compile_catalog import small_shape
    from fuser_core.catalog import catalog_names, load_catalog_spec
    from fuser_core.codegen.gpu_compile import CompilePool
    from fuser_core.codegen.plan import STRATEGIES, default_config, valid_strategies
    from fuser_core.derive import derive_cascade
    from fuser_core.reference import bind_shape
    from service.binaries import compile_request_for, compile_variant
    from service.bundle import bundle_v2, canonical_bytes, make_bundle

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = []
    with CompilePool(1) as pool:
        for name in catalog_names():
            spec = load_catalog_spec(name)
            derivation = derive_cascade(spec)
            shape = bind_shape(spec, small_shape(spec))
            valid = valid_strategies(spec, derivation, shape)
            strategy = next(s for s in STRATEGIES if not valid.get(s))
            config = default_config(spec, derivation, strategy, shape).to_dict()
            bundle = make_bundle(spec, shape=shape, dtype="float16", target="h100", strategy=strategy, config=config,
                                 measured={"measurer": "model"})
            variant = compile_variant(bundle, pool=pool)
            b2 = bundle_v2(bundle, {variant["arch"]: variant})
            times = pool._pool.submit(time_paths, compile_request_for(bundle, 90), canonical_bytes(bundle),
                                      canonical_bytes(b2), args.reps).result()
            src, cub = (statistics.median(times[k]) * 1000 for k in ("source", "cubin"))
            rows.append((name, strategy, len(variant["kernels"]), sum(k["cubin_size"] for k in variant["kernels"]),
                         src, cub))
            print(f"{name:22s} {strategy:16s} source {src:9.1f} ms  cubin {cub:7.2f} ms  x{src / cub:.0f}", flush=True)
    lines = [
        f"# Kernel start-up: cubin vs source (CPU-only machine, {datetime.date.today()})",
        "",
        f"Triton {triton.__version__}; target h100 (sm_90a); float16, small ragged shape, first valid strategy, "
        f"default config; median of {args.reps}. `benchmarks/kernel_startup.py` (its docstring says what each "
        "path covers).",
        "",
        "**Not measured on GPU**: no GPU was available. *source* is the sm_90 compile an inference server "
        "does at its first launch (verify + `triton.compile` into an empty cache); *cubin* is verify (cubin "
        "hashes included) + install into Triton's cache + `triton.compile` finding it there. Both stop "
        "before the CUDA module load and first launch, which are not measured; outputs were not checked "
        "against float64 on a GPU.",
        "",
        "| spec | strategy | kernels | cubin bytes | source ms | cubin ms | speed-up |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, strategy, n, size, src, cub in rows:
        lines.append(f"| {name} | {strategy} | {n} | {size} | {src:.1f} | {cub:.2f} | {src / cub:.0f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
