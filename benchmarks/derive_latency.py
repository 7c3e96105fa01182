"""Derive latency per catalog spec, cold and cached (a benchmark, not a test).

Cold: the report cache and sympy's own cache are cleared before each run, in a process
that has already imported its modules (import time is not derive time). Cached: the same
spec again, served from the spec_hash-keyed cache (validation + canonical form + lookup +
renaming). Prints a Markdown table with medians.

    python benchmarks/derive_latency.py [--repeat 5] [--cached-repeat 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import sympy.core.cache

from fuser_core.catalog import PACKAGED_DIR, catalog_entries
from fuser_core.report import clear_cache, derivation_report
from fuser_core.spec import load_spec

CATALOG = [entry.path for entry in catalog_entries([PACKAGED_DIR])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="cold runs per spec")
    parser.add_argument("--cached-repeat", type=int, default=200, help="cached runs per spec")
    args = parser.parse_args()

    texts = {p.stem: p.read_text() for p in CATALOG}
    derivation_report(load_spec(texts["safe_softmax"]))  # warm the imports, not the specs

    rows = []
    for name, text in texts.items():
        cold = []
        for _ in range(args.repeat):
            clear_cache()
            sympy.core.cache.clear_cache()
            t0 = time.perf_counter()
            derivation_report(load_spec(text))
            cold.append(time.perf_counter() - t0)
        cached = []
        for _ in range(args.cached_repeat):
            t0 = time.perf_counter()
            derivation_report(load_spec(text))  # validation included: a request pays for it
            cached.append(time.perf_counter() - t0)
        rows.append((name, statistics.median(cold) * 1e3, max(cold) * 1e3, statistics.median(cached) * 1e3))

    print("| spec | cold median ms | cold max ms | cached median ms |")
    print("|---|---:|---:|---:|")
    for name, cm, cx, ca in rows:
        print(f"| {name} | {cm:.1f} | {cx:.1f} | {ca:.3f} |")
    print(f"| **median over specs** | {statistics.median(r[1] for r in rows):.1f} | "
          f"{statistics.median(r[2] for r in rows):.1f} | {statistics.median(r[3] for r in rows):.3f} |")
    print(json.dumps({"targets": {"cold_median_ms": 300, "cached_ms": 5}}))


if __name__ == "__main__":
    main()
