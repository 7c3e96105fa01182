"""Per-case facts and the targets of issue 4, each marked met / missed / n/a.

The targets (:data:`TARGETS`; ratios are baseline time over fused time):

- ``chain_2x``: fused >= 2x faster than the unfused chain, for cascades with two or more
  dependent reductions (a reduction reading another over the same axis) over a long axis
  (>= :data:`LONG_AXIS` elements at the suite's shape);
- ``compile_1x``: fused at least as fast as ``torch.compile``;
- ``handwritten_0.9x``: fused at least 0.9x the speed of the hand-written kernel;
- ``copy_bw_80``: fused at >= 80% of the copy bandwidth, for memory-bound cascades:
  those whose arithmetic intensity (contraction FLOPs over the minimum traffic, at the
  suite's shape) is below the target profile's ridge point (:func:`roofline`).

On the CPU interpreter (``device != "cuda"``) a target that applies is "not evaluated".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tuner.bench.variants import BASELINES, EXPERT_PREFIX, LABELS
from tuner.static_bound import min_bytes

LONG_AXIS = 4096  # a reduction axis at least this long counts as long for the chain_2x target
TARGETS = {
    "chain_2x": ("fused >= 2x unfused chain (2+ dependent reductions over a long axis)", 2.0),
    "compile_1x": ("fused >= torch.compile", 1.0),
    "handwritten_0.9x": ("fused >= 0.9x hand-written", 0.9),
    "copy_bw_80": ("fused >= 80% of copy bandwidth (memory-bound)", 0.8),
}


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
    from tuner.torch_ref.contractions import contraction_flops

    flops = contraction_flops(spec, shape)
    nbytes = min_bytes(spec, shape, dtypes)
    unit = "fp16" if "float16" in dtypes.values() else "tf32"
    ridge = profile.dot_flops(unit) * DOT_EFFICIENCY / (profile.hbm_bytes_per_s * HBM_EFFICIENCY)
    intensity = flops / max(1, nbytes)
    return {"flops": flops, "min_bytes": nbytes, "intensity": intensity, "ridge": ridge, "unit": unit,
            "memory_bound": intensity < ridge, "profile": profile.name}


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
                                    hand.get("reason", "not run"), ratios.get("handwritten"),
                                    _missing(entry, "handwritten")),
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


__all__ = ["LONG_AXIS", "TARGETS", "dependent_long_axes", "evaluate_case", "roofline", "summarize_targets"]
