"""The one-call GPU check (``benchmarks/gpu/``, issue 21) without a GPU, so it cannot rot
between the rare calls that have one.

- **Refusal**: ``bash benchmarks/gpu/check.sh`` where no GPU is listed exits non-zero within
  10 s with one line on stderr naming the missing GPU, nothing on stdout, no result files.
  The environment is built, not found: a PATH with no ``nvidia-smi``, then a fake
  ``nvidia-smi`` that lists none; a fake that lists one shows the refusal hangs on the listing.
- **Dry run**: ``check.sh --dry-run`` runs every stage through Triton's interpreter at tiny
  shapes (Python 3.11 here, whatever Triton CI has) and writes the same files as the GPU run;
  every correctness row that ran passed, the client loaded its bundle (from source: no GPU
  binary), the speed stage timed the fused kernel and its baselines. Runs cut short by the
  budget list what they did not run.
- **Wheels**: ``benchmarks/gpu/wheels.txt`` carries every runtime dependency the GPU image
  (``benchmarks/gpu/image.txt``) lacks, one pin each; ``prepare_wheels.sh`` downloads them
  from PyPI (a network failure fails the test: CI has PyPI), they install for CPython 3.12
  (the GPU machine's), the pure-Python ones import here, and what travels stays under 64 MiB.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
CHECK_SH = GPU / "check.sh"
RESULT_FILES = {"env.txt", "check.log", "check.json", "summary.md", "correctness.md", "speed.md"}
CARRY_LIMIT = 64 << 20  # the device call's limit on what travels (repository + carried paths)
GPU_PYTHON = "3.12"  # the GPU image's Python (CPython, manylinux x86-64)

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pip's copy (prepare_wheels.sh does the same)
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

# The GPU machine, for environment markers in pyproject.toml and the wheels' metadata.
GPU_MARKERS = {"python_version": GPU_PYTHON, "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64",
               "platform_python_implementation": "CPython", "implementation_name": "cpython", "extra": ""}


def bash() -> str:
    path = shutil.which("bash")
    assert path, "bash is needed to run benchmarks/gpu/*.sh"
    return path


# ---------------------------------------------------------------------------- refusal


def tool_dir(tmp_path: Path, tools: tuple[str, ...], fake_smi: str | None = None) -> Path:
    """A folder for PATH holding links to exactly ``tools`` (and, given its body, a fake
    ``nvidia-smi``): what the preflight can find is then known, whatever this machine has."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        found = shutil.which(tool)
        assert found, f"{tool} is needed on PATH to build the test's environment"
        (bin_dir / tool).symlink_to(found)
    if fake_smi is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\n{fake_smi}\n")
        smi.chmod(0o755)
    return bin_dir


def refuse(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    # timeout: the "within 10 s"; a hang fails the test with TimeoutExpired
    proc = subprocess.run([bash(), str(CHECK_SH), *args], env=env, capture_output=True, text=True, timeout=10, cwd=ROOT)
    return proc, time.monotonic() - t0


def assert_refused(proc: subprocess.CompletedProcess, seconds: float) -> None:
    assert proc.returncode != 0, proc
    assert seconds < 10
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"want one line on stderr, got: {proc.stderr!r}"
    assert "no NVIDIA GPU" in lines[0], lines[0]  # names what is missing
    assert proc.stdout == "", f"nothing that looks like a result on stdout: {proc.stdout!r}"


# a driver with no GPU behind it: nvidia-smi exists, lists nothing and fails
NO_GPU_SMI = "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\" >&2; exit 9"


@pytest.mark.parametrize("smi", [None, NO_GPU_SMI], ids=["no-nvidia-smi", "nvidia-smi-lists-none"])
def test_refuses_at_once_without_a_gpu(tmp_path: Path, smi: str | None) -> None:
    # dirname (check.sh's cd) and grep (reads nvidia-smi -L): without grep the listing
    # could never match, and the refusal would pass for the wrong reason
    bin_dir = tool_dir(tmp_path, ("dirname", "grep"), fake_smi=smi)
    if smi is None:
        assert shutil.which("nvidia-smi", path=str(bin_dir)) is None
    out = tmp_path / "out"
    out.mkdir()
    proc, seconds = refuse({"PATH": str(bin_dir), "OUT": str(out)})
    assert_refused(proc, seconds)
    assert list(out.iterdir()) == [], "no result files"
    # a results folder given as the argument is not even created
    folder = tmp_path / "given"
    proc, seconds = refuse({"PATH": str(bin_dir)}, str(folder), "--budget-s", "30")
    assert_refused(proc, seconds)
    assert not folder.exists()


def test_a_listed_gpu_gets_past_the_preflight(tmp_path: Path) -> None:
    """The control for the refusal: the same script with an nvidia-smi that lists a GPU goes
    on (here torch then finds no CUDA device, and check.py refuses in its own words)."""
    bin_dir = tool_dir(tmp_path, (), fake_smi='echo "GPU 0: NVIDIA H200 (UUID: GPU-test)"')
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
           "FOLDWISE_GPU_SITE": str(tmp_path / "site")}  # if this checkout has a .whl/, it installs there
    proc = subprocess.run([bash(), str(CHECK_SH)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "no NVIDIA GPU here" not in proc.stderr + proc.stdout
    assert proc.returncode == 3, proc
    assert "torch sees no CUDA GPU" in (out / "check.log").read_text()
    assert "GPU 0: NVIDIA H200" in (out / "env.txt").read_text()  # the preflight's nvidia-smi output


# ---------------------------------------------------------------------------- dry run

# The dry run's options: every stage, one tuning trial per speed case. The whole run takes
# 60-120 s of wall time on a shared 2-CPU machine (about 55 s of CPU; correctness ~30 s of it,
# with 108 s of budget): the budget bounds a slow CI machine rather than cutting an ordinary run.
DRY_BUDGET_S = 240


def dry_run(out: Path, *options: str,
            timeout_s: float = DRY_BUDGET_S + 300) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([bash(), str(CHECK_SH), "--dry-run", str(out), *options], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, env=dict(os.environ))
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def full_dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("dry-run")
    proc, seconds = dry_run(out, "--budget-s", str(DRY_BUDGET_S), "--trials", "1")
    print(f"dry run: {seconds:.0f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"out": out, "proc": proc, "seconds": seconds, "results": json.loads((out / "check.json").read_text())}


def row_key(row: dict) -> tuple[str, str, str]:
    return row["spec"], row["dtype"], row["strategy"]


def test_dry_run_writes_the_results_of_a_gpu_run(full_dry_run: dict) -> None:
    out, results = full_dry_run["out"], full_dry_run["results"]
    names = {p.name for p in out.iterdir()}
    assert names == RESULT_FILES  # the device call brings back at most 8 files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    assert results["device"] == "cpu" and results["tiny"] is True
    # the bound holds: stages start no work past the budget (one speed case may run over)
    assert full_dry_run["seconds"] < DRY_BUDGET_S + 90
    # date and versions in every file: each is read on its own, later, beside other runs
    days = {results["started"][:10], results["finished"][:10]}  # a run may cross midnight (UTC)
    for name in sorted(RESULT_FILES):
        text = (out / name).read_text()
        assert any(day in text for day in days), name
        assert results["versions"]["torch"] in text and results["versions"]["triton"] in text, name
    # every number is labelled as the interpreter's, never as a GPU's
    assert "Triton interpreter" in (out / "summary.md").read_text()
    assert "not GPU" in (out / "speed.md").read_text()
    assert results["stages"]["probes"] == {"skipped": "no GPU: probes need CUDA", "seconds": pytest.approx(0, abs=1)}
    # the example's tokens/s need a GPU; its CPU run is the CI test it names
    assert results["stages"]["decoder"]["skipped"] == "no GPU: the example's CPU run is tests/e2e/test_example_decoder.py"
    assert "decoder: not run (no GPU" in (out / "summary.md").read_text()


def test_dry_run_checks_every_catalog_kernel(full_dry_run: dict) -> None:
    from fuser_core.catalog import catalog_names
    from fuser_core.codegen.plan import BASELINE  # the unfused chain's row

    stage = full_dry_run["results"]["stages"]["correctness"]
    assert "error" not in stage, stage.get("error")
    rows = stage["rows"]
    statuses = {r["status"] for r in rows}
    assert statuses <= {"passed", "not valid", "not run"}, [r for r in rows if r["status"] in ("wrong", "failed")][:3]
    # every spec of the catalog, each dtype with its unfused chain: nothing silently left out
    assert {r["spec"] for r in rows} == set(catalog_names())
    for spec, dtype in {(r["spec"], r["dtype"]) for r in rows}:
        strategies = [r["strategy"] for r in rows if (r["spec"], r["dtype"]) == (spec, dtype)]
        assert BASELINE in strategies and len(strategies) >= 2, (spec, dtype, strategies)
    assert len({row_key(r) for r in rows}) == len(rows)
    # what the budget cut is listed as such; the specs take turns, so a cut (the interpreter is
    # slow: CI's machine checks a third to a half of the rows in the budget) leaves none unchecked
    assert all(r.get("reason") == "time budget" for r in rows if r["status"] == "not run")
    passed = [r for r in rows if r["status"] == "passed"]
    assert {r["spec"] for r in passed} == set(catalog_names()), stage["counts"]
    for r in passed:  # a pass is a comparison that happened: an error below its tolerance
        assert r["max_rel_err"] is not None and r["max_rel_err"] <= max(r["tolerances"].values()), r
    assert f"passed {len(passed)}" in (full_dry_run["out"] / "correctness.md").read_text()


def test_dry_run_client_loads_its_bundle_from_source(full_dry_run: dict) -> None:
    stage = full_dry_run["results"]["stages"]["client"]
    assert "error" not in stage, stage.get("error")
    assert stage["device"] == "cpu"
    # no GPU, so no binary in the bundle: the client says so and runs the source
    assert stage["info"]["loaded"] == "source", stage["info"]
    assert stage["no_compile"] is False
    assert stage["passed"] is True and stage["max_rel_err"] is not None


def test_dry_run_times_the_fused_kernel_and_its_baselines(full_dry_run: dict) -> None:
    from tuner.bench.suites import case_id, load_suite

    stage = full_dry_run["results"]["stages"]["speed"]
    assert "error" not in stage, stage.get("error")
    assert stage["gpu"] is False and "not GPU" in stage["timing_label"]
    # every case of the smoke suite is there, run or listed as not run
    assert sorted(c["id"] for c in stage["cases"]) == sorted(case_id(c) for c in load_suite("smoke"))
    ran = [c for c in stage["cases"] if "skipped" not in c]
    assert ran, stage["cases"]
    assert all("time budget" in c["skipped"] for c in stage["cases"] if "skipped" in c)
    for case in ran:
        fused = case["variants"]["fused"]
        assert fused["status"] == "ok" and fused["time_ms"] > 0, (case["id"], fused)
        baselines = {k: v for k, v in case["variants"].items() if k != "fused" and v.get("status") == "ok"}
        assert "eager" in baselines, (case["id"], case["variants"])
        assert all(v["time_ms"] > 0 for v in baselines.values()), (case["id"], baselines)
        # none of the baselines that ran gave a wrong answer
        assert not [k for k, v in case["variants"].items() if v.get("status") == "wrong"], case["variants"]


def test_dry_run_lists_what_the_budget_cut(tmp_path: Path, full_dry_run: dict) -> None:
    """Short budgets: what was not run is in the results as not run, never dropped."""
    full_rows = full_dry_run["results"]["stages"]["correctness"]["rows"]
    # correctness gets 45% of 10 s: the worker's start and the first attention kernels use it
    # up (the whole plan takes ~30 s here). check.py as check.sh calls it, less env.txt's imports
    out = tmp_path / "correctness"
    proc = subprocess.run([sys.executable, str(GPU / "check.py"), "--out", str(out), "--device", "cpu", "--tiny",
                           "--budget-s", "10", "--stages", "correctness"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "check.json").read_text())
    rows = results["stages"]["correctness"]["rows"]
    assert [row_key(r) for r in rows] == [row_key(r) for r in full_rows]  # the same plan, row for row
    cut = [r for r in rows if r["status"] == "not run"]
    assert cut and all(r["reason"] == "time budget" for r in cut)
    assert {r["status"] for r in rows} <= {"passed", "not valid", "not run"}
    summary = (out / "summary.md").read_text()
    for stage in ("probes", "client", "speed"):
        assert results["stages"][stage] == {"skipped": "not asked for (--stages)"}
        assert f"- {stage}: not run (not asked for (--stages))" in summary
    assert f"not run {len(cut)}" in (out / "correctness.md").read_text()


def test_speed_stage_lists_the_cases_it_did_not_run() -> None:
    """The speed stage with no time left once its worker is up, called in this process
    (through check.sh, the run's own imports would eat a budget this short first): every case
    of the suite is listed, cut by the budget or left out by --only."""
    import argparse
    import importlib.util

    from tuner.bench.suites import case_id, load_suite

    spec = importlib.util.spec_from_file_location("gpu_check", GPU / "check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    args = argparse.Namespace(device="cpu", tiny=True, only="attention,safe_softmax", trials=1, target=None, seed=0,
                              timeout_s=90.0)
    saved = []
    stage = check.speed(args, 1e-3, saved.append)
    cases = stage["cases"]
    assert sorted(c["id"] for c in cases) == sorted(case_id(c) for c in load_suite("smoke"))
    for c in cases:
        wanted = c["spec"] in ("attention", "safe_softmax")
        assert c.get("skipped", "").startswith("time budget" if wanted else "not asked for (--only)"), c
    assert saved == []  # no case ran, so no partial save
    from tuner.bench.report import markdown

    not_run = markdown(stage).split("## Not run")[1]
    assert all(c["id"] in not_run for c in cases)


def test_check_rejects_names_it_does_not_know(tmp_path: Path) -> None:
    # a typo must not turn into a run that silently checks nothing (check.py directly: check.sh
    # passes these options through unchanged)
    for options, words in ((("--stages", "correctnes"), "unknown stage 'correctnes'"),
                           (("--only", "softmax"), "no case of spec 'softmax'")):
        proc = subprocess.run([sys.executable, str(GPU / "check.py"), "--out", str(tmp_path / "out"), "--device", "cpu",
                               "--tiny", *options], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and words in proc.stderr, proc
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- wheels


def pins() -> dict[str, list[tuple[str, str]]]:
    """wheels.txt as {canonical name: [(line's name, version), ...]} (a list, so a second pin shows)."""
    found: dict[str, list[tuple[str, str]]] = {}
    for line in (GPU / "wheels.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!]+)", line)
        assert m, f"wheels.txt: {line!r} is not one exact pin (name==version)"
        found.setdefault(canonicalize_name(m[1]), []).append((m[1], m[2]))
    return found


def image() -> tuple[list[str], dict[str, str]]:
    """image.txt (the one list, which prepare_wheels.sh reads too): name patterns, and the
    versions the image is known to have."""
    names, versions = [], {}
    for line in (GPU / "image.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            names.append(name)
            if version:
                versions[canonicalize_name(name)] = version
    return names, versions


def in_image(name: str, patterns: list[str]) -> bool:
    return any(name == canonicalize_name(p) or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


def runtime_dependencies() -> list[Requirement]:
    """pyproject.toml's ``dependencies`` that apply on the GPU machine (markers evaluated there)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(d) for d in project["dependencies"]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(GPU_MARKERS)]


def uncovered(deps: list[Requirement], carried: dict[str, list[tuple[str, str]]],
              patterns: list[str], known: dict[str, str]) -> list[str]:
    """What would break on the GPU machine: a dependency neither carried nor in the image, a
    name pinned twice, a pin or known image version outside the dependency's range."""
    problems = [f"{name} is pinned {len(p)} times: {p}" for name, p in carried.items() if len(p) != 1]
    for req in deps:
        name = canonicalize_name(req.name)
        if name in carried:
            version = carried[name][0][1]
            if not req.specifier.contains(version, prereleases=True):
                problems.append(f"{req}: wheels.txt pins {version}")
        elif in_image(name, patterns):
            if name in known and not req.specifier.contains(known[name], prereleases=True):
                problems.append(f"{req}: the image has {known[name]}")
        else:
            problems.append(f"{req}: neither in wheels.txt nor in the image")
    return problems


def test_wheels_list_carries_what_the_image_lacks() -> None:
    deps, carried, (patterns, known) = runtime_dependencies(), pins(), image()
    assert uncovered(deps, carried, patterns, known) == []
    # the check can fail: without the pin of a carried dependency, or with a second pin
    lacking = next(canonicalize_name(r.name) for r in deps if canonicalize_name(r.name) in carried)
    without = {k: v for k, v in carried.items() if k != lacking}
    assert [p for p in uncovered(deps, without, patterns, known) if "neither" in p] != []
    doubled = {**carried, lacking: carried[lacking] * 2}
    assert [p for p in uncovered(deps, doubled, patterns, known) if "pinned 2 times" in p] != []
    assert known, "image.txt names the versions it knows (numpy, torch, triton)"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """prepare_wheels.sh into a temporary folder (never the checkout's .whl/). It needs PyPI;
    CI has it, so a failed download fails here."""
    whl = tmp_path_factory.mktemp("whl")
    t0 = time.monotonic()
    proc = subprocess.run([bash(), str(GPU / "prepare_wheels.sh")], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "FOLDWISE_WHEEL_DIR": str(whl)})
    print(f"prepare_wheels.sh: {time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"dir": whl, "stdout": proc.stdout, "wheels": sorted(whl.glob("*.whl"))}


def is_binary(wheel: Path) -> bool:
    return any(t.abi != "none" or t.platform != "any" for t in parse_wheel_filename(wheel.name)[3])


def pip_install(target: Path, wheels: list[Path], *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                           str(target), "--only-binary=:all:", "--no-deps", "--no-index", "--no-compile", *options,
                           *map(str, wheels)],
                          capture_output=True, text=True, timeout=600)


def test_prepared_wheels_are_the_pins_and_fit(prepared: dict) -> None:
    got = {}
    for wheel in prepared["wheels"]:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        assert name not in got, f"two wheels of {name}"
        got[name] = str(version)
        assert zipfile.ZipFile(wheel).testzip() is None
    assert got == {name: p[0][1] for name, p in pins().items()}
    # the printed total is what travels: these wheels plus the files git would copy
    m = re.search(r"travels: (\d+) bytes", prepared["stdout"])
    assert m, prepared["stdout"]
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    repo_bytes = sum((ROOT / f).lstat().st_size for f in listed if f and os.path.lexists(ROOT / f))  # as stat(1)
    assert int(m[1]) == repo_bytes + sum(w.stat().st_size for w in prepared["wheels"])
    assert int(m[1]) < CARRY_LIMIT


@pytest.fixture(scope="module")
def site312(prepared: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheels installed as the GPU machine will: for CPython 3.12, which pip checks
    against each wheel's tags."""
    target = tmp_path_factory.mktemp("site312")
    proc = pip_install(target, prepared["wheels"], "--python-version", GPU_PYTHON)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return target


def extension_modules(site: Path) -> dict[str, list[str]]:
    """{distribution: [compiled module files]} from the installed RECORDs."""
    out = {}
    for record in site.glob("*.dist-info/RECORD"):
        files = [line.split(",")[0] for line in record.read_text().splitlines()]
        out[record.parent.name.split("-")[0]] = [f for f in files if f.endswith(".so")]
    return out


def test_wheels_install_for_python_312(prepared: dict, site312: Path, tmp_path: Path) -> None:
    binary = [w for w in prepared["wheels"] if is_binary(w)]
    assert binary, "pydantic-core, httptools and sqlalchemy are compiled: expected binary wheels"
    # their compiled modules cannot load on this interpreter (3.11 in CI): their tags say
    # which Python and machine they are for, and pip enforces the tags
    for wheel in binary:
        tags = parse_wheel_filename(wheel.name)[3]
        assert any(t.interpreter == "cp312" or (t.abi == "abi3" and 30 <= int(t.interpreter[2:]) <= 312)
                   for t in tags), wheel.name
        assert all(t.platform.startswith("manylinux") and t.platform.endswith("_x86_64") for t in tags), wheel.name
    refused = pip_install(tmp_path / "site311", binary, "--python-version", "3.11")
    assert refused.returncode != 0 and "is not a supported wheel" in refused.stderr, refused.stderr[-2000:]
    compiled = extension_modules(site312)
    assert all(compiled[parse_wheel_filename(w.name)[0].replace("-", "_")] for w in binary)
    for dist, files in compiled.items():
        for f in files:
            assert ".cpython-312-x86_64-linux-gnu." in f or ".abi3." in f, (dist, f)


IMPORT_CHECK = r"""
import importlib, importlib.metadata, json, re, sys
from pathlib import Path
target, want = Path(sys.argv[1]).resolve(), json.loads(sys.argv[2])
for dist, version in want["versions"].items():
    got = importlib.metadata.version(dist)
    assert got == version, f"{dist}: {got}, pinned {version}"
for name in want["carried"]:
    module = importlib.import_module(name)
    where = Path(module.__file__ or next(iter(module.__path__))).resolve()
    assert target in where.parents, f"{name} came from {where}, not the carried wheels"
for name in want["project"]:
    importlib.import_module(name)
from liger_kernel.transformers import functional
missing = [n for n in want["liger"] if not hasattr(functional, n)]
assert not missing, f"liger_kernel.transformers.functional lacks {missing}"
print(f"imported {len(want['carried'])} carried packages and {len(want['project'])} project modules")
"""


def top_level_modules(site: Path) -> list[str]:
    """Every importable top-level module of the installed wheels; a namespace package's
    (opentelemetry) subpackages instead of the namespace itself."""
    names = set()
    for record in site.glob("*.dist-info/RECORD"):
        files = {line.split(",")[0] for line in record.read_text().splitlines()}
        for f in files:
            parts = f.split("/")
            if len(parts) == 1 and f.endswith(".py"):
                names.add(f[:-3])
            elif len(parts) > 1 and parts[0] not in ("bin", "__pycache__") and not parts[0].endswith(".dist-info"):
                if f"{parts[0]}/__init__.py" in files:
                    names.add(parts[0])
                elif len(parts) > 2 and f"{parts[0]}/{parts[1]}/__init__.py" in files:
                    names.add(f"{parts[0]}.{parts[1]}")
    return sorted(names)


def test_carried_wheels_import_here(prepared: dict, tmp_path: Path) -> None:
    """The carried files import, with the project's modules on top of them. This Python is
    not the GPU machine's, so the compiled wheels are swapped for the same versions built
    for it (from PyPI); every pure-Python file imported is the carried one."""
    binary = [w for w in prepared["wheels"] if is_binary(w)]
    here = tmp_path / "binary-here"
    wanted = [f"{parse_wheel_filename(w.name)[0]}=={parse_wheel_filename(w.name)[1]}" for w in binary]
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                           "--only-binary=:all:", "-d", str(here), *wanted],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    site = tmp_path / "carried-site"  # not a module name: the subprocess's cwd is on its sys.path
    pure = [w for w in prepared["wheels"] if not is_binary(w)]
    proc = pip_install(site, pure + sorted(here.glob("*.whl")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    project = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for pkg in ("fuser_core", "tuner", "service") for p in (ROOT / pkg).rglob("*.py")
                     if p.stem != "__main__")  # a package's command line runs when imported
    # the Liger functions the expert baselines call, read from tuner/experts.py (one list)
    liger = re.findall(r'_liger\("(\w+)"\)', (ROOT / "tuner" / "experts.py").read_text())
    assert liger
    want = {"versions": {name: p[0][1] for name, p in pins().items()}, "carried": top_level_modules(site),
            "project": project, "liger": liger}
    assert {"pydantic", "fastapi", "sqlalchemy", "optuna", "liger_kernel"} <= set(want["carried"])
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}  # the carried wheels first, as on the GPU machine
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK, str(site), json.dumps(want)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stdout.strip())


def python312() -> str | None:
    """A CPython 3.12 to load the compiled wheels with: $FOLDWISE_TEST_PYTHON312, else
    python3.12 on PATH, if it runs (pyenv's shims exist where the version is not selected)."""
    for candidate in (os.environ.get("FOLDWISE_TEST_PYTHON312"), shutil.which("python3.12")):
        if not candidate:
            continue
        try:
            proc = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                  text=True, timeout=30)
        except OSError:
            continue
        if proc.returncode == 0 and proc.stdout.strip() == "(3, 12)":
            return candidate
    return None


def test_compiled_wheels_load_on_python_312(site312: Path) -> None:
    """Where a CPython 3.12 exists, every compiled module of the carried wheels loads in it."""
    python = python312()
    if python is None:
        pytest.skip("no CPython 3.12 here (set FOLDWISE_TEST_PYTHON312): the compiled wheels' tags are checked instead")
    modules = [f.split(".")[0].replace("/", ".") for files in extension_modules(site312).values() for f in files]
    assert modules
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint(len(sys.argv) - 1)"
    proc = subprocess.run([python, "-I", "-c", f"import sys; sys.path.insert(0, {str(site312)!r})\n{code}", *modules],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == str(len(modules))
