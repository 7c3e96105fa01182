"""The cost model's top 5 candidates, compiled for the target: before and after the compile gate.

For every case of the catalog's suite "paper" (a benchmark, not a test):

- **before**: every feasible candidate (``SearchSpace.enumerate()``: what ``SearchSpace.check``
  judges to fit) predicted by the cost model alone; its 5 fastest are compiled with Triton's
  compiler for the target's arch (``tuner.compile_gate.CompileGate``, no GPU needed) and
  counted: how many compiled, how many spilled registers, and how many were *wrongly judged to
  fit* (the compiler failed, or the compiled kernels exceed the target's shared memory or
  registers per SM, although the check accepted them);
- **after**: the ranking the compile-aware tuner sees: candidates the gate prunes are gone, the
  rest are predicted with the compiled registers, shared memory and spills; its top 5 are
  counted the same way. An exact ranking would compile every candidate (thousands per case): the plain ranking
  is compiled ``--compile-top`` (20) at a time, re-ranked with the facts, until the next plain
  prediction is past the 5th re-ranked time, at most ``--compile-max`` (100) per case. (A
  candidate further down that compiled facts would make faster, through a higher occupancy than
  estimated, is missed.)

Prints a Markdown table: predictions of the cost model for the target, from kernels compiled
on this machine; not GPU measurements.

    python benchmarks/compile_pruning.py [--target h100] [--compile-top 20] [--compile-max 100] [--only safe_softmax] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fuser_core.catalog import load_catalog_spec, load_suites  # noqa: E402
from fuser_core.derive import derive_cascade  # noqa: E402
from fuser_core.problem import make_problem  # noqa: E402
from tuner.compile_gate import CompileGate  # noqa: E402
from tuner.cost_model import predict  # noqa: E402
from tuner.profiles import get_profile  # noqa: E402
from tuner.space import SearchSpace  # noqa: E402

TOP = 5


def counts(verdicts) -> tuple[int, int, int]:
    """(compiled, spilled, wrongly judged to fit) among verdicts of candidates the check accepted."""
    compiled = sum(all(k.ok for k in v.kernels) and bool(v.kernels) for v in verdicts)
    spilled = sum(v.spill_bytes > 0 for v in verdicts)
    wrong = sum(v.pruned for v in verdicts)
    return compiled, spilled, wrong


def fmt_case(case) -> tuple[str, str]:
    shape = ",".join(f"{k}={v}" for k, v in case["shape"].items())
    dtype = case.get("dtype", "float32")
    dtype = dtype if isinstance(dtype, str) else ",".join(f"{k}={v}" for k, v in dtype.items())
    return shape, dtype


def label(candidate, time_s: float) -> str:
    c = candidate.config
    blocks = ",".join(f"{d}={b}" for d, b in c.blocks.items())
    split = f", split {c.split}" if candidate.config.split > 1 else ""
    return f"{time_s * 1e6:.1f} us {candidate.strategy} [{blocks}] w{c.num_warps} s{c.num_stages}{split}"


def first_reason(verdicts) -> str:
    reason = next((v.reason for v in verdicts if v.pruned), "")
    return reason.replace("|", "/").replace("\n", " ")[:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--suite", default="paper")
    parser.add_argument("--compile-top", type=int, default=20, help="candidates of the plain ranking compiled at a time")
    parser.add_argument("--compile-max", type=int, default=100, help="at most this many compiled per case")
    parser.add_argument("--only", help="only cases of these specs (comma-separated)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()

    profile = get_profile(args.target)
    lines = [
        f"| case | shape | dtype | feasible | before: compiled / spilled / wrongly fit (of {TOP}) | "
        f"after: compiled / spilled / wrongly fit (of {TOP}) | compiled / pruned / spilled (plain ranking's first N) | "
        "best before | best after | first compiler reason | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    totals = [0] * 7
    for case in load_suites()[args.suite]:
        if args.only and case["spec"] not in args.only.split(","):
            continue
        start = time.perf_counter()
        spec = load_catalog_spec(case["spec"])
        derivation = derive_cascade(spec)
        space = SearchSpace(make_problem(spec, case["shape"], case.get("dtype", "float32")), derivation, profile)
        gate = CompileGate.for_space(space)
        ranked = []
        for c in space.enumerate():
            p = predict(space.problem, derivation, c, profile)
            ranked.append((p.time_s, c.key(), c))
        ranked.sort(key=lambda r: (r[0], r[1]))
        head, verdicts, rescored = [], [], []
        while len(head) < min(len(ranked), args.compile_max):
            batch = [c for _, _, c in ranked[len(head):len(head) + args.compile_top]]
            found = gate.check_many(batch)  # in parallel in the pool; the first batch holds the top 5
            head += batch
            verdicts += found
            for c, v in zip(batch, found):
                if not v.pruned:
                    p = predict(space.problem, derivation, c, profile, v)
                    rescored.append((p.time_s, c.key(), c, v))
            rescored.sort(key=lambda r: (r[0], r[1]))
            # the compile facts only raise a time (spills, lower occupancy) far more often than they
            # lower it: stop once the plain prediction of the next candidate is past the 5th rescored
            if len(rescored) >= TOP and len(head) < len(ranked) and ranked[len(head)][0] >= rescored[TOP - 1][0]:
                break
        before = verdicts[:TOP]
        after = [v for _, _, _, v in rescored[:TOP]]
        b, a = counts(before), counts(after)
        pruned = sum(v.pruned for v in verdicts)
        spilled_head = sum(v.spill_bytes > 0 for v in verdicts)
        for i, x in enumerate((*b, *a, pruned)):
            totals[i] += x
        shape, dtype = fmt_case(case)
        best_after = label(rescored[0][2], rescored[0][0]) if rescored else "none compiled"
        lines.append(
            f"| {case['spec']} | {shape} | {dtype} | {len(ranked)} | {b[0]} / {b[1]} / {b[2]} | "
            f"{a[0]} / {a[1]} / {a[2]} (of {len(after)}) | {len(head)} / {pruned} / {spilled_head} | "
            f"{label(ranked[0][2], ranked[0][0])} | "
            f"{best_after} | {first_reason(verdicts)} | {time.perf_counter() - start:.0f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    lines.append(f"| **total** | | | | {totals[0]} / {totals[1]} / {totals[2]} | {totals[3]} / {totals[4]} / "
                 f"{totals[5]} | {totals[6]} | | | | |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
