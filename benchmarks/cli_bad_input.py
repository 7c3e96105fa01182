"""How fast ``foldwise run``, ``tune`` and ``compile`` refuse bad input, and which heavy modules
they had imported by then (issue 26: every bad-input exit within 1 s).

Each case runs the CLI in a fresh process (as a user would), ``--repeat`` times; the table has
the median wall time, the exit status, the message's first words and the heavy modules loaded
when the process exited (what makes a refusal slow: torch alone is ~2 s to import on a 2-core
host). Run it with ``PYTHONPATH`` on the checkout to measure:

    PYTHONPATH=. python3 benchmarks/cli_bad_input.py [--repeat 3] [--markdown]

Results: ``benchmarks/results/cli_bad_input_cpu.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HEAVY = ("torch", "triton", "sympy", "numpy", "scipy", "optuna")
# runs the CLI's main() and, at exit, names the heavy modules it had imported (stderr's last line)
WRAPPER = (
    "import atexit, sys\n"
    f"HEAVY = {HEAVY!r}\n"
    "atexit.register(lambda: print('HEAVY:' + ','.join(m for m in HEAVY if m in sys.modules), file=sys.stderr))\n"
    "from service.cli import main\n"
    "if __name__ == '__main__':\n"
    "    sys.exit(main(sys.argv[1:]))\n"
)

SHAPE = "m=4,n=300"
CASES = [
    ("run", "misspelt catalog name", ["safe_softmx", "--shape", SHAPE]),
    ("run", "wrong dim", ["safe_softmax", "--shape", "m=4,q=300"]),
    ("run", "bad dtype", ["safe_softmax", "--shape", SHAPE, "--dtype", "float33"]),
    ("run", "unknown strategy", ["safe_softmax", "--shape", SHAPE, "--strategy", "fastest"]),
    ("run", "bad --config JSON", ["safe_softmax", "--shape", SHAPE, "--config", "{bad"]),
    ("run", "unknown family", ["safe_softmax", "--shape", SHAPE, "--families", "bogus"]),
    ("run", "row too long for row_resident", ["safe_softmax", "--shape", "m=4,n=300000", "--strategy", "row_resident"]),
    ("tune", "misspelt catalog name", ["safe_softmx", "--shape", SHAPE]),
    ("tune", "wrong dim", ["safe_softmax", "--shape", "m=4,q=300"]),
    ("tune", "bad dtype", ["safe_softmax", "--shape", SHAPE, "--dtype", "float33"]),
    ("tune", "unknown target", ["safe_softmax", "--shape", SHAPE, "--target", "a1000"]),
    ("tune", "unknown measurer", ["safe_softmax", "--shape", SHAPE, "--measurer", "foo"]),
    ("tune", "--trials 0", ["safe_softmax", "--shape", SHAPE, "--trials", "0"]),
    ("compile", "misspelt catalog name", ["safe_softmx", "--shape", SHAPE]),
    ("compile", "wrong dim", ["safe_softmax", "--shape", "m=4,q=300"]),
    ("compile", "bad dtype", ["safe_softmax", "--shape", SHAPE, "--dtype", "float33"]),
    ("compile", "unknown target", ["safe_softmax", "--shape", SHAPE, "--target", "sm_999x"]),
    ("compile", "unknown strategy", ["safe_softmax", "--shape", SHAPE, "--strategy", "fastest"]),
    ("compile", "row too long for row_resident",
     ["safe_softmax", "--shape", "m=4,n=300000", "--strategy", "row_resident"]),
]


def run_case(command: str, args: list[str]) -> tuple[float, int, str, str]:
    """(wall seconds, exit status, the error line, heavy modules loaded) of one fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", WRAPPER, command, *args], capture_output=True, text=True, env=env,
                          timeout=300)
    wall = time.perf_counter() - start
    lines = done.stderr.strip().splitlines()
    heavy = lines[-1].removeprefix("HEAVY:") if lines and lines[-1].startswith("HEAVY:") else "?"
    error = next((line for line in lines if line.startswith("error:")), (done.stdout.strip().splitlines() or [""])[-1])
    return wall, done.returncode, error, heavy or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the median is shown (default 3)")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores")
    print("| command | bad input | median s | max s | exit | heavy modules loaded | message |")
    print("|---|---|---:|---:|---:|---|---|")
    worst = 0.0
    for command, what, case in CASES:
        runs = [run_case(command, case) for _ in range(args.repeat)]
        walls = [r[0] for r in runs]
        _, rc, error, heavy = runs[-1]
        worst = max(worst, statistics.median(walls))
        print(f"| `{command}` | {what} | {statistics.median(walls):.2f} | {max(walls):.2f} | {rc} | {heavy} | "
              f"{error[:90].replace('|', '/')} |", flush=True)
    print(f"\nslowest median: {worst:.2f} s; load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
