"""Dims reduced together (``"over": ["c", "p"]``): the user's tensors <-> the kernels' logical ones.

A reduction over a list of dims runs one loop over their merged dim (``c_p``, of size
size(c) * size(p)); every kernel, the reference and the certificate see *logical* tensors,
where the merged dim stands in the parts' place (:meth:`fuser_core.spec._Loader.merge_dims`).
The user's tensors have the parts (GroupNorm's x[n, g, c, p], its weight w[g, c]). This module
is the one place that converts between them, for numpy arrays and torch tensors alike:

- an input holding every part (x[n, g, c, p]) becomes a *view* x[n, g, c*p] where its strides
  allow it (a contiguous tensor, the case inference servers have), a copy otherwise;
- an input holding some parts (w[g, c]) is repeated along the others: w[g, c*p] with
  w[g, c * size(p) + q] = w[g, c]. That copy is the price of the logical layout (size(p) times
  the weight's bytes); reading w at m // size(p) in the kernels would avoid it (left open);
- an output's merged dim is split back into its parts (a view).

Example:
    >>> import numpy as np
    >>> from fuser_core.catalog import load_catalog_spec
    >>> spec = load_catalog_spec("group_norm")
    >>> shape = {"n": 1, "g": 2, "c": 3, "p": 4, "c_p": 12}
    >>> to_logical(spec, "w", np.ones((2, 3)), shape).shape
    (2, 12)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fuser_core.spec import Spec


def to_logical(spec: Spec, name: str, array: Any, shape: Mapping[str, int]) -> Any:
    """Input ``name`` in its storage dims (the user's) -> its logical dims (numpy or torch).
    ``shape`` is bound (:func:`fuser_core.problem.bind_shape`: parts and merged dims sized)."""
    inp = spec.input(name)
    if not inp.storage_dims:
        return array
    full = spec.storage_dims(inp.dims)  # every part of each merged dim the input holds
    held = [int(shape[d]) if d in inp.storage_dims else 1 for d in full]
    wide = [int(shape[d]) for d in full]
    array = array.reshape(held)
    if held != wide:  # repeated along the parts it does not hold
        array = array.expand(*wide) if hasattr(array, "expand") else _np_broadcast(array, wide)
    return array.reshape([int(shape[d]) for d in inp.dims])


def input_to_storage(spec: Spec, name: str, array: Any, shape: Mapping[str, int]) -> Any:
    """A logical input -> the user's dims: the inverse of :func:`to_logical` on the tensors it
    makes (an input holding some parts takes their first position along the others)."""
    inp = spec.input(name)
    if not inp.storage_dims:
        return array
    full = spec.storage_dims(inp.dims)
    array = array.reshape([int(shape[d]) for d in full])
    return array[tuple(slice(None) if d in inp.storage_dims else 0 for d in full)]


def to_storage(spec: Spec, dims: tuple[str, ...], array: Any, shape: Mapping[str, int]) -> Any:
    """An output in logical ``dims`` -> the user's dims (each merged dim split into its parts: a view)."""
    if not any(d in spec.merges for d in dims):
        return array
    return array.reshape([int(shape[d]) for d in spec.storage_dims(dims)])


def _np_broadcast(array: Any, wide: list[int]) -> Any:
    import numpy as np

    return np.broadcast_to(array, wide)
