"""service.dim_names.DimNames: the one mapping of canonical versus user names."""

from __future__ import annotations

import json

from fuser_core import canonical_names, load_spec
from service.dim_names import DimNames
from tests.support.catalog import load_catalog

RAW = load_catalog()["safe_softmax"]


def test_names_map_both_ways_and_shapes_read_in_the_user_s_names() -> None:
    spec = load_spec(RAW)
    names = DimNames.of(spec)
    assert dict(names.to_canonical) == canonical_names(spec)
    assert {names.to_user[c]: c for c in names.to_user} == dict(names.to_canonical)
    canon = {names.to_canonical[d]: n for d, n in {"m": 4, "n": 64}.items()}
    assert set(canon) == {"d0", "d1"} and names.user_shape(canon) == {"m": 4, "n": 64}
    assert names.user("not-a-name") == "not-a-name"  # a name it does not know, as is
    # the dims only: steps (s0, ...) are left out
    assert names.user_dims() == {names.to_canonical["m"]: "m", names.to_canonical["n"]: "n"}


def test_names_of_a_stored_source_are_the_spec_s_and_cached() -> None:
    text = json.dumps(RAW)
    assert DimNames.of_source(text) == DimNames.of(load_spec(RAW))
    assert DimNames.of_source(text) is DimNames.of_source(text)
