"""The Optuna search (tuner/search.py) and ``foldwise tune`` / ``foldwise worker``.

Unit tests use a small fake space and measurer (counting calls); the distributed tests run
real worker processes (``python -m service.cli tune|worker``) on one study, in the real
PostgreSQL (FOLDWISE_TEST_POSTGRES_URL) and in an SQLite file, with a measurer slowed by a
sleep so that a SIGKILL lands mid-trial.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from fuser_core.codegen.plan import KernelConfig
from tuner.search import (
    MeasurementFailed,
    NoResult,
    SharedBudget,
    Tuner,
    budget_used,
    make_storage,
    study_name_for,
    warm_start,
)

REPO = Path(__file__).resolve().parents[1]
optuna.logging.set_verbosity(optuna.logging.ERROR)


# ---------------------------------------------------------------------------------------------
# fakes with the interface of tuner.space / tuner.measure


@dataclass(frozen=True)
class FakeCandidate:
    strategy: str
    config: KernelConfig

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "config": self.config.to_dict()}

    def key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass
class FakeMeasurement:
    time_ms: float | None
    error: str | None = None
    predicted: bool = True
    details: dict = field(default_factory=dict)


class FakeSpace:
    """Two strategies; block_n up to ``max_block``; candidates with block_n * split > limit do not fit."""

    def __init__(self, max_block: int = 4096, limit: int = 1 << 14, warps=(1, 2, 4, 8, 16)):
        self.max_block, self.limit, self.warps = max_block, limit, list(warps)

    def strategies(self) -> list[str]:
        return ["streaming_fused", "split_fused"]

    def params(self, strategy: str) -> dict[str, list[int]]:
        p = {"block_n": [1 << i for i in range(4, self.max_block.bit_length())], "num_warps": self.warps}
        if strategy == "split_fused":
            p["split"] = [2, 4, 8, 16]
        return p

    def candidate(self, strategy: str, values: dict) -> FakeCandidate:
        return FakeCandidate(strategy, KernelConfig({"n": values["block_n"]}, values["num_warps"], 2, values.get("split", 1)))

    def check(self, c: FakeCandidate) -> str | None:
        if c.config.blocks["n"] * c.config.split > self.limit:
            return f"block_n * split = {c.config.blocks['n'] * c.config.split} > {self.limit}"
        return None

    def enumerate(self):
        for s in self.strategies():
            p = self.params(s)
            for combo in itertools.product(*p.values()):
                yield self.candidate(s, dict(zip(p, combo)))


def fake_time(c: FakeCandidate) -> float:
    t = 1 + 0.3 * abs(math.log2(c.config.blocks["n"]) - 9) + 0.2 * abs(math.log2(c.config.num_warps) - 2)
    return t * 0.8 + 0.1 * abs(math.log2(c.config.split) - 3) if c.strategy == "split_fused" else t


class FakeMeasurer:
    name = "fake"

    def __init__(self, fail=lambda c: None):
        self.calls: list[str] = []
        self.fail = fail

    def measure(self, c: FakeCandidate) -> FakeMeasurement:
        self.calls.append(c.key())
        error = self.fail(c)
        return FakeMeasurement(None, error) if error else FakeMeasurement(fake_time(c))


def trials_of(study: optuna.Study, *states: TrialState) -> list:
    return study.get_trials(deepcopy=False, states=states or None)


# ---------------------------------------------------------------------------------------------
# the search


def test_seeded_runs_are_reproducible() -> None:
    runs = []
    for _ in range(2):
        tuner = Tuner(FakeSpace(), FakeMeasurer(), seed=3)
        result = tuner.run(25)
        runs.append(([t.params for t in tuner.study.trials], result.to_dict()))
    assert runs[0][0] == runs[1][0]
    assert {k: v for k, v in runs[0][1].items() if not k.startswith(("overhead", "study"))} == \
        {k: v for k, v in runs[1][1].items() if not k.startswith(("overhead", "study"))}
    other = Tuner(FakeSpace(), FakeMeasurer(), seed=4)
    other.run(25)
    assert [t.params for t in other.study.trials] != runs[0][0]


def test_result_fields_and_overhead() -> None:
    measurer = FakeMeasurer()
    result = Tuner(FakeSpace(), measurer, seed=0, target="h100").run(30)
    assert result.trials == 30 and result.measurer == "fake" and result.target == "h100" and result.predicted
    assert result.time_ms == pytest.approx(min(fake_time(c) for c in FakeSpace().enumerate() if c.key() in measurer.calls))
    assert result.strategy in ("streaming_fused", "split_fused") and set(result.config) == {"blocks", "num_warps", "num_stages", "split"}
    assert sum(result.counts.values()) == 30
    assert 0 < result.overhead_ms <= result.overhead_max_ms < 1000
    assert {"strategy", "config", "time_ms", "measurer", "target", "trials", "predicted"} <= set(result.to_dict())


def test_repeated_suggestions_are_answered_from_stored_results() -> None:
    space = FakeSpace(max_block=32, warps=(4, 8))  # 2*2 + 2*2*4 = 20 candidates
    measurer = FakeMeasurer()
    tuner = Tuner(space, measurer, seed=0)
    result = tuner.run(60)
    assert len(measurer.calls) == len(set(measurer.calls)) <= 20
    assert result.counts["cached"] >= 40 and result.counts["measured"] == len(measurer.calls)
    for t in trials_of(tuner.study, TrialState.COMPLETE):
        cached = t.user_attrs["outcome"] == "cached"
        assert ("cached_from" in t.user_attrs) == cached
        assert t.value == pytest.approx(fake_time(space.candidate(t.user_attrs["strategy"], t.user_attrs["values"])))


def test_stored_results_are_shared_through_the_storage(tmp_path: Path) -> None:
    """A second process (here: a second tuner) on the same study re-measures nothing."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    space, first, second = FakeSpace(max_block=32, warps=(4, 8)), FakeMeasurer(), FakeMeasurer()
    Tuner(space, first, seed=0).run(20, storage=make_storage(url, heartbeat_interval=None), study_name="s")
    result = Tuner(space, second, seed=1).run(45, storage=make_storage(url, heartbeat_interval=None), study_name="s")
    assert result.trials == 45
    assert not set(first.calls) & set(second.calls)
    assert len(first.calls) + len(second.calls) <= 20


def test_infeasible_candidates_never_reach_the_measurer() -> None:
    space = FakeSpace(limit=512)  # most of split_fused and every block_n > 512 do not fit
    measurer = FakeMeasurer()
    tuner = Tuner(space, measurer, seed=0)
    result = tuner.run(40)
    pruned = trials_of(tuner.study, TrialState.PRUNED)
    assert pruned and result.counts["infeasible"] == len(pruned)
    for t in pruned:
        assert t.user_attrs["outcome"] == "infeasible" and "> 512" in t.user_attrs["reason"]
        assert t.value is None and t.user_attrs["candidate"] not in measurer.calls
    assert all(space.check(space.candidate(*_sv(k))) is None for k in measurer.calls)
    assert space.check(space.candidate(result.strategy, {"block_n": result.config["blocks"]["n"],
                                                           "num_warps": result.config["num_warps"],
                                                           "split": result.config["split"]})) is None


def _sv(key: str) -> tuple[str, dict]:
    d = json.loads(key)
    c = d["config"]
    return d["strategy"], {"block_n": c["blocks"]["n"], "num_warps": c["num_warps"], "split": c["split"]}


def test_all_infeasible_is_no_result() -> None:
    with pytest.raises(NoResult, match="no configuration succeeded in 5 trials; first reason: block_n"):
        Tuner(FakeSpace(limit=1), FakeMeasurer(), seed=0).run(5)


def test_failures_keep_their_error_and_are_not_remeasured() -> None:
    measurer = FakeMeasurer(fail=lambda c: "illegal memory access" if c.config.num_warps >= 8 else None)
    space = FakeSpace(max_block=64)
    tuner = Tuner(space, measurer, seed=0)
    result = tuner.run(50)
    failed = trials_of(tuner.study, TrialState.FAIL)
    assert failed and result.counts["failed"] + result.counts["cached"] + result.counts["measured"] + result.counts["infeasible"] == 50
    for t in failed:
        assert t.values is None and t.user_attrs["error"] == "illegal memory access" and t.user_attrs["outcome"] == "failed"
        assert "time_ms" not in t.user_attrs
    assert len(measurer.calls) == len(set(measurer.calls))
    assert result.config["num_warps"] < 8
    assert budget_used(tuner.study) == 50


def test_measurement_failed_is_caught_by_optimize() -> None:
    study = optuna.create_study()
    study.optimize(lambda t: (_ for _ in ()).throw(MeasurementFailed("x")), n_trials=2, catch=(MeasurementFailed,))
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 2


def _attrs(shape: dict, target: str = "h100", dtype: str = "float16") -> dict:
    return {"spec_hash": "ab" * 32, "shape": shape, "dtype": {"x": dtype}, "target": target, "measurer": "model"}


def test_warm_start_enqueues_the_best_of_other_shapes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'warm.db'}"
    storage = make_storage(url, heartbeat_interval=None)
    # shape 1: its best is enqueued first for shape 2
    first = Tuner(FakeSpace(), FakeMeasurer(), seed=0)
    best = first.run(30, storage=storage, study_name="n=4096", attrs=_attrs({"m": 8, "n": 4096}))
    # another target and an infeasible-here best: never enqueued
    odd = Tuner(FakeSpace(), FakeMeasurer(), seed=0)
    odd.run(5, storage=storage, study_name="a100", attrs=_attrs({"m": 8, "n": 2048}, target="a100"))

    second_space = FakeSpace(max_block=2048)
    measurer = FakeMeasurer()
    second = Tuner(second_space, measurer, seed=0)
    result = second.run(10, storage=storage, study_name="n=2048", attrs=_attrs({"m": 8, "n": 2048}))
    trial0 = second.study.trials[0]
    assert trial0.user_attrs["source"] == "warm start: best of n=4096"
    assert trial0.user_attrs["strategy"] == best.strategy and trial0.user_attrs["config"] == best.config
    assert measurer.calls[0] == json.dumps({"strategy": best.strategy, "config": best.config}, sort_keys=True)
    assert result.time_ms <= best.time_ms
    assert sum(1 for t in second.study.trials if "warm start" in t.user_attrs.get("source", "")) == 1

    # a space where that best does not fit: nothing enqueued
    tight = optuna.create_study(storage=storage, study_name="tight")
    for k, v in _attrs({"m": 8, "n": 64}).items():
        tight.set_user_attr(k, v)
    assert warm_start(tight, FakeSpace(limit=16), storage) == []
    assert warm_start(tight, FakeSpace(max_block=32), storage) == []  # value not among the choices


def test_shared_budget_ignores_trials_of_dead_workers() -> None:
    study = optuna.create_study()
    study.add_trial(optuna.create_trial(state=TrialState.FAIL, user_attrs={"outcome": "failed", "error": "e"}))
    study.add_trial(optuna.create_trial(state=TrialState.FAIL))  # its worker died: retried, not counted
    study.add_trial(optuna.create_trial(state=TrialState.PRUNED))
    study.add_trial(optuna.create_trial(value=1.0))
    assert budget_used(study) == 3
    study.optimize(lambda t: 2.0, n_trials=10, callbacks=[SharedBudget(5)])
    assert len(study.trials) == 6 and budget_used(study) == 5


def test_study_name_for() -> None:
    assert study_name_for("0123456789abcdef0123", {"n": 300, "m": 4}, {"x": "float16"}, "h100", "model") == \
        "foldwise:0123456789abcdef:m=4,n=300:float16:h100:model"
    assert study_name_for("ab" * 32, {"m": 1}, {"a": "float16", "w": "float8_e4m3fn"}, "h100", "cuda").endswith(
        ":m=1:a=float16,w=float8_e4m3fn:h100:cuda")
