"""Dims reduced together (``"over": ["c", "p"]``): the user's tensors <-> the kernels' logical ones.

A reduction over a list of dims runs one loop over their merged dim (``c_p``, of size
size(c) * size(p)); every kernel, the reference and the certificate see *logical* tensors,
where the merged dim stands in the parts' place (:meth:`fuser_core.spec._Loader.merge_dims`).
The user's tensors have the parts (GroupNorm's x[n, g, c, p], its weight w[g, c]). This module
is the one place that converts between them, for numpy arrays and torch tensors alike:

- an input holding every part (x[n, g, c, p]) becomes a *view* x[n, g, c*p] where its strides
  allow it (a contiguous tensor, the case inference servers have), a copy otherwise;
- an input holding some parts (w[g, c]) is, logically, repeated along the others: w[g, c*p]
  with w[g, c * size(p) + q] = w[g, c]. The reference, the certificate and the unfused chain
  use that (a copy); the fused kernels read the user's w[g, c] at c = m // size(p) of the merged
  index m (:func:`address`), and their launchers take either layout (:func:`launcher_lines`);
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

from fuser_core import paged
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


def as_logical(spec: Spec, name: str, array: Any, shape: Mapping[str, int]) -> Any:
    """Input ``name`` in its logical dims, whether ``array`` has them already or the user's."""
    inp = spec.input(name)
    if not inp.storage_dims or tuple(array.shape) == tuple(int(shape[d]) for d in inp.dims):
        return array
    return to_logical(spec, name, array, shape)


def consistent(spec: Spec, name: str, array: Any, shape: Mapping[str, int]) -> Any:
    """A logical input as a user's tensor makes it: an input holding some of a merged dim's parts is
    repeated along the others (random or family inputs drawn in logical dims are not; the kernels
    read such an input at its first positions, the reference at every one)."""
    inp = spec.input(name)
    if not inp.storage_dims or kernel_dims(spec, name) == inp.dims:
        return array
    return to_logical(spec, name, input_to_storage(spec, name, array, shape), shape)


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


# ---------------------------------------------------------------- how kernels address an input


def kernel_dims(spec: Spec, name: str) -> tuple[str, ...]:
    """The dims of input ``name`` as a fused kernel takes it: a merged dim where the input holds every
    part (x[n, g, c_p], a view of the user's tensor), the parts it holds where it holds some
    (w[g, c]: the user's tensor itself, read at c = m // size(p), no copy)."""
    inp = spec.input(name)
    if inp.paged is not None:
        return paged.kernel_dims(inp)
    out: list[str] = []
    for d in inp.dims:
        held = [k for k in spec.merges.get(d, ()) if k in inp.storage_dims]
        out.extend(held if held and len(held) < len(spec.merges[d]) else [d])
    return tuple(out)


def address(spec: Spec, name: str, var: str) -> tuple[tuple[str, str, str, tuple[str, ...]], ...]:
    """How a kernel reads input ``name`` (kernel variable ``var``): per logical dim d, entries
    ``(d, fmt, stride, sizes)``: the offset is ``fmt.format(offs_d) * stride``, reading the kernel
    arguments ``sizes``. A held part k of a merged dim m = (.., k, ..inner) is at
    ``(offs_m // prod(size(inner))) % size(k)`` (no ``%`` for the outer part, no ``//`` for the inner)."""
    inp = spec.input(name)
    if inp.paged is not None:
        return paged.address(inp, var)
    out = []
    for d in inp.dims:
        parts = spec.merges.get(d, ())
        held = [k for k in parts if k in inp.storage_dims]
        if not held or len(held) == len(parts):
            out.append((d, "{}", f"stride_{var}_{d}", ()))
            continue
        for k in held:
            i = parts.index(k)
            inner = parts[i + 1:]
            fmt, sizes = "{}", tuple(f"size_{q}" for q in inner)
            if inner:
                fmt = f"({fmt} // {' // '.join(sizes)})"
            if i > 0:
                fmt, sizes = f"({fmt} % size_{k})", (*sizes, f"size_{k}")
            out.append((d, fmt, f"stride_{var}_{k}", sizes))
    return tuple(out)


def launcher_lines(spec: Spec, name: str, var: str) -> list[str]:
    """Lines of a generated launcher that bring input ``name`` (in ``var``) to :func:`kernel_dims`
    from the user's dims (a view: merged parts flattened) or from the logical ones (what the
    runner and the reference use: a view of the first positions along the parts it does not hold)."""
    inp = spec.input(name)
    if not inp.storage_dims:
        return []
    want = kernel_dims(spec, name)
    full = spec.storage_dims(inp.dims)

    def sizes(dims) -> str:
        return "(" + "".join(f"size_{d}, " for d in dims) + ")"

    lines = [f"    if tuple({var}.shape) != {sizes(want)}:  # dims reduced together (fuser_core.merged)"]
    if want != tuple(inp.dims):
        pick = ", ".join(":" if d in inp.storage_dims else "0" for d in full)
        lines += [f"        if tuple({var}.shape) == {sizes(inp.dims)}:  # logical: its first positions along the rest",
                  f"            {var} = {var}.reshape{sizes(full)}[{pick}].reshape{sizes(want)}",
                  "        else:",
                  f"            {var} = {var}.reshape{sizes(want)}"]
    else:
        lines.append(f"        {var} = {var}.reshape{sizes(want)}")
    return lines


def _np_broadcast(array: Any, wide: list[int]) -> Any:
    import numpy as np

    return np.broadcast_to(array, wide).copy()  # writable (torch.from_numpy warns on a read-only view)
