"""The reduce kinds' table (fuser_core/reduce_ops.py, issue 25): one row per kind, consistent with
itself, with the spec grammar and with the @triton.jit helpers the generated kernels copy by name."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from fuser_core.errors import SpecError
from fuser_core.reduce_ops import (
    REDUCE_OPS, SPEC_REDUCE_KINDS, has_slots, is_extremum, is_negated, is_selection, reduce_op, returns_indices,
)
from fuser_core.spec import load_spec

HELPERS = Path(__file__).resolve().parents[2] / "fuser_core" / "codegen" / "helpers.py"


def _helper_names() -> set[str]:
    tree = ast.parse(HELPERS.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_the_spec_grammar_offers_exactly_the_spec_kinds():
    assert SPEC_REDUCE_KINDS == ("sum", "max", "min", "topk", "argmax", "argmin")
    raw = {"foldwise": 1, "name": "r", "inputs": {"x": {"dims": ["m", "n"]}},
           "steps": [{"name": "y", "reduce": "bottomk", "over": "n", "expr": "x", "k": 2, "as": "j"}],
           "outputs": ["y"]}
    with pytest.raises(SpecError, match="one of sum, max, min, topk, argmax, argmin"):
        load_spec(raw)  # bottomk is the derivation's, never a spec's


def test_every_helper_the_table_names_is_a_kernel_helper():
    helpers = _helper_names()
    named = {h for r in REDUCE_OPS.values() for h in (r.nan_helper, r.merge_helper) if h}
    assert named == {"max_nan", "min_nan", "argmax_merge", "topk_merge"}
    assert named <= helpers


def test_rows_are_consistent():
    for name, r in REDUCE_OPS.items():
        assert r.name == name
        # a selection merges with a helper and never reduces a tile whole; a combining kind is the reverse
        assert r.selection == (r.merge_helper is not None) == (not r.in_tile)
        assert not (r.selection and r.excludes_masked)  # a top-k of a short row keeps its k slots
        assert r.returns_indices <= r.selection and r.slots <= r.selection
        if r.swapped is not None:  # multiplying by a negative factor twice gives the kind back
            assert REDUCE_OPS[r.swapped].swapped in (name, None)
            assert r.order
    assert reduce_op("min").identity == math.inf and reduce_op("sum").identity == 0
    assert all(r.identity == -math.inf for r in REDUCE_OPS.values() if r.selection or r.name == "max")


def test_predicates_answer_none_and_unknown_kinds_with_false():
    for predicate in (is_selection, returns_indices, has_slots, is_negated, is_extremum):
        assert predicate(None) is False and predicate("mean") is False
    assert [k for k in REDUCE_OPS if is_selection(k)] == ["topk", "argmax", "argmin", "bottomk"]
    assert [k for k in REDUCE_OPS if is_negated(k)] == ["argmin", "bottomk"]
    assert [k for k in REDUCE_OPS if is_extremum(k)] == ["max", "min"]
    with pytest.raises(ValueError, match="unknown reduce kind 'mean'"):
        reduce_op("mean")
