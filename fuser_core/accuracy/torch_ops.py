"""Torch's own op for a catalog spec (matched by spec hash) and its outputs on the same inputs:
the second reference of the accuracy bar.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fuser_core.problem import bind_shape
from fuser_core.spec import Spec

# ---------------------------------------------------------------- torch's own ops


def _torch_ops() -> dict[str, Callable[[Mapping[str, int], Mapping[str, float], Mapping[str, Any]], dict[str, Any]]]:
    """Torch's op for each catalog spec of ``TORCH_OPS``: (shape, params, tensors) -> outputs, all
    in the catalog spec's own names (:func:`torch_outputs` translates a renamed copy's)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    return {
        "safe_softmax": lambda shape, p, t: {"y": torch.softmax(t["x"], dim=-1)},
        "logsumexp": lambda shape, p, t: {"lse": torch.logsumexp(t["x"], dim=-1)},
        "layernorm": lambda shape, p, t: {"y": F.layer_norm(t["x"], (shape["c"],), t["gamma"], t["beta"], p["eps"])},
        "rmsnorm": lambda shape, p, t: {"y": F.rms_norm(t["x"], (shape["c"],), t["w"], p["eps"])},
        "cross_entropy": lambda shape, p, t: {"loss": F.cross_entropy(t["logits"], t["target"], reduction="none")},
        "group_norm": lambda shape, p, t: {"y": _group_norm(F, shape, p, t)},
    }


def _group_norm(F: Any, shape: Mapping[str, int], p: Mapping[str, float], t: Mapping[str, Any]) -> Any:  # noqa: N803
    """torch's group_norm on the catalog's group_norm tensors in the merged layout: x[n, g, c_p] viewed as
    [n, g * c, p], the weight and bias w[g, c_p] at their first position along p (fuser_core.merged)."""
    n, g, c, q = (shape[d] for d in ("n", "g", "c", "p"))

    def per_channel(w: Any) -> Any:
        return w.reshape(g, c, q)[:, :, 0].reshape(g * c)

    y = F.group_norm(t["x"].reshape(n, g * c, q), g, per_channel(t["w"]), per_channel(t["b"]), p["eps"])
    return y.reshape(n, g, c * q)


TORCH_OPS = ("safe_softmax", "logsumexp", "layernorm", "rmsnorm", "cross_entropy", "group_norm")
_CATALOG_SPECS: dict[str, tuple[str, Spec]] | None = None  # spec hash -> (op name, the catalog's spec)


def _torch_op(spec: Spec) -> tuple[str, Spec] | None:
    """The catalog op torch has for ``spec`` and the catalog's copy of it, matched by spec hash."""
    global _CATALOG_SPECS
    from fuser_core.canonical import spec_hash
    from fuser_core.catalog import PACKAGED_DIR, load_catalog_spec

    if _CATALOG_SPECS is None:
        specs = {n: load_catalog_spec(PACKAGED_DIR / f"{n}.json") for n in TORCH_OPS}
        _CATALOG_SPECS = {spec_hash(s): (n, s) for n, s in specs.items()}
    return _CATALOG_SPECS.get(spec_hash(spec))


def torch_op_name(spec: Spec) -> str | None:
    """The catalog op torch has for ``spec`` (``TORCH_OPS``), matched by spec hash (a renamed
    copy of the catalog's layernorm counts, the service's canonical copy too; an edited one
    does not); None otherwise."""
    found = _torch_op(spec)
    return found[0] if found else None


def torch_outputs(spec: Spec, shape: Mapping[str, int], inputs: Mapping[str, np.ndarray],
                  dtypes: Mapping[str, str]) -> dict[str, np.ndarray] | None:
    """Torch's own op on ``inputs`` in their dtypes (on the CPU), as float64 arrays keyed by
    ``spec``'s output names; None when torch has no op for the spec or no CPU kernel for the dtype."""
    import torch

    from fuser_core.canonical import canonical_names
    from fuser_core.reference import param_values

    found = _torch_op(spec)
    if found is None:
        return None
    name, catalog = found
    shape = bind_shape(spec, shape, allow_empty=True)  # a merged dim's parts sized too
    # equal hashes: the two specs' dims, steps and params have the same canonical names
    ours = {canon: mine for mine, canon in canonical_names(spec).items()}
    theirs = {cat: ours[canon] for cat, canon in canonical_names(catalog).items()}
    params = param_values(spec, shape, inputs)  # runtime scalars ride with the inputs
    tensors = {}
    for inp in spec.inputs:  # inputs keep their names in the canonical form
        a = np.asarray(inputs[inp.name])
        tensors[inp.name] = (torch.from_numpy(a.astype(np.int64)) if inp.is_index
                             else torch.from_numpy(a.astype(np.float64 if dtypes[inp.name] == "float64" else np.float32))
                             .to(getattr(torch, dtypes[inp.name])))
    try:
        with torch.no_grad():
            got = _torch_ops()[name]({d: shape[theirs[d]] for d in catalog.sized_dims},
                                     {p.name: params[theirs.get(p.name, p.name)] for p in catalog.params
                                      if p.name in theirs or p.runtime},  # runtime params keep their names
                                     tensors)
    except (RuntimeError, NotImplementedError, TypeError):  # no CPU kernel for this dtype
        return None
    out = {}
    for part, t in got.items():  # in the spec's dim order (a canonical copy may order them otherwise)
        order = [theirs[d] for d in catalog.step(part).dims]
        out[theirs[part]] = t.double().numpy().transpose([order.index(d) for d in spec.step(theirs[part]).dims])
    return out
