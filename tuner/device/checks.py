"""The variants a worker runs, and their checks against the sampled float64 reference.

Contract: :func:`make_variant` turns a variant (``{"kind": "fused", "strategy", "config"}``, or
a baseline kind) into a function of the input tensors returning the outputs by part;
:func:`check_outputs` compares outputs with the sampled float64 reference using the project's
error measure and tolerances (:func:`fuser_core.runner.judge`; fused strategies whose
derivation is inexact are judged normwise, as :func:`fuser_core.runner.self_check` does), and
:func:`accuracy_bar` holds a variant to the accuracy bar on the gate families. A wrong kernel
is a failed check carrying its errors, never a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fuser_core.codegen.strategies import is_fused
from fuser_core.problem import Problem, tuning_scalars
from tuner.device.inputs import DeviceProblem, select_rows


def fused_module(problem: DeviceProblem, variant: Mapping[str, Any]) -> Any:
    """The loaded generated module of a fused candidate (``{"strategy", "config"}``); loaded
    modules are cached by key, so a second call returns the module (and JIT caches) of the first."""
    from fuser_core.codegen.module import generate
    from fuser_core.codegen.plan import KernelConfig

    config = KernelConfig.from_dict(dict(variant["config"]))
    return generate(problem.spec, problem.derivation, variant["strategy"], problem.shape, config,
                    problem.dtypes).load()


def make_variant(problem: DeviceProblem, variant: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """A function of the input tensors returning the outputs by part, for one variant:
    ``fused`` (a candidate), ``chain`` (the unfused kernel chain), ``eager`` (the spec in
    PyTorch), ``compile`` (that under ``torch.compile``), ``handwritten`` (torch's own kernel),
    ``expert`` (``variant["name"]``: an expert baseline of :mod:`tuner.experts`)."""
    spec, shape, dtypes = problem.spec, problem.shape, problem.dtypes
    kind = variant["kind"]
    if kind == "fused":
        launch = fused_module(problem, variant).launch
        scalars = tuning_scalars(spec, shape)
        return lambda tensors: launch(tensors, shape, scalars=scalars)
    if kind == "chain":
        return chain_function(problem.problem)
    if kind in ("eager", "compile", "handwritten", "expert"):
        import torch

        from tuner.torch_ref.contractions import matmul_precision

        # float32 matmuls in TF32 exactly where the fused kernels use it (bf16 inputs)
        torch.set_float32_matmul_precision(matmul_precision(dtypes))
    if kind in ("eager", "compile"):
        from tuner.torch_ref.builder import build

        fn = build(problem.problem)
        if kind == "compile":
            import torch

            torch._dynamo.reset()  # one compiled function per job: never hit the recompile limit
            fn = torch.compile(fn, dynamic=False)
        return fn
    if kind == "handwritten":
        from tuner.torch_ref.handwritten import handwritten, handwritten_reason

        hw = handwritten(spec)
        if hw is None:
            raise ValueError(handwritten_reason(spec))
        return lambda tensors: hw.fn(tensors, shape)
    if kind == "expert":
        from tuner.experts import expert

        chosen = expert(problem.problem, variant["name"])
        why_not = chosen.applies(problem.problem)
        if why_not is not None:
            raise ValueError(why_not)
        fn = chosen.build(problem.problem)
        return lambda tensors: fn(tensors, shape)
    raise ValueError(f"unknown variant kind {kind!r}")


def chain_function(problem: Problem) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The unfused kernel chain (fuser_core.codegen.chain) with its modules generated and
    loaded once: one launch per kernel, intermediates through memory, as run_chain_detailed."""
    import torch

    from fuser_core.codegen.chain import chain_modules

    spec, shape = problem.spec, problem.shape
    kernels = chain_modules(spec, dict(shape), dict(problem.dtypes))
    for k in kernels:
        k.load()
    final = {p: getattr(torch, d) for p, d in problem.output_dtypes.items()}
    parts = spec.output_parts

    scalars = tuning_scalars(spec, shape)

    def run(tensors: Mapping[str, Any]) -> dict[str, Any]:
        memory: dict[str, Any] = {}
        for k in kernels:
            memory.update(k.launch(tensors, memory, shape, scalars))
        out = {}
        for part in parts:
            t = memory[part]
            out[part] = (t if t.dtype == final[part] else t.to(final[part])).contiguous()
        return out

    return run


def accuracy_bar(problem: DeviceProblem, fn: Callable[[Any], Any]) -> dict[str, Any]:
    """The accuracy bar (fuser_core.accuracy) on the device, for the tuner's gate families
    (``GATE_FAMILIES``: x + 100, x + 1000, peaked rows): the variant runs on each family's inputs at the
    job's shape, and its sampled rows are held to 2x the formula's error in the run's dtype on the same
    rows. torch's own op is the model measurer's comparison (at a reduced shape), not repeated here.
    ``{"passed", "families": [{"family", "passed", "error", "formula_error", "ratio", ...}]}``."""
    from fuser_core.accuracy import GATE_FAMILIES, bar_verdict, formula_dtype

    rows = []
    fdtype = formula_dtype(problem.dtypes)
    for name in GATE_FAMILIES:
        fam = problem.family(name)
        outputs = fn(fam["inputs"])
        sliced = {p: select_rows(outputs[p], problem.spec.step(p.split(".")[0]).dims, problem.rows)
                  for p in fam["reference"]}
        verdict = bar_verdict(problem.spec, sliced, fam["reference"], fam["formula"], problem.stores,
                              cancel=fam["cancel"])
        verdict.pop("parts")
        rows.append({"family": name, **verdict, "shape": dict(problem.shape), "formula_dtype": fdtype, "note": ""})
    return {"passed": all(r["passed"] for r in rows), "families": rows}


def check_outputs(problem: DeviceProblem, outputs: Mapping[str, Any], variant: Mapping[str, Any]) -> dict[str, Any]:
    """Compare with the sampled float64 reference, as fuser_core.runner.self_check judges."""
    import torch

    from fuser_core.runner import judge

    spec = problem.spec
    reference = problem.reference()
    missing = [p for p in reference if p not in outputs]
    if missing:
        return {"passed": False, "error": f"output {missing[0]!r} is missing"}
    sliced = {}
    for part in reference:
        t = outputs[part]
        want = tuple(problem.shape[d] for d in spec.step(part.split(".")[0]).dims)
        if tuple(t.shape) != want:
            return {"passed": False, "error": f"output {part!r} has shape {tuple(t.shape)}, expected {want}"}
        sliced[part] = select_rows(t, spec.step(part.split(".")[0]).dims, problem.rows)
    strategy = variant.get("strategy")
    exact = variant["kind"] != "fused" or not is_fused(strategy) or problem.derivation.exact
    noise, ties = problem.allowances()
    report: dict[str, Any] = judge(spec, sliced, reference, problem.stores, exact=exact, noise=noise, alternatives=ties,
                                   knife=problem.knife_edges)
    bad, errors, tolerances = report.pop("bad"), report["errors"], report["tolerances"]
    report["rows_checked"] = {d: len(v) for d, v in problem.rows_np.items()} or "all"
    if bad:
        p = bad[0]
        report["error"] = (f"wrong result: {p} has max relative error {errors[p]:.3g} > tolerance {tolerances[p]:.3g} "
                           f"against the float64 reference")
        return report
    for part, ref in reference.items():  # rows outside the sample: at least finite where the sample is
        t = outputs[part]
        if t.dtype.is_floating_point and np.isfinite(ref).all() and not bool(torch.isfinite(t.float()).all()):
            report.update(passed=False, error=f"wrong result: {part} has non-finite values outside the checked rows")
            return report
    return report
