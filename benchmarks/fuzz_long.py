"""The long fuzz run: random valid cascades (and mutated, mostly invalid ones) through
load_spec, derive_cascade, the certificate and, for a share of them, every valid kernel
strategy under Triton's interpreter (or the GPU, where there is one); every kernel that
ran is also compiled for sm_90 by Triton's GPU compiler (``--no-compile`` skips that).

    python benchmarks/fuzz_long.py --examples 2000 --minutes 20 --kernel-share 0.2 --seed 1

Prints the counts by outcome (fusible, not fusible, limit-stopped, invalid, kernels
checked, failures) and, for every failure, the finding and the spec JSON, so that it can
be replayed (``--replay FILE`` runs the checks on one spec file and prints the outcome; given a run's
``--json`` file, it checks every failure recorded there again, one line each).
The CI runs a bounded, derandomised version of the same checks (tests/fuser_core/test_fuzz_cascades.py).
Exit code 1 when there was a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # this checkout's fuser_core (and tests/support), whatever is installed
os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1000, help="valid cascades to draw (default 1000)")
    parser.add_argument("--minutes", type=float, default=10.0, help="stop drawing after this long (default 10)")
    parser.add_argument("--kernel-share", type=float, default=0.2,
                        help="share of cascades whose kernels run, every valid strategy (default 0.2)")
    parser.add_argument("--mutated", type=int, default=None, help="mutated specs to draw (default examples / 2)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--time-limit", type=float, default=None, help="derive_cascade's time limit in seconds")
    parser.add_argument("--cert-trials", type=int, default=4, help="certificate trials per spec (default 4)")
    parser.add_argument("--max-steps", type=int, default=5, help="most steps per drawn cascade (default 5)")
    parser.add_argument("--merged-share", type=float, default=None,
                        help="share of cascades whose axis is written as two dims reduced together, \"over\": [a, b] "
                             "(default 0.15)")
    parser.add_argument("--wild", action="store_true",
                        help="also draw exponents the anchor does not bound and cubics around raw-sum estimates "
                             "(known range/accuracy weaknesses of fused forms; expect failures)")
    parser.add_argument("--no-compile", action="store_true", help="skip the GPU compiler (sm_90) on checked kernels")
    parser.add_argument("--json", type=Path, default=None, help="also write counts and failures to this file")
    parser.add_argument("--replay", type=Path, default=None,
                        help="check one spec JSON file and print the outcome, or every failure a --json file recorded")
    args = parser.parse_args(argv)

    from fuser_core.codegen.gpu_compile import CompilePool

    pool = None if args.no_compile else CompilePool()
    try:
        return fuzz(args, pool)
    finally:
        if pool is not None:
            pool.close()


def fuzz(args: argparse.Namespace, pool) -> int:
    from tests.support.fuzz_strategies import MERGED_SHARE, cascade_specs, check_cascade, mutated_specs
    from hypothesis import HealthCheck, Phase, given, seed, settings

    if args.replay:
        raw = json.loads(args.replay.read_text())
        if "failures" not in raw:  # one spec
            outcome = check_cascade(raw, kernels=True, time_limit_s=args.time_limit, cert_trials=args.cert_trials,
                                    compile_pool=pool)
            print(json.dumps(outcome.__dict__, indent=2, default=str))
            return 1 if outcome.failure else 0
        # a run's --json: every failure it recorded, checked again, one line each
        still = 0
        for i, failure in enumerate(raw["failures"]):
            outcome = check_cascade(failure["spec"], kernels=True, time_limit_s=args.time_limit,
                                    cert_trials=args.cert_trials, compile_pool=pool)
            still += bool(outcome.failure)
            print(f"#{i}: {'FAILS: ' + outcome.failure if outcome.failure else 'passes'}", flush=True)
        print(f"{still} of {len(raw['failures'])} recorded failures still fail")
        return 1 if still else 0

    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()  # which limit stopped a derivation, which step was undefined
    failures: list[dict] = []
    slowest: list[tuple[float, str]] = []
    deadline = time.monotonic() + 60 * args.minutes
    share_every = max(1, round(1 / args.kernel_share)) if args.kernel_share > 0 else 0
    common = {"deadline": None, "database": None, "phases": [Phase.generate], "derandomize": False,
              "suppress_health_check": list(HealthCheck)}

    def record(raw: dict, outcome, elapsed: float, tag: str) -> None:
        counts[f"{tag}{outcome.status}"] += 1
        if outcome.status in ("limit_stopped", "undefined") and outcome.detail:
            reason = outcome.detail["error"].split(": ", 1)[-1]
            key = f"{tag}{outcome.status}: {reason[:70]}"
            if not reasons[key]:
                print(f"first of {key}\n{json.dumps(raw)}\n", flush=True)
            reasons[key] += 1
        counts["kernels checked"] += outcome.kernels_checked
        counts["kernels not valid (NotValid)"] += outcome.kernels_not_valid
        counts["modules compiled (sm_90)"] += outcome.kernels_compiled
        if outcome.failure:
            counts["FAILURES"] += 1
            failures.append({"finding": outcome.failure, "spec": raw})
            print(f"\nFAILURE: {outcome.failure}\n{json.dumps(raw)}\n", flush=True)
        slowest.append((elapsed, json.dumps(raw)))
        slowest.sort(reverse=True)
        del slowest[5:]

    @seed(args.seed)
    @settings(max_examples=args.examples, **common)
    @given(cascade_specs(max_steps=args.max_steps, wild=args.wild,
                         merged=MERGED_SHARE if args.merged_share is None else args.merged_share))
    def valid(raw: dict) -> None:
        if time.monotonic() > deadline:
            return
        counts["drawn"] += 1
        kernels = bool(share_every) and counts["drawn"] % share_every == 0
        start = time.perf_counter()
        outcome = check_cascade(raw, kernels=kernels, time_limit_s=args.time_limit, cert_trials=args.cert_trials,
                                compile_pool=pool)
        record(raw, outcome, time.perf_counter() - start, "")
        if counts["drawn"] % 50 == 0:
            print(f"{counts['drawn']} drawn, {time.monotonic() - deadline + 60 * args.minutes:.0f} s: {dict(counts)}",
                  flush=True)

    n_mutated = args.mutated if args.mutated is not None else args.examples // 2

    @seed(args.seed + 1)
    @settings(max_examples=max(1, n_mutated), **common)
    @given(mutated_specs())
    def mutated(pair: tuple[str, dict]) -> None:
        if time.monotonic() > deadline:
            return
        _mutation, raw = pair
        counts["mutated drawn"] += 1
        start = time.perf_counter()
        outcome = check_cascade(raw, time_limit_s=args.time_limit, cert_trials=args.cert_trials)
        record(raw, outcome, time.perf_counter() - start, "mutated: ")

    started = time.monotonic()
    valid()
    if n_mutated:
        mutated()
    elapsed = time.monotonic() - started
    print(f"\n== fuzz_long: {elapsed:.0f} s, seed {args.seed}")
    for key in ("drawn", "fusible", "not_fusible", "limit_stopped", "undefined", "invalid", "kernels checked",
                "kernels not valid (NotValid)", "modules compiled (sm_90)", "mutated drawn", "mutated: invalid", "mutated: undefined", "mutated: fusible",
                "mutated: not_fusible", "mutated: limit_stopped", "FAILURES"):
        print(f"  {key:32s} {counts.get(key, 0)}")
    for reason, n in reasons.most_common(10):
        print(f"  {n:5d} x {reason}")
    print("  slowest specs (s): " + ", ".join(f"{t:.2f}" for t, _ in slowest))
    if args.json:
        args.json.write_text(json.dumps({"counts": dict(counts), "reasons": dict(reasons), "failures": failures,
                                         "seconds": elapsed,
                                         "seed": args.seed}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
