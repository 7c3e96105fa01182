"""Issue 26: `foldwise compile` shows its progress (a line redrawn on a terminal, a line per
kernel in a log) and answers a rerun from its on-disk cache without starting a compile worker;
`foldwise tune` logs a line per tenth of its budget when stderr is not a terminal."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuser_core import CompilePool, CompileRequest, Target, bind_dtypes, bind_shape, load_spec, spec_source
from fuser_core.codegen.gpu_compile import KernelBuild, ModuleBuild
from service.cli import main
from service.cli.progress import CompileProgress

REPO = Path(__file__).resolve().parents[2]


class Stream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def build() -> ModuleBuild:
    return ModuleBuild("split_fused", {}, (KernelBuild("k_main", True, registers=26, spill_bytes=0, shared_bytes=1056),
                                           KernelBuild("k_combine", False, "k_combine: line 3: boom\nmore")))


def test_compile_progress_is_a_line_per_kernel_in_a_log_and_one_line_on_a_terminal() -> None:
    log = Stream(terminal=False)
    progress = CompileProgress({}, log)
    request = CompileRequest(load_spec(spec_source("safe_softmax")), {"m": 2, "n": 64}, {"x": "float32"}, "split_fused")
    progress(1, 2, request, build(), False)
    progress(2, 2, request, ModuleBuild("row_resident", None, refused="the row is too long"), True)
    progress.close()
    assert log.getvalue().splitlines() == [
        "compile sm_90 split_fused k_main: ok, 26 registers, 0 spilled, 1056 shared bytes",
        "compile sm_90 split_fused k_combine: FAILED: k_combine: line 3: boom",
        "compile sm_90 row_resident: refused: the row is too long"]
    terminal = Stream(terminal=True)
    progress = CompileProgress({id(request): "h100"}, terminal)
    progress(1, 2, request, build(), False)
    progress(2, 2, request, build(), True)
    progress.close()
    shown = terminal.getvalue()
    assert "\n" not in shown and shown.count("\r") == 3
    assert "[1/2] compiled h100 split_fused" in shown and "[2/2] compiled h100 split_fused (from the compile cache)" in shown


def compile_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", "compile", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})


def test_compile_logs_each_kernel_and_a_rerun_starts_no_compile_worker() -> None:
    args = ("safe_softmax", "--shape", "m=3,n=200", "--dtype", "float16", "--target", "a100",
            "--strategy", "streaming_fused")
    first = compile_cli(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    line = "compile a100 streaming_fused safe_softmax_streaming_fused_kernel: ok, "
    assert line in first.stderr and "(from the compile cache)" not in first.stderr, first.stderr
    again = compile_cli(*args)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stdout + again.stderr
    assert "(from the compile cache)" in again.stderr, again.stderr
    # what the rerun did: the request cache answered in this process, no worker process started
    spec = load_spec(spec_source("safe_softmax"))
    shape = bind_shape(spec, {"m": 3, "n": 200})
    request = CompileRequest(spec, shape, bind_dtypes(spec, "float16"), "streaming_fused", None,
                             Target.parse("sm_80"), sass=True)
    with CompilePool(1) as pool:
        [module] = pool.compile([request])
        assert not pool._pool._processes  # the executor starts its processes on the first submit only
    assert module.ok and module.kernels[0].kernel == "safe_softmax_streaming_fused_kernel"


def test_tune_logs_progress_lines_off_a_terminal(capsys: pytest.CaptureFixture) -> None:
    assert main(["tune", "safe_softmax", "--shape", "m=8,n=64", "--trials", "20", "--no-compile-check"]) == 0
    err = capsys.readouterr().err
    stage, *lines = [line for line in err.splitlines() if line.startswith("tune: ")]
    assert stage.startswith("tune: safe_softmax m=8,n=64: deriving"), stage  # what it is about to do, first
    assert [line.split(" trials")[0] for line in lines] == [f"tune: {n}/20" for n in (2, 4, 6, 8, 10, 12, 14, 16, 18, 20)]
    assert "\r" not in err and ", best " in lines[-1]


@pytest.mark.parametrize("command", [["run", "safe_softmax", "--families", "none"],
                                     ["tune", "safe_softmax", "--trials", "1", "--measurer", "model", "--no-compile-check"]])
def test_a_long_command_says_what_it_does_before_it_does_it(command: list[str]) -> None:
    """Issue 37, 8: the first thing on stderr is the stage line, written before the derivation,
    the kernels or the search start (``run`` printed nothing for 32 s on a fresh clone)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", *command], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stderr.readline()
    out, rest = proc.communicate(timeout=300)
    assert proc.returncode == 0, rest[-2000:]
    assert first.startswith(f"{command[0]}: safe_softmax m=5,n=300"), first
    assert "deriving" in first
