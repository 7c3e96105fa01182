"""Bounded, reproducible fuzz of the core on random VALID cascades (tests/support/fuzz_strategies.py):

- every generated spec loads, and its canonical form and a consistent renaming keep its hash;
- derive_cascade raises nothing but our documented errors (DerivationLimitError counts as
  "reported as such");
- every fused reduction's certificate holds (exact ones to float64 rounding);
- for a subset, the default strategy and every valid strategy pass self_check against the
  float64 reference at a small ragged shape under Triton's interpreter (float32), and each of
  those kernels compiles with Triton's GPU compiler for sm_90 and sm_80;
- targeted mutations of generated specs raise only SpecError (or load and derive).

Examples are derandomised (the same specs on every run). Raise FOLDWISE_FUZZ_EXAMPLES for a
longer run here; benchmarks/fuzz_long.py is the long run with counts by outcome.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from datetime import timedelta

import pytest
from tests.support.fuzz_strategies import CI_FAMILIES, cascade_specs, check_cascade, mutated_specs
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fuser_core import expr as ex
from fuser_core.canonical import canonical_form, spec_hash
from fuser_core.spec import load_spec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values

EXAMPLES = int(os.environ.get("FOLDWISE_FUZZ_EXAMPLES", "0")) or None


def bounded(n: int, deadline_s: float, *, shrink: bool = True):
    """A fixed number of derandomised examples, each within a (generous) deadline. Without
    shrinking, a failure reports the spec as drawn (shrinking kernel runs takes minutes)."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=EXAMPLES or n, deadline=timedelta(seconds=deadline_s), derandomize=True, database=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def show(raw: dict) -> str:
    return json.dumps(raw)


def test_random_cascades_derive_and_certify():
    counts: Counter[str] = Counter()

    @bounded(200, deadline_s=30)
    @given(cascade_specs())
    def check(raw):
        outcome = check_cascade(raw)
        assert outcome.status != "invalid", f"the generator made an invalid spec: {outcome.detail}\n{show(raw)}"
        assert outcome.failure is None, f"{outcome.failure}\n{show(raw)}"
        counts[outcome.status] += 1
        if outcome.status == "fusible" and any("where(" in s["expr"] and "reduce" in s for s in raw["steps"]):
            masks["fused reductions of a where()"] += 1

    masks: Counter[str] = Counter()
    check()
    total = sum(counts.values())
    print(f"\nfuzzed {total} cascades: {dict(counts)} {dict(masks)}")
    # the generator's purpose: a good share fuse, some do not, and masked terms fuse too; among the specs derived
    # (a derivation past its time limit, as on a loaded machine, says nothing of the generator)
    derived = total - counts["limit_stopped"]
    assert counts["fusible"] >= 0.3 * derived and counts["not_fusible"] >= 0.05 * derived, counts
    # 3%: the draws differ when other test modules ran first in the process (7 of 200 after
    # the old test_fuzz_regressions.py, 15 alone; cause not found), and the share of masked terms that fuse with them
    assert masks["fused reductions of a where()"] >= 0.03 * derived, (masks, counts)


def test_random_cascades_kernels_match_the_reference_and_compile(compile_pool):
    """Every kernel that passes the interpreter also compiles for sm_90 and sm_80."""
    counts: Counter[str] = Counter()

    @bounded(24, deadline_s=240, shrink=False)
    @given(cascade_specs(max_steps=4))
    def check(raw):
        outcome = check_cascade(raw, kernels=True, compile_pool=compile_pool, capabilities=(90, 80), families=CI_FAMILIES)
        assert outcome.failure is None, f"{outcome.failure}\n{show(raw)}"
        counts["specs"] += 1
        counts["kernels checked"] += outcome.kernels_checked
        counts["not valid (NotValid)"] += outcome.kernels_not_valid
        counts["modules compiled"] += outcome.kernels_compiled
        counts["families checked"] += outcome.families_checked

    check()
    print(f"\nkernels: {dict(counts)}")
    assert counts["kernels checked"] >= 2 * counts["specs"], counts  # most specs run several strategies
    assert counts["families checked"] >= len(CI_FAMILIES) * counts["kernels checked"], counts  # the accuracy bar's families too
    assert counts["modules compiled"] >= 2 * counts["specs"], counts


def test_mutated_cascades_raise_only_spec_errors():
    counts: Counter[str] = Counter()

    @bounded(150, deadline_s=30)
    @given(mutated_specs())
    def check(pair):
        mutation, raw = pair
        outcome = check_cascade(raw)  # load_spec: SpecError ("invalid") or a spec that derives
        assert outcome.failure is None, f"{mutation}: {outcome.failure}\n{show(raw)}"
        counts[outcome.status] += 1

    check()
    print(f"\nmutated: {dict(counts)}")
    assert counts["invalid"] >= 0.8 * sum(counts.values()), counts


def renamed(raw: dict, suffix: str) -> dict:
    """The same computation with every dim, step and param renamed (inputs keep their names)."""
    spec = load_spec(raw)
    mapping = {d: f"{d}{suffix}" for d in spec.dims}
    mapping |= {s.name: f"{s.name}{suffix}" for s in spec.steps} | {p.name: f"{p.name}{suffix}" for p in spec.params}
    out = {"foldwise": 1, "name": "renamed", "outputs": [mapping[o] for o in raw["outputs"]],
           "inputs": {n: {**d, "dims": [mapping[x] for x in d["dims"]]} for n, d in raw["inputs"].items()},
           "params": {mapping[p.name]: ex.to_text(p.expr, mapping) for p in spec.params}, "steps": []}
    for s in raw["steps"]:
        step = {**s, "name": mapping[s["name"]], "expr": ex.to_text(ex.parse_expr_text(s["expr"]), mapping)}
        for key in ("over", "as"):
            if key in s:
                step[key] = mapping.get(s[key], s[key])
        out["steps"].append(step)
    return out


@bounded(100, deadline_s=10)
@given(cascade_specs(), st.sampled_from(["_r", "Z", "9"]))
def test_generated_specs_have_a_stable_canonical_hash(raw, suffix):
    spec = load_spec(raw)
    h = spec_hash(spec)
    assert spec_hash(load_spec(canonical_form(spec))) == h
    assert spec_hash(load_spec(json.dumps(renamed(raw, suffix)))) == h
