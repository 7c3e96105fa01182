"""Issue 26: `foldwise run`, `tune` and `compile` refuse bad input before the heavy imports, a
closed pipe ends a command quietly, and `bench` writes where it says.

No wall time is asserted (a loaded CI machine would fail it; benchmarks/cli_bad_input.py
measures it): what makes a refusal fast is what it has imported by then, and that is asserted
(torch and Triton take seconds to import, sympy about half of one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import EXIT_CLOSED_PIPE, bench_out_dir, main

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "sympy", "optuna", "scipy")
# the CLI's main() in a fresh process; at exit, the heavy modules it had imported (stderr's last line)
WRAPPER = (
    "import atexit, sys\n"
    f"atexit.register(lambda: print('HEAVY:' + ','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr))\n"
    "from service.cli import main\n"
    "if __name__ == '__main__':\n"
    "    sys.exit(main(sys.argv[1:]))\n"
)


def cli_with_imports(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("HEAVY:"), done.stderr
    return done, {m for m in last.removeprefix("HEAVY:").split(",") if m}


SHAPE = ["--shape", "m=4,n=300"]
LIGHT = [  # (command and arguments, what the error names)
    (["run", "safe_softmx", *SHAPE], "safe_softmx: no such file, and no catalog spec"),
    (["run", "safe_softmax", "--shape", "m=4,q=300"], "unknown dim 'q'"),
    (["run", "safe_softmax", *SHAPE, "--dtype", "float33"], "unknown dtype 'float33'"),
    (["run", "safe_softmax", *SHAPE, "--strategy", "fastest"], "--strategy: unknown strategy 'fastest'"),
    (["run", "safe_softmax", *SHAPE, "--config", "{bad"], "--config:"),
    (["run", "safe_softmax", *SHAPE, "--inputs", "/nonexistent/in.npz"], "--inputs: cannot read"),
    (["tune", "safe_softmx", *SHAPE], "safe_softmx: no such file, and no catalog spec"),
    (["tune", "safe_softmax", "--shape", "m=4,q=300"], "unknown dim 'q'"),
    (["tune", "safe_softmax", *SHAPE, "--dtype", "float33"], "unknown dtype 'float33'"),
    (["tune", "safe_softmax", *SHAPE, "--target", "a1000"], "--target: unknown target 'a1000'"),
    (["tune", "safe_softmax", *SHAPE, "--measurer", "foo"], "--measurer: unknown measurer 'foo'"),
    (["tune", "safe_softmax", *SHAPE, "--trials", "0"], "--trials: must be at least 1"),
    (["compile", "safe_softmx", *SHAPE], "safe_softmx: no such file, and no catalog spec"),
    (["compile", "safe_softmax", "--shape", "m=4,q=300"], "unknown dim 'q'"),
    (["compile", "safe_softmax", *SHAPE, "--dtype", "float33"], "unknown dtype 'float33'"),
    (["compile", "safe_softmax", *SHAPE, "--target", "sm_999x"], "--target: unknown target 'sm_999x'"),
    (["compile", "safe_softmax", *SHAPE, "--strategy", "fastest"], "--strategy: unknown strategy 'fastest'"),
    (["compile", "safe_softmax", *SHAPE, "--config", "{bad"], "--config:"),
]


@pytest.mark.parametrize(("args", "message"), LIGHT, ids=[" ".join(a[:1] + a[2:]) for a, _ in LIGHT])
def test_bad_input_is_refused_before_any_heavy_import(args: list[str], message: str) -> None:
    done, loaded = cli_with_imports(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not loaded, f"loaded {sorted(loaded)} before refusing"


@pytest.mark.parametrize("command", ["run", "compile"])
def test_a_strategy_that_cannot_hold_the_row_is_refused_before_torch_and_triton(command: str) -> None:
    """Whether a strategy can run a shape is the plan's question, which needs the derivation
    (sympy); torch and Triton are still not loaded. `compile` used to answer exit 0 with an
    empty table for the strategy it was asked for."""
    done, loaded = cli_with_imports(command, "safe_softmax", "--shape", "m=4,n=300000", "--strategy", "row_resident")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--strategy: the row (300000) is too long to keep resident" in done.stderr, done.stderr
    assert not loaded & {"torch", "triton", "optuna"}, f"loaded {sorted(loaded)} before refusing"


def test_bad_families_need_numpy_only() -> None:
    done, loaded = cli_with_imports("run", "safe_softmax", *SHAPE, "--families", "bogus")
    assert done.returncode == 2 and "--families: unknown input family 'bogus'" in done.stderr, done.stderr
    assert not loaded & {"torch", "triton", "sympy"}, f"loaded {sorted(loaded)} before refusing"


# ---------------------------------------------------------------------------------------------
# a closed pipe (`foldwise ... | head`)


def test_a_closed_pipe_exits_141_without_a_traceback() -> None:
    """stdout is a pipe whose reader has gone: the first write fails with EPIPE (Python ignores
    SIGPIPE), which used to end in a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "service.cli", "catalog"], stdout=write, stderr=subprocess.PIPE,
                              text=True, cwd=REPO, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == EXIT_CLOSED_PIPE == 141
    assert done.stderr == "", done.stderr


# ---------------------------------------------------------------------------------------------
# bench --out


def test_bench_writes_under_a_folder_it_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    assert bench_out_dir(None, "paper", "cuda") == Path("foldwise-bench/paper")
    assert bench_out_dir(None, "smoke", "cpu") == Path("foldwise-bench/smoke-cpu-interpreter")
    assert bench_out_dir(str(tmp_path / "mine"), "paper", "cuda") == tmp_path / "mine"
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--suite", "nope", "--device", "cpu"]) == 2  # an unknown suite: refused
    err = capsys.readouterr().err
    assert f"bench: results go to {tmp_path / 'foldwise-bench' / 'nope-cpu-interpreter'} (choose with --out)" in err
    assert not (tmp_path / "benchmarks").exists()
