"""The device measurer (tuner/device/, ``--measurer cuda``): worker process, correctness gate, sampled
reference, timeouts and crashes.

Without a GPU everything runs with ``device="cpu"``: the same worker process and protocol,
kernels through Triton's interpreter, times labelled as interpreter times. Faults are injected
for real in the child (FOLDWISE_MEASURE_FAULT_FILE): a hang is killed by the timeout, a
segfault and an exit are reported as crashes, corrupted outputs fail the check, and after each
fault the next trial succeeds. The GPU test at the end runs only where CUDA is available.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import signal
import time
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from tests.support.catalog import load_catalog

from fuser_core.derive import derive_cascade
from fuser_core.problem import make_problem
from fuser_core.reference import bind_shape, evaluate
from fuser_core.spec import load_spec
from tuner.measure import Measurer
from fuser_core.sampled_reference import SampledEvaluator, reference_cost, sample_rows, sliceable_dims
from tuner.device.checks import check_outputs
from tuner.device.inputs import DeviceProblem, problem_payload
from tuner.device.measurer import DeviceMeasurer
from tuner.device.timing import CPU_LABEL, TimingSettings
from tuner.device.worker import FAULT_ENV, WorkerProcess
from tuner.profiles import get_profile
from tuner.search.tuner import Tuner
from tuner.space import SearchSpace

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked tile lanes compute 0/0

CATALOG = load_catalog()
H100 = get_profile("h100")
FAST = TimingSettings(cpu_warmup=0, cpu_reps=1)
SOFTMAX_SHAPE = {"m": 3, "n": 40}
HAS_CUDA = __import__("torch").cuda.is_available()


@cache
def loaded(name: str):
    spec = load_spec(CATALOG[name])
    return spec, derive_cascade(spec)


def softmax_candidate():
    spec, d = loaded("safe_softmax")
    space = SearchSpace(make_problem(spec, SOFTMAX_SHAPE, "float32"), d, H100)
    c = space.candidate("streaming_fused", {"block_n": 16, "block_m": 1, "num_warps": 1, "num_stages": 2})
    assert space.check(c) is None
    return spec, d, space, c


# ------------------------------------------------------------------------------ sampled reference


def test_sample_rows_fit_the_budget_and_keep_tails() -> None:

    from tests.support.catalog import load_catalog_suites

    for case in load_catalog_suites()["paper"]:
        spec, _ = loaded(case["spec"])
        shape = bind_shape(spec, case["shape"])
        rows = sample_rows(spec, shape, 1 << 24, np.random.default_rng(0))
        sampled = {d: (len(rows[d]) if d in rows else n) for d, n in shape.items()}
        assert reference_cost(spec, sampled) <= 1 << 24, case
        assert set(rows) <= set(sliceable_dims(spec))
        for d, idx in rows.items():
            assert list(idx) == sorted(set(idx.tolist())) and 0 <= idx[0] and idx[-1] == shape[d] - 1
            if len(idx) >= 2:
                assert idx[0] == 0
    spec, _ = loaded("attention")
    assert sliceable_dims(spec) == ("b", "h", "m", "e")  # d (inner) and n (the axis) are reduced over
    spec, _ = loaded("moe_routing")
    assert sliceable_dims(spec) == ("t",)  # j is topk's `as` dim
    assert sample_rows(spec, {"t": 4, "x": 40, "j": 8}) == {}  # small enough: every row
    with pytest.raises(ValueError, match="single row"):
        sample_rows(spec, {"t": 4, "x": 100_000, "j": 8}, budget=1000)


def test_sampled_evaluator_matches_the_full_reference_on_its_rows() -> None:
    """index() and size() of a sampled dim keep their full-shape values."""
    rowscale = load_spec({
        "foldwise": 1, "name": "rowscale", "inputs": {"x": {"dims": ["m", "n"]}},
        "steps": [{"name": "s", "reduce": "sum", "over": "n", "expr": "x * (index(m) + 1) / size(m)"},
                  {"name": "y", "expr": "x - s * index(n)"}],
        "outputs": ["y", "s"]})
    cases = [(rowscale, {"m": 37, "n": 9}), (loaded("attention_causal")[0], {"b": 2, "h": 3, "m": 19, "n": 23, "d": 4, "e": 5})]
    rng = np.random.default_rng(1)
    for spec, shape in cases:
        inputs = {i.name: rng.standard_normal([shape[d] for d in i.dims]) for i in spec.inputs}
        full = evaluate(spec, shape, inputs)
        rows = sample_rows(spec, shape, budget=reference_cost(spec, shape) // 6, rng=rng)
        assert rows, "the budget must force sampling"
        sliced = {}
        for i in spec.inputs:
            a = inputs[i.name]
            for ax, d in enumerate(i.dims):
                if d in rows:
                    a = np.take(a, rows[d], axis=ax)
            sliced[i.name] = a
        got = SampledEvaluator(spec, shape, rows).outputs(sliced)
        for part, ref in full.items():
            dims = spec.step(part.split(".")[0]).dims
            for ax, d in enumerate(dims):
                if d in rows:
                    ref = np.take(ref, rows[d], axis=ax)
            np.testing.assert_allclose(got[part], ref, rtol=1e-12, atol=1e-12)


def test_check_outputs_on_sampled_rows() -> None:
    """The gate in-process: a correct result passes; an error in a checked row fails; a NaN in
    a row outside the sample fails; a finite error outside the sample is (by design) not seen."""
    import torch

    from tuner.torch_ref.builder import build

    spec, d = loaded("safe_softmax")
    shape = {"m": 50, "n": 40}
    bound = make_problem(spec, shape, {"x": "float32"})
    problem = DeviceProblem(problem_payload(bound, d), "cpu", {"reference_budget": 400, "seed": 3})
    rows = problem.rows_np["m"]
    assert 2 <= len(rows) < 50 and rows[0] == 0 and rows[-1] == 49
    outside = next(i for i in range(50) if i not in set(rows.tolist()))
    good = build(bound)(problem.inputs)
    variant = {"kind": "eager"}
    report = check_outputs(problem, good, variant)
    assert report["passed"] and report["max_rel_err"] < 1e-5 and report["rows_checked"] == {"m": len(rows)}

    bad = {"y": good["y"].clone()}
    bad["y"][rows[-1], 7] *= 1.01
    report = check_outputs(problem, bad, variant)
    assert not report["passed"] and "wrong result: y has max relative error" in report["error"]

    nan = {"y": good["y"].clone()}
    nan["y"][outside, 0] = float("nan")
    report = check_outputs(problem, nan, variant)
    assert not report["passed"] and "outside the checked rows" in report["error"]

    unseen = {"y": good["y"].clone()}
    unseen["y"][outside, 0] += 1.0
    assert check_outputs(problem, unseen, variant)["passed"]

    wrong_shape = {"y": torch.zeros(50, 41)}
    assert "has shape (50, 41)" in check_outputs(problem, wrong_shape, variant)["error"]


# ------------------------------------------------------------------------------ the worker, on CPU


def test_cpu_measurer_times_checked_kernels_on_a_reused_worker() -> None:
    spec, d, space, c = softmax_candidate()
    with WorkerProcess("cpu") as worker:
        info = worker.call("info")
        assert info.ok and info.value["device"] == "cpu" and info.value["timing_label"] == CPU_LABEL
        m = DeviceMeasurer(make_problem(spec, SOFTMAX_SHAPE, "float32"), d, H100, timeout_s=60, timing=FAST, worker=worker)
        assert isinstance(m, Measurer) and m.name == "cuda-interpreter" and m.device == "cpu"
        r = m.measure(c)
        assert r.error is None and r.time_ms is not None and r.time_ms > 0 and r.predicted is False
        assert r.details["clock"] == CPU_LABEL and r.details["timing"]["clock"] == CPU_LABEL
        assert r.details["check"]["passed"] and r.details["check"]["rows_checked"] == "all"
        t = r.details["timing"]
        assert t["min_ms"] <= t["p20_ms"] <= t["median_ms"] <= t["p80_ms"] <= t["max_ms"] and t["reps"] == 1
        # the search drives it like any measurer; the worker process is reused across trials
        result = Tuner(space, m, seed=0, startup=2).run(3)
        assert result.measurer == "cuda-interpreter" and result.predicted is False and result.time_ms > 0
        assert worker.starts == 1
        m.close()  # a shared worker is not the measurer's to stop
        assert worker.alive()
        bad = worker.call("no_such_job")
        assert not bad.ok and "unknown job 'no_such_job'" in bad.error and worker.starts == 1
    assert not worker.alive()  # closing the worker stopped it
    with pytest.raises(ValueError, match="device"):
        WorkerProcess("tpu")
    with pytest.raises(ValueError, match="timeout_s"):
        DeviceMeasurer(make_problem(spec, SOFTMAX_SHAPE, "float32"), d, H100, device="cpu", timeout_s=0)


def test_the_device_gate_holds_a_fused_kernel_to_the_accuracy_bar() -> None:
    """The GPU measurer's gate (here on the CPU worker) runs each fused variant on the gate families
    (x + 100, x + 1000, peaked rows) at the job's shape and refuses one whose sampled rows lose digits
    the formula keeps: a variance weighted by exp(x - mx) (2 + sin(x)), whose fused form accumulates
    raw moments (sympy cannot prove the weights >= 0); its multi-pass kernel keeps them."""
    weight = "exp(x - mx) * (2 + sin(x))"
    spec = load_spec({"foldwise": 1, "name": "wvar", "inputs": {"x": {"dims": ["m", "n"]}, "v": {"dims": ["m", "n"]}},
                      "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                                {"name": "den", "reduce": "sum", "over": "n", "expr": weight},
                                {"name": "mu", "reduce": "sum", "over": "n", "expr": f"{weight} * v / den"},
                                {"name": "var", "reduce": "sum", "over": "n", "expr": f"{weight} * (v - mu) ** 2 / den"}],
                      "outputs": ["var"]})
    d = derive_cascade(spec)
    problem = make_problem(spec, SOFTMAX_SHAPE, "float32")
    space = SearchSpace(problem, d, H100)
    fused = space.candidate("streaming_fused", {"block_n": 16, "block_m": 1, "num_warps": 1, "num_stages": 2})
    passes = space.candidate("multi_pass", {"block_n": 16, "block_m": 1, "num_warps": 1, "num_stages": 2})
    with WorkerProcess("cpu") as worker:
        m = DeviceMeasurer(problem, d, H100, timeout_s=120, timing=FAST, worker=worker)
        refused = m.measure(fused)
        kept = m.measure(passes)
        m.close()
    assert refused.time_ms is None and "fails the accuracy bar on the offset" in refused.error, refused.error
    assert kept.error is None and kept.details["accuracy"]["passed"], kept.details
    assert [r["family"] for r in kept.details["accuracy"]["families"]] == ["offset100", "offset1000", "peaked"]


def test_faults_fail_one_trial_and_the_next_succeeds(tmp_path) -> None:
    """Every fatal fault costs a worker start (seconds: torch is imported anew), so the hang
    runs on a second worker in a thread while the other faults run here."""
    import threading

    spec, d, _, c = softmax_candidate()

    def measurer(name: str, timeout_s: float) -> tuple[DeviceMeasurer, Path]:
        fault = tmp_path / name
        worker = WorkerProcess("cpu", env={FAULT_ENV: str(fault)})  # the child takes the file before each job
        return DeviceMeasurer(make_problem(spec, SOFTMAX_SHAPE, "float32"), d, H100, timeout_s=timeout_s, timing=FAST, worker=worker), fault

    def succeeds(m: DeviceMeasurer) -> None:
        r = m.measure(c)
        assert r.error is None and r.time_ms > 0 and r.details["check"]["passed"], r.error

    hang_results: list = []

    def hang_sequence() -> None:
        m, fault = measurer("hang", 4)
        try:
            fault.write_text("hang")
            t0 = time.monotonic()
            r = m.measure(c)
            hang_results.append((r, time.monotonic() - t0, fault.exists()))
            hang_results.append(m.measure(c))
            hang_results.append(m.worker.starts)
        finally:
            m.worker.close()

    thread = threading.Thread(target=hang_sequence)
    thread.start()
    m, fault = measurer("faults", 60)
    try:
        fault.write_text("segv")
        r = m.measure(c)
        assert r.time_ms is None and r.error == "worker process died with signal SIGSEGV while running"
        assert r.details["failure"]["kind"] == "crash" and not fault.exists()
        succeeds(m)
        assert m.worker.starts == 2

        fault.write_text("corrupt")  # a wrong result: the check's verdict, never a time; the worker stays
        pid = m.worker.pid
        r = m.measure(c)
        assert r.time_ms is None and r.error.startswith("wrong result: y has max relative error")
        assert not r.details["check"]["passed"] and r.details["check"]["errors"]["y"] > 1
        fault.write_text("raise")  # an exception in the job: failed trial, same worker
        r = m.measure(c)
        assert r.error == "RuntimeError: injected fault (raise)" and "traceback" in r.details
        succeeds(m)
        assert m.worker.pid == pid

        fault.write_text("cuda_error")  # a fatal CUDA error: the child exits after answering
        r = m.measure(c)
        assert "illegal memory access" in r.error
        succeeds(m)
        assert m.worker.pid != pid and m.worker.starts == 3

        os.kill(m.worker.pid, signal.SIGKILL)  # killed from outside between trials
        time.sleep(0.2)
        succeeds(m)
        assert m.worker.starts == 4
    finally:
        m.worker.close()
        thread.join(timeout=120)
    (r, elapsed, left), ok, starts = hang_results
    assert r.time_ms is None and r.error == "timed out after 4s compiling", r.error
    assert r.details["failure"] == {"kind": "timeout", "phase": "compiling"}
    assert elapsed < 60 and not left
    assert ok.error is None and ok.time_ms > 0 and starts == 2


def test_exit_codes_and_signals_are_named(tmp_path) -> None:
    """How a dead child is described (a real os._exit(3), no torch import: the child is a bare
    Python that exits at once; the segfault is exercised for real above)."""
    import subprocess
    import sys

    w = WorkerProcess("cpu")
    for code, message in ((3, "worker process exited with code 3 while running"),
                          (-signal.SIGKILL, "worker process died with signal SIGKILL while compiling")):
        die = f"os.kill(os.getpid(), {-code})" if code < 0 else f"os._exit({code})"
        proc = subprocess.Popen([sys.executable, "-c", f"import os; {die}"])
        proc.wait()
        w._state["proc"] = proc
        phase = "running" if code > 0 else "compiling"
        r = w._crashed(phase)
        assert (r.ok, r.kind, r.error) == (False, "crash", message)
        assert w._state["proc"] is None


ECHO_JOBS = """
class EchoJobs:
    def __init__(self, device, conn):
        self.info = {"device": device, "runner": "echo"}

    def run(self, job, payload, fault):
        if job == "boom":
            raise ValueError("no " + payload["what"])
        return {"job": job, **payload}
"""


def test_the_worker_process_runs_any_job_runner(tmp_path) -> None:
    """The crash-isolated worker is not tied to measuring: it runs the job runner it is given
    (``module:Class``), answers a job's exception as that job's failure and keeps its child, and
    a runner that cannot be set up is a startup error answered at once to every later call."""
    (tmp_path / "echo_jobs.py").write_text(ECHO_JOBS)
    env = {"PYTHONPATH": str(tmp_path)}  # the child also gets the repository on its path
    with WorkerProcess("cpu", env=env, jobs="echo_jobs:EchoJobs") as w:
        r = w.call("echo", {"x": 1})
        assert r.ok and r.value == {"job": "echo", "x": 1} and w.info == {"device": "cpu", "runner": "echo"}
        pid = w.pid
        bad = w.call("boom", {"what": "luck"})
        assert (bad.ok, bad.kind, bad.error) == (False, "exception", "ValueError: no luck")
        assert w.call("echo").ok and w.pid == pid and w.starts == 1
    with WorkerProcess("cpu", env=env, jobs="echo_jobs:Missing") as w:
        r = w.call("echo")
        assert (r.ok, r.kind) == (False, "startup") and "AttributeError" in r.error
        assert w.call("echo").error == r.error and w.starts == 1


def test_the_child_answers_the_measured_binary_job_after_measuring() -> None:
    """The kernel store's ``binary`` job (tuner.measured_binary) through the child on the CPU
    device: the measured module is launched again, but Triton's interpreter keeps no JIT cache
    of compiled kernels, so the answer is a clear error (on a GPU it is the measured cubins;
    not measured on GPU here)."""
    spec, d, _, c = softmax_candidate()
    with DeviceMeasurer(make_problem(spec, SOFTMAX_SHAPE, "float32"), d, H100, device="cpu", timeout_s=60, timing=FAST) as m:
        assert m.measure(c).error is None
        with pytest.raises(RuntimeError, match="no compiled kernel in the module's JIT cache"):
            m.measured_binary(c.strategy, c.config.to_dict())


@pytest.mark.skipif(HAS_CUDA, reason="checks the answer of a machine without a GPU")
def test_no_gpu_is_a_clear_failure_remembered_once() -> None:
    spec, d, _, c = softmax_candidate()
    with DeviceMeasurer(make_problem(spec, SOFTMAX_SHAPE, "float32"), d, H100, device="cuda", timeout_s=60) as m:
        r = m.measure(c)
        assert r.time_ms is None and "could not start on cuda" in r.error and "no CUDA GPU" in r.error
        t0 = time.monotonic()
        assert m.measure(c).error == r.error and time.monotonic() - t0 < 1.0 and m.worker.starts == 1


# ------------------------------------------------------------------------------ on a GPU


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_measure_flushes_l2_and_rotates_inputs() -> None:
    spec, d = loaded("safe_softmax")
    shape = {"m": 4096, "n": 8192}
    space = SearchSpace(make_problem(spec, shape, "float16"), d, H100)
    c = space.candidate("streaming_fused", {"block_n": 1024, "block_m": 1, "num_warps": 8, "num_stages": 2})
    assert space.check(c) is None
    with DeviceMeasurer(space.problem, d, H100, timeout_s=300) as m:
        r = m.measure(c)
        assert r.error is None, r.error
        t, info = r.details["timing"], m.worker.info
        assert t["reps"] >= 10 and t["min_ms"] <= t["p20_ms"] <= t["median_ms"] <= t["p80_ms"]
        assert t["flush_bytes"] >= 2 * info["l2_bytes"] and t["sets"] * 2 * 4096 * 8192 > info["l2_bytes"]
        assert r.details["check"]["passed"] and r.details["device_name"] == info["device_name"]
        # 64 MiB read + 64 MiB written: no faster than 10 TB/s, i.e. nothing timed from cache
        assert r.time_ms > 2 * 4096 * 8192 * 2 / 10e12 * 1e3
