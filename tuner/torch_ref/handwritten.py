"""The hand-written kernels torch ships for some catalog cascades: :func:`handwritten` maps a
spec to ``scaled_dot_product_attention`` for attention, ``softmax``, ``logsumexp``,
``layer_norm``, ``rms_norm`` or ``cross_entropy``, **only** when the spec has the exact
structure of the catalog spec of that name (same ``spec_hash`` as the template kept here,
:data:`HANDWRITTEN_TEMPLATES`): a user spec called ``safe_softmax`` that computes something
else never gets ``torch.softmax`` (:func:`handwritten_reason` says why not).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fuser_core.spec import Spec, load_spec


@dataclass(frozen=True)
class Handwritten:
    """A kernel torch ships for one catalog cascade: ``fn(inputs, shape) -> outputs``."""

    name: str  # what the table shows, e.g. "F.scaled_dot_product_attention"
    fn: Callable[[Mapping[str, Any], Mapping[str, int]], dict[str, Any]]


def _spec(name: str, inputs: dict, steps: list, outputs: list, params: dict | None = None,
          constraints: list[str] | None = None) -> dict:
    spec = {"foldwise": 1, "name": name, "inputs": inputs, "params": params or {}, "steps": steps, "outputs": outputs}
    return spec | ({"constraints": constraints} if constraints else {})


_ATTENTION_INPUTS = {"q": {"dims": ["b", "h", "m", "d"]}, "k": {"dims": ["b", "h", "n", "d"]},
                     "v": {"dims": ["b", "h", "n", "e"]}}
_SOFTMAX_STEPS = [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                  {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}]

def _runtime_eps(default: float) -> dict:
    """The norms' eps, a runtime scalar since issue 24. Its default is no part of the spec_hash; the
    hand-written baselines run at it, as tuning launches do (fuser_core.problem.tuning_scalars)."""
    return {"runtime": "float", "default": default, "positive": True}


# The structure each hand-written kernel computes: the catalog specs (fuser_core/catalog) as of
# issue 4 (issue 24: eps at call time). A spec gets the kernel only when its spec_hash equals its template's.
HANDWRITTEN_TEMPLATES: dict[str, dict] = {
    "attention": _spec("attention", _ATTENTION_INPUTS, [
        {"name": "s", "reduce": "sum", "over": "d", "expr": "q * k * scale"},
        {"name": "mx", "reduce": "max", "over": "n", "expr": "s"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(s - mx)"},
        {"name": "o", "reduce": "sum", "over": "n", "expr": "exp(s - mx) * v / den"}], ["o"],
        {"scale": "1 / sqrt(size(d))"}),
    "attention_causal": _spec("attention_causal", _ATTENTION_INPUTS, [
        {"name": "s0", "reduce": "sum", "over": "d", "expr": "q * k * scale"},
        {"name": "s", "expr": "where(index(n) <= index(m) + size(n) - size(m), s0, -inf)"},  # issue 36: bottom-right
        {"name": "mx", "reduce": "max", "over": "n", "expr": "s"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(s - mx)"},
        {"name": "o", "reduce": "sum", "over": "n", "expr": "exp(s - mx) * v / den"}], ["o"],
        {"scale": "1 / sqrt(size(d))"}, ["m <= n"]),
    "safe_softmax": _spec("safe_softmax", {"x": {"dims": ["m", "n"]}},
                          [*_SOFTMAX_STEPS, {"name": "y", "expr": "exp(x - mx) / den"}], ["y"]),
    "logsumexp": _spec("logsumexp", {"x": {"dims": ["m", "n"]}}, [  # torch's own guard of an infinite max
        {"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - where(abs(mx) == inf, 0, mx))"},
        {"name": "lse", "expr": "where(abs(mx) == inf, 0, mx) + log(den)"}], ["lse"]),
    "layernorm": _spec("layernorm", {"x": {"dims": ["t", "c"]}, "gamma": {"dims": ["c"]}, "beta": {"dims": ["c"]}}, [
        {"name": "mean", "reduce": "sum", "over": "c", "expr": "x / size(c)"},
        {"name": "var", "reduce": "sum", "over": "c", "expr": "(x - mean) ** 2 / size(c)"},
        {"name": "y", "expr": "(x - mean) * rsqrt(var + eps) * gamma + beta"}], ["y"], {"eps": _runtime_eps(1e-05)}),
    "rmsnorm": _spec("rmsnorm", {"x": {"dims": ["t", "c"]}, "w": {"dims": ["c"]}}, [
        {"name": "ms", "reduce": "sum", "over": "c", "expr": "x * x / size(c)"},
        {"name": "y", "expr": "x * rsqrt(ms + eps) * w"}], ["y"], {"eps": _runtime_eps(1e-06)}),
    "cross_entropy": _spec("cross_entropy", {"logits": {"dims": ["t", "v"]},
                                             "target": {"dims": ["t"], "kind": "index"}}, [
        {"name": "mx", "reduce": "max", "over": "v", "expr": "logits"},
        {"name": "den", "reduce": "sum", "over": "v", "expr": "exp(logits - mx)"},
        {"name": "picked", "reduce": "sum", "over": "v", "expr": "where(index(v) == target, logits, 0)"},
        {"name": "loss", "expr": "mx + log(den) - picked"}], ["loss"]),
}


def _sdpa(causal: bool):
    def fn(t: Mapping[str, Any], shape: Mapping[str, int]) -> dict[str, Any]:
        import torch.nn.functional as F

        q, k, v = t["q"], t["k"], t["v"]
        if not causal or q.shape[-2] == k.shape[-2]:  # square: is_causal's top-left mask is the same one
            return {"o": F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
        from torch.nn.attention.bias import causal_lower_right

        return {"o": F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]))}

    return fn


def _softmax(t, shape):
    import torch

    return {"y": torch.softmax(t["x"], dim=-1)}


def _logsumexp(t, shape):
    import torch

    return {"lse": torch.logsumexp(t["x"], dim=-1)}


def _layer_norm(t, shape):
    import torch.nn.functional as F

    x = t["x"]
    return {"y": F.layer_norm(x, (x.shape[-1],), t["gamma"], t["beta"], eps=1e-05)}


def _rms_norm(t, shape):
    import torch.nn.functional as F

    x = t["x"]
    return {"y": F.rms_norm(x, (x.shape[-1],), t["w"], eps=1e-06)}


def _cross_entropy(t, shape):
    import torch.nn.functional as F

    return {"loss": F.cross_entropy(t["logits"], t["target"].long(), reduction="none")}


_HANDWRITTEN: dict[str, Handwritten] = {
    "attention": Handwritten("F.scaled_dot_product_attention", _sdpa(False)),
    "attention_causal": Handwritten("F.scaled_dot_product_attention(causal_lower_right)", _sdpa(True)),
    "safe_softmax": Handwritten("torch.softmax", _softmax),
    "logsumexp": Handwritten("torch.logsumexp", _logsumexp),
    "layernorm": Handwritten("F.layer_norm", _layer_norm),
    "rmsnorm": Handwritten("F.rms_norm", _rms_norm),
    "cross_entropy": Handwritten("F.cross_entropy(reduction='none')", _cross_entropy),
}
_TEMPLATE_HASHES: dict[str, str] = {}


def template_hash(name: str) -> str:
    from fuser_core.canonical import spec_hash

    if name not in _TEMPLATE_HASHES:
        _TEMPLATE_HASHES[name] = spec_hash(load_spec(HANDWRITTEN_TEMPLATES[name]))
    return _TEMPLATE_HASHES[name]


def handwritten_reason(spec: Spec) -> str | None:
    """None when torch has a hand-written kernel for ``spec``, else why not."""
    from fuser_core.canonical import spec_hash

    if spec.name not in _HANDWRITTEN:
        return f"torch has no hand-written kernel for {spec.name!r}"
    if spec_hash(spec) != template_hash(spec.name):
        return (f"{spec.name!r} does not have the structure of the catalog spec of that name "
                f"(its spec_hash differs), so {_HANDWRITTEN[spec.name].name} does not compute it")
    return None


def handwritten(spec: Spec) -> Handwritten | None:
    """The hand-written torch kernel for ``spec``, or None (see :func:`handwritten_reason`)."""
    return _HANDWRITTEN[spec.name] if handwritten_reason(spec) is None else None


__all__ = ["HANDWRITTEN_TEMPLATES", "Handwritten", "handwritten", "handwritten_reason", "template_hash"]
