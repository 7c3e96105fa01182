"""The strategy registry (issue 25): each strategy one object, named in one place, holding its
validity, tunables, configurations, what it holds whole and how it builds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.plan import KernelConfig, NotValid, default_config, make_plan, valid_strategies
from fuser_core.codegen.strategies import (
    BASELINE,
    FALLBACK,
    PREFERENCE,
    ROW_RESIDENT,
    SPLIT_FUSED,
    STRATEGIES,
    STREAMING_FUSED,
    is_fused,
    strategy_named,
)
from fuser_core.codegen.structure import build_structure
from fuser_core.derive import derive_cascade

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "fuser_core" / "codegen" / "strategies" / "registry.py"


def test_the_registry_names_each_strategy_once_and_the_baseline_apart():
    assert all(s.name == name for name, s in STRATEGIES.items())
    assert sorted(PREFERENCE) == sorted(STRATEGIES) and len(set(PREFERENCE)) == len(PREFERENCE)
    assert BASELINE not in STRATEGIES and FALLBACK in STRATEGIES
    assert strategy_named(SPLIT_FUSED.name) is SPLIT_FUSED
    with pytest.raises(NotValid, match="unknown strategy 'vectorised'; one of"):
        strategy_named("vectorised")
    assert is_fused(STREAMING_FUSED.name) and is_fused(SPLIT_FUSED.name)
    assert not is_fused(ROW_RESIDENT.name) and not is_fused(BASELINE) and not is_fused(None)


def test_no_strategy_name_is_written_outside_the_registry():
    names = "|".join(map(re.escape, [*STRATEGIES, BASELINE]))
    literal = re.compile(rf"""(["'])({names})\1""")
    found = []
    for package in ("fuser_core", "tuner", "service"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == REGISTRY:
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if literal.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []
    assert len(literal.findall(REGISTRY.read_text(encoding="utf-8"))) == len(STRATEGIES) + 1  # one each


def test_each_strategy_holds_its_rules():
    spec = load_catalog_spec("safe_softmax")
    d = derive_cascade(spec)
    shape = {"m": 4, "n": 1000}
    assert valid_strategies(spec, d, shape) == {name: None for name in STRATEGIES}
    resident = default_config(spec, d, ROW_RESIDENT.name, shape)
    assert resident.blocks["n"] == 1024 and resident.num_stages == 1  # the whole axis, nothing to pipeline
    split = default_config(spec, d, SPLIT_FUSED.name, shape)
    assert split.split >= 2 and SPLIT_FUSED.least_split == 2 and ROW_RESIDENT.least_split == 1
    with pytest.raises(NotValid, match=f"{ROW_RESIDENT.name} needs BLOCK_n >= size\\(n\\) = 1000"):
        make_plan(spec, d, ROW_RESIDENT.name, shape, KernelConfig({"n": 512}))
    with pytest.raises(NotValid, match=f"split = 2 is only for {SPLIT_FUSED.name}"):
        make_plan(spec, d, STREAMING_FUSED.name, shape, KernelConfig({"n": 256}, split=2))
    with pytest.raises(NotValid, match=f"{SPLIT_FUSED.name} needs split >= 2"):
        make_plan(spec, d, SPLIT_FUSED.name, shape, KernelConfig({"n": 256}))
    assert ROW_RESIDENT.holds_axis_whole and not any(s.holds_axis_whole for s in STRATEGIES.values()
                                                     if s is not ROW_RESIDENT)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_builds_its_kernels(name):
    spec = load_catalog_spec("safe_softmax")
    d = derive_cascade(spec)
    shape = {"m": 4, "n": 1000}
    plan = make_plan(spec, d, name, shape, default_config(spec, d, name, shape))
    structure = build_structure(plan, {"x": "float16"})
    roles = [k.role for k in structure.kernels]
    assert roles == (["split_part", "combine"] if STRATEGIES[name].splits_axis else ["main"])
    assert all(k.doc.startswith(f"{spec.name}, ") for k in structure.kernels)
