"""Generate, run and check kernels: what ``foldwise run`` does.

On a machine without a GPU the kernels run through Triton's interpreter
(``TRITON_INTERPRET=1``, set here before any kernel module is loaded).

Every check compares with the float64 reference (:mod:`fuser_core.reference`) on the same
inputs. The error measure is elementwise relative error with a floor, so that values that
are tiny next to the rest of their output do not dominate:
``|got - ref| / max(|ref|, floor * max|ref|)``, i.e. a check
``|got - ref| <= rtol * |ref| + atol * max|ref|`` with ``rtol`` the tolerance and
``atol = rtol * floor``. An output element that is a sum cancelling to almost nothing
(attention's ``p.v`` with signed ``v``) carries the rounding error of its terms, not of its
value: 16-bit tensor-core operands round each probability by 2^-11, about 1e-3 of the
output's scale. So: float32 rtol 1e-4, atol 1e-7; float16/bfloat16 rtol 1e-2, atol 1e-3;
float8_e4m3fn 0.13 (one e4m3 step: kernel and reference may round a value sitting on a
rounding boundary differently). An output whose reference is 0 everywhere (``x - x`` once
sympy has reordered it) takes 1 as its scale: it is judged with the absolute ``atol``.

One more allowance comes from float32 itself, not from the kernel: an output that is a small
difference of large terms (``max(q + acc0)`` where ``acc0`` nearly cancels ``q``) moves in
float64 when its inputs move by one float32 ulp, and no float32 program can do better than
that. :func:`rounding_noise` measures that movement (the reference at inputs perturbed by
about one ulp); each element may err by ``NOISE_FACTOR`` times it on top of the tolerance.
A wrong formula still errs at the scale of the values, far above the noise. Likewise an
argmax/argmin over values distinct in float64 but equal in float32 (``tanh`` of large values)
is rounding's choice in a kernel: :func:`tie_alternatives` re-evaluates the reference with each
of the first ``TIE_VARIANTS`` positions within float32 resolution of the extreme, and every
element may match any of them (the index and all that reads it). A fused strategy
whose derivation is inexact (a cast inside a fused reduction) is judged normwise,
``max|got - ref| / max|ref|``, against one e4m3 step, and the report says so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuser_core.codegen.plan import BASELINE, KernelConfig, NotValid, default_config, valid_strategies
from fuser_core.derive import Derivation, derive_cascade
from fuser_core.errors import SpecError
from fuser_core.reference import bind_shape, check_inputs, evaluate, random_inputs
from fuser_core.spec import Spec

TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-2, "float8_e4m3fn": 0.13, "int32": 0.0}
FLOOR = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.1, "float8_e4m3fn": 1e-2, "int32": 0.0}
# Each float32 operation of a kernel rounds by up to 2^-24; the noise perturbs the inputs by up
# to 2^-23. The cancelling max(q + acc0) the fuzzer found errs by 1.2 times its noise in float32
# (numpy, the unfused chain and our kernels alike); 32 leaves room for longer chains of roundings.
NOISE_FACTOR = 32.0
NOISE_ULP = 2.0**-23
TIE_VARIANTS = 4  # argmax/argmin positions within float32 resolution of the extreme, tried in order
INEXACT_TOLERANCE = 0.125  # normwise: one float8 e4m3 step
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")
INDEX_DTYPES = ("int32", "int64")
PREFERENCE = ("streaming_fused", "row_resident", "split_fused", "multi_pass")


def device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return "cpu"


def interpreter_quiet() -> contextlib.AbstractContextManager:
    """Silences NumPy's floating-point warnings while kernels run through Triton's interpreter
    (a no-op on a GPU). The interpreter computes every lane in NumPy, masked-off lanes and both
    sides of a ``tl.where`` included, so ``log(0)`` or ``0 * inf`` in values that are then
    discarded print "divide by zero" or "invalid value" although the outputs are right. Use it
    only where the outputs are then checked against the float64 reference, which catches a NaN
    that does reach an output. ``np.errstate`` holds per thread, so it never silences a
    service worker's neighbour."""
    return np.errstate(all="ignore") if os.environ.get("TRITON_INTERPRET") == "1" else contextlib.nullcontext()


def bind_dtypes(spec: Spec, dtype: str | Mapping[str, str]) -> dict[str, str]:
    """One dtype for every floating input, or a map per input (docs/SPEC.md); index inputs int64."""
    out: dict[str, str] = {}
    if isinstance(dtype, str):
        if dtype not in FLOAT_DTYPES[:3]:
            raise SpecError(f"unknown dtype {dtype!r}; one of {', '.join(FLOAT_DTYPES[:3])} (fp8 per input only)", loc=("dtype",))
        mapping: Mapping[str, str] = {i.name: dtype for i in spec.inputs if i.kind == "float"}
    else:
        mapping = dtype
        unknown = set(mapping) - {i.name for i in spec.inputs}
        if unknown:
            raise SpecError(f"names unknown input {sorted(unknown)[0]!r}", loc=("dtype",))
    for i in spec.inputs:
        allowed = INDEX_DTYPES if i.kind == "index" else FLOAT_DTYPES
        d = mapping.get(i.name, "int64" if i.kind == "index" else "float32")
        if d not in allowed:
            raise SpecError(f"{d!r} is not allowed for {i.kind} input {i.name!r}; one of {', '.join(allowed)}", loc=("dtype", i.name))
        out[i.name] = d
    return out


def choose_strategy(spec: Spec, derivation: Derivation, shape: dict[str, int]) -> str:
    valid = valid_strategies(spec, derivation, shape)
    for s in PREFERENCE:
        if valid.get(s) is None:
            return s
    raise NotValid("no strategy can run this spec: " + "; ".join(f"{k}: {v}" for k, v in valid.items()))


def to_torch(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str], dev: str) -> dict[str, Any]:
    import torch

    out = {}
    for name, arr in arrays.items():
        t = torch.from_numpy(np.ascontiguousarray(arr))
        dt = dtypes[name]
        t = t.to(torch.int64 if dt == "int64" else getattr(torch, dt if dt != "float8_e4m3fn" else "float32"))
        if dt == "float8_e4m3fn":
            t = t.to(torch.float8_e4m3fn)
        out[name] = t.to(dev)
    return out


@dataclass
class RunResult:
    strategy: str
    config: KernelConfig
    outputs: dict[str, Any]  # torch tensors
    source: str


def run(
    spec: Spec, shape: Mapping[str, int], dtype: str | Mapping[str, str], inputs: Mapping[str, np.ndarray],
    *, strategy: str | None = None, config: KernelConfig | None = None, derivation: Derivation | None = None,
) -> RunResult:
    from fuser_core.codegen.module import generate

    bound = bind_shape(spec, shape)
    dtypes = bind_dtypes(spec, dtype)
    dev = device()
    tensors = to_torch(check_inputs(spec, bound, inputs), dtypes, dev)
    if strategy == BASELINE:  # the comparison baseline: one kernel per reduction, through memory
        from fuser_core.codegen.chain import run_chain_detailed

        config = config or KernelConfig()
        chain = run_chain_detailed(spec, bound, dtypes, tensors, config_blocks=config.blocks)
        return RunResult(strategy, config, chain.outputs, "\n\n".join(k.source for k in chain.kernels))
    derivation = derivation or derive_cascade(spec)
    strategy = strategy or choose_strategy(spec, derivation, bound)
    config = config or default_config(spec, derivation, strategy, bound)
    module = generate(spec, derivation, strategy, bound, config, dtypes)
    outputs = module.load().launch(tensors, bound)
    return RunResult(strategy, config, outputs, module.source)


def rel_err(got: np.ndarray, ref: np.ndarray, floor: float, allowance: np.ndarray | float = 0.0,
            alternatives: Sequence[np.ndarray] = ()) -> float:
    """max |got - ref| / max(|ref|, floor * scale, allowance), with scale = max |ref| (1 when the
    reference is 0 everywhere); equal values (inf, nan included) count as 0. Each element is
    judged against whichever of ``ref`` and ``alternatives`` (same scale) it is closest to."""
    ref = np.asarray(ref, np.float64)
    scale = float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0)) or 1.0
    err = None
    for r in (ref, *alternatives):
        g, r = np.broadcast_arrays(np.asarray(got, np.float64), np.asarray(r, np.float64))
        with np.errstate(all="ignore"):
            e = np.abs(g - r) / np.maximum(np.maximum(np.abs(r), max(floor * scale, 1e-30)), allowance)
        e = np.where((g == r) | (np.isnan(g) & np.isnan(r)), 0.0, np.where(np.isnan(e), np.inf, e))
        err = e if err is None else np.minimum(err, e)
    return float(np.max(err, initial=0.0))


def _as_numpy(t: Any) -> np.ndarray:
    return t.cpu().numpy() if not t.dtype.is_floating_point else t.float().cpu().numpy()


def rounding_noise(evaluate_outputs: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
                   inputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    """|reference(inputs perturbed by about one float32 ulp) - reference(inputs)| per float output.

    ``evaluate_outputs`` is the float64 reference as a function of the inputs. Non-finite
    movements (a value crossing overflow) count as 0: they widen nothing."""
    rng = np.random.default_rng(seed)
    perturbed = {
        name: arr * (1.0 + rng.uniform(-NOISE_ULP, NOISE_ULP, arr.shape)) if arr.dtype.kind == "f" else arr
        for name, arr in inputs.items()
    }
    moved = evaluate_outputs(perturbed)
    out = {}
    for part, ref in reference.items():
        if np.asarray(ref).dtype.kind == "f":
            with np.errstate(all="ignore"):
                diff = np.abs(np.asarray(moved[part], np.float64) - np.asarray(ref, np.float64))
            out[part] = np.where(np.isfinite(diff), diff, 0.0)
    return out


def tie_alternatives(evaluate_outputs: Callable[[int], Mapping[str, np.ndarray]], spec: Spec,
                     reference: Mapping[str, np.ndarray]) -> list[Mapping[str, np.ndarray]]:
    """The reference again with each argmax/argmin taking the k-th position within float32
    resolution of its extreme (k < TIE_VARIANTS), where that changes anything: values distinct in
    float64 but equal in float32 make the kernel's choice, and all that reads it, rounding's.

    ``evaluate_outputs(k)`` is the float64 reference with ``tie_choice=k``."""
    if not any(s.reduce in ("argmax", "argmin") for s in spec.steps):
        return []
    out: list[Mapping[str, np.ndarray]] = []
    for k in range(TIE_VARIANTS):
        alt = evaluate_outputs(k)
        if all(np.array_equal(alt[p], prev[p], equal_nan=True) for prev in (reference, *out) for p in reference):
            if k:  # no position further down the ties: later choices repeat this one
                break
            continue
        out.append(alt)
    return out


def compare(spec: Spec, outputs: Mapping[str, Any], reference: Mapping[str, np.ndarray], stores: Mapping[str, str],
            noise: Mapping[str, np.ndarray] | None = None,
            alternatives: Sequence[Mapping[str, np.ndarray]] = ()) -> dict[str, float]:
    """Relative error per output part (indices: 1.0 where they differ and values are not tied)."""
    errors = {}
    for part, ref in reference.items():
        got = _as_numpy(outputs[part])
        others = [alt[part] for alt in alternatives]
        if stores[part] == "int32":
            errors[part] = _index_error(spec, part, got, ref, reference, others)
        else:
            allowance = NOISE_FACTOR * noise[part] / TOLERANCE[stores[part]] if noise and part in noise else 0.0
            errors[part] = rel_err(got, ref, FLOOR[stores[part]], allowance, others)
    return errors


def _index_error(spec: Spec, part: str, got: np.ndarray, ref: np.ndarray, reference: Mapping[str, np.ndarray],
                 alternatives: Sequence[np.ndarray] = ()) -> float:
    wrong = got != ref
    for alt in alternatives:
        wrong &= got != alt
    values = reference.get(part.replace(".indices", ".values"))
    if values is not None and wrong.any() and values.shape[-1] > 1:
        eq = np.diff(values, axis=-1) == 0
        pad = [(0, 0)] * (values.ndim - 1)
        tied = np.pad(eq, [*pad, (1, 0)]) | np.pad(eq, [*pad, (0, 1)])
        wrong &= ~tied
    return 1.0 if wrong.any() else 0.0


def self_check(
    spec: Spec, shape: Mapping[str, int], dtype: str | Mapping[str, str] = "float32", *,
    strategy: str | None = None, config: KernelConfig | None = None, seed: int = 0,
    derivation: Derivation | None = None,
) -> dict[str, Any]:
    """Run on random inputs and compare with the float64 reference; the `foldwise run` report."""
    from fuser_core.codegen.module import output_dtypes

    bound = bind_shape(spec, shape)
    dtypes = bind_dtypes(spec, dtype)
    inputs = random_inputs(spec, bound, np.random.default_rng(seed), dtypes)
    with interpreter_quiet():  # the outputs are judged below
        result = run(spec, bound, dtypes, inputs, strategy=strategy, config=config, derivation=derivation)
    reference = evaluate(spec, bound, inputs)
    noise = rounding_noise(lambda arrays: evaluate(spec, bound, arrays), inputs, reference, seed)
    ties = tie_alternatives(lambda k: evaluate(spec, bound, inputs, tie_choice=k), spec, reference)
    stores = output_dtypes(spec, dtypes)
    derivation = derivation or derive_cascade(spec)
    exact = result.strategy not in ("streaming_fused", "split_fused") or derivation.exact
    verdict = judge(spec, result.outputs, reference, stores, exact=exact, noise=noise, alternatives=ties)
    return {
        "strategy": result.strategy,
        "config": result.config.to_dict(),
        **verdict,
        "shape": bound,
        "dtype": dtypes,
        "device": device(),
    }


def judge(spec: Spec, outputs: Mapping[str, Any], reference: Mapping[str, np.ndarray], stores: Mapping[str, str],
          *, exact: bool, noise: Mapping[str, np.ndarray] | None = None,
          alternatives: Sequence[Mapping[str, np.ndarray]] = ()) -> dict[str, Any]:
    """Outputs against the float64 reference: ``passed``, ``max_rel_err``, ``errors``,
    ``tolerances``, ``exact``, ``error_measure``, ``bad`` (the failing parts). ``noise`` is
    :func:`rounding_noise` of the reference and ``alternatives`` :func:`tie_alternatives`
    (module docstring).

    ``exact=False`` is for fused strategies of a cascade with a cast inside a fused reduction:
    the cast rounds with running values (docs/THEORY.md 5), so the result is exact in real
    arithmetic only, and is judged normwise against one e4m3 step.
    """
    if exact:
        errors = compare(spec, outputs, reference, stores, noise, alternatives)
        tolerances = {p: TOLERANCE[stores[p]] for p in errors}
    else:
        errors = {p: rel_err(_as_numpy(outputs[p]), ref, 1.0, 0.0, [a[p] for a in alternatives])
                  for p, ref in reference.items()}
        tolerances = {p: INEXACT_TOLERANCE for p in errors}
    bad = [p for p, err in errors.items() if not err <= tolerances[p]]
    return {
        "max_rel_err": max(errors.values(), default=0.0),
        "passed": not bad,
        "exact": exact,
        "error_measure": "elementwise" if exact else "normwise (fused casts round with running values)",
        "errors": errors,
        "tolerances": tolerances,
        "bad": bad,
    }
