"""Running a bench: :func:`run_bench` tunes every case's fused kernel and times it and its
baselines in one crash-isolated worker process (:mod:`tuner.device.worker`), then checks the
targets (:mod:`tuner.bench.targets`) and returns the results (written by
:mod:`tuner.bench.report` when given a folder). What the bench does is the package docstring
(:mod:`tuner.bench`).
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tuner.bench.errors import BenchError, NoGpu
from tuner.bench.report import write_outputs
from tuner.bench.suites import bench_catalog_dirs, case_id, load_suite
from tuner.bench.targets import LONG_AXIS, dependent_long_axes, evaluate_case, roofline, summarize_targets
from tuner.bench.variants import BASELINES, EXPERT_PREFIX, label_of
from tuner.device.inputs import problem_payload
from tuner.device.measurer import DeviceMeasurer
from tuner.device.timing import TimingSettings
from tuner.device.worker import DEFAULT_TIMEOUT_S, WorkerProcess
from tuner.static_bound import min_bytes

COMPILE_TIMEOUT_S = 600.0
RESULT_FORMAT = 1


def _versions() -> dict[str, str]:
    import torch
    import triton

    out = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        from importlib.metadata import version

        out["foldwise"] = version("foldwise")
    except Exception:  # noqa: BLE001, S110 (not installed as a distribution: leave it out)
        pass
    return out


def _quiet_optuna() -> None:
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def _variant_entry(result: Any) -> dict[str, Any]:
    """A variant's outcome for the results: its time and check, or why there is none."""
    if not result.ok:
        return {"status": "failed", "error": result.error, "failure": result.kind, "phase": result.phase}
    value = result.value
    entry: dict[str, Any] = {"check": value.get("check"), "sample": value.get("sample")}
    if "float32_matmul_precision" in value:
        entry["float32_matmul_precision"] = value["float32_matmul_precision"]
    if value.get("error"):
        entry.update(status="wrong", error=value["error"])
        return entry
    entry.update(status="ok", time_ms=value["time_ms"], timing=value["timing"])
    return entry


def run_bench(
    suite: str,
    out_dir: Path | None = None,
    *,
    trials: int = 40,
    device: str | None = None,
    baselines: Iterable[str] = BASELINES,
    target: str | None = None,
    catalog_dir: Path | None = None,
    only: Iterable[str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    compile_timeout_s: float = COMPILE_TIMEOUT_S,
    timing: TimingSettings | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    experts: bool = False,
    budget_s: float | None = None,
    cases: Sequence[Mapping[str, Any]] | None = None,
    on_case: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the bench (the package docstring, :mod:`tuner.bench`) and return the results; with ``out_dir``, also write
    them (:func:`write_outputs`). ``only`` keeps the cases of those spec names.

    ``experts``: also time every expert baseline of :mod:`tuner.experts` that computes the
    case (Liger-Kernel, SDPA per backend, a split-KV decoder, ``torch._scaled_mm``), each as
    variant ``expert:<name>``. ``cases``: run these cases (each like a suite's: spec, shape,
    dtype) in this order instead of the suite's. ``budget_s``: wall-clock seconds for the whole
    run; a case or variant that would start after it is recorded as skipped, not run (the cases
    come in priority order). ``on_case(results so far)`` is called after each case, so a
    caller can save partial results."""
    import torch

    from fuser_core import MULTI_PASS
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from fuser_core.catalog import load_catalog_spec
    from tuner.compile_gate import CompileGate
    from tuner.measure import reduced_problem
    from tuner.profiles import get_profile, profile_for_device_name
    from tuner.search.tuner import NoResult, Tuner
    from tuner.space import SearchSpace
    from tuner.torch_ref.handwritten import handwritten_reason

    say = progress or (lambda _msg: None)
    if trials < 1:
        raise BenchError(f"trials: must be at least 1, got {trials}")
    baselines = tuple(baselines)
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise BenchError(f"baselines: unknown baseline {unknown[0]!r}; choose from {', '.join(BASELINES)}")
    if device is None:
        device = "cuda"
    if device not in ("cuda", "cpu"):
        raise BenchError(f"device: expected cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise NoGpu("foldwise bench times kernels on a CUDA GPU, and none is visible here (torch.cuda.is_available() "
                    "is false); --device cpu runs a smoke test through the Triton interpreter instead (tiny shapes, "
                    "timings labelled 'CPU interpreter, not GPU')")
    import time

    started = time.monotonic()

    def out_of_time() -> bool:
        return budget_s is not None and time.monotonic() - started > budget_s

    dirs = bench_catalog_dirs(catalog_dir)
    cases = list(cases) if cases is not None else load_suite(suite, catalog_dir)
    if only is not None:
        keep = set(only)
        missing = keep - {c["spec"] for c in cases}
        if missing:
            raise BenchError(f"only: suite {suite!r} has no case of spec {min(missing)!r}")
        cases = [c for c in cases if c["spec"] in keep]
    timing = timing or TimingSettings(seed=seed)
    _quiet_optuna()

    worker = WorkerProcess(device)
    try:
        say("starting the measurement worker")
        info = worker.call("info", timeout_s=timeout_s)
        if not info.ok:
            raise BenchError(f"the measurement worker failed: {info.error}")
        dev = info.value
        if device == "cuda":
            found = profile_for_device_name(dev["device_name"])
            if target is not None and found is not None and found != target.lower():
                raise BenchError(f"target: this GPU ({dev['device_name']}) is {found!r}, not {target!r}")
            name = target or found
            if name is None:
                raise BenchError(f"no GPU profile matches {dev['device_name']!r}: pass --target to name the profile "
                                 "whose limits the search space should use")
        else:
            name = target or "h100"
        try:
            profile = get_profile(name)
        except ValueError as err:
            raise BenchError(f"target: {err}") from None
        say("measuring the copy bandwidth")
        copy = worker.call("copy_bandwidth", {"timing": timing.to_dict()}, timeout_s=timeout_s)
        copy_entry = copy.value if copy.ok else {"error": copy.error}

        results_cases: list[dict[str, Any]] = []
        for i, case in enumerate(cases):
            if out_of_time():
                results_cases.append({"id": case_id(case), "spec": case["spec"], "dtype": case.get("dtype", "float32"),
                                      "skipped": f"time budget of {budget_s:g} s used up before this case"})
                continue
            spec = load_catalog_spec(case["spec"], dirs)
            derivation = derive_cascade(spec)
            at_suite_shape = make_problem(spec, case["shape"], case.get("dtype", "float32"))
            suite_shape, dtypes = at_suite_shape.shape, at_suite_shape.dtypes
            problem = at_suite_shape if device == "cuda" else make_problem(
                spec, reduced_problem(spec, derivation, suite_shape, MULTI_PASS.name)[0], dtypes)
            shape = problem.shape
            say(f"[{i + 1}/{len(cases)}] {case_id(case)} {json.dumps(case.get('dtype', 'float32'))}: "
                f"tuning ({trials} trials)")
            entry: dict[str, Any] = {
                "id": case_id(case), "spec": spec.name, "suite_shape": suite_shape, "shape": shape, "dtype": dtypes,
                "note": case.get("note"), "min_bytes": min_bytes(spec, shape, dtypes),
                "roofline": roofline(spec, suite_shape, dtypes, profile),
                "dependent_long_axes": dependent_long_axes(spec, derivation, suite_shape),
                "variants": {},
            }
            space = SearchSpace(problem, derivation, profile)
            measurer = DeviceMeasurer(problem, derivation, profile, device=device, timeout_s=timeout_s, timing=timing,
                                    worker=worker)
            try:
                # compiled for the target before it is timed: what does not compile or fit is pruned
                tuned = Tuner(space, measurer, seed=seed, gate=CompileGate.for_space(space)).run(trials)
                entry["tuning"] = {"strategy": tuned.strategy, "config": tuned.config, "time_ms": tuned.time_ms,
                                   "trials": tuned.trials, "counts": tuned.counts, "measurer": tuned.measurer,
                                   "compile": tuned.compile, "compile_pruned_trials": tuned.compile_pruned_trials}
            except NoResult as err:
                entry["tuning"] = {"error": str(err)}
            payload = problem_payload(problem, derivation)
            labels: list[str] = ["fused", *baselines]
            if experts:
                from tuner.experts import experts_for

                for e in experts_for(problem):
                    why_not = e.applies(problem)
                    if why_not is None:
                        labels.append(EXPERT_PREFIX + e.name)
                    else:
                        entry["variants"][EXPERT_PREFIX + e.name] = {"status": "none", "reason": why_not}
            for label in labels:
                if label != "fused" and out_of_time():
                    entry["variants"][label] = {"status": "skipped", "reason": f"time budget of {budget_s:g} s used up"}
                    continue
                if label.startswith(EXPERT_PREFIX):
                    variant = {"kind": "expert", "name": label[len(EXPERT_PREFIX):]}
                elif label == "fused":
                    if "error" in entry["tuning"]:
                        entry["variants"]["fused"] = {"status": "failed", "error": entry["tuning"]["error"]}
                        continue
                    variant = {"kind": "fused", "strategy": entry["tuning"]["strategy"],
                               "config": entry["tuning"]["config"]}
                elif label == "handwritten":
                    reason = handwritten_reason(spec)
                    if reason is not None:
                        entry["variants"]["handwritten"] = {"status": "none", "reason": reason}
                        continue
                    from tuner.torch_ref.handwritten import handwritten

                    variant = {"kind": label}
                    entry["handwritten_name"] = handwritten(spec).name  # type: ignore[union-attr]
                else:
                    variant = {"kind": label}
                say(f"[{i + 1}/{len(cases)}] {case_id(case)}: {label_of(label)}")
                r = worker.call("variant", {"problem": payload, "variant": variant, "timing": timing.to_dict()},
                                timeout_s=compile_timeout_s if label == "compile" else timeout_s)
                entry["variants"][label] = _variant_entry(r)
            evaluate_case(entry, copy_entry, device)
            results_cases.append(entry)
            if on_case is not None:
                on_case({"cases": results_cases, "copy_bandwidth": copy_entry, "device": dev})
    finally:
        worker.close()

    results = {
        "format": RESULT_FORMAT,
        "suite": suite,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": {k: dev.get(k) for k in ("device", "device_name", "profile", "capability", "sm_count", "l2_bytes",
                                            "total_memory", "cuda") if k in dev},
        "gpu": device == "cuda",
        "timing_label": dev.get("timing_label"),
        "versions": {**_versions(), **({"cuda": dev["cuda"]} if dev.get("cuda") else {})},
        "target": profile.name,
        "copy_bandwidth": copy_entry,
        "settings": {"trials": trials, "baselines": list(baselines), "timeout_s": timeout_s,
                     "compile_timeout_s": compile_timeout_s, "timing": timing.to_dict(), "seed": seed,
                     "long_axis": LONG_AXIS, "catalog_dirs": [str(d) for d in dirs],
                     "only": sorted(only) if only else None, "experts": experts, "budget_s": budget_s,
                     "shapes": "suite shapes" if device == "cuda" else "reduced (tuner.measure.reduced_problem)"},
        "cases": results_cases,
        "summary": summarize_targets([c for c in results_cases if "skipped" not in c]),
    }
    if out_dir is not None:
        results["files"] = {k: str(v) for k, v in write_outputs(results, out_dir).items()}
    return results


__all__ = ["COMPILE_TIMEOUT_S", "RESULT_FORMAT", "run_bench"]
