"""A problem's inputs on the device: the checked set, the sampled reference, the timing and family sets.

Contract: the parent sends :func:`problem_payload` (a problem and its derivation, a few KB);
the worker child rebuilds it as a :class:`DeviceProblem`, which draws its inputs on the device
(standard normal values exactly representable in their dtypes, index inputs below their
bound), computes the sampled float64 reference of the checked set once
(:mod:`fuser_core.sampled_reference`), and makes the input sets timing rotates through and the
accuracy bar's family sets once. The inputs never leave the device, except the sampled rows
the reference reads. ``device`` is a torch device name: ``"cuda"`` (which is also ROCm's
name in PyTorch) or ``"cpu"`` (Triton's interpreter).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fuser_core.derive import Derivation
from fuser_core.merged import consistent
from fuser_core.paged import to_pages
from fuser_core.problem import Problem
from fuser_core.reference import index_input_bound
from fuser_core.sampled_reference import (
    REFERENCE_BUDGET,
    SampledEvaluator,
    SampledFormula,
    SampledTermScales,
    sample_rows,
)
from fuser_core.spec import Spec


def problem_payload(problem: Problem, derivation: Derivation) -> dict[str, Any]:
    """What the child needs to rebuild a problem (problems and derivations pickle; a few KB)."""
    from fuser_core.canonical import spec_hash

    spec = problem.spec
    key = f"{spec_hash(spec)}|{spec.name}|{sorted(problem.shape.items())}|{sorted(problem.dtypes.items())}"
    return {"key": key, "problem": problem, "derivation": derivation}



def family_tensor(name: str, x: Any, pos: int, generator: Any) -> Any:
    """An affine input family (:class:`fuser_core.accuracy.Family`: scale, shift, a peak per row along
    axis ``pos``) applied to a device tensor, rounded to its dtype: the inputs never leave the device."""
    import torch

    from fuser_core.accuracy import FAMILIES

    fam = FAMILIES[name]
    assert fam.affine, f"{name} is not an affine family"
    out = x.float() * fam.scale + fam.shift
    if fam.peak and out.numel():
        moved = out.movedim(pos, -1)
        at = torch.randint(0, moved.shape[-1], (*moved.shape[:-1], 1), generator=generator, device=x.device)
        moved.scatter_add_(-1, at, torch.full(at.shape, fam.peak, device=x.device))
        out = moved.movedim(-1, pos)
    return out.to(x.dtype)



def as_called(spec: Spec, inputs: Mapping[str, Any], shape: Mapping[str, int]) -> dict[str, Any]:
    """Inputs as a server passes them: a paged input as its pages and table (fuser_core.paged), made
    once, so a timed launch reads through the table and never pages a logical tensor itself."""
    if not spec.page_tables:
        return dict(inputs)
    pages, tables = to_pages(spec, {n: t for n, t in inputs.items() if spec.input(n).paged is not None}, shape)
    return {**inputs, **pages, **tables}


def select_rows(t: Any, dims: tuple[str, ...], rows: Mapping[str, Any]) -> Any:
    """``t`` (over ``dims``) restricted to the sampled rows. float8 rows are selected as their
    bytes: whether ``index_select`` takes float8 on CUDA depends on the torch release."""
    import torch

    fp8 = t.dtype == torch.float8_e4m3fn
    if fp8:
        t = t.view(torch.uint8)
    for axis, d in enumerate(dims):
        if d in rows:
            t = t.index_select(axis, rows[d])
    return t.view(torch.float8_e4m3fn) if fp8 else t


def to_float64(t: Any) -> np.ndarray:
    """A device tensor as a host array: float64 for floating point (through float32), int64 for integers."""
    import torch

    if t.dtype.is_floating_point:
        return t.detach().to("cpu", torch.float32).numpy().astype(np.float64)
    return t.detach().to("cpu", torch.int64).numpy()


class DeviceProblem:
    """One problem (:class:`fuser_core.problem.Problem`) in the child: check inputs on the device,
    the sampled reference (computed once), and the input sets timing rotates through (made once)."""

    def __init__(self, payload: Mapping[str, Any], device: str, timing: Mapping[str, Any]):
        import torch

        self.key = payload["key"]
        self.problem: Problem = payload["problem"]
        self.spec: Spec = self.problem.spec
        self.derivation: Derivation = payload["derivation"]
        self.shape: dict[str, int] = self.problem.shape
        self.dtypes: dict[str, str] = self.problem.dtypes
        self.device = device
        self.seed = int(timing.get("seed", 0))
        self.stores = self.problem.output_dtypes
        self.inputs = self.random_inputs(0)
        self.budget = int(timing.get("reference_budget", REFERENCE_BUDGET))
        self.rows_np = sample_rows(self.spec, self.shape, self.budget, np.random.default_rng(self.seed))
        self.rows = {d: torch.as_tensor(v, device=device) for d, v in self.rows_np.items()}
        self._reference: dict[str, np.ndarray] | None = None
        self._noise: dict[str, np.ndarray] = {}
        self._ties: list[dict[str, np.ndarray]] = []
        self._arrays: dict[str, np.ndarray] = {}  # the sampled inputs the reference read
        self._sets: list[dict[str, Any]] | None = None
        self._families: dict[str, dict[str, Any]] = {}  # the accuracy bar's input sets (family())
        self.input_bytes = sum(t.numel() * t.element_size() for t in self.inputs.values())

    def random_inputs(self, index: int) -> dict[str, Any]:
        """Standard normal values rounded to each input's dtype (as reference.random_inputs),
        index inputs uniform below their bound; drawn on the device."""
        import torch

        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1000 + index)
        out = {}
        for inp in self.spec.inputs:
            size = tuple(self.shape[d] for d in inp.dims)
            dt = self.dtypes[inp.name]
            if inp.is_index:
                bound = index_input_bound(self.spec, inp.name, self.shape)
                out[inp.name] = torch.randint(0, bound, size, generator=g, device=self.device, dtype=getattr(torch, dt))
                continue
            x = torch.randn(size, generator=g, device=self.device, dtype=torch.float32)
            if dt == "float8_e4m3fn":
                x = x.clamp_(-448.0, 448.0)
            out[inp.name] = consistent(self.spec, inp.name, x.to(getattr(torch, dt)), self.shape)
        return out

    def reference(self) -> dict[str, np.ndarray]:
        if self._reference is None:
            from fuser_core.runner import rounding_noise, tie_alternatives

            arrays = {i.name: to_float64(select_rows(self.inputs[i.name], i.dims, self.rows)) for i in self.spec.inputs}
            evaluator = SampledEvaluator(self.spec, self.shape, self.rows_np)
            self._reference = evaluator.outputs(arrays)
            self._noise = rounding_noise(evaluator.outputs, arrays, self._reference)

            def with_ties(k: int) -> dict[str, np.ndarray]:
                tied = SampledEvaluator(self.spec, self.shape, self.rows_np)
                tied.tie_choice = k
                return tied.outputs(arrays)

            self._ties = tie_alternatives(with_ties, self.spec, self._reference)
            self._arrays = arrays
        return self._reference

    def family(self, name: str) -> dict[str, Any]:
        """The checked input set moved to family ``name`` on the device, with the sampled float64 reference
        and the formula's evaluations in the run's dtype on the same rows (computed once per problem: a
        variant only runs its kernel on them). Index inputs are kept; float inputs over the loop axis
        get the family along it, others along their last dim (as fuser_core.accuracy.family_inputs)."""
        if name not in self._families:
            import torch

            from fuser_core.accuracy import cancellation, formula_dtype, formula_outputs
            from fuser_core.codegen.plan import loop_axis

            axis, _ = loop_axis(self.spec)
            g = torch.Generator(device=self.device)
            g.manual_seed(self.seed * 1000 + 999)
            inputs = {}
            for inp in self.spec.inputs:
                x = self.inputs[inp.name]
                pos = inp.dims.index(axis) if axis in inp.dims else x.dim() - 1
                inputs[inp.name] = (x if inp.is_index or x.dim() == 0 else
                                    consistent(self.spec, inp.name, family_tensor(name, x, pos, g), self.shape))
            arrays = {i.name: to_float64(select_rows(inputs[i.name], i.dims, self.rows)) for i in self.spec.inputs}
            with np.errstate(all="ignore"):
                reference = SampledEvaluator(self.spec, self.shape, self.rows_np).outputs(arrays)
            formula = formula_outputs(self.spec, self.shape, arrays, formula_dtype(self.dtypes), self.seed,
                                      make=lambda d, r: SampledFormula(self.spec, self.shape, self.rows_np, d, r))
            cancel = cancellation(self.spec, self.shape, arrays, reference,
                                  SampledTermScales(self.spec, self.shape, self.rows_np))
            self._families[name] = {"inputs": inputs, "reference": reference, "formula": formula, "cancel": cancel}
        return self._families[name]

    def knife_edges(self) -> list[dict[str, np.ndarray]]:
        """The reference's float32-sized evaluations for knife edges (fuser_core.runner.knife_edges)."""
        from fuser_core.runner import knife_edges

        self.reference()

        def rounded(arrays: dict[str, np.ndarray], rounding) -> dict[str, np.ndarray]:
            evaluator = SampledEvaluator(self.spec, self.shape, self.rows_np)
            evaluator.rounding = rounding
            return evaluator.outputs(arrays)

        return knife_edges(rounded, self._arrays)

    def allowances(self) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
        """The reference's float32 rounding noise and tie alternatives (fuser_core.runner)."""
        self.reference()
        return self._noise, self._ties

    def timing_sets(self, settings: Mapping[str, Any], l2_bytes: int) -> list[dict[str, Any]]:
        """Set 0 is the checked set; more sets until their total exceeds 4 x L2 (bounded by
        ``max_sets`` and by 30% of the free device memory)."""
        import torch

        if self._sets is None:
            want = 1
            if self.device == "cuda":
                want = max(2, math.ceil(4 * l2_bytes / max(1, self.input_bytes)))
                want = min(want, int(settings.get("max_sets", 32)))
                free, _total = torch.cuda.mem_get_info()
                want = max(1, min(want, int(0.3 * free // max(1, self.input_bytes))))
            self._sets = [as_called(self.spec, s, self.shape)
                          for s in [self.inputs] + [self.random_inputs(i) for i in range(1, want)]]
        return self._sets

