"""Time from a downloaded bundle to a kernel ready to launch: from the stored cubin, and from
source, for every catalog spec (issue 15).

    python benchmarks/kernel_startup.py [--reps 5] [--fresh-reps 5] [--fresh-specs safe_softmax,attention]
                                        [--out benchmarks/results/kernel_startup_cpu.md]

For each catalog spec: a bundle at a small ragged size (float16, the first valid strategy, its
default config) for h100, with its sm_90a variant compiled as a worker stores it. "Ready" means
Triton's JIT cache of every kernel the module launches holds a ``CompiledKernel`` for the
launch's specialisation, so the first ``kernel[grid](...)`` only loads the module
(``cuModuleLoadData``) and launches. Each path, timed from the bundle's bytes:

- **source**: ``json.loads`` + :func:`service.bundle.verify_bundle` of the format-1 bundle,
  import of its module (a fresh file: the source compiled to bytecode, every ``@triton.jit``
  built), then the module's launcher on ``meta`` tensors of the tuned shape with every launch a
  Triton *warm-up* (``JITFunction.run(warmup=True)``: Triton binds, specialises, keys, and
  compiles for sm_90 into an empty Triton cache, as an inference server's first launch does);
- **cubin** (what :class:`service.client.KernelCache` does): ``json.loads`` + ``verify_bundle`` of
  the format-2 bundle (every cubin's sha256 included), the same module import, then
  :func:`service.client.cubin_loader.seed_jit_caches` (cubin hashes checked again, the same warm-up
  launches, each given a ``CompiledKernel`` built from the stored metadata and cubin: no
  compile, no source hashing, no Triton cache files);
- **via Triton's cache** (the previous cubin path, kept for comparison and as the client's path
  for a Triton version the loader does not know): ``verify_bundle`` + import +
  :func:`service.bundle.install_variant` into an empty Triton cache + the warm-up launches,
  ``triton.compile`` finding the cubin there.

The table's medians are taken in one warm worker process (interpreter off) after one untimed
round: they are each kernel's own cost. Once per process Triton also hashes its own files and
``libtriton.so`` and runs ``ptxas --version`` for its cache key (``triton_key()``): the source and
the Triton-cache paths pay that at an inference server's first kernel, the cubin path never
does. The "fresh process" table measures that first kernel, each run in a new interpreter
(``--fresh-specs``; imports of torch, triton, foldwise and ``triton.experimental.gluon``, which
Triton imports at the first launch it specialises whatever the path, are done before the clock,
and so is the full garbage collection those imports leave pending).

No GPU here: a stand-in driver (:class:`fuser_core.codegen.launches.TargetOnlyDriver`) answers the
device, stream and target (sm_90) that ``JITFunction.run`` asks before launching. What only a
GPU can run is **not measured on GPU**: Triton's CUDA driver start-up, ``cuModuleLoadData`` of
the cubin and the first launch, and checking outputs against float64.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # this checkout's packages, and tests/support/catalog_shapes.py
PATHS = ("source", "cubin", "triton_cache")


def _fresh_module(source: str, folder: str, n: int):
    """The bundle's module imported from a new file (no bytecode cache, new JITFunctions)."""
    import importlib.util

    path = Path(folder) / f"startup_module_{n}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"startup_module_{os.getpid()}_{n}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _warm_up_launches(module, bundle: dict) -> list:
    """The module's launcher on meta tensors, each launch a Triton warm-up (no launch)."""
    from triton.runtime.jit import JITFunction

    from service.client.cubin_loader import meta_inputs

    kernels = []
    original = JITFunction.run

    def warm_up(self, *args, grid, warmup, **kwargs):
        kernels.append(original(self, *args, grid=grid, warmup=True, **kwargs))

    JITFunction.run = warm_up
    try:
        module.launch(meta_inputs(bundle), dict(bundle["shape"]))
    finally:
        JITFunction.run = original
    return kernels


def time_path(path: str, content: bytes, folder: str, n: int) -> tuple[float, float]:
    """Seconds of one path (module docstring), from the bundle's bytes to a ready kernel: (the
    path without the module import, the import)."""
    from service.bundle import install_variant, verify_bundle
    from service.client.cubin_loader import seed_jit_caches

    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # empty: nothing compiled before
        t0 = time.perf_counter()
        bundle = json.loads(content)
        verify_bundle(bundle)
        if path == "triton_cache":
            install_variant(bundle["binaries"]["sm_90a"])
        t1 = time.perf_counter()
        module = _fresh_module(bundle["triton_source"], folder, n)
        t2 = time.perf_counter()
        if path == "cubin":
            ready = seed_jit_caches(module, bundle, bundle["binaries"]["sm_90a"])
        else:
            ready = _warm_up_launches(module, bundle)
        t3 = time.perf_counter()
    if not ready or any(k is None for k in ready):
        raise RuntimeError(f"{path}: no kernel ready")
    return (t1 - t0) + (t3 - t2), t2 - t1


def _set_up_process() -> None:
    from triton.runtime.driver import driver

    from fuser_core.codegen.launches import TargetOnlyDriver

    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.pop("TRITON_DEFAULT_FP_FUSION", None)  # as an inference server runs
    driver.set_active(TargetOnlyDriver(90))


def time_paths(bundle1: bytes, bundle2: bytes, reps: int) -> dict[str, list[float]]:
    """In a compile worker: seconds of each path without the import, ``reps`` each, after one
    untimed round; and of every module import (``"import"``)."""
    _set_up_process()
    out: dict[str, list[float]] = {p: [] for p in (*PATHS, "import")}
    with tempfile.TemporaryDirectory() as folder:
        for rep in range(reps + 1):
            for k, path in enumerate(PATHS):
                took, imported = time_path(path, bundle1 if path == "source" else bundle2, folder,
                                           rep * len(PATHS) + k)
                if rep:
                    out[path].append(took)
                    out["import"].append(imported)
    os.environ.pop("TRITON_CACHE_DIR", None)
    return out


def _one(path: str, bundle_file: str) -> None:
    """``--one``: a fresh interpreter times one path once (imports first, untimed)."""
    import torch  # noqa: F401
    import triton  # noqa: F401
    import triton.experimental.gluon  # noqa: F401  # Triton imports it at its first specialisation, any path


    import service.bundle  # noqa: F401
    import service.client.cubin_loader  # noqa: F401

    _set_up_process()
    # the imports leave a full garbage collection pending (hundreds of thousands of new objects):
    # whatever allocates first pays it (100+ ms here, in the source check's parse), whichever path
    gc.collect()
    content = Path(bundle_file).read_bytes()
    with tempfile.TemporaryDirectory() as folder:
        print(json.dumps({"seconds": sum(time_path(path, content, folder, 0))}))


def fresh_times(path: str, content: bytes, reps: int) -> list[float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        f.write(content)
        f.flush()
        out = []
        for _ in range(reps):
            done = subprocess.run([sys.executable, __file__, "--one", path, f.name], capture_output=True, text=True,
                                  check=True, env={**os.environ, "TRITON_INTERPRET": "0"})
            out.append(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])
        return out


def main(argv: list[str] | None = None) -> int:
    import triton

    from tests.support.catalog_shapes import small_shape
    from fuser_core.catalog import catalog_names, load_catalog_spec
    from fuser_core.codegen.gpu_compile import CompilePool
    from fuser_core.codegen.plan import STRATEGIES, default_config, valid_strategies
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from fuser_core.reference import bind_shape
    from service.binaries import compile_variant
    from service.bundle import bundle_v2, canonical_bytes
    from service.bundle_maker import make_bundle

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--fresh-reps", type=int, default=5)
    parser.add_argument("--fresh-specs", default="safe_softmax,attention",
                        help="specs timed in fresh processes (comma-separated; empty: none)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", nargs=2, metavar=("PATH", "BUNDLE_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _one(*args.one)
        return 0
    fresh_specs = [s for s in args.fresh_specs.split(",") if s]
    rows, fresh_rows = [], []
    with CompilePool(1) as pool:
        for name in catalog_names():
            spec = load_catalog_spec(name)
            derivation = derive_cascade(spec)
            shape = bind_shape(spec, small_shape(spec))
            valid = valid_strategies(spec, derivation, shape)
            strategy = next(s for s in STRATEGIES if not valid.get(s))
            config = default_config(spec, derivation, strategy, shape).to_dict()
            bundle = make_bundle(make_problem(spec, shape, "float16"), target="h100", strategy=strategy, config=config,
                                 measured={"measurer": "model"})
            variant = compile_variant(bundle, pool=pool)
            b1, b2 = canonical_bytes(bundle), canonical_bytes(bundle_v2(bundle, {variant["arch"]: variant}))
            times = pool._pool.submit(time_paths, b1, b2, args.reps).result()
            src, cub, via, imp = (statistics.median(times[p]) * 1000 for p in (*PATHS, "import"))
            rows.append((name, strategy, len(variant["kernels"]), sum(k["cubin_size"] for k in variant["kernels"]),
                         src, via, cub, imp))
            print(f"{name:22s} source {src:8.1f} ms  via cache {via:6.2f} ms  cubin {cub:6.2f} ms  x{src / cub:.0f}  "
                  f"import {imp:.2f} ms (cubin runs {', '.join(f'{t * 1000:.2f}' for t in times['cubin'])})",
                  flush=True)
            if name in fresh_specs:
                fresh = {p: statistics.median(fresh_times(p, b1 if p == "source" else b2, args.fresh_reps)) * 1000
                         for p in PATHS}
                fresh_rows.append((name, fresh["source"], fresh["triton_cache"], fresh["cubin"]))
                print(f"{name:22s} fresh process: {fresh}", flush=True)
    lines = [
        f"# Kernel start-up: cubin vs source (CPU-only machine, {datetime.date.today()})",
        "",
        f"Triton {triton.__version__}; target h100 (sm_90a); float16, small ragged shape, first valid strategy, "
        f"default config. `benchmarks/kernel_startup.py` (its docstring says exactly what each path covers). "
        "Measured on a 2-core machine shared with other jobs while this ran: single runs vary by a few ms, "
        "so each figure is a median.",
        "",
        "**Not measured on GPU**: no GPU was available. Every path runs from the bundle's bytes to a "
        "kernel ready in Triton's JIT cache (json, verify, module import, the launches bound and keyed by "
        "Triton on `meta` tensors with a stand-in driver for sm_90). *source* compiles every kernel for "
        "sm_90 into an empty cache (an inference server's first launch); *cubin* is the client's path "
        "(`service.client.cubin_loader`: a `CompiledKernel` from the stored metadata and cubin, hashes verified); "
        "*via Triton's cache* is the previous cubin path (install into Triton's cache, `triton.compile` "
        "finding it). Triton's CUDA driver start-up, `cuModuleLoadData` and the first launch are not "
        "measured, and outputs were not checked against float64 on a GPU.",
        "",
        f"## Each kernel (warm process, median of {args.reps})",
        "",
        "Triton's once-per-process cache-key set-up is excluded here (see the next table). The module "
        "import (its bytecode compile and one `@triton.jit` per kernel and helper, about 14 in every "
        "generated module) is the same in every path: the path columns leave it out, as this benchmark always "
        "has, and it has its own column; the last column puts it back into both paths.",
        "",
        "| spec | strategy | kernels | cubin bytes | source ms | via Triton's cache ms | cubin ms | cubin speed-up "
        "| module import ms | speed-up with the import |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, strategy, n, size, src, via, cub, imp in rows:
        lines.append(f"| {name} | {strategy} | {n} | {size} | {src:.1f} | {via:.2f} | {cub:.2f} | {src / cub:.1f}x "
                     f"| {imp:.1f} | {(src + imp) / (cub + imp):.1f}x |")
    worst = min(row[4] / row[6] for row in rows)
    worst_all = min((row[4] + row[7]) / (row[6] + row[7]) for row in rows)
    lines += ["", f"Smallest speed-up: {worst:.1f}x without the module import (goal: at least 20x for every spec: "
                  f"{'met' if worst >= 20 else 'NOT met'}); {worst_all:.1f}x with it "
                  f"({'met' if worst_all >= 20 else 'NOT met'})."]
    if fresh_rows:
        lines += [
            "",
            f"## First kernel in a fresh process (median of {args.fresh_reps} processes)",
            "",
            "What an inference server pays at start-up: each whole path, module import included, plus Triton's "
            "once-per-process work "
            "(for the source and Triton-cache paths, `triton_key()`: a hash of Triton's files and "
            "`libtriton.so`, and `ptxas --version`). Imports of torch, triton and foldwise are before the clock, "
            "and so is `triton.experimental.gluon`, which Triton imports at the first launch it specialises in a "
            "process (60-300 ms here), whichever path loaded the kernel; so is the full garbage collection "
            "the imports leave pending (100+ ms here, paid by whatever allocates first).",
            "",
            "| spec | source ms | via Triton's cache ms | cubin ms | cubin speed-up |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, src, via, cub in fresh_rows:
            lines.append(f"| {name} | {src:.1f} | {via:.1f} | {cub:.1f} | {src / cub:.1f}x |")
        worst_fresh = min(src / cub for _, src, _, cub in fresh_rows)
        lines += ["", f"Smallest speed-up: {worst_fresh:.1f}x (goal 20x: {'met' if worst_fresh >= 20 else 'NOT met'} "
                      f"for the {len(fresh_rows)} specs timed here)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
