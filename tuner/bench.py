"""``foldwise bench``: the tuned fused kernel against its baselines, on the GPU.

For every case of a suite (the catalog's ``suites.json``, :mod:`fuser_core.catalog`: a catalog spec, sizes, dtype)
the bench

1. tunes the fused kernel with the ``cuda`` measurer (:class:`tuner.measure_cuda.CudaMeasurer`,
   ``trials`` per case);
2. times, in the same worker process and with the same harness (correctness check against
   the float64 reference first, then CUDA events, L2 flushed, inputs rotated, median): the
   tuned fused kernel, the unfused kernel chain (:mod:`fuser_core.codegen.chain`), torch
   eager and ``torch.compile`` (Inductor) of the spec (:mod:`tuner.torch_ref`), and torch's
   hand-written kernel where one exists. A baseline that gives a wrong result is reported
   with its error and not timed; one that crashes or hangs is reported as failed;
3. measures the device-to-device copy bandwidth once, and reports each fused kernel's
   achieved bandwidth on the **minimum traffic** (every input read once, every output written
   once) as a fraction of it;
4. checks the targets of issue 4 and marks each met / missed / n/a:

   - ``chain_2x``: fused >= 2x faster than the unfused chain, for cascades with two or more
     dependent reductions (a reduction reading another over the same axis) over a long axis
     (>= :data:`LONG_AXIS` elements at the suite's shape);
   - ``compile_1x``: fused at least as fast as ``torch.compile``;
   - ``handwritten_0.9x``: fused at least 0.9x the speed of the hand-written kernel;
   - ``copy_bw_80``: fused at >= 80% of the copy bandwidth, for memory-bound cascades:
     those whose arithmetic intensity (contraction FLOPs over the minimum traffic, at the
     suite's shape) is below the target profile's ridge point (:func:`roofline`).

Results record the device name, the date, torch, Triton and Python versions, and every
setting; they are written as JSON, a Markdown table and a PNG bar chart (matplotlib, Agg).

Without a CUDA GPU the bench refuses (:class:`NoGpu`), unless ``device="cpu"`` asks for the
smoke mode: kernels through Triton's interpreter at tiny shapes (each case shrunk like the
model measurer's correctness check, :func:`tuner.measure.reduced_problem`), every time
labelled "CPU interpreter, not GPU", targets not evaluated. It exists to exercise the whole
pipeline and the writers on machines without a GPU; its numbers say nothing about GPUs.

Example (on a GPU)::

    results = run_bench("paper", Path("benchmarks/results/paper"), trials=40)
    write_outputs(results, Path("benchmarks/results/paper"))
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tuner.measure_cuda import (
    CPU_LABEL,
    DEFAULT_TIMEOUT_S,
    CudaMeasurer,
    TimingSettings,
    WorkerProcess,
    problem_payload,
)
from tuner.static_bound import min_bytes

BASELINES = ("chain", "eager", "compile", "handwritten")
VARIANTS = ("fused", *BASELINES)
LABELS = {"fused": "fused (tuned)", "chain": "unfused chain", "eager": "torch eager", "compile": "torch.compile",
          "handwritten": "hand-written"}
EXPERT_PREFIX = "expert:"  # variants[EXPERT_PREFIX + name]: an expert baseline of tuner.experts
LONG_AXIS = 4096  # a reduction axis at least this long counts as long for the chain_2x target
COMPILE_TIMEOUT_S = 600.0
TARGETS = {
    "chain_2x": ("fused >= 2x unfused chain (2+ dependent reductions over a long axis)", 2.0),
    "compile_1x": ("fused >= torch.compile", 1.0),
    "handwritten_0.9x": ("fused >= 0.9x hand-written", 0.9),
    "copy_bw_80": ("fused >= 80% of copy bandwidth (memory-bound)", 0.8),
}
RESULT_FORMAT = 1


class BenchError(Exception):
    """A bench that cannot run as asked (unknown suite, bad case, bad option): the message says why."""


class NoGpu(BenchError):
    """No CUDA GPU, and the CPU smoke mode was not asked for."""


# ---------------------------------------------------------------------------- suites


def _catalog_dirs(catalog_dir: Path | None) -> list[Path]:
    """The catalog folders a bench reads: ``catalog_dir`` (``--catalog``) first, then
    ``$FOLDWISE_CATALOG_DIR`` and the packaged catalog (:mod:`fuser_core.catalog`)."""
    from fuser_core.catalog import catalog_dirs

    if catalog_dir is not None and not Path(catalog_dir).is_dir():
        raise BenchError(f"catalog: {catalog_dir} is not a folder")
    return catalog_dirs(extra=[catalog_dir] if catalog_dir is not None else [])


def load_suite(suite: str, catalog_dir: Path | None = None) -> list[dict[str, Any]]:
    """The cases of ``suite`` from the catalog's suites (``catalog_dir`` first, see
    :func:`_catalog_dirs`); BenchError naming the suite or the case."""
    from fuser_core.catalog import CatalogError, catalog_names, load_suites

    dirs = _catalog_dirs(catalog_dir)
    try:
        suites = load_suites(dirs)
    except CatalogError as err:
        raise BenchError(str(err)) from None
    if suite not in suites:
        raise BenchError(f"unknown suite {suite!r}; the catalog has {', '.join(sorted(suites)) or 'none'}")
    cases = suites[suite]
    names = set(catalog_names(dirs))
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or not isinstance(case.get("spec"), str) or not isinstance(case.get("shape"), dict):
            raise BenchError(f"{suite}[{i}]: a case needs 'spec' (a catalog name) and 'shape' (dim -> size)")
        if case["spec"] not in names:
            raise BenchError(f"{suite}[{i}].spec: no catalog spec {case['spec']!r} in {', '.join(map(str, dirs))}")
    return cases


def case_id(case: Mapping[str, Any]) -> str:
    return f"{case['spec']}[" + ",".join(f"{k}={v}" for k, v in case["shape"].items()) + "]"


# ---------------------------------------------------------------------------- per-case facts


def dependent_long_axes(spec: Any, derivation: Any, shape: Mapping[str, int]) -> list[str]:
    """Axes with two or more dependent reductions (one reads another over the same axis) and
    at least LONG_AXIS elements."""
    axes = []
    for form in derivation.forms.values():
        if form.deps and shape[form.axis] >= LONG_AXIS and form.axis not in axes:
            axes.append(form.axis)
    return axes


def roofline(spec: Any, shape: Mapping[str, int], dtypes: Mapping[str, str], profile: Any) -> dict[str, Any]:
    """Memory- or compute-bound on ``profile``: contraction FLOPs over the minimum traffic,
    against the ridge point of the attainable rates (tensor-core peak x the cost model's
    DOT_EFFICIENCY, fp16 units when the spec has fp16 inputs, else TF32, over the datasheet
    bandwidth x HBM_EFFICIENCY)."""
    from tuner.cost_model import DOT_EFFICIENCY, HBM_EFFICIENCY
    from tuner.torch_ref import contraction_flops

    flops = contraction_flops(spec, shape)
    nbytes = min_bytes(spec, shape, dtypes)
    unit = "fp16" if "float16" in dtypes.values() else "tf32"
    ridge = profile.dot_flops(unit) * DOT_EFFICIENCY / (profile.hbm_bytes_per_s * HBM_EFFICIENCY)
    intensity = flops / max(1, nbytes)
    return {"flops": flops, "min_bytes": nbytes, "intensity": intensity, "ridge": ridge, "unit": unit,
            "memory_bound": intensity < ridge, "profile": profile.name}


# ---------------------------------------------------------------------------- running


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


def label_of(kind: str) -> str:
    """How tables name a variant: LABELS, or an expert's own name."""
    return kind[len(EXPERT_PREFIX):] if kind.startswith(EXPERT_PREFIX) else LABELS[kind]


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
    """Run the bench (module docstring) and return the results; with ``out_dir``, also write
    them (:func:`write_outputs`). ``only`` keeps the cases of those spec names.

    ``experts``: also time every expert baseline of :mod:`tuner.experts` that computes the
    case (Liger-Kernel, SDPA per backend, a split-KV decoder, ``torch._scaled_mm``), each as
    variant ``expert:<name>``. ``cases``: run these cases (each like a suite's: spec, shape,
    dtype) in this order instead of the suite's. ``budget_s``: wall-clock seconds for the whole
    run; a case or variant that would start after it is recorded as skipped, not run (the cases
    come in priority order). ``on_case(results so far)`` is called after each case, so a
    caller can save partial results."""
    import torch

    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from fuser_core.catalog import load_catalog_spec
    from tuner.compile_gate import CompileGate
    from tuner.measure import reduced_problem
    from tuner.profiles import get_profile, profile_for_device_name
    from tuner.search import NoResult, Tuner
    from tuner.space import SearchSpace
    from tuner.torch_ref import handwritten_reason

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

    dirs = _catalog_dirs(catalog_dir)
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
                spec, reduced_problem(spec, derivation, suite_shape, "multi_pass")[0], dtypes)
            shape = problem.shape
            say(f"[{i + 1}/{len(cases)}] {case_id(case)} {json.dumps(case.get('dtype', 'float32'))}: tuning ({trials} trials)")
            entry: dict[str, Any] = {
                "id": case_id(case), "spec": spec.name, "suite_shape": suite_shape, "shape": shape, "dtype": dtypes,
                "note": case.get("note"), "min_bytes": min_bytes(spec, shape, dtypes),
                "roofline": roofline(spec, suite_shape, dtypes, profile),
                "dependent_long_axes": dependent_long_axes(spec, derivation, suite_shape),
                "variants": {},
            }
            space = SearchSpace(problem, derivation, profile)
            measurer = CudaMeasurer(problem, derivation, profile, device=device, timeout_s=timeout_s, timing=timing,
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
                    variant = {"kind": "fused", "strategy": entry["tuning"]["strategy"], "config": entry["tuning"]["config"]}
                elif label == "handwritten":
                    reason = handwritten_reason(spec)
                    if reason is not None:
                        entry["variants"]["handwritten"] = {"status": "none", "reason": reason}
                        continue
                    from tuner.torch_ref import handwritten

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


def _time(entry: Mapping[str, Any], kind: str) -> float | None:
    v = entry["variants"].get(kind)
    return v["time_ms"] if v and v.get("status") == "ok" else None


def evaluate_case(entry: dict[str, Any], copy: Mapping[str, Any], device: str) -> None:
    """Ratios (baseline time / fused time: above 1, the fused kernel is faster), achieved
    bandwidth, and the targets' verdicts, added to ``entry``."""
    fused = _time(entry, "fused")
    ratios: dict[str, float | None] = {}
    for kind in BASELINES:
        t = _time(entry, kind)
        ratios[kind] = t / fused if (t is not None and fused) else None
    entry["speedup"] = ratios
    entry["expert_speedup"] = {kind[len(EXPERT_PREFIX):]: (t / fused if (t is not None and fused) else None)
                               for kind in entry["variants"] if kind.startswith(EXPERT_PREFIX)
                               for t in [_time(entry, kind)]}
    bw = None
    if fused and copy.get("bytes_per_s"):
        achieved = entry["min_bytes"] / (fused / 1e3)
        bw = {"achieved_bytes_per_s": achieved, "fraction_of_copy": achieved / copy["bytes_per_s"]}
    entry["bandwidth"] = bw

    def verdict(name: str, applies: bool, why_not: str, value: float | None, missing: str) -> dict[str, Any]:
        text, threshold = TARGETS[name]
        out: dict[str, Any] = {"target": text, "threshold": threshold, "value": value, "applies": applies}
        if not applies:
            out["status"], out["reason"] = "n/a", why_not
        elif value is None:
            out["status"], out["reason"] = "not measured", missing
        elif device != "cuda":
            out["status"], out["reason"] = "not evaluated", "CPU interpreter timings say nothing about GPUs"
        else:
            out["status"] = "met" if value >= threshold else "missed"
        return out

    hand = entry["variants"].get("handwritten", {})
    entry["targets"] = {
        "chain_2x": verdict("chain_2x", bool(entry["dependent_long_axes"]),
                            f"no axis with 2+ dependent reductions and >= {LONG_AXIS} elements", ratios.get("chain"),
                            _missing(entry, "chain")),
        "compile_1x": verdict("compile_1x", True, "", ratios.get("compile"), _missing(entry, "compile")),
        "handwritten_0.9x": verdict("handwritten_0.9x", hand.get("status") != "none",
                                    hand.get("reason", "not run"), ratios.get("handwritten"), _missing(entry, "handwritten")),
        "copy_bw_80": verdict("copy_bw_80", bool(entry["roofline"]["memory_bound"]),
                              "compute-bound on the target profile", bw["fraction_of_copy"] if bw else None,
                              "no fused time or no copy bandwidth"),
    }


def _missing(entry: Mapping[str, Any], kind: str) -> str:
    fused, other = entry["variants"].get("fused"), entry["variants"].get(kind)
    if not fused or fused.get("status") != "ok":
        return "the fused kernel has no time"
    if not other:
        return f"{LABELS[kind]} was not run (--baselines)"
    return f"{LABELS[kind]}: {other.get('status')}"


def summarize_targets(cases: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for name in TARGETS:
        counts: dict[str, int] = {}
        for c in cases:
            status = c["targets"][name]["status"]
            counts[status] = counts.get(status, 0) + 1
        out[name] = counts
    return out


# ---------------------------------------------------------------------------- writers


def write_outputs(results: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """``bench_<suite>.json``, ``.md`` and ``.png`` in ``out_dir`` (created)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{results['suite']}"
    paths = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    write_json(results, paths["json"])
    paths["markdown"].write_text(markdown(results))
    write_plot(results, paths["png"])
    return paths


def write_json(results: Mapping[str, Any], path: Path) -> None:
    body = {k: v for k, v in results.items() if k != "files"}
    Path(path).write_text(json.dumps(body, indent=2, sort_keys=False, default=str) + "\n")


def _ms(v: Mapping[str, Any] | None) -> str:
    if not v:
        return "-"
    status = v.get("status")
    if status == "ok":
        return f"{v['time_ms']:.4g}"
    if status == "none":
        return "none"
    if status == "skipped":
        return "skipped"
    if status == "wrong":
        err = (v.get("check") or {}).get("max_rel_err")
        return f"WRONG (err {err:.2g})" if isinstance(err, float) else "WRONG"
    return f"FAILED ({v.get('failure') or 'error'})"


def _percent(bw: Mapping[str, Any] | None) -> str:
    return "-" if not bw else f"{100 * bw['fraction_of_copy']:.0f}%"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}x"


_MARK = {"met": "met", "missed": "**missed**", "n/a": "n/a", "not measured": "not measured",
         "not evaluated": "not evaluated"}


def markdown(results: Mapping[str, Any]) -> str:
    """The results as Markdown: a header (device, date, versions), the times and ratios, the
    targets, and every failure with its message."""
    gpu = results.get("gpu")
    dev = results.get("device", {})
    v = results.get("versions", {})
    lines = [f"# foldwise bench: suite `{results['suite']}`", ""]
    if not gpu:
        lines += [(f"> **{CPU_LABEL}.** Kernels ran in Triton's interpreter at reduced shapes: these times exercise the "
                   "pipeline and say nothing about GPU performance; targets are not evaluated."), ""]
    copy = results.get("copy_bandwidth", {})
    copy_txt = f"{copy['bytes_per_s'] / 1e9:.1f} GB/s" if copy.get("bytes_per_s") else f"unavailable ({copy.get('error')})"
    lines += [
        f"- device: {dev.get('device_name')} ({'GPU' if gpu else 'CPU'}); target profile `{results.get('target')}`",
        f"- date: {results.get('date')}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        (f"- timing: {results.get('timing_label')}; median of the timed runs; tuning trials per case: "
         f"{results['settings']['trials']}"),
        f"- copy bandwidth (read + write): {copy_txt}",
        "- speed-ups are baseline time / fused time (above 1: the fused kernel is faster)",
        "",
        ("| case | dtype | fused (strategy) ms | unfused chain ms | torch eager ms | torch.compile ms | hand-written ms "
         "| chain / fused | compile / fused | hand-written / fused | BW / copy |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    skipped = [c for c in results["cases"] if "skipped" in c]
    ran = [c for c in results["cases"] if "skipped" not in c]
    for c in ran:
        var = c["variants"]
        strategy = c.get("tuning", {}).get("strategy")
        fused = _ms(var.get("fused")) + (f" ({strategy})" if strategy else "")
        bw = c.get("bandwidth")
        dtype = sorted(set(c["dtype"].values()))
        name = c["id"] if c["shape"] == c["suite_shape"] else (
            f"{c['id']} run at " + ",".join(f"{k}={v}" for k, v in c["shape"].items()))
        lines.append(
            f"| {name} | {'/'.join(dtype)} | {fused} | {_ms(var.get('chain'))} | {_ms(var.get('eager'))} | "
            f"{_ms(var.get('compile'))} | {_ms(var.get('handwritten'))} | {_ratio(c['speedup'].get('chain'))} | "
            f"{_ratio(c['speedup'].get('compile'))} | {_ratio(c['speedup'].get('handwritten'))} | "
            f"{_percent(bw)} |")
    lines += ["", "## Targets", "", "| case | " + " | ".join(TARGETS[t][0] for t in TARGETS) + " |",
              "|---|" + "---|" * len(TARGETS)]
    for c in ran:
        cells = []
        for name in TARGETS:
            t = c["targets"][name]
            value = t["value"]
            shown = "" if value is None or t["status"] == "n/a" else (f" ({100 * value:.0f}%)" if name == "copy_bw_80" else f" ({value:.2f}x)")
            cells.append(_MARK[t["status"]] + shown)
        lines.append(f"| {c['id']} | " + " | ".join(cells) + " |")
    summary = results.get("summary", {})
    lines += ["", "Summary: " + "; ".join(
        f"{TARGETS[n][0]}: " + ", ".join(f"{k} {v}" for k, v in sorted(s.items())) for n, s in summary.items())]
    expert_rows = [(c, kind[len(EXPERT_PREFIX):], val) for c in ran for kind, val in c["variants"].items()
                   if kind.startswith(EXPERT_PREFIX)]
    if expert_rows:
        lines += ["", "## Experts", "", "fused / expert is the fused kernel's time over the expert's (below 1: the fused "
                  "kernel is faster).", "", "| case | expert | expert ms | fused ms | fused / expert |", "|---|---|---|---|---|"]
        for c, name, val in expert_rows:
            up = c.get("expert_speedup", {}).get(name)
            shown = val.get("reason", "") if val.get("status") in ("none", "skipped") else ""
            lines.append(f"| {c['id']} | {name} | {_ms(val)}{' ' + shown if shown else ''} | {_ms(c['variants'].get('fused'))} "
                         f"| {'-' if not up else f'{1 / up:.3g}'} |")
    if skipped:
        lines += ["", "## Not run", "", *(f"- {c['id']}: {c['skipped']}" for c in skipped)]
    problems = []
    for c in ran:
        for kind, val in c["variants"].items():
            if val.get("status") in ("wrong", "failed"):
                problems.append(f"- {c['id']} {label_of(kind)}: {val['status']}: {val.get('error')}")
    if problems:
        lines += ["", "## Failures", "", *problems]
    return "\n".join(lines) + "\n"


def write_plot(results: Mapping[str, Any], path: Path) -> None:
    """Grouped bars: per case, each baseline's time over the fused kernel's (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in results["cases"] if "skipped" not in c]
    kinds = [k for k in BASELINES if any(c["speedup"].get(k) for c in cases)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cases) + 2), 4.5))
    width = 0.8 / max(1, len(kinds))
    for j, kind in enumerate(kinds):
        xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(cases))]
        ys = [c["speedup"].get(kind) or float("nan") for c in cases]  # no bar where there is no ratio
        ax.bar(xs, ys, width, label=LABELS[kind])
    ax.axhline(1.0, color="black", linewidth=0.8)
    if "chain" in kinds:
        ax.axhline(TARGETS["chain_2x"][1], color="grey", linewidth=0.8, linestyle="--", label="2x (chain target)")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c["id"] for c in cases], rotation=30, ha="right", fontsize=7)
    if any((c["speedup"].get(k) or 0) > 0 for c in cases for k in kinds):
        ax.set_yscale("log")
    ax.set_ylabel("baseline time / fused time (higher: fused faster)")
    title = f"foldwise bench {results['suite']}: {results['device'].get('device_name')}"
    if not results.get("gpu"):
        title += f"\n{CPU_LABEL}"
    ax.set_title(title, fontsize=9)
    if kinds:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = [
    "BASELINES",
    "LONG_AXIS",
    "TARGETS",
    "VARIANTS",
    "BenchError",
    "NoGpu",
    "case_id",
    "dependent_long_axes",
    "evaluate_case",
    "load_suite",
    "markdown",
    "min_bytes",
    "roofline",
    "run_bench",
    "summarize_targets",
    "write_json",
    "write_outputs",
    "write_plot",
]

