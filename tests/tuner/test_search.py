"""The Optuna search (tuner/search/) and ``foldwise tune`` / ``foldwise worker``.

Unit tests use a small fake space and measurer (counting calls); the distributed tests run
real worker processes (``python -m service.cli tune|worker``) on one study, in the real
PostgreSQL (FOLDWISE_TEST_POSTGRES_URL) and in an SQLite file, with a measurer slowed by a
sleep so that a SIGKILL lands mid-trial.
"""

from __future__ import annotations

import io
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
from tuner.search.objective import MeasurementFailed
from tuner.search.storage import make_storage, study_name_for
from tuner.search.trials import SharedBudget, budget_used
from tuner.search.tuner import NoResult, Tuner
from tuner.search.warm_start import warm_start

REPO = Path(__file__).resolve().parents[2]
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
    timing = ("overhead", "setup", "study")
    assert {k: v for k, v in runs[0][1].items() if not k.startswith(timing)} == \
        {k: v for k, v in runs[1][1].items() if not k.startswith(timing)}
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
        r = t.user_attrs["result"]
        assert ("cached_from" in r) == (r["outcome"] == "cached")
        assert t.value == r["time_ms"] == pytest.approx(fake_time(space.candidate(r["strategy"], r["values"])))


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
    tuner = Tuner(space, measurer, seed=0, local_search=False)  # TPE alone proposes infeasible ones
    result = tuner.run(40)
    pruned = trials_of(tuner.study, TrialState.PRUNED)
    assert pruned and result.counts["infeasible"] == len(pruned)
    for t in pruned:
        r = t.user_attrs["result"]
        assert r["outcome"] == "infeasible" and "> 512" in r["reason"] and "time_ms" not in r
        assert t.value is None and space.candidate(r["strategy"], r["values"]).key() not in measurer.calls
    assert all(space.check(space.candidate(*_sv(k))) is None for k in measurer.calls)
    assert space.check(space.candidate(result.strategy, {"block_n": result.config["blocks"]["n"],
                                                           "num_warps": result.config["num_warps"],
                                                           "split": result.config["split"]})) is None


def _sv(key: str) -> tuple[str, dict]:
    d = json.loads(key)
    c = d["config"]
    return d["strategy"], {"block_n": c["blocks"]["n"], "num_warps": c["num_warps"], "split": c["split"]}


def _fixed(space: FakeSpace) -> tuple[dict, FakeCandidate]:
    values = {"block_n": 512, "num_warps": 4}
    return {"strategy": "streaming_fused", "streaming_fused/block_n": 5, "streaming_fused/num_warps": 2}, \
        space.candidate("streaming_fused", values)


def test_a_candidate_another_worker_is_measuring_is_waited_for() -> None:
    """Trial 0 stands for another worker measuring the same candidate: trial 1 waits for its
    result instead of measuring it again (and measures itself if trial 0 never finishes)."""
    import threading

    from tuner.search.objective import Objective

    space, measurer = FakeSpace(), FakeMeasurer()
    params, candidate = _fixed(space)
    study = optuna.create_study()
    study.enqueue_trial(params)
    study.enqueue_trial(params)
    other = study.ask()
    other.set_user_attr("candidate", candidate.key())
    other.set_user_attr("measuring", True)

    def finish() -> None:
        time.sleep(0.3)
        other.set_user_attr("result", {"outcome": "measured", "time_ms": 1.25, "predicted": True})
        study.tell(other, 1.25)

    threading.Thread(target=finish).start()
    objective = Objective(space, measurer)
    start = time.perf_counter()
    study.optimize(objective, n_trials=1)
    assert time.perf_counter() - start >= 0.25 and measurer.calls == []
    waited = study.trials[1]
    assert waited.value == 1.25 and waited.user_attrs["result"]["cached_from"] == 0
    assert objective.outside_s[1] >= 0.2  # waiting is not the tuner's overhead

    stuck = optuna.create_study()  # the other trial never finishes: measure after wait_s
    stuck.enqueue_trial(params)
    stuck.enqueue_trial(params)
    stuck.ask().set_user_attr("candidate", candidate.key())
    stuck.optimize(Objective(space, measurer, wait_s=0.2), n_trials=1)
    assert measurer.calls == [candidate.key()] and stuck.trials[1].user_attrs["result"]["outcome"] == "measured"


def test_frontier_candidates_fill_what_fits(catalog_specs: dict) -> None:
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from fuser_core.spec import load_spec
    from tuner.profiles import get_profile
    from tuner.search.proposals import frontier_candidates
    from tuner.space import SearchSpace

    spec = load_spec(catalog_specs["safe_softmax"])
    problem = make_problem(spec, {"m": 4096, "n": 32768}, "float16")
    space = SearchSpace(problem, derive_cascade(spec), get_profile("h100"))
    found = frontier_candidates(space)
    assert {s for s, _ in found} == set(space.strategies())
    for strategy, values in found:
        assert space.check(space.candidate(strategy, values)) is None
        for name in ("block_n", "block_m"):  # no block can grow by one step and still fit
            choices = space.params(strategy)[name]
            if values[name] != choices[-1]:
                bigger = {**values, name: choices[choices.index(values[name]) + 1]}
                assert space.check(space.candidate(strategy, bigger)) is not None


@pytest.mark.parametrize("name, shape, dtype, want", [
    # Liger's calculate_settings: the whole row in one block, 32 warps from 32768 columns
    ("safe_softmax", {"m": 4096, "n": 32768}, "float16", ("row_resident", {"block_n": 32768, "num_warps": 32})),
    ("rmsnorm", {"t": 4096, "c": 8192}, "float16", ("row_resident", {"block_c": 8192, "num_warps": 16})),
    # Liger's cross-entropy: a loop of 32768-wide blocks, 32 warps; Foldwise's loop holds half at 32 warps
    ("cross_entropy", {"t": 4096, "v": 128256}, "bfloat16", ("streaming_fused", {"block_v": 16384, "num_warps": 32})),
    # tutorial 06: BLOCK_M 128, BLOCK_N 128 at head dim 128, 8 warps, 3 stages
    ("attention", {"b": 4, "h": 32, "m": 4096, "n": 4096, "d": 128, "e": 128}, "float16",
     ("streaming_fused", {"block_m": 128, "block_n": 128, "block_e": 128, "num_warps": 8, "num_stages": 3})),
    # the split-KV decoder: 64 keys a step, 4 warps; 1024 rows fill 132 SMs twice with one part each
    ("attention", {"b": 32, "h": 32, "m": 1, "n": 8192, "d": 128, "e": 128}, "float16",
     ("streaming_fused", {"block_n": 64, "block_e": 128, "num_warps": 4})),
    # one row: 264 parts would fill the SMs twice, 8192 / 256 = 32 is the decoder's cap
    ("attention", {"b": 1, "h": 1, "m": 1, "n": 8192, "d": 128, "e": 128}, "float16",
     ("split_fused", {"block_n": 64, "split": 32, "num_warps": 4})),
])
def test_expert_candidates_are_the_hand_written_kernels_configurations(catalog_specs: dict, name, shape, dtype,
                                                                       want) -> None:
    """Issue 35: the search's first trials include the experts' configurations (tuner.search.proposals.expert_candidates)."""
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from fuser_core.spec import load_spec
    from tuner.profiles import get_profile
    from tuner.search.proposals import expert_candidates
    from tuner.space import SearchSpace

    spec = load_spec(catalog_specs[name])
    space = SearchSpace(make_problem(spec, shape, dtype), derive_cascade(spec), get_profile("h100"))
    found = expert_candidates(space)
    assert len(found) == 1
    strategy, values = found[0]
    assert strategy == want[0] and {k: values[k] for k in want[1]} == want[1]
    assert space.check(space.candidate(strategy, values)) is None


def test_a_gemm_s_expert_is_the_matmul_tutorial_s_first_tile_that_fits(catalog_specs: dict) -> None:
    """The fp8 GEMM: the tutorial's 128 x 256 does not fit Foldwise's kernel (it quantises its
    activations in registers); its 64 x 256 does for multi_pass, at the tutorial's fp8 K step and
    8 warps: two warpgroups side by side over the 256 columns, which the space does not refuse for
    a lone dot (it does for attention's chained dots, below)."""
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from fuser_core.spec import load_spec
    from tuner.profiles import get_profile
    from tuner.search.proposals import expert_candidates
    from tuner.space import SearchSpace

    spec = load_spec(catalog_specs["fp8_quant_gemm"])
    dtypes = {"a": "float16", "w": "float8_e4m3fn", "w_scale": "float32"}
    space = SearchSpace(make_problem(spec, {"m": 4096, "n": 4096, "k": 4096}, dtypes), derive_cascade(spec),
                        get_profile("h100"))
    found = dict(expert_candidates(space))
    assert found["multi_pass"] == {"block_m": 64, "block_n": 256, "block_k": 128, "num_warps": 8, "num_stages": 3}
    assert space.check(space.candidate("multi_pass", {**found["multi_pass"], "block_m": 128})) is not None  # registers
    attention = load_spec(catalog_specs["attention"])
    att = SearchSpace(make_problem(attention, {"b": 4, "h": 32, "m": 4096, "n": 4096, "d": 128, "e": 128}, "float16"),
                      derive_cascade(attention), get_profile("h100"))
    why = att.check(att.candidate("streaming_fused", {"block_m": 64, "block_n": 128, "block_e": 128, "num_warps": 8,
                                                      "num_stages": 2}))
    assert why and "two warpgroups would compute the same product" in why


def test_the_first_trials_measure_the_defaults_and_the_experts(catalog_specs: dict) -> None:
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from fuser_core.spec import load_spec
    from tuner.profiles import get_profile
    from tuner.search.proposals import default_candidates, expert_candidates
    from tuner.space import Candidate, SearchSpace

    spec = load_spec(catalog_specs["safe_softmax"])
    space = SearchSpace(make_problem(spec, {"m": 64, "n": 4096}, "float16"), derive_cascade(spec), get_profile("h100"))
    measurer = FakeMeasurer()  # records each measured candidate's key, in order
    Tuner(space, measurer, seed=0).run(12)
    first = [(c.strategy, space.values_of(c)) for c in map(Candidate.from_dict, map(json.loads, measurer.calls))]
    wanted = default_candidates(space) + expert_candidates(space)
    assert wanted and all(w in first[:len(wanted) + 2] for w in wanted)


def test_local_search_proposes_only_untried_feasible_candidates() -> None:
    space, measurer = FakeSpace(limit=1024), FakeMeasurer()
    tuner = Tuner(space, measurer, seed=0)
    result = tuner.run(30)
    assert result.counts == {"measured": 30, "cached": 0, "infeasible": 0, "failed": 0}
    sources = [t.user_attrs.get("source", "TPE") for t in tuner.study.trials]
    assert sum(s.startswith("local: from trial") for s in sources) >= 15
    assert result.time_ms == pytest.approx(min(fake_time(c) for c in space.enumerate() if space.check(c) is None))


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
        r = t.user_attrs["result"]
        assert t.values is None and r["error"] == "illegal memory access" and r["outcome"] == "failed"
        assert "time_ms" not in r
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
    assert trial0.user_attrs["result"]["strategy"] == best.strategy and trial0.user_attrs["result"]["config"] == best.config
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
    study.add_trial(optuna.create_trial(state=TrialState.FAIL, user_attrs={"result": {"outcome": "failed", "error": "e"}}))
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


# ---------------------------------------------------------------------------------------------
# foldwise tune / worker (in process)


def _main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    from service.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_tune_json_and_stored_study(tmp_path: Path, catalog_dir: Path, capsys: pytest.CaptureFixture) -> None:
    spec, url = catalog_dir / "layernorm.json", f"sqlite:///{tmp_path / 'cli.db'}"
    code, out, err = _main(capsys, "tune", spec, "--shape", "t=8192,c=8192", "--dtype", "bfloat16", "--trials", "8",
                           "--db", url, "--json")
    assert code == 0, err
    first = json.loads(out)
    assert {"strategy", "config", "time_ms", "measurer", "target", "trials", "predicted"} <= set(first)
    assert first["measurer"] == "model" and first["target"] == "h100" and first["predicted"] is True and first["trials"] == 8
    assert first["study_name"].startswith("foldwise:") and first["study_name"].endswith(":c=8192,t=8192:bfloat16:h100:model")
    study = optuna.load_study(study_name=first["study_name"], storage=make_storage(url, heartbeat_interval=None))
    attrs = study.user_attrs
    assert attrs["shape"] == {"t": 8192, "c": 8192} and attrs["budget"] == 8 and attrs["measurer"] == "model"
    assert attrs["spec"] == json.loads(spec.read_text()) and len(attrs["spec_hash"]) == 64

    # the same job again: its budget is used, nothing runs, the stored best is printed
    code, out, _ = _main(capsys, "tune", spec, "--shape", "t=8192,c=8192", "--dtype", "bfloat16", "--trials", "8", "--db", url, "--json")
    again = json.loads(out)
    assert code == 0 and again["time_ms"] == first["time_ms"] and again["counts"]["measured"] == 0

    # another shape of the same spec, target and dtype starts from the first one's best
    code, out, _ = _main(capsys, "tune", spec, "--shape", "t=4096,c=8192", "--dtype", "bfloat16", "--trials", "3", "--db", url, "--json")
    other = optuna.load_study(study_name=json.loads(out)["study_name"], storage=make_storage(url, heartbeat_interval=None))
    assert code == 0 and other.trials[0].user_attrs["source"] == f"warm start: best of {first['study_name']}"
    assert other.trials[0].user_attrs["result"]["config"] == first["config"]

    code, out, err = _main(capsys, "tune", spec, "--shape", "t=64,c=64", "--trials", "3")
    assert code == 0 and out.startswith("best: ") and "ms (predicted by the model, target h100, measurer model)" in out


@pytest.mark.parametrize("args, message", [
    (["--measurer", "cuda"], "--measurer cuda: no CUDA GPU is visible"),
    (["--measurer", "tpu"], "--measurer: unknown measurer 'tpu'"),
    (["--target", "v100"], "--target: unknown target 'v100'"),
    (["--trials", "0"], "--trials: must be at least 1"),
    (["--db", "nosuch://x"], "--db: not a database URL"),
    (["--shape", "t=4,q=3"], "unknown dim 'q'"),
])
def test_cli_tune_bad_input_exits_2(args: list, message: str, catalog_dir: Path, capsys: pytest.CaptureFixture) -> None:
    if args[:2] == ["--measurer", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    base = {"--shape": "t=4,c=8"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    code, out, err = _main(capsys, "tune", catalog_dir / "layernorm.json", *[x for kv in base.items() for x in kv])
    assert code == 2 and out == "" and message in err


def test_cli_worker_bad_input_exits_2(tmp_path: Path, catalog_dir: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    code, out, _ = _main(capsys, "tune", catalog_dir / "safe_softmax.json", "--shape", "m=8,n=64", "--trials", "2", "--db", url, "--json")
    name = json.loads(out)["study_name"]
    code, _, err = _main(capsys, "worker", "--db", url, "--study", "nope")
    assert code == 2 and "no study named 'nope'" in err
    code, _, err = _main(capsys, "worker", "--db", url, "--study", name, "--target", "a100")
    assert code == 2 and "tunes with target 'h100', not 'a100'" in err
    optuna.create_study(storage=make_storage(url, heartbeat_interval=None), study_name="bare")
    code, _, err = _main(capsys, "worker", "--db", url, "--study", "bare")
    assert code == 2 and "was not created by `foldwise tune`" in err
    code, out, err = _main(capsys, "worker", "--db", url, "--study", name, "--json")  # budget used: nothing to do
    assert code == 0 and json.loads(out)["counts"]["measured"] == 0


# ---------------------------------------------------------------------------------------------
# distributed: real worker processes on one stored study

POSTGRES_URL = os.environ.get("FOLDWISE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SPEC = "safe_softmax.json"


def _shape() -> str:
    """A shape of its own per test: the study name follows the shape, and other sessions may run
    these tests against the same database at the same time."""
    return f"m={4096 + uuid.uuid4().int % 4000},n=32768"


DELAY_S = 0.4  # every measurement sleeps this long first, so that a SIGKILL lands mid-trial
# `python -c SLOW tune|worker ...`: the real CLI, with the model measurer slowed down
# (and without the interpreter check of each strategy, which is not what these tests are about)
SLOW = f"""
import sys, time
import tuner.measure as m
_init, _measure = m.ModelMeasurer.__init__, m.ModelMeasurer.measure
def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.verify_kernels = False
def slow(self, candidate):
    time.sleep({DELAY_S})
    return _measure(self, candidate)
m.ModelMeasurer.__init__, m.ModelMeasurer.measure = init, slow
from service.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _postgres_reachable() -> str | None:
    try:
        import sqlalchemy as sa

        engine = sa.create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
        engine.dispose()
        return None
    except Exception as err:  # noqa: BLE001 - any failure means: no server to test against
        return f"no PostgreSQL server at FOLDWISE_TEST_POSTGRES_URL ({POSTGRES_URL}): {type(err).__name__}"


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tune.db'}"
    reason = _postgres_reachable()
    if reason:
        pytest.skip(reason)
    return POSTGRES_URL


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-c", SLOW, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"a worker exited with {p.returncode} while waiting for {what}: {p.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _start_two_workers(url: str, catalog_dir: Path, budget: int, names: list) -> tuple[subprocess.Popen, subprocess.Popen, optuna.Study]:
    """`foldwise tune --db` creates the study (one trial, in this process), its budget is
    raised, and two `foldwise worker` processes start on it together."""
    from service.cli import main

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stdout", out := io.StringIO())
        assert main(["tune", str(catalog_dir / SPEC), "--shape", _shape(), "--dtype", "float16", "--trials", "1",
                     "--db", url, "--json"]) == 0
    names[0] = json.loads(out.getvalue())["study_name"]
    study = optuna.load_study(study_name=names[0], storage=make_storage(url, heartbeat_interval=None))
    study.set_user_attr("budget", budget)
    workers = [_cli("worker", "--db", url, "--study", names[0], "--heartbeat", "1", "--json") for _ in range(2)]
    return workers[0], workers[1], study


def _check_study(study: optuna.Study, budget: int, workers: int) -> list:
    trials = study.get_trials(deepcopy=False)
    assert [t.number for t in trials] == list(range(len(trials)))  # no duplicated or missing numbers
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    used = budget_used(study)
    assert budget <= used <= budget + workers - 1
    for t in trials:
        r = t.user_attrs.get("result")
        if t.state == TrialState.COMPLETE:  # no lost results: every finished trial has its time
            assert r["outcome"] in ("measured", "cached") and t.value == r["time_ms"] > 0
        elif t.state == TrialState.WAITING:
            assert r is None or "retry_history" in t.system_attrs
    measured = [t.user_attrs["candidate"] for t in trials if t.user_attrs.get("result", {}).get("outcome") == "measured"]
    assert len(measured) == len(set(measured))  # nothing measured twice, across both processes
    return trials


def test_two_worker_processes_share_one_budget(db_url: str, catalog_dir: Path) -> None:
    budget, names = 10, [None]
    storage = make_storage(db_url, heartbeat_interval=None)
    try:
        first, second, study = _start_two_workers(db_url, catalog_dir, budget, names)
        out = [p.communicate(timeout=90) for p in (first, second)]
        assert first.returncode == 0 and second.returncode == 0, out[0][1][-3000:] + out[1][1][-3000:]
        trials = _check_study(study, budget, workers=2)
        workers = {t.user_attrs["worker"].rsplit(":", 1)[1] for t in trials if t.state == TrialState.COMPLETE}
        assert {str(first.pid), str(second.pid)} <= workers  # both processes ran trials
        reports = [json.loads(text) for text, _ in out]  # each: the best when that worker stopped
        for best in reports:
            assert best["trials"] >= budget and best["measurer"] == "model" and best["predicted"] is True
            assert best["time_ms"] >= study.best_value
        assert min(best["time_ms"] for best in reports) == pytest.approx(study.best_value)
    finally:
        for p in (locals().get("first"), locals().get("second")):
            if p is not None and p.poll() is None:
                p.kill()
        if names[0]:
            optuna.delete_study(study_name=names[0], storage=storage)


def test_killed_worker_trial_is_failed_by_heartbeat_and_retried(db_url: str, catalog_dir: Path) -> None:
    budget, names = 16, [None]
    storage = make_storage(db_url, heartbeat_interval=None)
    try:
        first, second, study = _start_two_workers(db_url, catalog_dir, budget, names)
        victim = f":{second.pid}"

        def second_mid_trial():
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if t.user_attrs.get("worker", "").endswith(victim) and t.user_attrs.get("measuring"):
                    return t
            return None

        killed = _wait_for(second_mid_trial, 60, "the worker to be measuring", [second])
        assert budget_used(study) <= budget // 2  # the survivor has trials left to run past the grace period
        second.send_signal(signal.SIGKILL)
        second.wait(timeout=10)
        out, err = first.communicate(timeout=90)
        assert first.returncode == 0, err[-3000:]
        assert json.loads(out)["trials"] >= budget

        trials = _check_study(study, budget, workers=2)
        # the trial the worker was in when it died (the one seen measuring, unless it just finished)
        unfinished = [t for t in trials if t.user_attrs.get("worker", "").endswith(victim) and "result" not in t.user_attrs]
        assert len(unfinished) == 1 and unfinished[0].number >= killed.number
        dead = unfinished[0]
        assert dead.state == TrialState.FAIL  # failed by the heartbeat
        retries = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
        assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
        assert retries[0].params == dead.params and retries[0].user_attrs["worker"] != dead.user_attrs["worker"]
        assert retries[0].user_attrs["result"]["outcome"] in ("measured", "cached")
    finally:
        for p in (locals().get("first"), locals().get("second")):
            if p is not None and p.poll() is None:
                p.kill()
        if names[0]:
            optuna.delete_study(study_name=names[0], storage=storage)


@pytest.mark.parametrize("name,shape,dtype", [
    ("cross_entropy", {"t": 8192, "v": 128256}, "bfloat16"),
    ("safe_softmax", {"m": 16384, "n": 1024}, "float16"),
    ("attention", {"b": 128, "h": 16, "m": 512, "n": 512, "d": 64, "e": 64}, "float16"),
    # d = e = 128: the default 128 x 64 tile fits (129 KiB compiled), once K and V alone count per stage
    ("attention_causal", {"b": 4, "h": 32, "m": 4096, "n": 4096, "d": 128, "e": 128}, "bfloat16"),
])
def test_a_new_study_first_tries_each_strategys_default(catalog_specs: dict, name: str, shape: dict, dtype: str) -> None:
    """The configuration an expert starts from (plan.default_config) is every strategy's first trial:
    a few trials on a GPU measure it. (Defaults that leave lane blocks of 1 implicit were once
    dropped on their way to the study, so a 3-trial GPU run never tried them.)"""
    from fuser_core.codegen.plan import default_config
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from fuser_core.spec import load_spec
    from tuner.measure import ModelMeasurer
    from tuner.profiles import get_profile
    from tuner.search.proposals import default_candidates
    from tuner.search.trials import trial_result
    from tuner.space import Candidate, SearchSpace

    spec = load_spec(catalog_specs[name])
    derivation = derive_cascade(spec)
    problem = make_problem(spec, shape, dtype)
    space = SearchSpace(problem, derivation, get_profile("h100"))
    defaults = default_candidates(space)
    fitting = [s for s in space.strategies() if space.check(space.candidate(
        s, space.values_of(Candidate(s, default_config(spec, derivation, s, problem.shape))))) is None]
    assert [s for s, _ in defaults] == fitting and "streaming_fused" in fitting  # every default that fits
    assert fitting == space.strategies()  # and each strategy's default does fit
    tuner = Tuner(space, ModelMeasurer(problem, derivation, get_profile("h100")), seed=0)
    tuner.run(len(defaults))
    first = [trial_result(t) for t in tuner.study.trials[:len(defaults)]]
    assert [t.user_attrs.get("source") for t in tuner.study.trials[:len(defaults)]] == ["default"] * len(defaults)
    for (strategy, _), got in zip(defaults, first):
        want = default_config(spec, derivation, strategy, problem.shape)
        assert got["strategy"] == strategy
        assert {d: got["config"]["blocks"][d] for d in want.blocks} == want.blocks
        assert (got["config"]["num_warps"], got["config"].get("per_lane", True)) == (want.num_warps, want.per_lane)
