"""split_fused's combine kernel, one program per lane block (serial) or SPLIT of them (parallel):
the cost model's predicted time for both at a grid of safe_softmax shapes (default config,
float16, h100 profile), and which one ``fuser_core.codegen.plan.parallel_combine`` picks.
A model prediction, not a GPU measurement.

    python benchmarks/parallel_combine.py [--out TABLE.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # this checkout's packages, whatever is installed

SHAPES = [(64, 1024), (256, 1024), (512, 2048), (1024, 2048), (256, 4096), (512, 8192), (1024, 8192),
          (8, 262144), (256, 32768), (512, 32768), (1024, 32768), (2048, 32768), (4096, 32768), (16384, 1024)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    from fuser_core.catalog import load_catalog_spec
    from fuser_core.codegen import plan as plan_module
    from fuser_core.codegen.plan import default_config
    from fuser_core.codegen.strategies import SPLIT_FUSED
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from tuner.cost_model import predict
    from tuner.profiles import get_profile
    from tuner.space import Candidate

    spec = load_catalog_spec("safe_softmax")
    derivation = derive_cascade(spec)
    profile = get_profile("h100")
    rule = plan_module.PARALLEL_COMBINE_BELOW
    rows = ["| m | n | split | serial (us) | parallel (us) | picked |", "|---|---|---|---|---|---|"]
    try:
        for m, n in SHAPES:
            shape = {"m": m, "n": n}
            config = default_config(spec, derivation, SPLIT_FUSED.name, shape)
            problem = make_problem(spec, shape, "float16")
            times = {}
            for label, below in (("serial", 0), ("parallel", 1 << 62)):
                plan_module.PARALLEL_COMBINE_BELOW = below  # force one form
                times[label] = predict(problem, derivation, Candidate(SPLIT_FUSED.name, config), profile).time_s * 1e6
            plan_module.PARALLEL_COMBINE_BELOW = rule
            picked = "parallel" if plan_module.parallel_combine(SPLIT_FUSED.name, ("m",), shape, {"m": 1}) else "serial"
            best = min(times, key=times.get)
            mark = "" if picked == best else " (model prefers " + best + ")"
            rows.append(f"| {m} | {n} | {config.split} | {times['serial']:.1f} | {times['parallel']:.1f} | {picked}{mark} |")
    finally:
        plan_module.PARALLEL_COMBINE_BELOW = rule
    text = "\n".join(rows) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
