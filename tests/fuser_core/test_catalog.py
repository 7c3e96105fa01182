"""The packaged catalog (fuser_core/catalog): specs by name, a path still works, a user's folder
through $FOLDWISE_CATALOG_DIR, the suites, and `foldwise catalog`."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fuser_core.catalog import (
    PACKAGED_DIR,
    CatalogError,
    catalog_dirs,
    catalog_entries,
    catalog_names,
    load_catalog_spec,
    load_suites,
    spec_path,
    spec_source,
)
from fuser_core.spec import load_spec
from service.cli import main

ROOT = Path(__file__).resolve().parents[2]
PACKAGED_SPECS = {"attention", "attention_causal", "attention_sink", "cross_entropy", "fp8_quant_gemm",
                  "fp8_quant_per_token", "group_norm", "layernorm", "logsumexp", "moe_routing", "rmsnorm", "safe_softmax",
                  # the serving catalog (issue 24)
                  "attention_gqa", "attention_padded", "attention_varlen", "attention_sliding_window",
                  "attention_softcap", "cross_entropy_ignore", "rmsnorm_residual", "swiglu_fp8_per_token",
                  # norm + fp8 quantisation (issue 36)
                  "rmsnorm_fp8_per_token", "rmsnorm_residual_fp8_per_token", "rmsnorm_fp8_per_block",
                  # a paged KV cache (issue 36)
                  "attention_paged",
                  # an LM head's GEMM fused with its loss (issue 39)
                  "linear_cross_entropy"}


def test_packaged_catalog_names_are_the_specs_own_names():
    assert set(catalog_names([PACKAGED_DIR])) == PACKAGED_SPECS
    for entry in catalog_entries([PACKAGED_DIR]):
        spec = load_catalog_spec(entry.name)
        assert spec.name == entry.name and entry.packaged and entry.doc  # every packaged spec says what it is


def test_the_package_data_ships_every_catalog_file():
    """pyproject's package-data patterns must match each file of the catalog folder, or a wheel
    (and a non-editable install) would come without specs."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["fuser_core.catalog"]
    files = [p.name for p in PACKAGED_DIR.iterdir() if p.is_file() and p.suffix == ".json"]
    assert "suites.json" in files and len(files) == len(PACKAGED_SPECS) + 1
    assert all(any(fnmatch.fnmatch(name, pat) for pat in patterns) for name in files)


def test_a_name_or_a_path():
    by_name = spec_source("safe_softmax")
    assert by_name == (PACKAGED_DIR / "safe_softmax.json").read_bytes()
    assert spec_source(PACKAGED_DIR / "safe_softmax.json") == by_name
    assert spec_source(str(PACKAGED_DIR / "safe_softmax.json")) == by_name


def test_an_existing_file_wins_over_a_catalog_name(tmp_path, monkeypatch):
    (tmp_path / "safe_softmax").write_text((PACKAGED_DIR / "rmsnorm.json").read_text())
    monkeypatch.chdir(tmp_path)
    assert load_catalog_spec("safe_softmax").name == "rmsnorm"


def test_unknown_names_say_what_exists():
    with pytest.raises(CatalogError, match=r"safe_softmaxx: no such file, and no catalog spec of that name; "
                                           r"catalog names: attention, attention_causal, attention_gqa,"):
        spec_path("safe_softmaxx")
    with pytest.raises(CatalogError, match=r"the catalog has 'layernorm': give the name without \.json"):
        spec_path("layernorm.json")
    with pytest.raises(CatalogError, match="no such file"):
        spec_path("../fuser_core/catalog/layernorm")  # names never walk out of a folder
    with pytest.raises(CatalogError, match="not a file"):
        spec_path(PACKAGED_DIR)


def test_user_folders_come_first_and_add_names(tmp_path, monkeypatch):
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir(), other.mkdir()
    (mine / "safe_softmax.json").write_text((PACKAGED_DIR / "logsumexp.json").read_text())
    (other / "my_norm.json").write_text((PACKAGED_DIR / "rmsnorm.json").read_text())
    (other / "suites.json").write_text(json.dumps({"doc": "not a suite", "smoke": [{"spec": "my_norm", "shape": {}}]}))
    monkeypatch.setenv("FOLDWISE_CATALOG_DIR", os.pathsep.join([str(mine), str(other), str(tmp_path / "absent")]))
    assert catalog_dirs() == [mine.resolve(), other.resolve(), PACKAGED_DIR]
    assert set(catalog_names()) == PACKAGED_SPECS | {"my_norm"}
    assert load_catalog_spec("safe_softmax").name == "logsumexp"  # the user's spec of that name
    assert load_catalog_spec("my_norm").name == "rmsnorm"
    entries = {e.name: e for e in catalog_entries()}
    assert not entries["my_norm"].packaged and entries["attention"].packaged
    suites = load_suites()
    assert suites["smoke"] == [{"spec": "my_norm", "shape": {}}] and "paper" in suites and "doc" not in suites


def test_packaged_suites_name_catalog_specs_with_complete_shapes():
    suites = load_suites([PACKAGED_DIR])
    assert {"paper", "smoke"} <= set(suites)
    for name, cases in suites.items():
        for case in cases:
            spec = load_spec(spec_source(case["spec"], [PACKAGED_DIR]))
            assert set(case["shape"]) <= set(spec.dims), (name, case)


def test_a_broken_suites_file_is_named(tmp_path):
    (tmp_path / "suites.json").write_text("{")
    with pytest.raises(CatalogError, match=f"{tmp_path / 'suites.json'}: not valid JSON"):
        load_suites([tmp_path])


def test_cli_catalog_lists_and_prints(capsys, tmp_path, monkeypatch):
    assert main(["catalog"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^safe_softmax +Softmax over the last axis, max-shifted for numerical safety\.$", out, re.M)
    assert f"{len(PACKAGED_SPECS)} specs; packaged catalog {PACKAGED_DIR}" in out
    assert main(["catalog", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {e["name"] for e in listing} == PACKAGED_SPECS and all(e["packaged"] for e in listing)
    assert main(["catalog", "attention"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((PACKAGED_DIR / "attention.json").read_text())
    assert main(["catalog", "nope"]) == 2
    assert "error: nope: no such file, and no catalog spec of that name" in capsys.readouterr().err
    (tmp_path / "mine.json").write_text((PACKAGED_DIR / "rmsnorm.json").read_text())
    monkeypatch.setenv("FOLDWISE_CATALOG_DIR", str(tmp_path))
    assert main(["catalog"]) == 0
    out = capsys.readouterr().out
    assert f"[{tmp_path.resolve() / 'mine.json'}]" in out and f"searched first: {tmp_path.resolve()}" in out


def test_derive_by_name_in_a_subprocess(tmp_path):
    """The console path end to end: a name from any working directory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FOLDWISE_CATALOG_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "service.cli", "derive", "safe_softmax"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("safe_softmax  spec_hash ") and "fusible: yes" in proc.stdout


@pytest.mark.parametrize("name", sorted(PACKAGED_SPECS))
def test_foldwise_run_without_a_shape_runs_the_specs_example(name, capsys, monkeypatch):
    """Issue 36: every catalog spec carries an example shape, and `foldwise run NAME` runs it: the
    random self-check and the accuracy bar of every input family pass there."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    example = load_catalog_spec(name).example
    assert example, name
    assert main(["run", name]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["accuracy"]["passed"]
    assert {d: report["shape"][d] for d in example} == example


def test_an_example_is_checked_as_a_shape_and_is_no_part_of_the_identity(tmp_path, capsys):
    from fuser_core import SpecError
    from fuser_core.canonical import spec_hash

    raw = json.loads((PACKAGED_DIR / "attention_causal.json").read_text())
    with pytest.raises(SpecError, match=r"example\.d: must be a positive integer, got 0"):
        load_spec({**raw, "example": {**raw["example"], "d": 0}})
    with pytest.raises(SpecError, match=r"^example: expected an object"):
        load_spec({**raw, "example": [3, 37]})
    # bound where a command uses it, as every shape is: the spec's constraint holds for its example too
    (tmp_path / "wide.json").write_text(json.dumps({**raw, "example": {**raw["example"], "m": 40}}))
    assert main(["run", str(tmp_path / "wide.json")]) == 2
    assert "example.m: m = 40 and n = 37: the spec takes only m <= n" in capsys.readouterr().err
    (tmp_path / "odd.json").write_text(json.dumps({**raw, "example": {**raw["example"], "x": 2}}))
    assert main(["compile", str(tmp_path / "odd.json")]) == 2
    assert "example.x: unknown dim 'x'" in capsys.readouterr().err
    bare = {k: v for k, v in raw.items() if k != "example"}
    assert spec_hash(load_spec(bare)) == spec_hash(load_spec(raw))
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    assert main(["run", str(tmp_path / "bare.json")]) == 2
    assert "--shape: attention_causal has no example shape; give one" in capsys.readouterr().err
