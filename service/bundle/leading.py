"""Model-shaped tensors: extra leading dims folded into an input's first dim.

A model hands its activations as ``[b, s, c]`` where a norm's spec says ``x[t, c]``, and torch's
own ops (``rms_norm``, ``layer_norm``, ``linear``) take any leading dims. So does a kernel: an
input tensor with k more dims than its spec input has its first k + 1 dims taken as the input's
first dim (``t = b * s``, a view where the strides allow it, a copy otherwise), and every output
whose first dim is that dim comes back with those leading dims (``y[b, s, c]``, a view); ``out=``
tensors are given that way too. Every input given extra dims must fold the same sizes into the
same dim (``x`` and ``residual`` both ``[b, s, c]``); one holding the dim flat (``[b * s, c]``)
is taken as it is. Inputs stored in pages (a paged KV cache) never fold.

Used by :class:`~service.bundle.BundleKernel`, :class:`~service.client.range_kernel.RangeKernel` (which
picks a bucket from the folded sizes) and the torch operator's shapes (service.client.torch_ops). No torch
import: sizes may be symbolic (torch.compile's fake tensors).

Example:
    >>> import torch
    >>> fold = fold_of({"x": ("t", "c"), "w": ("c",)}, {"x": torch.ones(2, 3, 8), "w": torch.ones(8)})
    >>> fold
    LeadingFold(dim='t', lead=(2, 3))
    >>> flat = folded_inputs({"x": ("t", "c"), "w": ("c",)}, {"x": torch.ones(2, 3, 8), "w": torch.ones(8)}, fold)
    >>> tuple(flat["x"].shape)
    (6, 8)
    >>> unfolded_shapes({"y": ("t", "c")}, {"y": [6, 8]}, fold)
    {'y': [2, 3, 8]}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.bundle.hashing import BundleError


@dataclass(frozen=True)
class LeadingFold:
    """The leading sizes ``lead`` a call's tensors fold into dim ``dim`` (of size their product)."""

    dim: str
    lead: tuple[Any, ...]


def _extra(dims: tuple[str, ...], t: Any) -> int:
    """How many more dims tensor ``t`` has than ``dims``, where it may fold (a real first dim: not a page's)."""
    if not hasattr(t, "dim") or not dims or "." in dims[0]:
        return 0
    return max(0, t.dim() - len(dims))


def fold_of(input_dims: Mapping[str, tuple[str, ...]], given: Mapping[str, Any]) -> LeadingFold | None:
    """The fold of a call's tensors (``input_dims``: input -> its tensor's dims), None when no tensor
    has extra dims. :class:`BundleError` naming an input whose fold disagrees with another's."""
    found: tuple[LeadingFold, str] | None = None
    for name, dims in input_dims.items():
        t = given.get(name)
        extra = _extra(dims, t)
        if not extra:
            continue
        fold = LeadingFold(dims[0], tuple(t.shape[: extra + 1]))
        if found is None:
            found = (fold, name)
        elif found[0] != fold:
            raise BundleError(f"inputs.{name}: its leading sizes {fold.lead} fold into {fold.dim}, but those of "
                              f"inputs.{found[1]} are {found[0].lead} into {found[0].dim}; give both the same leading dims")
    return found[0] if found else None


def folded_inputs(input_dims: Mapping[str, tuple[str, ...]], given: Mapping[str, Any], fold: LeadingFold) -> dict[str, Any]:
    """``given`` with each tensor's extra leading dims folded into its first dim (a view where possible)."""
    out = dict(given)
    for name, dims in input_dims.items():
        t = given.get(name)
        extra = _extra(dims, t)
        if extra:
            out[name] = t.reshape(-1, *t.shape[extra + 1:])
    return out


def unfolded_shapes(output_dims: Mapping[str, tuple[str, ...]], shapes: Mapping[str, list[Any]],
                    fold: LeadingFold) -> dict[str, list[Any]]:
    """Output shapes (``shapes``, flat) with the leading sizes back where an output's first dim is the fold's."""
    return {part: ([*fold.lead, *shape[1:]] if output_dims[part][:1] == (fold.dim,) else list(shape))
            for part, shape in shapes.items()}


def folded_out(output_dims: Mapping[str, tuple[str, ...]], out: Mapping[str, Any], fold: LeadingFold) -> dict[str, Any]:
    """``out=`` tensors given with the leading dims, viewed flat for the kernel (a view: the kernel
    writes into the caller's tensors). :class:`BundleError` naming one whose strides do not fold."""
    flat = dict(out)
    for part, dims in output_dims.items():
        t = out.get(part)
        if t is None or dims[:1] != (fold.dim,) or not hasattr(t, "dim") or t.dim() != len(dims) + len(fold.lead) - 1:
            continue
        try:
            flat[part] = t.view(-1, *t.shape[len(fold.lead):])
        except RuntimeError:
            raise BundleError(f"out.{part}: its leading dims {tuple(t.shape[:len(fold.lead)])} cannot be viewed as one "
                              "(not contiguous across them); pass a tensor whose leading dims are") from None
    return flat


def unfolded_outputs(output_dims: Mapping[str, tuple[str, ...]], outputs: Mapping[str, Any],
                     fold: LeadingFold) -> dict[str, Any]:
    """A call's flat outputs with the leading dims back (views)."""
    return {part: (t.view(*fold.lead, *t.shape[1:]) if output_dims[part][:1] == (fold.dim,) else t)
            for part, t in outputs.items()}


def call_folded(call: Any, input_dims: Mapping[str, tuple[str, ...]], output_dims: Mapping[str, tuple[str, ...]],
                given: Mapping[str, Any], out: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``call(inputs, out=...)`` (a kernel's call) on ``given`` with its leading dims folded, its
    outputs unfolded (``out=``: the caller's own tensors, written through flat views); None when
    no tensor of ``given`` has extra dims (the caller then calls as it is)."""
    fold = fold_of(input_dims, given)
    if fold is None:
        return None
    flat = folded_inputs(input_dims, given, fold)
    if out is not None and isinstance(out, Mapping):
        call(flat, out=folded_out(output_dims, out, fold))
        return {part: out[part] for part in output_dims}
    return unfolded_outputs(output_dims, call(flat, out=None), fold)
