"""A problem: a spec with its sizes and dtypes bound once, and the checks every layer shares.

:func:`make_problem` is the one place a (spec, shape, dtype) request is bound: it returns a
:class:`Problem` (the spec, its canonical names, the complete checked shape, every input's
dtype and every output part's storage dtype). The search space, the measurers, the cost model,
the torch baselines and the bundle maker take a Problem and never bind again.

The pieces: :func:`bind_shape` (dim -> size, complete and checked, with the size limits of
:func:`check_sizes`), :func:`bind_dtypes` (input -> dtype), :func:`output_dtypes` (output part
-> storage dtype), and the normalisers that name a problem the same way everywhere
(:func:`canonical_shape`, :func:`bound_to_canonical`, :func:`normalize_dtype`). Pure Python over
a :class:`~fuser_core.spec.Spec`: no numpy, sympy or scipy, so that the kernel client
(:mod:`service.client`) can validate a request without importing the derivation or the
reference evaluator. :mod:`fuser_core.reference` and :mod:`fuser_core.runner` re-export the
binders, :mod:`fuser_core.codegen.module` re-exports :func:`output_dtypes`.

The size checks build lists, never generator expressions (``math.prod([...])``): a kernel call
binds its sizes here, and torch.compile's Dynamo cannot trace a generator handed to a builtin
(``fullgraph=True`` failed on it before any Triton code: issue 24).

Example:
    >>> from fuser_core.spec import load_spec
    >>> spec = load_spec({"foldwise": 1, "name": "rowmax", "inputs": {"x": {"dims": ["m", "n"]}},
    ...     "steps": [{"name": "t", "reduce": "max", "over": "n", "expr": "x"}], "outputs": ["t"]})
    >>> p = make_problem(spec, {"m": 4, "n": 300}, "float16")
    >>> p.shape, p.dtypes, p.output_dtypes, p.canonical_shape, p.dtype
    ({'m': 4, 'n': 300}, {'x': 'float16'}, {'t': 'float16'}, {'d0': 4, 'd1': 300}, 'float16')
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from fuser_core import expr as ex
from fuser_core.canonical import canonical_names
from fuser_core.errors import SpecError
from fuser_core.reduce_ops import returns_indices
from fuser_core.spec import Spec

# Size limits of a bound shape, per tensor rather than for the product of every dim (attention's
# b, h, m, n, d, e multiply to 2**41 though its largest tensor has 2**29 elements), and per tensor
# stored: the kernels address each with 32-bit offsets (fuser_core.codegen.helpers.int32_offsets).
MAX_ELEMENTS = 2**31  # the most elements an input, an output, or an intermediate a strategy stores may have
MAX_WORK = 2**48  # the most points of any step's iteration space (its dims and the dim it reduces over)
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn")
PROBLEM_DTYPES = FLOAT_DTYPES[:4]  # one dtype for every float input (fp8 per input only)
INDEX_DTYPES = ("int32", "int64")


class ShapeError(SpecError):
    """Sizes or arrays that do not fit the spec; ``loc`` names the dim or the input.

    Example:
        >>> str(ShapeError("must be a positive integer, got 0", loc=("shape", "n")))
        'shape.n: must be a positive integer, got 0'
    """


# ---------------------------------------------------------------- sizes


def bind_shape(spec: Spec, shape: Mapping[str, int], *, allow_empty: bool = False) -> dict[str, int]:
    """Check ``shape`` (dim -> positive int) against the spec; return a new, complete dict.

    A topk ``as`` dim may be left out (it is then ``k``); if given it must equal ``k``. With
    ``allow_empty`` (running a kernel, not tuning one) a size may be 0 (fuser_core.empty), except
    where an argmax/argmin reduces over it: nothing is there to select.
    """
    if not isinstance(shape, Mapping):
        raise ShapeError(f"expected an object of dim -> size, got {type(shape).__name__}", loc=("shape",))
    unknown = [d for d in shape if d not in spec.sized_dims]
    if unknown:
        raise ShapeError(
            f"unknown dim{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"the spec's dims are {', '.join(spec.dims)}",
            loc=("shape", str(unknown[0])),
        )
    as_dims = {s.as_dim: s for s in spec.steps if s.reduce == "topk"}
    bound: dict[str, int] = {}
    for merged, parts in spec.merges.items():  # the user gives the parts (c, p); a merged size given wins
        if merged in shape:
            continue
        for d in parts:
            n = shape.get(d)
            if n is None:
                raise ShapeError(f"no size given for this dim (reduced together as {list(parts)})", loc=("shape", d))
            if isinstance(n, bool) or not isinstance(n, Integral) or n < 0:
                raise ShapeError(f"must be a non-negative integer, got {n!r:.40}", loc=("shape", d))
        shape = {**shape, merged: math.prod([int(shape[d]) for d in parts])}
    shape = fill_parts(spec, shape)
    for d in spec.sized_dims:
        if d not in shape and d in as_dims:
            bound[d] = as_dims[d].k
            continue
        if d not in shape:
            raise ShapeError("no size given for this dim", loc=("shape", d))
        n = shape[d]
        if isinstance(n, bool) or not isinstance(n, Integral) or n < (0 if allow_empty else 1):
            what = "a non-negative" if allow_empty else "a positive"
            raise ShapeError(f"must be {what} integer, got {n!r:.40}", loc=("shape", d))
        bound[d] = int(n)
    for step in spec.steps:
        if returns_indices(step.reduce) and bound[step.over] == 0:
            raise ShapeError(f"is 0, and step {step.name!r} takes the {step.reduce} over it: an empty dim has "
                             "no position to select", loc=("shape", step.over))
    for d, step in as_dims.items():
        if bound[d] != step.k:
            raise ShapeError(f"is topk step {step.name!r}'s 'as' dim, so its size must be k={step.k}, got {bound[d]}",
                             loc=("shape", d))
        if step.k > bound[step.over]:
            raise ShapeError(f"topk step {step.name!r} takes k={step.k} of {step.over!r}, which has only "
                             f"{bound[step.over]}", loc=("shape", step.over))
    for a, rel, b in spec.constraints:  # what the spec's doc excludes is refused, never run
        if not _RELATIONS[rel](bound[a], bound[b]):
            raise ShapeError(f"{a} = {bound[a]} and {b} = {bound[b]}: the spec takes only {a} {rel} {b}",
                             loc=("shape", a))
    check_sizes(spec, bound)
    return bound


def meeting_constraints(spec: Spec, shape: dict[str, int]) -> dict[str, int]:
    """``shape`` with each of the spec's constraints met (``m <= n``: n raised to m where smaller): a
    shape a program draws or caps (the certificate's trials, the interpreter's reduced shapes) that the
    spec takes."""
    out = dict(shape)
    for a, rel, b in spec.constraints:
        if a in out and b in out:
            out[b] = out[a] if rel == "==" else max(out[b], out[a] + (rel == "<"))
    return out


_RELATIONS = {"<": operator.lt, "<=": operator.le, "==": operator.eq, ">=": operator.ge, ">": operator.gt}


def bind_scalars(spec: Spec, shape: Mapping[str, int], given: Mapping[str, Any]) -> dict[str, float]:
    """Every runtime param's value (a float): ``given``'s, else its default at these sizes.

    ``given`` may hold other names (the inputs, when scalars ride along with them): only runtime
    params are read. A missing one without a default, a value that is not one real number, or a
    non-positive value for a param declared positive (the derivation assumed it) raises
    :class:`ShapeError` naming ``scalars.<name>``. Light: a number default costs no import; an
    expression of sizes (``1 / sqrt(size(d))``) is evaluated by the reference."""
    out: dict[str, float] = {}
    for p in spec.runtime_params:
        loc = ("scalars", p.name)
        if p.name in given:
            value = given[p.name]
            # a Python or NumPy number, or a 0-d array/tensor; never a bool or a string
            if isinstance(value, bool) or not (isinstance(value, Real) or getattr(value, "ndim", None) == 0):
                raise ShapeError(f"a runtime scalar takes one real number, got {type(value).__name__}", loc=loc)
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ShapeError(f"a runtime scalar takes one real number, got {type(value).__name__}", loc=loc) from None
        elif isinstance(p.expr, ex.Num):
            number = p.expr.value
        elif p.expr is not None:
            number = size_expression_value(p.expr, shape, loc)
        else:
            raise ShapeError("this runtime scalar has no default: pass its value", loc=loc)
        if p.positive and not 0 < number < math.inf:  # the derivation and the kernels take it as finite
            raise ShapeError(f"is declared positive (a finite number > 0), got {number:g}", loc=loc)
        out[p.name] = number
    return out


_SIZE_FUNCTIONS = {"sqrt": math.sqrt, "rsqrt": lambda x: 1 / math.sqrt(x), "exp": math.exp, "log": math.log,
                   "log2": math.log2, "exp2": lambda x: 2.0 ** x, "abs": abs}
_SIZE_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b,
             "**": lambda a, b: a ** b}


def size_expression_value(e: ex.Expr, shape: Mapping[str, int], loc: tuple) -> float:
    """A runtime param's default (numbers, size(dim), arithmetic and a few functions: ``1 / sqrt(size(d))``)
    at these sizes, in plain Python: the client evaluates it per call, without NumPy or the reference (which
    imports this module). Anything else raises ShapeError at ``loc``."""
    try:
        if isinstance(e, ex.Num):
            return float(e.value)
        if isinstance(e, ex.Size):
            return float(shape[e.dim])
        if isinstance(e, ex.Neg):
            return -size_expression_value(e.operand, shape, loc)
        if isinstance(e, ex.BinOp):
            return float(_SIZE_OPS[e.op](size_expression_value(e.left, shape, loc), size_expression_value(e.right, shape, loc)))
        if isinstance(e, ex.Call) and e.func in _SIZE_FUNCTIONS and len(e.args) == 1:
            return float(_SIZE_FUNCTIONS[e.func](size_expression_value(e.args[0], shape, loc)))
    except (ArithmeticError, ValueError, KeyError) as err:
        raise ShapeError(f"its default cannot be evaluated at these sizes: {err}", loc=loc) from None
    raise ShapeError("its default uses more than numbers, size(), arithmetic, sqrt, rsqrt, exp, log: pass its value",
                     loc=loc)


def placeholder_scalars(spec: Spec) -> dict[str, float]:
    """A value for every runtime param where only the compiled kernel or its time matters (compile
    checks, cubin loading, tuning launches): a runtime scalar is a plain fp32 argument, so its value
    is no part of the binary (Triton specialises integer arguments, never floats). 1.0 satisfies
    ``positive``."""
    return {p.name: 1.0 for p in spec.runtime_params}


def tuning_scalars(spec: Spec, shape: Mapping[str, int]) -> dict[str, float]:
    """Runtime params for a tuning or baseline run: their defaults at these sizes, a placeholder
    (:func:`placeholder_scalars`) where a param has none. A kernel's time does not depend on the
    values; a baseline's result is then the spec's at its defaults."""
    return bind_scalars(spec, shape, {n: v for n, v in placeholder_scalars(spec).items()
                                      if next(p for p in spec.runtime_params if p.name == n).expr is None})


def fill_parts(spec: Spec, shape: Mapping[str, int]) -> dict[str, int]:
    """``shape`` with each merged dim's parts sized to match it (``spec.merges``): kept where their
    product is the merged size, else refit, inner parts first (kept at most their given size),
    the outer part taking the rest, and the merged size set to the parts' product (at most what
    was given: shapes derived by capping, the accuracy families' axis of length 1 or 0)."""
    out = dict(shape)
    for merged, parts in spec.merges.items():
        if merged not in out:
            continue
        n = int(out[merged])
        if all([d in out for d in parts]) and math.prod([int(out[d]) for d in parts]) == n:
            continue
        rest = n
        for d in reversed(parts[1:]):
            size = max(1, min(int(out.get(d, rest)), rest)) if rest else int(out.get(d, 1)) or 1
            out[d] = size
            rest //= size
        out[parts[0]] = rest
        out[merged] = math.prod([out[d] for d in parts])
    return out


def tensor_size(bound: Mapping[str, int], dims) -> tuple[int, str]:
    """(the points of ``dims`` at the sizes ``bound``, and those sizes as an error names them: ``m=4, n=300``)."""
    return math.prod([bound[d] for d in dims]), ", ".join(f"{d}={bound[d]}" for d in dims)


def check_sizes(spec: Spec, bound: Mapping[str, int], *, max_elements: int = MAX_ELEMENTS,
                max_work: int = MAX_WORK) -> None:
    """ShapeError (field ``shape``) naming the first tensor, an input or an output, with more than
    ``max_elements`` elements, or the first step whose iteration space has more than ``max_work``
    points. Only what every strategy addresses counts as a tensor: the inputs and the outputs. A
    step no fused strategy stores (attention's score matrix ``s``, 2**39 elements at a 131072-token
    context) is limited where a strategy does store it: the unfused chain refuses such a shape
    (fuser_core.codegen.chain.chain_plan). A step's iteration space adds the dim it reduces over
    (a topk step's own ``as`` dim is not iterated)."""
    tensors = [(f"input {i.name!r}", i.dims) for i in spec.inputs] + [(f"output {o!r}", spec.step(o).dims)
                                                                      for o in spec.outputs]
    for what, dims in tensors:
        n, sizes = tensor_size(bound, dims)
        if n > max_elements:
            raise ShapeError(f"{what} ({sizes}) would have {n} elements; the limit per tensor is {max_elements}",
                             loc=("shape",))
    for step in spec.steps:
        dims = [d for d in step.dims if d != step.as_dim] + ([step.over] if step.over else [])
        n, sizes = tensor_size(bound, dims)
        if n > max_work:
            raise ShapeError(f"step {step.name!r} iterates over {sizes}: {n} points; the limit is {max_work}",
                             loc=("shape",))


def bind_dtypes(spec: Spec, dtype: str | Mapping[str, str]) -> dict[str, str]:
    """One dtype for every floating input, or a map per input (docs/SPEC.md); index inputs int64."""
    out: dict[str, str] = {}
    if isinstance(dtype, str):
        if dtype not in PROBLEM_DTYPES:
            raise SpecError(f"unknown dtype {dtype!r}; one of {', '.join(PROBLEM_DTYPES)} (fp8 per input only)", loc=("dtype",))
        mapping: Mapping[str, str] = {i.name: dtype for i in spec.inputs if i.is_float}
    else:
        mapping = dtype
        unknown = set(mapping) - {i.name for i in spec.inputs}
        if unknown:
            raise SpecError(f"names unknown input {sorted(unknown)[0]!r}", loc=("dtype",))
    for i in spec.inputs:
        allowed = INDEX_DTYPES if i.is_index else FLOAT_DTYPES
        d = mapping.get(i.name, "int64" if i.is_index else "float32")
        if d not in allowed:
            raise SpecError(f"{d!r} is not allowed for {'index' if i.is_index else 'float'} input {i.name!r}; one of {', '.join(allowed)}", loc=("dtype", i.name))
        out[i.name] = d
    return out


def compute_dtype(dtypes: Mapping[str, str]) -> str:
    """The dtype a problem's kernels compute in: float32 (16-bit and fp8 inputs are converted to it on
    load), or float64 where an input is float64 (what ``torch.autograd.gradcheck`` runs in)."""
    return "float64" if "float64" in dtypes.values() else "float32"


def output_dtypes(spec: Spec, dtypes: Mapping[str, str]) -> dict[str, str]:
    """Storage dtype of each output part (docs/SPEC.md: the floating inputs' dtype unless a cast or the
    spec's ``output_dtypes`` says otherwise)."""
    floats = [dtypes[i.name] for i in spec.inputs if i.is_float]
    default = next((d for d in floats if d != "float8_e4m3fn"), "float32") if len(set(floats)) != 1 else floats[0]
    if default == "float8_e4m3fn":
        default = "float32"
    out = {}
    for part in spec.output_parts:
        step = spec.step(part.split(".")[0])
        if part.endswith(".indices") or returns_indices(step.reduce):
            out[part] = "int32"
        elif step.name in dict(spec.output_dtypes) and not (default == "float64" and dict(spec.output_dtypes)[step.name]
                                                            == "float32"):
            # float32 is never narrower than the data: a float64 problem keeps its statistics in float64
            out[part] = dict(spec.output_dtypes)[step.name]
        elif isinstance(step.expr, ex.Cast) and not step.is_reduction:
            out[part] = step.expr.dtype
        else:
            out[part] = default
    return out


# ---------------------------------------------------------------- normalised names


def canonical_shape(spec: Spec, shape: Mapping[str, int]) -> dict[str, int]:
    """``shape`` in ``spec``'s dim names -> the complete shape in canonical dim names.

    Validated with :func:`bind_shape` (a topk ``as`` dim may be left out).
    """
    return bound_to_canonical(spec, bind_shape(spec, shape))


def bound_to_canonical(spec: Spec, bound: Mapping[str, int]) -> dict[str, int]:
    """A shape already bound to ``spec`` (:func:`bind_shape`) in canonical dim names."""
    return _renamed(bound, canonical_names(spec))


def _renamed(bound: Mapping[str, int], names: Mapping[str, str]) -> dict[str, int]:
    return {names[d]: n for d, n in sorted(bound.items(), key=lambda kv: names[kv[0]])}


def normalize_dtype(spec: Spec, dtype: str | Mapping[str, str]) -> str | dict[str, str]:
    """One canonical form of a dtype request: a string when every floating input shares one
    of float32/float16/bfloat16 (and index inputs are int64), else the complete per-input map.

    So ``{"x": "float16"}`` and ``"float16"`` name the same kernel. Input names are the same
    in every naming of a spec, so the result needs no translation.
    """
    return _dtype_request(spec, bind_dtypes(spec, dtype))


def _dtype_request(spec: Spec, bound: Mapping[str, str]) -> str | dict[str, str]:
    floats = {bound[i.name] for i in spec.inputs if i.is_float}
    index_default = all(bound[i.name] == "int64" for i in spec.inputs if i.is_index)
    if len(floats) == 1 and index_default and next(iter(floats)) in PROBLEM_DTYPES:
        return next(iter(floats))
    return dict(sorted(bound.items()))


# ---------------------------------------------------------------- the problem


@dataclass(frozen=True, eq=False)
class Problem:
    """A spec with its sizes and dtypes bound: what every layer below the request takes.

    Make one with :func:`make_problem` (never by hand: the fields are checked there, once).
    ``shape`` is complete (every dim of the spec, topk ``as`` dims included) in the spec's own
    dim names; ``dtypes`` names every input's dtype, ``output_dtypes`` every output part's
    storage dtype; ``names`` maps the spec's dim, step and param names to the canonical ones
    (:func:`fuser_core.canonical.canonical_names`). Treat the dicts as read-only.
    """

    spec: Spec
    shape: dict[str, int]
    dtypes: dict[str, str]
    output_dtypes: dict[str, str]
    names: dict[str, str]

    @property
    def canonical_shape(self) -> dict[str, int]:
        """The shape in canonical dim names (``d0, d1, ...``), sorted: how bundles and jobs key it."""
        return _renamed(self.shape, self.names)

    @property
    def dtype(self) -> str | dict[str, str]:
        """The dtype request in its one normal form (:func:`normalize_dtype`)."""
        return _dtype_request(self.spec, self.dtypes)


def make_problem(spec: Spec, shape: Mapping[str, int], dtype: str | Mapping[str, str]) -> Problem:
    """Bind ``shape`` (:func:`bind_shape`) and ``dtype`` (:func:`bind_dtypes`: one name for every
    floating input, or a map per input) to ``spec``: the one place a problem is bound.
    Raises :class:`ShapeError` / :class:`~fuser_core.errors.SpecError` naming the field."""
    bound = bind_shape(spec, shape)
    dtypes = bind_dtypes(spec, dtype)
    return Problem(spec, bound, dtypes, output_dtypes(spec, dtypes), canonical_names(spec))
