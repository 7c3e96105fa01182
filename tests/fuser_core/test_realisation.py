"""Realisations as data (fuser_core/realisation.py): one merge rule for every kind, read by the
certificate and the Triton printer alike, and no realisation-kind branch anywhere else."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import sympy as sp
from tests.support.catalog import load_catalog

from fuser_core.certificate import certify
from fuser_core.codegen.module import module_source, output_dtypes
from fuser_core.codegen.plan import default_config, make_plan
from fuser_core.derive import derive_cascade
from fuser_core.realisation import (
    COUNT_OLD,
    Combine,
    Rescale,
    acc_symbol,
    new,
    old,
    part_acc,
    part_anchor,
    part_count,
)
from fuser_core.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
CATALOG = load_catalog()
KIND_BRANCH = re.compile(r"\.kind (==|!=|in)\b")


def derived(name: str):
    return derive_cascade(load_spec(CATALOG[name]))


def spec_of(steps: list[dict], outputs: list[str]):
    return load_spec({"foldwise": 1, "name": "t", "inputs": {"x": {"dims": ["m", "n"]}}, "steps": steps,
                      "outputs": outputs})


def sym(d, name: str) -> sp.Symbol:
    return d.symbols.symbols[name]


def test_no_kind_branch_outside_the_realisation_module():
    """The realisation module is the only place that reads a realisation's kind to decide anything;
    other `.kind` comparisons (input kinds, tokens, dtypes, passes) have names of their own."""
    found = []
    for package in ("fuser_core", "tuner", "service"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() == "fuser_core/realisation.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if KIND_BRANCH.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
    assert KIND_BRANCH.search((ROOT / "fuser_core/realisation.py").read_text())  # the walk sees real files


def test_every_fused_reduction_has_one_realisation_built_by_the_derivation():
    d = derived("attention")
    assert set(d.realisations) == {n for n, f in d.forms.items() if f.fused}
    for name, real in d.realisations.items():
        assert real is d.forms[name].realisation and real.name == name
        assert real.accumulators and all(a.op == real.op for a in real.accumulators)


def test_merge_rule_first_sum_adds_the_parts():
    real = derived("layernorm").realisations["mean"]
    assert real.kind == "first" and real.per_lane
    assert real.merge() == (Combine("sum", part_acc(0, "a"), part_acc(0, "b")),)
    assert real.step() == (Combine("sum", acc_symbol(0), real.accumulators[0].contribution),)
    assert real.accumulators[0].initial == 0


def test_merge_rule_scaled_rescales_each_part_to_the_merged_max():
    d = derived("safe_softmax")
    real, mx = d.realisations["den"], sym(d, "mx")
    assert real.kind == "scaled" and real.op == "sum"
    (acc,) = real.accumulators
    assert acc.moved == Rescale(acc_symbol(0), sp.exp(old(mx) - new(mx)))
    (rule,) = real.merge()
    assert rule.op == "sum"
    assert rule.left == Rescale(part_acc(0, "a"), sp.exp(part_anchor(mx, "a") - new(mx)))
    assert rule.right == Rescale(part_acc(0, "b"), sp.exp(part_anchor(mx, "b") - new(mx)))
    assert real.doc and real.per_lane


def test_merge_rule_shifted_adds_each_parts_shift_with_its_count():
    # the shifted form, where Taylor does not apply: a cast inside the integrand (layernorm is Taylor)
    steps = [{"name": "mean", "reduce": "sum", "over": "n", "expr": "x / size(n)"},
             {"name": "var", "reduce": "sum", "over": "n", "expr": '(cast(x, "bfloat16") - mean) ** 2 / size(n)'}]
    d = derive_cascade(spec_of(steps, ["var"]))
    real, mean = d.realisations["var"], sym(d, "mean")
    assert real.kind == "shifted"
    (acc,) = real.accumulators
    shift = acc.moved - acc_symbol(0)
    assert COUNT_OLD in shift.free_symbols and {old(mean), new(mean)} <= shift.free_symbols
    (rule,) = real.merge()
    for side, expr in (("a", rule.left), ("b", rule.right)):
        assert expr.free_symbols >= {part_acc(0, side), part_count(side), part_anchor(mean, side), new(mean)}
        assert sp.simplify(expr - part_acc(0, side) - real.at_part(shift, side)) == 0
    # both parts empty-anchored at the merged mean: no shift at all
    same = rule.left.xreplace({part_anchor(mean, "a"): new(mean)})
    assert sp.simplify(same - part_acc(0, "a")) == 0


def test_merge_rule_taylor_moves_every_coefficient_jointly():
    steps = [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
             {"name": "v", "reduce": "sum", "over": "n", "expr": "(x - mx) ** 2"}]
    d = derive_cascade(spec_of(steps, ["v"]))
    real, mx = d.realisations["v"], sym(d, "mx")
    # coefficients 0 and 1 held; coefficient 2 (sum 1) is the count, no state
    assert real.kind == "taylor" and len(real.accumulators) == 2 and real.moves_jointly
    rules = real.merge()
    assert all(r.op == "sum" for r in rules)
    # coefficient 0 after the move reads the higher coefficients (the binomial shift), the top one as each part's count
    assert {part_acc(1, "a"), part_count("a")} <= rules[0].left.free_symbols
    assert {part_acc(1, "b"), part_count("b")} <= rules[0].right.free_symbols
    # unmoved anchors: the shift is the identity
    at_rest = {part_anchor(mx, "a"): new(mx)}
    for j, r in enumerate(rules):
        assert sp.simplify(r.left.xreplace(at_rest) - part_acc(j, "a")) == 0


def test_merge_rule_topk_selects_over_rescaled_values_and_is_not_per_lane():
    d = derived("moe_routing")
    real = d.realisations["gate"]
    assert real.selection and real.op == "topk" and real.k == d.spec.step("gate").k
    (rule,) = real.merge()
    assert rule.op == "topk" and rule.left.func == Rescale and rule.left.args[0] == part_acc(0, "a")
    assert not real.per_lane and "k" in real.per_lane_reason
    assert real.accumulators[0].initial == -sp.oo


def _corrupt_den(d):
    """den's realisation with its correction dropped: T is no longer rescaled when mx moves."""
    form = d.forms["den"]
    real = form.realisation
    acc = dataclasses.replace(real.accumulators[0], moved=acc_symbol(0))
    form.realisation = dataclasses.replace(real, accumulators=(acc,))
    return d


def test_certificate_and_printer_read_the_same_realisation():
    """Corrupting the realisation object (not the form it came from) breaks the certificate and
    changes the printed kernel the same way: both read it, neither keeps its own copy."""
    spec = load_spec(CATALOG["safe_softmax"])
    good = derive_cascade(spec)
    shape = {"m": 3, "n": 37}
    dtypes = {i.name: "float32" for i in spec.inputs}

    def source(d) -> str:
        plan = make_plan(spec, d, "split_fused", shape, default_config(spec, d, "split_fused", shape))
        return module_source(plan, output_dtypes(spec, dtypes), dtypes)

    assert certify(good, trials=6).holds
    assert "rescale(den_acc" in source(good)
    bad = _corrupt_den(derive_cascade(spec))
    cert = certify(bad, trials=6)
    assert not cert.holds and cert.per_reduction["den"] > 1e-3
    assert "rescale(den_acc" not in source(bad)


def test_a_corrupted_merge_operator_is_caught_by_the_certificate():
    d = derived("logsumexp")
    real = d.forms["mx"].realisation
    acc = dataclasses.replace(real.accumulators[0], op="min")  # the running max merged (and folded) as a min
    d.forms["mx"].realisation = dataclasses.replace(real, op="min", accumulators=(acc,))
    assert not certify(d, trials=6).holds


def test_the_dashboard_renders_a_taylor_realisation_from_its_expressions():
    from service.dashboard.mathtex import reduction_math

    steps = [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
             {"name": "v", "reduce": "sum", "over": "n", "expr": "(x - mx) ** 2"}]
    m = reduction_math(derive_cascade(spec_of(steps, ["v"])).forms["v"])
    assert len(m["accumulators"]) == 2 and len(m["merge"]) == 2
    assert m["correction"][0].startswith(r"T_{1} \leftarrow T_{1} + T_{2}")  # the binomial shift, as moved
    for text in [*m["update"], *m["merge"], *m["correction"], m["finalize"]]:
        double_subscript = re.search(r"_\{[^{}]*\}_\{", text)  # T_{1}_{a}: KaTeX refuses it
        assert text.count("{") == text.count("}") and not double_subscript and "[old]" not in text, text
