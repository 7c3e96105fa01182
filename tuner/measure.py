"""Measurers: one small interface, a time (or a failure) per candidate.

:class:`Measurer` is the contract every measurer keeps and everyone calls it by: the search
calls ``measure`` (and records ``name``), the service worker reads ``measured_binary`` of the
winner and then calls ``close``. :class:`ModelMeasurer` (``--measurer model``) answers with the
cost model's prediction for the target profile, labelled ``predicted=True``, for machines
without a GPU. The device measurer (:class:`tuner.device.measurer.DeviceMeasurer`, ``--measurer
cuda``) times on the GPU.

Correctness still gates the model: before the first prediction for a strategy, that
strategy's kernels run once under Triton's interpreter at a reduced shape (every dim shrunk,
topk's ``k`` kept) against the float64 reference (:func:`fuser_core.runner.self_check`), then
on the input families ``GATE_FAMILIES`` (x + 100, x + 1000, peaked rows) against the accuracy
bar (:mod:`fuser_core.accuracy`: at most 2x the error of the spec's formula evaluated in the
run's dtype, and 2x torch's op where the catalog has one and the formula itself meets it). The
result is cached per (spec, strategy, dtypes); a failing strategy makes every one of its
candidates a failed measurement carrying the error (the bar's names the family and the ratio),
never a time.

Example (TRITON_INTERPRET=1 on a machine without a GPU):
    >>> from fuser_core.catalog import load_catalog_spec
    >>> from fuser_core.derive import derive_cascade
    >>> from tuner.profiles import get_profile
    >>> from fuser_core.problem import make_problem
    >>> from tuner.space import SearchSpace
    >>> from fuser_core.codegen.strategies import STREAMING_FUSED
    >>> spec = load_catalog_spec("safe_softmax")
    >>> d, problem = derive_cascade(spec), make_problem(spec, {"m": 4096, "n": 32768}, "float16")
    >>> space = SearchSpace(problem, d, get_profile("h100"))
    >>> m = ModelMeasurer(problem, d, get_profile("h100"))
    >>> values = {"block_n": 2048, "block_m": 1, "num_warps": 8, "num_stages": 3}
    >>> r = m.measure(space.candidate(STREAMING_FUSED.name, values))
    >>> r.predicted, r.error, r.time_ms > 0, r.details["verified"]["passed"]
    (True, None, True, True)
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from fuser_core.canonical import spec_hash
from fuser_core.codegen.plan import KernelConfig, capped_shape, contraction_dims, loop_axis, next_pow2
from fuser_core.codegen.strategies import strategy_named
from fuser_core.derive import Derivation
from fuser_core.problem import Problem
from fuser_core.spec import Spec
from tuner.compile_gate import CompileGate
from tuner.cost_model import predict
from tuner.profiles import GpuProfile
from tuner.space import Candidate

REDUCED_AXIS = 40  # the loop axis at the reduced shape: three tiles of 16, the last one partial
REDUCED_INNER = 16  # inner reduction axes (attention's d): tl.dot's minimum
REDUCED_FREE = 20  # free dims of a contraction: one full tile of 16 and a tail
REDUCED_LANE = 3  # other lanes
REDUCED_BATCH = 2  # batch dims of a contraction


@dataclass
class Measurement:
    """A time, or the reason there is none. ``predicted`` marks the cost model's answers."""

    time_ms: float | None
    error: str | None = None
    predicted: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"time_ms": self.time_ms, "error": self.error, "predicted": self.predicted, "details": self.details}


@runtime_checkable
class Measurer(Protocol):
    """A time (or a failure) per candidate; ``name`` is recorded with every result.

    ``measure`` never raises for a candidate's failure: it returns a :class:`Measurement` with
    the error. ``measured_binary(strategy, config)`` gives the compiled kernels of a candidate
    as this measurer ran them (:mod:`tuner.measured_binary`'s artifacts), or None when it ran
    none (a prediction); it raises RuntimeError when it ran them but cannot give them.
    ``close`` releases what the measurer holds (a worker process); it is idempotent.
    """

    name: str

    def measure(self, candidate: Candidate) -> Measurement: ...

    def measured_binary(self, strategy: str, config: Mapping[str, Any]) -> dict[str, Any] | None: ...

    def close(self) -> None: ...


# (spec hash, strategy, dtypes) -> self_check report (or {"passed": False, "error": ...})
_VERIFIED: dict[tuple[str, str, str], dict[str, Any]] = {}


def clear_verification_cache() -> None:
    _VERIFIED.clear()


def reduced_problem(spec: Spec, derivation: Derivation, shape: Mapping[str, int],
                    strategy: str) -> tuple[dict[str, int], KernelConfig]:
    """A small shape with the same structure (tails, several tiles, tl.dot-sized contraction
    tiles) and a config for ``strategy`` on it."""
    rules = strategy_named(strategy)
    axis, inner = loop_axis(spec)
    free, batch = contraction_dims(spec, derivation)
    as_dims = {s.as_dim for s in spec.steps if s.as_dim}
    small = capped_shape(spec, derivation, shape, axis=REDUCED_AXIS, inner=REDUCED_INNER, free=REDUCED_FREE,
                         batch=REDUCED_BATCH, lane=REDUCED_LANE)
    blocks: dict[str, int] = {}
    for d in spec.dims:
        if d == axis:
            blocks[d] = rules.reduced_axis_block(small[d])
        elif d in inner or d in as_dims:
            continue
        elif d in free:
            blocks[d] = min(16, next_pow2(small[d]))
        elif d in batch:
            blocks[d] = 1
        else:
            blocks[d] = min(2, next_pow2(small[d]))
    return small, KernelConfig(blocks, num_warps=4, num_stages=2, split=rules.least_split)


class ModelMeasurer:
    """``--measurer model``: the cost model's prediction on ``profile``, labelled as such.

    With a ``gate`` (:class:`tuner.compile_gate.CompileGate`) the prediction uses the compiled
    kernels' registers, shared memory and spills (recorded in ``details["compile"]``), and a
    candidate the gate prunes is a failed measurement with the gate's reason.
    """

    name = "model"

    def __init__(self, problem: Problem, derivation: Derivation, profile: GpuProfile, *, verify: bool = True,
                 gate: CompileGate | None = None):
        spec = problem.spec
        self.problem = problem
        self.spec = spec
        self.derivation = derivation
        self.shape = problem.shape
        self.dtypes = problem.dtypes
        self.profile = profile
        self.verify_kernels = verify
        self.gate = gate  # its verdicts give the model compiled registers, shared memory and spills
        self.interpreter_runs: list[str] = []  # strategies this instance ran under the interpreter
        self._hash = spec_hash(spec)

    def verification(self, strategy: str) -> dict[str, Any]:
        """The strategy's correctness check at the reduced shape (run once, then cached)."""
        key = (self._hash, strategy, json.dumps(self.dtypes, sort_keys=True))
        if key not in _VERIFIED:
            from fuser_core.runner import self_check

            small, config = reduced_problem(self.spec, self.derivation, self.shape, strategy)
            self.interpreter_runs.append(strategy)
            try:
                report = self_check(self.spec, small, self.dtypes, strategy=strategy, config=config,
                                    derivation=self.derivation)
                result = {"passed": bool(report["passed"]), "max_rel_err": report["max_rel_err"],
                          "shape": small, "config": config.to_dict(), "device": report["device"]}
                if not report["passed"]:
                    result["error"] = (f"{strategy} is wrong at the reduced shape {small}: max relative error "
                                       f"{report['max_rel_err']:.3g} (tolerances {report['tolerances']})")
                else:  # the accuracy bar on the families that lose digits (fuser_core.accuracy)
                    from fuser_core.accuracy import GATE_FAMILIES, accuracy_check, refusal

                    bar = accuracy_check(self.spec, small, self.dtypes, families=GATE_FAMILIES, strategy=strategy,
                                         config=config, derivation=self.derivation, reduce_shape=False)
                    result["accuracy"] = {r["family"]: {k: r[k] for k in ("passed", "error", "formula_error", "ratio",
                                                                           "torch_error", "torch_ratio", "note")}
                                          for r in bar["families"]}
                    if not bar["passed"]:
                        result["passed"] = False
                        result["error"] = f"{refusal(strategy, bar)} (at the reduced shape {small})"
            except Exception as err:  # a kernel that does not compile or crashes fails its strategy
                result = {"passed": False, "shape": small, "config": config.to_dict(),
                          "error": f"{strategy} failed at the reduced shape {small}: {type(err).__name__}: {err}",
                          "traceback": traceback.format_exc(limit=3)}
            _VERIFIED[key] = result
        return _VERIFIED[key]

    def measure(self, candidate: Candidate) -> Measurement:
        details: dict[str, Any] = {"measurer": self.name, "target": self.profile.name, "predicted": True}
        if self.verify_kernels:
            verified = self.verification(candidate.strategy)
            details["verified"] = {k: v for k, v in verified.items() if k != "traceback"}
            if not verified["passed"]:
                return Measurement(None, verified["error"], True, details)
        compiled = None
        if self.gate is not None:  # the Objective asked the same gate first: this is its cached verdict
            compiled = self.gate.check(candidate)
            details["compile"] = compiled.facts()
            if compiled.pruned:
                return Measurement(None, compiled.reason, True, details)
        try:
            p = predict(self.problem, self.derivation, candidate, self.profile, compiled)
        except Exception as err:
            return Measurement(None, f"cost model failed: {type(err).__name__}: {err}", True, details)
        details["model"] = {
            "time_s": p.time_s, "hbm_bytes": p.bytes, "flops": p.flops, "programs": p.programs,
            "waves": p.waves, "occupancy": p.occupancy,
            "kernels": [{k: v for k, v in kd.items() if k in _KERNEL_FIELDS} for kd in p.details["kernels"]],
        }
        time_s = p.time_s
        floor = self.static_floor(candidate, compiled)
        if floor is not None:  # the compiled code cannot run faster than its static bound
            details["static_bound"] = floor
            time_s = max(time_s, floor["time_s"])
        return Measurement(time_s * 1e3, None, True, details)

    def static_floor(self, candidate: Candidate, compiled: Any) -> dict[str, Any] | None:
        """The static bound of the compiled candidate (tuner.static_bound: the largest of HBM bytes,
        instruction issue, SFU and tensor work read from its SASS), summed over its kernels; None
        without compile facts."""
        if compiled is None or not compiled.kernels or not all(getattr(k, "sass", None) for k in compiled.kernels):
            return None
        from tuner.static_bound import problem_bounds

        kernels = problem_bounds(self.problem, self.derivation, candidate.strategy, candidate.config, compiled.kernels,
                                 self.profile)
        if kernels is None:
            return None
        return {"time_s": sum(k["time_s"] for k in kernels),
                "kernels": [{"kernel": k["kernel"], "bound": k["bound"], "terms_s": k["terms_s"]} for k in kernels]}

    def measured_binary(self, strategy: str, config: Mapping[str, Any]) -> None:
        """None: a prediction runs no kernel (the service compiles the winner on its host instead)."""
        return None

    def close(self) -> None:
        """Nothing to release: the model holds no process or device."""


_KERNEL_FIELDS = ("kernel", "time_s", "bound", "programs", "blocks_per_sm", "waves", "occupancy", "regs_per_thread",
                  "smem_bytes", "hbm_bytes", "l2_bytes", "compiled", "spill_bytes", "spill_l2_bytes")
