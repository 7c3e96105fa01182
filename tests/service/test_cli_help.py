"""The command line's own surface: --version, help texts with descriptions and defaults, and the
tune progress bar (on a terminal only, never under --json)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest

from fuser_core import __version__
from service.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"foldwise {__version__}"


def _help(*command: str) -> str:
    parser = build_parser()
    for name in command:
        parser = next(a for a in parser._actions if a.dest == "command").choices[name]
    return " ".join(parser.format_help().split())  # argparse wraps at the terminal width


def test_every_command_has_a_description():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {"catalog", "derive", "run", "tune", "worker", "serve", "db", "token", "bench"} <= set(commands)
    for name, command in commands.items():
        assert command.description, name
    assert "validate a spec and derive its fused form" in _help("derive")
    assert "a catalog name (see `foldwise catalog`) or a path to a spec JSON file" in _help("derive")


def test_tune_help_shows_the_defaults():
    text = _help("tune")
    assert "or a JSON map input -> dtype (default: float32)" in text
    assert "(h100, h200, a100, ...) (default: h100)" in text
    assert "(predict from the target's profile) (default: model)" in text
    assert "(default 40)" in text and "(default: 40)" not in text  # stated once
    assert "(default: None)" not in text and "(default: False)" not in text


def _tune_on_a_terminal(*extra: str) -> str:
    """`foldwise tune` with stderr on a pseudo-terminal (stdout a pipe); what the terminal saw."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "tune", "safe_softmax", "--shape", "m=8,n=64",
                             "--trials", "3", *extra], stdout=subprocess.PIPE, stderr=terminal, env=env)
    os.close(terminal)
    seen = b""
    while True:
        ready, _, _ = select.select([controller], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    proc.communicate(timeout=120)
    os.close(controller)
    assert proc.returncode == 0, seen
    return seen.decode()


def test_tune_shows_progress_on_a_terminal_but_not_under_json():
    shown = _tune_on_a_terminal()
    assert "\r[" in shown and "3/3 trials, best " in shown
    assert "\r[" not in _tune_on_a_terminal("--json")


def test_tune_without_a_terminal_prints_no_bar(capsys):
    assert main(["tune", "safe_softmax", "--shape", "m=8,n=64", "--trials", "2"]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and captured.out.startswith("best: ")


def test_tune_prints_no_interpreter_warnings():
    """moe_routing's kernels divide by zero in masked-off lanes under the interpreter; the outputs
    are checked, so NumPy's warnings about those lanes are not printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "service.cli", "tune", "moe_routing", "--shape", "t=8,x=64",
                           "--trials", "6"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "0 failed" in proc.stdout and "RuntimeWarning" not in proc.stderr, proc.stderr
