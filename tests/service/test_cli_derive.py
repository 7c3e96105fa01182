"""`foldwise derive` as docs/API.md specifies it: JSON fields, exit codes, messages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.catalog import CATALOG_DIR, NOT_FUSED, load_catalog
from fuser_core.canonical import spec_hash
from fuser_core.report import derivation_report
from fuser_core.spec import load_spec
from service.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_derive_json_has_the_interface_fields():
    out = run_cli("derive", str(CATALOG_DIR / "attention.json"), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["spec_hash"] == spec_hash(load_spec((CATALOG_DIR / "attention.json").read_text()))
    assert report["fusible"] is True
    for red in report["reductions"]:
        assert {"name", "op", "over", "fused", "correction", "reason"} <= set(red)
    assert {r["name"] for r in report["reductions"]} == {"s", "mx", "den", "o"}
    cert = report["certificate"]
    assert {"max_rel_err", "trials", "exact"} <= set(cert) and cert["max_rel_err"] < 1e-9


@pytest.mark.parametrize("name", sorted(load_catalog()))
def test_every_catalog_spec_derives_in_process(name, capsys):
    assert main(["derive", str(CATALOG_DIR / f"{name}.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["name"] == name and report["fusible"] is (name not in NOT_FUSED)


def test_non_fusible_spec_exits_0_with_a_reason(tmp_path):
    spec = {
        "foldwise": 1, "name": "nf", "inputs": {"x": {"dims": ["m", "n"]}},
        "steps": [{"name": "mean", "reduce": "sum", "over": "n", "expr": "x / size(n)"},
                  {"name": "r", "reduce": "sum", "over": "n", "expr": "maximum(x, mean)"}],
        "outputs": ["r"],
    }
    path = tmp_path / "nf.json"
    path.write_text(json.dumps(spec))
    out = run_cli("derive", str(path), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["fusible"] is False
    (r,) = [x for x in report["reductions"] if x["name"] == "r"]
    assert r["fused"] is False and "Max(mean, x)" in r["reason"]


@pytest.mark.parametrize(
    "expr, field, words",
    [
        ("x.__class__", "steps[0] (a).expr", "attribute access"),
        ("__import__('os')", "steps[0] (a).expr", "unknown function"),
        ("y", "steps[0] (a).expr", "unknown name 'y'"),
        ("exp(x, x)", "steps[0] (a).expr", "exp() takes 1 argument"),
        ("(" * 200 + "x" + ")" * 200, "steps[0] (a).expr", "deeper"),
    ],
)
def test_invalid_spec_exits_2_naming_the_field(tmp_path, expr, field, words):
    spec = {"foldwise": 1, "name": "bad", "inputs": {"x": {"dims": ["n"]}},
            "steps": [{"name": "a", "reduce": "sum", "over": "n", "expr": expr}], "outputs": ["a"]}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(spec))
    out = run_cli("derive", str(path))
    assert out.returncode == 2
    assert field in out.stderr and words in out.stderr
    assert out.stdout == ""


def test_invalid_spec_is_rejected_before_sympy_is_imported(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"foldwise": 1, "name": "bad"}')
    code = (
        "import sys; from service.cli import main; rc = main(['derive', sys.argv[1]]); "
        "print('sympy' in sys.modules, rc)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "2"], out.stderr


def test_missing_file_and_bad_json_exit_2(tmp_path):
    assert run_cli("derive", str(tmp_path / "nope.json")).returncode == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    out = run_cli("derive", str(bad))
    assert out.returncode == 2 and "not valid JSON" in out.stderr


def test_renamed_spec_shares_the_hash_but_keeps_its_own_names():
    raw = load_catalog()["safe_softmax"]
    renamed = json.loads(
        json.dumps(raw).replace('"mx"', '"peak"').replace("x - mx", "x - peak").replace('"n"', '"cols"')
    )
    a, b = derivation_report(load_spec(raw)), derivation_report(load_spec(renamed))
    assert a["spec_hash"] == b["spec_hash"]
    assert [r["name"] for r in b["reductions"]] == ["peak", "den"]
    assert b["reductions"][1]["correction"] == "multiply by exp(peak[old] - peak[new])"
    assert b["reductions"][1]["over"] == "cols"


def test_derivation_over_its_limits_exits_2_naming_the_step(tmp_path, capsys):
    from tests.fuser_core.test_limits import CRAFTED

    path = tmp_path / "maximum_chain.json"
    path.write_text(json.dumps(CRAFTED["maximum_chain"][0]))
    assert main(["derive", str(path)]) == 2
    err = capsys.readouterr().err
    assert "the derivation exceeds its limits" in err and "step 'e8'" in err, err


def test_a_failing_certificate_exits_1_and_says_what_it_means(tmp_path, capsys, monkeypatch):
    """A wrong fused form (den's correction dropped, in the derivation the certificate checks)
    fails the certificate: exit 1, FAILED, and a line naming the reduction and the consequence."""
    import dataclasses

    import sympy as sp

    import fuser_core.certificate as certificate
    from fuser_core.report import clear_cache

    real = certificate.certify

    def certify_a_wrong_form(derivation, **kw):
        den = next(k for k, f in derivation.forms.items() if f.step.reduce == "sum")
        derivation.forms[den] = dataclasses.replace(derivation.forms[den], corrections=(sp.Integer(1),))
        derivation.realise(den)
        return real(derivation, **kw)

    monkeypatch.setattr(certificate, "certify", certify_a_wrong_form)
    clear_cache()
    try:
        path = tmp_path / "softmax.json"
        path.write_text(json.dumps(load_catalog()["safe_softmax"]))
        assert main(["derive", str(path)]) == 1
        text = capsys.readouterr().out
        assert "FAILED" in text and "certificate fails for den" in text and "allow_uncertified" in text
        assert main(["derive", str(path), "--json"]) == 1
        cert = json.loads(capsys.readouterr().out)["certificate"]
        assert cert["holds"] is False and cert["failed"] == ["den"] and "den" in cert["verdict"]
    finally:
        monkeypatch.undo()
        clear_cache()
    assert main(["derive", str(path)]) == 0 and "FAILED" not in capsys.readouterr().out
