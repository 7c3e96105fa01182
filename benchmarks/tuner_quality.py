"""Tuner quality on the paper suite with the model measurer (a benchmark, not a test).

For every case of the catalog's suite "paper" (fuser_core/catalog/suites.json), target h100, the ``model``
measurer: the exhaustive optimum (every feasible candidate of ``SearchSpace.enumerate()``
predicted) against Optuna's best after ``--trials`` trials (seed 0, in memory), the gap in
percent, the worst gap over ``--seeds`` seeds, and the tuner's own overhead per trial
(everything but the measurer: sampler, suggestions, bookkeeping, storage). Issue 4 asks for
gaps within 3% and an overhead under 30 ms. For comparison, seed 0 without the local search
(``Tuner(local_search=False)``: the same start-up trials, then TPE only) and plain TPE
(``frontier=False, local_search=False``: random feasible start-up, then TPE only).
Prints a Markdown table.

    python benchmarks/tuner_quality.py [--trials 40] [--seeds 5] [--target h100] [--only attention] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import optuna

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fuser_core.derive import derive_cascade  # noqa: E402
from fuser_core.problem import make_problem  # noqa: E402
from fuser_core.catalog import load_catalog_spec, load_suites  # noqa: E402
from tuner.measure import ModelMeasurer  # noqa: E402
from tuner.profiles import get_profile  # noqa: E402
from tuner.search.tuner import Tuner  # noqa: E402
from tuner.space import SearchSpace  # noqa: E402


class Counting:
    """The measurer, counting calls (the tuner never measures a candidate twice)."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, 0

    def measure(self, candidate):
        self.calls += 1
        return self.inner.measure(candidate)


def exhaustive(space, measurer) -> tuple[float, str, int, float]:
    best, where, n = float("inf"), "", 0
    start = time.perf_counter()
    for c in space.enumerate():
        m = measurer.measure(c)
        n += 1
        if m.error is None and m.time_ms is not None and m.time_ms < best:
            best, where = m.time_ms, c.strategy
    return best, where, n, time.perf_counter() - start


def dtype_text(dtype) -> str:
    return dtype if isinstance(dtype, str) else ",".join(f"{k}={v}" for k, v in dtype.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 for the worst-gap column")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--suite", default="paper")
    parser.add_argument("--only", help="only cases of this spec")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    profile = get_profile(args.target)
    cases = load_suites()[args.suite]
    header = ("| case | shape | dtype | feasible | exhaustive best | Optuna best (seed 0) | gap | worst gap, "
              f"{args.seeds} seeds | overhead ms/trial (mean / max) | measured / cached / infeasible | gap, no local search | gap, plain TPE |")
    lines = [f"Tuner quality: {args.suite} suite, target {profile.name}, model measurer, {args.trials} trials", "",
             header, "|" + "---|" * (header.count("|") - 1)]
    gaps, overheads = [], []
    for case in cases:
        if args.only and case["spec"] != args.only:
            continue
        spec = load_catalog_spec(case["spec"])
        derivation = derive_cascade(spec)
        problem = make_problem(spec, case["shape"], case["dtype"])
        space = SearchSpace(problem, derivation, profile)
        model = ModelMeasurer(problem, derivation, profile)
        best, best_strategy, n, _ = exhaustive(space, model)
        runs = []
        for seed in range(args.seeds):
            measurer = Counting(model)
            result = Tuner(space, measurer, seed=seed).run(args.trials)
            assert measurer.calls == result.counts["measured"], "a candidate was measured twice"
            runs.append(result)
        tpe = Tuner(space, model, seed=0, local_search=False).run(args.trials)
        plain = Tuner(space, model, seed=0, frontier=False, local_search=False).run(args.trials)
        first = runs[0]
        gap = 100 * (first.time_ms - best) / best
        worst = max(100 * (r.time_ms - best) / best for r in runs)
        mean_overhead = statistics.mean(r.overhead_ms for r in runs)
        gaps.append(worst)
        overheads.append(mean_overhead)
        c = first.counts
        shape = ",".join(f"{k}={v}" for k, v in case["shape"].items())
        lines.append(
            f"| {case['spec']} | {shape} | {dtype_text(case['dtype'])} | {n} | {best * 1e3:.1f} us ({best_strategy}) "
            f"| {first.time_ms * 1e3:.1f} us ({first.strategy}) | {gap:.2f}% | {worst:.2f}% "
            f"| {mean_overhead:.1f} / {max(r.overhead_max_ms for r in runs):.1f} "
            f"| {c['measured']} / {c['cached']} / {c['infeasible']} | {100 * (tpe.time_ms - best) / best:.2f}% "
            f"| {100 * (plain.time_ms - best) / best:.2f}% |")
        print(lines[-1], file=sys.stderr, flush=True)
    lines += ["", f"worst gap {max(gaps):.2f}% (target: within 3%); mean tuner overhead "
              f"{statistics.mean(overheads):.1f} ms/trial, worst case mean {max(overheads):.1f} ms (target: < 30 ms)"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
