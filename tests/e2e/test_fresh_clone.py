"""The README's tour, run from a fresh copy of the repository with nothing beside it.

The copy holds exactly the files git tracks (``git ls-files``), in an empty temporary folder, so
nothing outside the repository (a ``../shared`` folder, an untracked file, a build artefact) can
make it pass. It reuses the environment the tests run in: the copy goes first on ``PYTHONPATH``
and ``foldwise`` is a shim running ``python -m service.cli`` with this interpreter, and the test
checks that ``fuser_core``, ``tuner`` and ``service`` are imported from the copy, not from an
installed checkout.

The commands come from the README itself: every line ``    $ COMMAND`` of its code blocks is run
in the copy, in order, and must exit 0 (or the code listed in EXIT_CODES); the lines shown after
it are its expected output, where ``...`` stands for anything. The service part runs the README's
``curl`` submission against ``foldwise serve`` and then its CPU client snippet. Finally, every
relative link and every repository path the README (and docs/) names must exist in the copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
EXIT_CODES = {"foldwise derive bad.json": 2}  # the README's invalid-spec example
COMMAND_TIMEOUT_S = 240


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.fail(f"git ls-files failed in {ROOT}: {err}")
    return [name for name in out.decode().split("\0") if name]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """``<empty tmp>/foldwise``: the tracked files only."""
    repo = tmp_path_factory.mktemp("fresh-clone") / "foldwise"
    for name in _tracked_files():
        source = ROOT / name
        if not source.is_file():  # deleted in the work tree but not yet in the index
            continue
        target = repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    assert sorted(p.name for p in repo.parent.iterdir()) == ["foldwise"]  # nothing beside it
    return repo


@pytest.fixture(scope="module")
def env(clone: Path, tmp_path_factory) -> dict[str, str]:
    """The environment of every command: the copy first on PYTHONPATH, `foldwise` from the copy."""
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "foldwise"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m service.cli "$@"\n')
    shim.chmod(0o755)
    out = {k: v for k, v in os.environ.items() if not k.startswith("FOLDWISE_") and k not in ("PYTHONPATH",)}
    out.update(PYTHONPATH=str(clone), PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               FOLDWISE_CACHE_DIR=str(tmp_path_factory.mktemp("cache")), TRITON_INTERPRET="1",
               PYTHONDONTWRITEBYTECODE="1")
    return out


def run(command: str, clone: Path, env: dict[str, str], timings: list | None = None) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    proc = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    if timings is not None:
        timings.append((command, proc.returncode, time.perf_counter() - start))
    return proc


# ----------------------------------------------------------------------------- the README's text


def tour_commands(readme: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for every ``    $ COMMAND`` line of the README."""
    out: list[tuple[str, list[str]]] = []
    lines = readme.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("    $ "):
            continue
        expected = []
        for follow in lines[i + 1:]:
            if not follow.startswith("    ") or follow.startswith("    $ "):
                break
            expected.append(follow[4:])
        out.append((line[6:], expected))
    return out


def code_block_after(readme: str, first_line: str) -> str:
    """The indented code block that starts with ``first_line`` (unindented)."""
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"    {first_line}"))
    block = []
    for line in lines[start:]:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block).strip() + "\n"


def pattern(expected_line: str) -> re.Pattern:
    """A shown output line as a pattern: ``...`` matches anything, the rest literally."""
    return re.compile(".*".join(re.escape(part) for part in expected_line.rstrip().split("...")))


def test_the_copy_imports_its_own_code(clone: Path, env: dict[str, str]) -> None:
    proc = run(f'"{sys.executable}" -c "import fuser_core, tuner, service.cli, fuser_core.catalog as c; '
               'print(fuser_core.__file__, tuner.__file__, service.cli.__file__, c.PACKAGED_DIR)"', clone, env)
    assert proc.returncode == 0, proc.stderr
    for path in proc.stdout.split():
        assert Path(path).resolve().is_relative_to(clone.resolve()), (path, clone)
    assert not (clone.parent / "shared").exists()


def test_the_readme_tour_runs_from_the_copy(clone: Path, env: dict[str, str]) -> None:
    readme = (clone / "README.md").read_text()
    commands = tour_commands(readme)
    names = [c for c, _ in commands]
    for wanted in ("foldwise catalog", "foldwise derive attention", "foldwise derive layernorm",
                   "foldwise run moe_routing", "foldwise tune safe_softmax", "foldwise bench --suite smoke --device cpu"):
        assert any(c.startswith(wanted) for c in names), f"the README's tour lost `{wanted}`"
    timings: list[tuple[str, int, float]] = []
    stdout: dict[str, str] = {}
    for command, expected in commands:
        proc = run(command, clone, env, timings)
        stdout[command] = proc.stdout
        shown = proc.stdout + proc.stderr
        assert proc.returncode == EXIT_CODES.get(command, 0), (command, shown[-3000:])
        assert "RuntimeWarning" not in proc.stderr, (command, proc.stderr[-3000:])
        for line in expected:
            assert pattern(line).search(shown), (command, line, shown[-3000:])
    # what the shown lines leave out
    report = json.loads(next(out for c, out in stdout.items() if c.startswith("foldwise run moe_routing")))
    assert report["passed"] is True and report["strategy"] == "streaming_fused"
    assert json.loads((clone / "foldwise-bench/smoke-cpu-interpreter/bench_smoke.json").read_text())["gpu"] is False
    _print_timings(timings)


def test_the_readme_service_tour_runs_from_the_copy(clone: Path, env: dict[str, str]) -> None:
    """`foldwise serve`, the README's curl submission (the spec by catalog name through
    `foldwise catalog`), then its CPU client snippet, whose kernel must compute a softmax."""
    readme = (clone / "README.md").read_text()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    timings: list[tuple[str, int, float]] = []
    server = subprocess.Popen(["foldwise", "serve", "--port", str(port)], cwd=clone, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        start = time.perf_counter()
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "foldwise serve did not answer /healthz within 120 s"
            time.sleep(0.3)
        timings.append((f"foldwise serve --port {port} (until /healthz answers)", 0, time.perf_counter() - start))
        assert (clone / "foldwise.db").is_file()  # the embedded default database, in the working directory

        curl = code_block_after(readme, "curl -s localhost:8000/v1/jobs").replace("localhost:8000", f"127.0.0.1:{port}")
        proc = run(curl, clone, env, timings)
        assert proc.returncode == 0, proc.stderr
        job = json.loads(proc.stdout)
        assert job["status"] in ("queued", "running", "succeeded"), job
        start = time.perf_counter()
        deadline = time.monotonic() + 180
        while job["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, job
            time.sleep(0.5)
            job = httpx.get(f"{base}/v1/jobs/{job['id']}", timeout=10).json()
        timings.append(("(the job, until it succeeded)", 0, time.perf_counter() - start))
        assert job["status"] == "succeeded", job

        # the README's bad curl: the command inside $(...) fails, and the 422 says what is missing
        bad = curl.replace("$(foldwise catalog safe_softmax)", "$(foldwise catalog no_such_spec)")
        proc = run(bad.replace("curl -s ", "curl -s -w '\\n%{http_code}' "), clone, env)
        body, status = proc.stdout.rsplit("\n", 1)
        assert status == "422" and "no_such_spec: no such file, and no catalog spec" in proc.stderr
        assert json.loads(body)["errors"][0]["field"] == "body"
        assert "the value of 'spec' is missing" in json.loads(body)["errors"][0]["message"]

        snippet = code_block_after(readme, "import os")
        assert 'os.environ["TRITON_INTERPRET"] = "1"' in snippet and 'device="cpu"' in snippet
        check = ("\nx = torch.randn(64, 4096, dtype=torch.float16, device='cpu')\n"
                 "y = kernel(x=x)['y']\n"
                 "ref = torch.softmax(x.double(), dim=1)\n"
                 "assert y.shape == (64, 4096) and y.dtype == torch.float16, (y.shape, y.dtype)\n"
                 "assert (y.double() - ref).abs().max() < 1e-3, (y.double() - ref).abs().max()\n"
                 "print('client ok')\n")
        script = clone.parent.parent / "client_snippet.py"  # outside the copy's folder
        script.write_text(snippet.replace("http://127.0.0.1:8000", base) + check)
        client_env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}  # the snippet sets it itself
        proc = run(f'"{sys.executable}" {script}', clone, client_env, timings)
        assert proc.returncode == 0 and "client ok" in proc.stdout, proc.stderr[-3000:]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    _print_timings(timings)


def _print_timings(timings: list[tuple[str, int, float]]) -> None:
    """The tour's commands with exit codes and times (shown with pytest -s or -rA)."""
    for command, code, seconds in timings:
        print(f"exit {code}  {seconds:6.1f} s  {command.splitlines()[0][:150]}")


# ----------------------------------------------------------------------------- links


LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]*)`")  # `fuser_core/spec.py`, `docs/`, `benchmarks/results/`
LAYOUT_ROW = re.compile(r"^\| `([\w/]+/)`[^|]*\| (.*) \|$", re.M)  # | `fuser_core/codegen/` | ... |
ROW_NAME = re.compile(r"`([\w./]+\.py|\w+/)`")  # `plan.py`, `api/`


def test_readme_and_docs_point_only_at_files_the_repository_has(clone: Path) -> None:
    documents = [clone / "README.md", *sorted((clone / "docs").glob("*.md"))]
    assert {p.name for p in documents} >= {"README.md", "SPEC.md", "THEORY.md", "API.md", "OPERATIONS.md",
                                           "DECISIONS.md"}
    missing = []
    for doc in documents:
        text = doc.read_text()
        assert "../shared" not in text, f"{doc.name} points outside the repository"
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists():
                missing.append(f"{doc.name}: link {target}")
        if doc.name in ("README.md", "DECISIONS.md"):  # these name repository paths in backticks too
            top = {p.name for p in clone.iterdir()}
            for target in CODE_PATH.findall(text):
                if target.split("/")[0] in top and not (clone / target).exists():
                    missing.append(f"{doc.name}: path `{target}`")
            # the layout table: | `dir/` | ... (`file.py`, `sub/`) ... | names files of that folder
            for folder, row in LAYOUT_ROW.findall(text):
                for name in ROW_NAME.findall(row):
                    if not any((clone / f / name).exists() for f in (folder, "")):
                        missing.append(f"{doc.name}: layout `{folder}` names `{name}`")
    assert not missing, missing


def test_the_readme_is_for_users(clone: Path) -> None:
    """Issue 26: the README is what it is, the two set-up commands and the tour, in at most 150
    lines; the design decisions live in docs/DECISIONS.md."""
    readme = (clone / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, len(readme.splitlines())
    headings = [line for line in readme.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## Set-up: two commands", "## A five-minute tour"], headings
    assert "docs/DECISIONS.md" in readme
    decisions = (clone / "docs" / "DECISIONS.md").read_text()
    for heading in ("## Decisions (where the docs are silent)", "## Service decisions",
                    "## Supported Triton versions: 3.6 to 3.9", "**The seed.**"):
        assert heading in decisions, heading

