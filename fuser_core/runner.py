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
output's scale. So: float32 rtol 1e-4, atol 1e-7; float16 rtol 1e-2, atol 1e-3; bfloat16 rtol 2^-6
(4 bf16 ulps), atol 1.6e-3;
float8_e4m3fn 0.13 (one e4m3 step: kernel and reference may round a value sitting on a
rounding boundary differently). An output whose reference is 0 everywhere (``x - x`` once
sympy has reordered it) takes 1 as its scale: it is judged with the absolute ``atol``.

The principle behind the allowances: a float32 kernel is right when each output element equals,
within the tolerance, what float64 gives for SOME evaluation whose inputs and intermediate
results lie within float32 rounding of the exact ones. Continuous outputs need nothing more
than the tolerance, except where they amplify rounding; discontinuities (``round``, a ``where``
condition, the choice of an argmax/argmin/topk) need the judge to recognise knife edges, and an
element is excused only where a float32-sized evaluation lands on the kernel's side:

- Amplified rounding: an output that is a small difference of large terms (``max(q + acc0)``
  where ``acc0`` nearly cancels ``q``) moves in float64 when its inputs move by one float32 ulp,
  and no float32 program can do better than that. :func:`rounding_noise` measures that
  movement (the reference at inputs perturbed by ``NOISE_ULP``); each element may err by
  ``NOISE_FACTOR`` times it on top of the tolerance. A wrong formula still errs at the scale of
  the values, far above the noise.
- Ties in an argmax/argmin: values distinct in float64 but equal in float32 (``tanh`` of large
  values) make the kernel's choice rounding's: :func:`tie_alternatives` re-evaluates the
  reference with each of the first ``TIE_VARIANTS`` positions within float32 resolution of the
  extreme, and every element may match any of them (the index and all that reads it).
- Selections are judged by what they select (:func:`index_wrong`): an argmax/argmin/topk index
  that differs from the reference's is right when the float64 value it selects
  (:meth:`fuser_core.reference.Evaluator.selected`) equals the value the reference's index
  selects, within the float32 tolerance, and a top-k's k indices are distinct. ``acc0 + tiny``
  with ``acc0`` constant along the axis ties in float32 at every position: any k are right; an
  index selecting a clearly smaller value, or the right values in the wrong slots, is not. (What
  reads a top-k's indices is not re-evaluated with the kernel's choice.)
- Knife edges of ``round`` and ``where``: :func:`knife_edges` evaluates the float64 reference
  ``KNIFE_SAMPLES`` times with the inputs and every rounding operation's result (arithmetic,
  math functions, non-integer constants, sums; never comparisons, ``where``, min/max, ``round``,
  casts or integer values below 2^24, which float32 computes exactly) moved by a random relative
  error within one of ``KNIFE_ULPS`` (2^-24 .. 2^-21: one rounding to a math function's few-ulp
  error). Each element may match any of these evaluations. A ``round()`` whose argument sits on
  a half step (or that float32 cancellation moves across one, ``1 + l tanh h`` near 0) or a
  ``where`` deciding at equality lands on both sides among them; an element one step of
  ``round`` off, with its arguments away from any boundary, matches none and fails. They are
  computed only when an output fails without them, so passing kernels cost nothing more.

A fused strategy
whose derivation is inexact (a cast inside a fused reduction) is judged normwise,
``max|got - ref| / max|ref|``, against one e4m3 step, and the report says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuser_core.codegen.plan import KernelConfig, NotValid, default_config, valid_strategies
from fuser_core.codegen.strategies import BASELINE, PREFERENCE, is_fused
from fuser_core.derive import Derivation, derive_cascade
from fuser_core.merged import consistent
from fuser_core.problem import FLOAT_DTYPES, INDEX_DTYPES, ShapeError, bind_dtypes  # noqa: F401  (re-exported)
from fuser_core.reduce_ops import returns_indices
from fuser_core.tensors import device, to_torch  # noqa: F401  (re-exported)
from fuser_core.empty import empty_outputs, has_empty_dim
from fuser_core.interpreter import interpreter_quiet  # (re-exported: fuser_core.accuracy.check)
from fuser_core.reference import (
    Evaluator, bind_scalars, bind_shape, cast_to, check_inputs, evaluate, random_inputs, random_scalars,
)
from fuser_core.spec import Spec

NO_LAUNCH = "none"  # the strategy a run reports when a dim is empty and no kernel is launched

# bfloat16: 4 of its ulps (2^-8 each). A bf16 attention rounds twice (P to the tensor cores' operand type, the
# output to its storage): 2 ulps, 0.0121 measured on causal multi_pass, which the former 1e-2 refused while it
# meets FlashAttention's own criterion (tests/fuser_core/test_attention_accuracy.py)
# float64 (what gradcheck runs in): a runtime scalar enters a kernel as a float32 argument and a literal
# as a float32 constant (Triton's), so a float64 kernel is held to 1e-9, five orders below float32's bar
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2.0**-6, "float8_e4m3fn": 0.13, "int32": 0.0,
             "float64": 1e-9}
FLOOR = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.1, "float8_e4m3fn": 1e-2, "int32": 0.0, "float64": 1e-8}
# Each float32 operation of a kernel rounds by up to 2^-24; the noise perturbs the inputs by up
# to 2^-23. The cancelling max(q + acc0) the fuzzer found errs by 1.2 times its noise in float32
# (numpy, the unfused chain and our kernels alike); 32 leaves room for longer chains of roundings.
NOISE_FACTOR = 32.0
NOISE_ULP = 2.0**-23
TIE_VARIANTS = 4  # argmax/argmin positions within float32 resolution of the extreme, tried in order
# Knife edges: evaluations with every input and rounding result moved by a relative error of up
# to one of KNIFE_ULPS (one float32 rounding, 2^-24, to a math function's few-ulp error, 2^-21),
# KNIFE_SAMPLES draws in all, the bounds taken in turn. Small bounds find the evaluations next to
# the exact one (a round() whose argument float32 cancellation moved), large ones the far side of
# a knife edge a chain of roundings reaches.
KNIFE_ULPS = (2.0**-24, 2.0**-23, 2.0**-22, 2.0**-21)
KNIFE_SAMPLES = 32
INEXACT_TOLERANCE = 0.125  # normwise: one float8 e4m3 step


def choose_strategy(spec: Spec, derivation: Derivation, shape: dict[str, int]) -> str:
    valid = valid_strategies(spec, derivation, shape)
    for s in PREFERENCE:
        if valid.get(s) is None:
            return s
    raise NotValid("no strategy can run this spec: " + "; ".join(f"{k}: {v}" for k, v in valid.items()))


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
    import torch

    from fuser_core.codegen.module import generate
    from fuser_core.problem import output_dtypes

    bound = bind_shape(spec, shape, allow_empty=True)
    dtypes = bind_dtypes(spec, dtype)
    dev = device()
    arrays = check_inputs(spec, bound, inputs)
    scalars = bind_scalars(spec, bound, inputs)  # runtime params ride with the inputs (their defaults else)
    for inp in spec.inputs:  # the fused kernels read a per-channel input at its first position along the rest
        if not np.array_equal(consistent(spec, inp.name, arrays[inp.name], bound), arrays[inp.name], equal_nan=True):
            raise ShapeError(f"holds only ({', '.join(inp.storage_dims)}) of dims reduced together: in the merged "
                             "layout it must repeat along the others (fuser_core.merged.to_logical of the user's "
                             "tensor)", loc=("inputs", inp.name))
    tensors = to_torch(arrays, dtypes, dev)
    if has_empty_dim(bound):  # no launch: empty outputs, reductions over an empty axis their identities
        return RunResult(strategy or NO_LAUNCH, config or KernelConfig(),
                         empty_outputs(spec, bound, tensors, output_dtypes(spec, dtypes)), "")
    if strategy == BASELINE:  # the comparison baseline: one kernel per reduction, through memory
        from fuser_core.codegen.chain import run_chain_detailed

        config = config or KernelConfig()
        with interpreter_quiet():  # NumPy's warnings about discarded lanes (fuser_core/interpreter.py)
            chain = run_chain_detailed(spec, bound, dtypes, tensors, config_blocks=config.blocks, scalars=scalars)
        return RunResult(strategy, config, chain.outputs, "\n\n".join(k.source for k in chain.kernels))
    derivation = derivation or derive_cascade(spec)
    strategy = strategy or choose_strategy(spec, derivation, bound)
    config = config or default_config(spec, derivation, strategy, bound)
    module = generate(spec, derivation, strategy, bound, config, dtypes)
    # outputs contiguous in the spec's dim order (docs/SPEC.md), whatever layout the launcher's own
    # allocation picks (fuser_core.codegen.module.output_memory_order: the server's, for canonical specs)
    stores = output_dtypes(spec, dtypes)
    out = {p: torch.empty([bound[d] for d in spec.step(p.split(".")[0]).dims], dtype=getattr(torch, stores[p]),
                          device=dev) for p in spec.output_parts}
    with interpreter_quiet():  # NumPy's warnings about discarded lanes (fuser_core/interpreter.py)
        outputs = module.load().launch(tensors, bound, out=out, scalars=scalars)
    return RunResult(strategy, config, outputs, module.source)


def rel_err(got: np.ndarray, ref: np.ndarray, floor: float, allowance: np.ndarray | float = 0.0,
            alternatives: Sequence[np.ndarray] = ()) -> float:
    """max |got - ref| / max(|ref|, floor * scale, allowance), with scale = max |ref| (1 when the
    reference is 0 everywhere); equal values (inf, nan included) count as 0. Each element is
    judged against whichever of ``ref`` and ``alternatives`` (same scale) it is closest to."""
    return float(np.max(elementwise_err(got, ref, floor, allowance, alternatives), initial=0.0))


def elementwise_err(got: np.ndarray, ref: np.ndarray, floor: float, allowance: np.ndarray | float = 0.0,
                    alternatives: Sequence[np.ndarray] = ()) -> np.ndarray:
    """The error of each element, as :func:`rel_err` measures it."""
    ref = np.asarray(ref, np.float64)
    scale = float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0)) or 1.0
    err = None
    for r in (ref, *alternatives):
        g, r = np.broadcast_arrays(np.asarray(got, np.float64), np.asarray(r, np.float64))
        with np.errstate(all="ignore"):
            e = np.abs(g - r) / np.maximum(np.maximum(np.abs(r), max(floor * scale, 1e-30)), allowance)
        e = np.where((g == r) | (np.isnan(g) & np.isnan(r)), 0.0, np.where(np.isnan(e), np.inf, e))
        err = e if err is None else np.minimum(err, e)
    return err


def _as_numpy(t: Any) -> np.ndarray:
    return t.cpu().numpy() if not t.dtype.is_floating_point else t.double().cpu().numpy()  # float64 exactly


def rounding_noise(evaluate_outputs: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
                   inputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    """|reference(inputs perturbed by about one float32 ulp) - reference(inputs)| per float output.

    ``evaluate_outputs`` is the float64 reference as a function of the inputs. Non-finite
    movements (a value crossing overflow) count as 0: they widen nothing."""
    rng = np.random.default_rng(seed)
    perturbed = {
        name: arr * (1.0 + rng.uniform(-NOISE_ULP, NOISE_ULP, arr.shape)) if np.issubdtype(arr.dtype, np.floating) else arr
        for name, arr in inputs.items()
    }
    moved = evaluate_outputs(perturbed)
    out = {}
    for part, ref in reference.items():
        if np.issubdtype(np.asarray(ref).dtype, np.floating):
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
    if not any(returns_indices(s.reduce) for s in spec.steps):
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


def knife_edges(evaluate_rounded: Callable[[dict[str, np.ndarray], tuple[np.random.Generator, float]], Mapping[str, np.ndarray]],
                inputs: Mapping[str, np.ndarray], seed: int = 0) -> list[Mapping[str, np.ndarray]]:
    """``KNIFE_SAMPLES`` evaluations of the reference that a float32 program may compute: the
    inputs and every rounding operation's result each moved by a random relative error within
    one of ``KNIFE_ULPS`` (:class:`fuser_core.reference.Evaluator`'s ``rounding``). Where the exact value
    sits on a discontinuity (a ``round`` at a half step, a ``where`` condition at equality), some of
    them land on each side; away from one, all land where the reference does.

    ``evaluate_rounded(inputs, rounding)`` is the float64 reference with that ``rounding``."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(KNIFE_SAMPLES):
        u = KNIFE_ULPS[i % len(KNIFE_ULPS)]
        moved = {name: arr * (1.0 + rng.uniform(-u, u, arr.shape)) if arr.dtype.kind == "f" else arr
                 for name, arr in inputs.items()}
        out.append(evaluate_rounded(moved, (rng, u)))
    return out


def compare(spec: Spec, outputs: Mapping[str, Any], reference: Mapping[str, np.ndarray], stores: Mapping[str, str],
            noise: Mapping[str, np.ndarray] | None = None,
            alternatives: Sequence[Mapping[str, np.ndarray]] = (),
            selected: Callable[[str, np.ndarray], np.ndarray] | None = None) -> dict[str, float]:
    """Relative error per output part (indices: 1.0 where some index is wrong, see
    :func:`index_wrong`)."""
    errors = {}
    for part, ref in reference.items():
        got = _as_numpy(outputs[part])
        others = [alt[part] for alt in alternatives]
        if stores[part] == "int32":
            errors[part] = 1.0 if index_wrong(spec, part, got, ref, reference, others, selected).any() else 0.0
        else:
            allowance = NOISE_FACTOR * noise[part] / TOLERANCE[stores[part]] if noise and part in noise else 0.0
            errors[part] = rel_err(got, held_as_stored(ref, stores[part]), FLOOR[stores[part]], allowance, others)
    return errors


def held_as_stored(ref: np.ndarray, store: str) -> np.ndarray:
    """The float64 reference where the output's dtype holds it, and the dtype's infinity where it
    cannot: a backward stage's sums of random saved statistics reach 9.5e43, +inf in float32, and
    the kernel that stores inf stored the right value (it was judged infinitely wrong)."""
    ref = np.asarray(ref, np.float64)
    with np.errstate(over="ignore"):
        stored = cast_to(ref, store)
    return np.where(np.isfinite(ref) & np.isinf(stored), stored, ref)


def index_wrong(spec: Spec, part: str, got: np.ndarray, ref: np.ndarray, reference: Mapping[str, np.ndarray],
                alternatives: Sequence[np.ndarray] = (),
                selected: Callable[[str, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Where an argmax/argmin/topk index differs from the reference's and from every alternative's
    and is not excused: with ``selected`` (the float64 values ranked, taken at given indices:
    :meth:`fuser_core.reference.Evaluator.selected`), an index is right when the value it selects
    equals the value the reference's index selects within float32's tolerance (a top-k also needs
    k distinct indices); without it, only indices of values tied in float64 are excused."""
    wrong = np.asarray(got != ref)
    for alt in alternatives:
        wrong &= got != alt
    if not wrong.any():
        return wrong
    if selected is not None:
        picked, wanted = selected(part, got), selected(part, ref)
        wrong &= ~(elementwise_err(picked, wanted, FLOOR["float32"]) <= TOLERANCE["float32"])
        step = spec.step(part.split(".")[0])
        if step.reduce == "topk":  # k distinct positions: a repeated index selects a value twice
            axis = step.dims.index(step.as_dim)
            ordered = np.sort(got, axis=axis)
            repeated = np.diff(ordered, axis=axis) == 0
            wrong |= np.any(repeated, axis=axis, keepdims=True) & np.ones_like(wrong)
        return wrong
    # a top-k's values are sorted along their last axis: equal neighbours are float64 ties
    values = reference.get(part.replace(".indices", ".values")) if part.endswith(".indices") else None
    if values is not None and values.ndim and values.shape[-1] > 1:
        eq = np.diff(values, axis=-1) == 0
        pad = [(0, 0)] * (values.ndim - 1)
        tied = np.pad(eq, [*pad, (1, 0)]) | np.pad(eq, [*pad, (0, 1)])
        wrong &= ~tied
    return wrong


def self_check(
    spec: Spec, shape: Mapping[str, int], dtype: str | Mapping[str, str] = "float32", *,
    strategy: str | None = None, config: KernelConfig | None = None, seed: int = 0,
    derivation: Derivation | None = None,
) -> dict[str, Any]:
    """Run on random inputs and compare with the float64 reference; the `foldwise run` report."""
    from fuser_core.codegen.module import output_dtypes

    bound = bind_shape(spec, shape, allow_empty=True)
    dtypes = bind_dtypes(spec, dtype)
    inputs = random_inputs(spec, bound, np.random.default_rng(seed), dtypes)
    # runtime params at random values, as the certificate draws them (a canonical spec, as a worker has it,
    # carries no default); their own generator leaves the inputs' draws as they were
    inputs.update(random_scalars(spec, np.random.default_rng(seed + 1)))
    result = run(spec, bound, dtypes, inputs, strategy=strategy, config=config, derivation=derivation)
    reference = evaluate(spec, bound, inputs)
    noise = rounding_noise(lambda arrays: evaluate(spec, bound, arrays), inputs, reference, seed)
    ties = tie_alternatives(lambda k: evaluate(spec, bound, inputs, tie_choice=k), spec, reference)
    stores = output_dtypes(spec, dtypes)
    derivation = derivation or derive_cascade(spec)
    exact = not is_fused(result.strategy) or derivation.exact
    verdict = judge(
        spec, result.outputs, reference, stores, exact=exact, noise=noise, alternatives=ties,
        knife=lambda: knife_edges(lambda arrays, r: evaluate(spec, bound, arrays, rounding=r), inputs, seed),
        selected=lambda part, indices: Evaluator(spec, bound).selected(inputs, part, indices),
    )
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
          alternatives: Sequence[Mapping[str, np.ndarray]] = (),
          knife: Callable[[], Sequence[Mapping[str, np.ndarray]]] | None = None,
          selected: Callable[[str, np.ndarray], np.ndarray] | None = None) -> dict[str, Any]:
    """Outputs against the float64 reference: ``passed``, ``max_rel_err``, ``errors``,
    ``tolerances``, ``exact``, ``error_measure``, ``bad`` (the failing parts). ``noise`` is
    :func:`rounding_noise` of the reference, ``alternatives`` :func:`tie_alternatives`, ``knife``
    a function giving :func:`knife_edges` (called only when some part fails without them) and
    ``selected`` the ranked values at given indices, for argmax/argmin/topk indices
    (:func:`index_wrong`); all as in the module docstring.

    ``exact=False`` is for fused strategies of a cascade with a cast inside a fused reduction:
    the cast rounds with running values (docs/THEORY.md 5), so the result is exact in real
    arithmetic only, and is judged normwise against one e4m3 step.
    """
    def errors_with(alts: Sequence[Mapping[str, np.ndarray]]) -> tuple[dict[str, float], dict[str, float]]:
        if exact:
            errors = compare(spec, outputs, reference, stores, noise, alts, selected)
            return errors, {p: TOLERANCE[stores[p]] for p in errors}
        errors = {p: rel_err(_as_numpy(outputs[p]), ref, 1.0, 0.0, [a[p] for a in alts])
                  for p, ref in reference.items()}
        return errors, {p: INEXACT_TOLERANCE for p in errors}

    errors, tolerances = errors_with(alternatives)
    bad = [p for p, err in errors.items() if not err <= tolerances[p]]
    if bad and knife is not None:  # a knife-edge element is right if some float32-like evaluation agrees
        errors, tolerances = errors_with([*alternatives, *knife()])
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
