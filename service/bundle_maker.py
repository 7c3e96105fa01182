"""Making a kernel bundle: derive, generate and wrap one tuned kernel (server side).

The format, its verification and the loader are :mod:`service.bundle` (light, what the client
imports); this module is the part that needs the derivation and the code generator, so the
worker, benchmarks and tests import it, never :mod:`service.client`.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fuser_core import Problem, canonical_form, spec_hash
from service.bundle import BUNDLE_FORMAT, BundleError, bundle_sha256, canonical_spec

if TYPE_CHECKING:
    from tuner import GpuProfile


def make_bundle(
    problem: Problem, *, target: str | GpuProfile, strategy: str, config: Mapping[str, Any],
    measured: Mapping[str, Any], derivation: Mapping[str, Any] | None = None, derived: Any = None,
) -> dict:
    """Generate the kernel for (problem, strategy, config) and wrap it in a bundle.

    ``problem`` (:func:`fuser_core.problem.make_problem`: spec, shape and dtype already bound)
    and ``config.blocks`` may use any naming of the spec (translated to the canonical names). ``measured`` is stored as given (time, baselines, device, measurer...),
    with ``triton_version``, ``torch_version`` and ``date`` filled in when absent.
    ``derivation`` is the derivation report; None computes it for the canonical spec
    (recommended: then its text uses the bundle's own names). ``derived`` is the canonical spec's
    :class:`fuser_core.Derivation` when the caller has it (the worker derived it for its search):
    the kernel and the derivation report are both made from it; None derives it here, once.
    ``target`` is a target name, or the :class:`tuner.GpuProfile` the caller already looked up
    (the worker's, checked once when it started).
    """
    import torch
    import triton

    from fuser_core import GENERATOR_VERSION, STRATEGIES, KernelConfig, NotValid, derive_cascade, generate
    from tuner import GpuProfile, get_profile

    if not isinstance(problem, Problem):
        raise BundleError(f"problem: expected a bound Problem (fuser_core.make_problem), got {type(problem).__name__}")
    spec, names, dtypes = problem.spec, problem.names, problem.dtypes  # input names are the same in canon
    canon = canonical_spec(spec)
    cshape, norm_dtype = problem.canonical_shape, problem.dtype
    try:
        target_name = target.name if isinstance(target, GpuProfile) else get_profile(target).name
    except ValueError as err:
        raise BundleError(f"target: {err}") from None
    if strategy not in STRATEGIES:
        raise BundleError(f"strategy: {strategy!r} cannot be bundled; one of {', '.join(STRATEGIES)}")
    try:
        raw = dict(config)
        blocks = raw.get("blocks", {})
        if isinstance(blocks, Mapping):
            unknown = [d for d in blocks if d not in names or d not in spec.dims]
            if unknown:
                raise ValueError(f"blocks names unknown dim {unknown[0]!r}; the spec's dims are {', '.join(spec.dims)}")
            raw["blocks"] = {names[d]: b for d, b in blocks.items()}
        kconfig = KernelConfig.from_dict(raw)
    except (ValueError, TypeError) as err:
        raise BundleError(f"config: {err}") from None
    if not isinstance(measured, Mapping):
        raise BundleError(f"measured: expected an object, got {type(measured).__name__}")
    if derivation is not None and not isinstance(derivation, Mapping):
        raise BundleError(f"derivation: expected an object, got {type(derivation).__name__}")

    if derived is None:
        derived = derive_cascade(canon)
    try:
        module = generate(canon, derived, strategy, cshape, kconfig, dtypes)
    except NotValid as err:
        shown = json.dumps(kconfig.to_dict(), sort_keys=True)
        raise BundleError(f"strategy {strategy} with config {shown}: {err}") from None
    plan = module.plan
    stores = {canonical_part(p, names): d for p, d in problem.output_dtypes.items()}
    if derivation is None:
        from fuser_core import derivation_report

        derivation = derivation_report(canon, derived)
    elif derivation.get("spec_hash", spec_hash(spec)) != spec_hash(spec):
        raise BundleError("derivation: its spec_hash is not the spec's")

    # a dim summed in a K loop (plan.contraction_loops) takes any size: the loop runs to it
    held_whole = set(plan.inner) - set(plan.contraction_loops) | {s.as_dim for s in canon.steps if s.as_dim}
    if plan.rules.holds_axis_whole:
        held_whole.add(plan.axis)
    record = dict(measured)
    record.setdefault("triton_version", triton.__version__)
    record.setdefault("torch_version", torch.__version__)
    record.setdefault("date", _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    bundle: dict[str, Any] = {
        "format": BUNDLE_FORMAT,
        "spec": canonical_form(spec),
        "spec_hash": spec_hash(spec),
        "shape": cshape,
        "dtype": norm_dtype,
        "target": target_name,
        "strategy": strategy,
        "config": kconfig.to_dict(),
        "blocks": dict(sorted(plan.blocks.items())),
        "size_limits": {d: plan.blocks[d] for d in sorted(held_whole)},
        "inputs": {i.name: {"dims": list(i.dims), "dtype": dtypes[i.name]} for i in canon.inputs},
        "outputs": {p: {"dims": list(canon.step(p.split(".")[0]).dims), "dtype": stores[p]}
                    for p in canon.output_parts},
        "triton_source": module.source,
        "generator_version": GENERATOR_VERSION,
        "triton_version": triton.__version__,
        "measured": copy.deepcopy(record),
        "derivation": copy.deepcopy(dict(derivation)),
    }
    bundle["sha256"] = bundle_sha256(bundle)
    return bundle


def canonical_part(part: str, names: Mapping[str, str]) -> str:
    """An output part (``step`` or ``step.values``/``step.indices``) in canonical step names."""
    step, dot, field = part.partition(".")
    return names[step] + dot + field
