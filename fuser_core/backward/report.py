"""The backward of a spec as plain data: what ``foldwise backward`` prints and writes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fuser_core.backward.certify import certify_backward
from fuser_core.backward.derive import derive_backward, spec_json
from fuser_core.backward.in_forward import gradient_factor, gradient_in_forward
from fuser_core.spec_model import Spec


def backward_report(spec: Spec, *, derive_specs: bool = True, sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The backward cascade(s) of ``spec``, their certificate and (``derive_specs``) each backward
    spec's own derivation summary: fused or not, its certificate. ``sizes``: packed for the sizes
    the kernels run at, as the torch op packs it (:func:`derive_backward`). Raises SpecError as
    :func:`derive_backward` does."""
    cascade = derive_backward(spec, sizes=sizes)
    with_grad = gradient_in_forward(spec, cascade)
    factor = gradient_factor(cascade) if with_grad is not None else None
    specs = [spec_json(s) for s in cascade.specs]
    if derive_specs:
        from fuser_core.report import derivation_report

        for raw, s in zip(specs, cascade.specs):
            r = derivation_report(s)
            raw["derivation"] = {"fusible": r["fusible"], "certificate_holds": r["certificate"]["holds"]}
    return {
        "name": spec.name,
        "saved": list(cascade.saved),
        "forward": spec_json(cascade.forward),
        "upstream": cascade.upstream,
        "gradients": [{"input": g.input, "output": g.output, "spec": g.spec, "dims": list(g.dims)}
                      for g in cascade.gradients],
        "zero_gradients": list(cascade.zero),
        "not_differentiated": cascade.not_differentiated,
        "shifts": list(cascade.shifts),
        "vanished": cascade.vanished,
        "specs": specs,
        "gradient_in_forward": spec_json(with_grad) if with_grad is not None else None,
        "gradient_factor": spec_json(factor.spec) if factor is not None else None,
        "certificate": certify_backward(spec, cascade),
    }


def format_backward(r: dict[str, Any]) -> str:
    """:func:`backward_report` as text."""
    lines = [f"{r['name']}: backward"]
    if r["saved"]:
        lines.append(f"the forward saves {', '.join(r['saved'])} ({r['forward']['name']})")
    if r["shifts"]:
        lines.append(f"no gradient through {', '.join(r['shifts'])}: the outputs do not depend on it (a shift)")
    for name, text in r["vanished"].items():
        lines.append(f"dropped {name} = {text}: zero for every input (a statistic's stationarity)")
    for name, why in r["not_differentiated"].items():
        lines.append(f"not differentiated: {name} ({why})")
    for name in r["zero_gradients"]:
        lines.append(f"gradient of {name}: zero (read only in conditions)")
    for s in r["specs"]:
        derived = s.get("derivation")
        state = "" if derived is None else (" fused" if derived["fusible"] else " not fused (the unfused chain runs it)")
        if not any("reduce" in step for step in s["steps"]):
            state = (" elementwise: the forward writes it (below)" if r["gradient_in_forward"] else
                     " elementwise: no strategy runs a spec without a reduction yet")
        lines.append(f"spec {s['name']}: writes {', '.join(s['outputs'])};{state}")
        for step in s["steps"]:
            head = f"  {step['name']:<12}" + (f" sum over {step['over']}:" if "reduce" in step else "")
            lines.append(f"{head} {step['expr']}")
    if r["gradient_in_forward"]:
        g = r["gradient_in_forward"]
        lines.append(f"gradient in the forward: {g['name']} writes {', '.join(g['outputs'])}")
        f = r["gradient_factor"]
        factor = next(step["expr"] for step in f["steps"] if step["name"] == "factor")
        lines.append(f"  the backward: {factor} times it" + "".join(
            f"; {step['name']} = {step['expr']}" for step in f["steps"] if step["name"] != "factor"))
    c = r["certificate"]
    worst = ", ".join(f"{k} {v:.1e}" for k, v in c["worst"].items())
    lines.append(f"certificate vs torch float64 autograd: {'holds' if c['holds'] else 'FAILED'} "
                 f"(max rel err {worst}; tolerance {c['tolerance']:.0e}; {c['samples']} samples)")
    return "\n".join(lines)
