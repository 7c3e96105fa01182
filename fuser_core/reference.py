"""The float64 NumPy reference evaluator: the ground truth for every correctness check.

A spec is run step by step, literally as written (no fusion, no rewriting), in float64
(index inputs, ``argmax``/``argmin`` results and topk indices in int64).

**Aligned layout.** Every array the evaluator holds has rank ``len(spec.dims)``, its axes
in ``spec.dims`` order, and size 1 on the dims it lacks, so "broadcast by name" is plain
NumPy broadcasting. Inputs arrive in their own dims order and are aligned on the way in;
:meth:`Evaluator.outputs` squeezes each output back to its step's own dims, in
``step.dims`` order (the interface's output dim order rule).

**Semantics** (docs/SPEC.md):

- ``sum``/``max``/``min`` reduce over ``over``; ``argmax``/``argmin`` give the first position
  of the extreme value (NaN counts as the extreme, as in NumPy); ``topk`` gives the k
  largest values, sorted descending, and their positions along ``over``, ties going to the
  lower position first; NaN sorts as the smallest value. The result lies on the ``as`` dim.
- IEEE float math, never an exception: division by zero, ``log`` of negatives and the like
  give inf/nan silently. ``maximum``/``minimum``/``max``/``min`` propagate NaN.
- ``round`` is round-half-to-even; ``rsqrt(x) = 1 / sqrt(x)``;
  ``sigmoid(x) = 1 / (1 + exp(-x))``; ``clamp(x, lo, hi) = minimum(maximum(x, lo), hi)``.
- ``cast(x, dtype)`` rounds to ``dtype`` (round to nearest even) and back to float64; see
  :func:`cast_to`, which also records what happens out of range.

Example:
    >>> from fuser_core.spec import load_spec
    >>> spec = load_spec('''{"foldwise": 1, "name": "sm", "inputs": {"x": {"dims": ["m", "n"]}},
    ...   "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
    ...             {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"},
    ...             {"name": "y", "expr": "exp(x - mx) / den"}], "outputs": ["y"]}''')
    >>> out = evaluate(spec, {"m": 2, "n": 3}, {"x": np.zeros((2, 3))})
    >>> out["y"].round(4).tolist()
    [[0.3333, 0.3333, 0.3333], [0.3333, 0.3333, 0.3333]]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np
import scipy.special

from fuser_core import expr as ex
from fuser_core.merged import consistent
from fuser_core.index_values import first_out_of_range, index_ranges, out_of_range_message
from fuser_core.problem import MAX_ELEMENTS, MAX_WORK, ShapeError, bind_scalars, bind_shape, check_sizes  # noqa: F401  (re-exported)
from fuser_core.reduce_ops import is_selection, returns_indices
from fuser_core.spec import Spec, Step

FLOAT_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
}
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def param_values(spec: Spec, shape: Mapping[str, int], scalars: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Every constant param's value for these sizes (params use numbers, size(dim) and functions);
    given ``scalars``, the runtime params' too, from it or their defaults (:func:`bind_scalars`)."""
    ev = Evaluator(spec, shape)
    out = {p.name: float(ev.eval_expr(p.expr, {})) for p in spec.params if not p.runtime}
    return out if scalars is None else {**out, **bind_scalars(spec, shape, scalars)}


# ---------------------------------------------------------------- casts and functions


def cast_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 ``x`` to ``dtype`` (nearest, ties to even) and back to float64.

    float16/float32 overflow to +-inf, and bfloat16 too, as on the GPU.
    float8_e4m3fn has no inf: ml_dtypes (0.6) rounds to nearest and turns every value whose
    rounding passes 448 (|x| >= 464, the midpoint to the next binade step) and +-inf into
    NaN; it does not saturate. Triton's fp32 -> fp8e4nv (``cvt.rn.satfinite``) and torch's
    ``.to(torch.float8_e4m3fn)`` saturate instead (finite and infinite values beyond the
    range become +-448, NaN stays NaN). The reference follows the hardware: it clips to
    +-448 before rounding, so out-of-range values saturate and only NaN gives NaN.
    (ml_dtypes converts float64 by way of float32, so a value within 2**-24 relative of a
    rounding midpoint may round as its float32 neighbour would; kernels round from float32.)
    """
    if dtype == "float8_e4m3fn":
        x = np.clip(x, -FP8_MAX, FP8_MAX)
    return np.asarray(x, np.float64).astype(FLOAT_DTYPES[dtype]).astype(np.float64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _rsqrt(x: np.ndarray) -> np.ndarray:
    return 1.0 / np.sqrt(x)


def _clamp(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return np.minimum(np.maximum(x, lo), hi)


FUNCTIONS: dict[str, Callable[..., np.ndarray]] = {
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "log1p": np.log1p,
    "sqrt": np.sqrt, "rsqrt": _rsqrt, "abs": np.abs, "tanh": np.tanh, "sigmoid": _sigmoid,
    "erf": scipy.special.erf, "sin": np.sin, "cos": np.cos, "round": np.rint,
    "maximum": np.maximum, "minimum": np.minimum, "where": np.where, "clamp": _clamp,
}
BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide, "**": np.power,
}
COMPARE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
    "==": np.equal, "!=": np.not_equal,
}
LOGIC: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {"and": np.logical_and, "or": np.logical_or}
assert set(FUNCTIONS) == set(ex.FUNCTIONS)
# functions whose float32 result is exact (no rounding of their own)
EXACT_FUNCTIONS = frozenset({"abs", "round", "maximum", "minimum", "where", "clamp"})


# ---------------------------------------------------------------- the evaluator


class Evaluator:
    """Runs one spec at one bound shape. Arrays are in the aligned layout (module doc)."""

    def __init__(self, spec: Spec, shape: Mapping[str, int], *, tie_choice: int | None = None,
                 rounding: tuple[np.random.Generator, float] | None = None, cast_nudge: float = 1.0):
        self.spec = spec
        self.shape = bind_shape(spec, shape, allow_empty=True)
        self.axis = {d: i for i, d in enumerate(spec.dims)}
        # None: argmax/argmin give the first exact extreme. k: the k-th position (the last when fewer)
        # among those within float32 resolution of it, which a float32 kernel may find instead
        self.tie_choice = tie_choice
        # None: exact float64. (rng, u): every rounding operation's result (arithmetic, functions,
        # casts, non-integer constants, sums) is multiplied by 1 + uniform(-u, u): one of the
        # evaluations a float32 program may compute (see :meth:`rounded`)
        self.rounding = rounding
        # every cast's operand multiplied by this before it rounds: the certificate's probe for an
        # operand on a rounding midpoint (certificate._reference_movement)
        self.cast_nudge = cast_nudge

    def rounded(self, value: np.ndarray) -> np.ndarray:
        """``value`` moved by a random relative error within the evaluator's ``rounding`` (as is
        without one). Exact operations (comparisons, where, min/max, abs, round, negation,
        casts, indices, sizes) are never moved, nor integer values below 2**24 (index arithmetic,
        counts): a float32 program computes those exactly too."""
        if self.rounding is None:
            return value
        rng, u = self.rounding
        value = np.asarray(value, np.float64)
        with np.errstate(all="ignore"):
            exact = (value == np.round(value)) & (np.abs(value) < 2.0**24)
            return np.where(exact, value, value * (1.0 + rng.uniform(-u, u, value.shape)))

    # -- layout
    def aligned_shape(self, dims: tuple[str, ...] | list[str]) -> tuple[int, ...]:
        """The aligned shape of an array over ``dims``: bound size on them, 1 elsewhere."""
        return tuple(self.shape[d] if d in dims else 1 for d in self.spec.dims)

    def aligned(self, array: np.ndarray, dims: tuple[str, ...] | list[str]) -> np.ndarray:
        """``array`` over ``dims`` (its own axis order) in the aligned layout."""
        array = np.asarray(array)
        dims = tuple(dims)
        if array.ndim != len(dims) or len(set(dims)) != len(dims) or not set(dims) <= set(self.spec.dims):
            raise ValueError(f"dims {dims} do not describe an array of rank {array.ndim} over {self.spec.dims}")
        for d, n in zip(dims, array.shape):
            if n != self.shape[d]:
                raise ShapeError(f"has size {self.shape[d]}, but the array has {n} along it", loc=("shape", d))
        order = sorted(range(len(dims)), key=lambda i: self.axis[dims[i]])
        return array.transpose(order).reshape(self.aligned_shape(dims))

    def unaligned(self, array: np.ndarray, dims: tuple[str, ...] | list[str]) -> np.ndarray:
        """The inverse of :meth:`aligned`: drop the other (size-1) axes, order axes as ``dims``."""
        own = [d for d in self.spec.dims if d in dims]
        squeezed = np.asarray(array).reshape([self.shape[d] for d in own])
        return squeezed.transpose([own.index(d) for d in dims])

    # -- expressions
    def eval_expr(self, e: ex.Expr, env: Mapping[str, np.ndarray]) -> np.ndarray:
        """Evaluate ``e`` in float64 against ``env`` (names and ``"g.values"``-style topk parts
        -> aligned arrays). The result broadcasts to the aligned shape of the expression's dims
        (it may keep size 1 where the expression does not vary)."""
        with np.errstate(all="ignore"):
            return np.asarray(self._eval(e, env))

    def size_value(self, dim: str) -> np.float64:
        """``size(dim)``."""
        return np.float64(self.shape[dim])

    def index_array(self, dim: str) -> np.ndarray:
        """``index(dim)``, aligned."""
        return np.arange(self.shape[dim], dtype=np.float64).reshape(self.aligned_shape((dim,)))

    def _eval(self, e: ex.Expr, env: Mapping[str, np.ndarray]) -> np.ndarray:
        if isinstance(e, ex.Num):
            return self.rounded(np.float64(e.value))
        if isinstance(e, ex.Ref):
            key = e.name if e.part is None else f"{e.name}.{e.part}"
            return np.asarray(env[key], np.float64)
        if isinstance(e, ex.Size):
            return self.size_value(e.dim)
        if isinstance(e, ex.Index):
            return self.index_array(e.dim)
        if isinstance(e, ex.Neg):
            return np.negative(self._eval(e.operand, env))
        if isinstance(e, ex.BinOp):
            return self.rounded(BINARY[e.op](self._eval(e.left, env), self._eval(e.right, env)))
        if isinstance(e, ex.Compare):
            return COMPARE[e.op](self._eval(e.left, env), self._eval(e.right, env))
        if isinstance(e, ex.Logic):
            args = [self._eval(a, env) for a in e.args]
            return np.logical_not(args[0]) if e.op == "not" else LOGIC[e.op](*args)
        if isinstance(e, ex.Call):
            value = FUNCTIONS[e.func](*(self._eval(a, env) for a in e.args))
            return value if e.func in EXACT_FUNCTIONS else self.rounded(value)
        if isinstance(e, ex.Cast):
            return cast_to(self._eval(e.operand, env) * self.cast_nudge, e.dtype)  # rounds as the kernel does
        raise TypeError(f"cannot evaluate {e!r}")

    # -- steps
    def reduce(self, step: Step, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One reduction step's part(s), aligned."""
        edims = self.spec.expr_dims(step.expr)
        with np.errstate(all="ignore"):
            value = np.broadcast_to(self.eval_expr(step.expr, env), self.aligned_shape(edims))
            value = self.without_masked(step, value, env)
            ax = self.axis[step.over]
            if step.reduce == "sum":
                return {step.name: self.summed(value, ax)}
            if step.reduce == "max":  # over an empty axis: the identity, -inf (torch.logsumexp of nothing is -inf)
                return {step.name: np.max(value, axis=ax, keepdims=True, initial=-np.inf)}
            if step.reduce == "min":
                return {step.name: np.min(value, axis=ax, keepdims=True, initial=np.inf)}
            if returns_indices(step.reduce):
                pick = np.argmax if step.reduce == "argmax" else np.argmin
                first = pick(value, axis=ax, keepdims=True)
                if self.tie_choice is not None:
                    first = _near_tie(value, first, ax, self.tie_choice)
                return {step.name: first.astype(np.int64)}
            assert step.reduce == "topk"
            return self.topk(step, value)

    def without_masked(self, step: Step, value: np.ndarray, env: Mapping[str, np.ndarray]) -> np.ndarray:
        """``value`` with the identity at the elements a where() on indices masks out (:mod:`fuser_core.masks`:
        not part of the reduction, as in the kernels that skip them; ``0 * NaN`` there is 0)."""
        from fuser_core.masks import step_exclusions, truth
        from fuser_core.realisation import identity

        cond = step_exclusions(self.spec).get(step.name)
        if cond is None:
            return value
        values = {s: self._condition_value(s, env) for s in cond.free_symbols}  # index inputs: their aligned values
        return np.where(truth(cond, values), value, float(identity(step.reduce)))

    def _condition_value(self, sym: Any, env: Mapping[str, Any]) -> np.ndarray:
        """A condition's symbol's values: a dim's index or size, or an input's (aligned)."""
        from fuser_core.dim_symbols import symbol_kind

        kind = symbol_kind(sym)
        if kind is not None and kind[0] == "index":
            return self.index_array(kind[1])
        if kind is not None and kind[0] == "size":
            return self.size_value(kind[1])
        return np.asarray(env[sym.name], np.float64)

    def summed(self, value: np.ndarray, ax: int) -> np.ndarray:
        """A sum along axis ``ax`` (kept, of length 1): exact, then :meth:`rounded` once."""
        return self.rounded(np.sum(value, axis=ax, keepdims=True))

    def topk(self, step: Step, value: np.ndarray) -> dict[str, np.ndarray]:
        """The k largest along ``over`` (stable: lower position first on ties), laid on ``as``."""
        ax, as_ax = self.axis[step.over], self.axis[step.as_dim]
        order = np.argsort(-value, axis=ax, kind="stable")
        indices = np.take(order, np.arange(step.k), axis=ax)
        values = np.take_along_axis(value, indices, axis=ax)
        # the over axis holds k now and the as axis 1: swap them
        return {
            f"{step.name}.values": np.swapaxes(values, ax, as_ax).astype(np.float64),
            f"{step.name}.indices": np.swapaxes(indices, ax, as_ax).astype(np.int64),
        }

    def selected(self, inputs: Mapping[str, np.ndarray], part: str, indices: np.ndarray) -> np.ndarray:
        """The float64 values that ``part``'s argmax/argmin/topk step ranks, taken at ``indices``
        (an index output over the step's dims, as a kernel returns it; out-of-range positions
        give NaN). Judges a selection by what it selects (fuser_core.runner)."""
        step = self.spec.step(part.split(".")[0])
        assert is_selection(step.reduce), step
        env = self.run(inputs)
        ax = self.axis[step.over]
        value = np.asarray(self.eval_expr(step.expr, env), np.float64)
        value = np.broadcast_to(value, self.aligned_shape(self.spec.expr_dims(step.expr)))
        idx = self.aligned(np.asarray(indices, np.int64), step.dims)
        if step.reduce == "topk":  # the k slots lie on the `as` axis: move them to `over`
            idx = np.swapaxes(idx, ax, self.axis[step.as_dim])
        size = value.shape[ax]
        outside = (idx < 0) | (idx >= size)
        full = list(np.broadcast_shapes(value.shape[:ax] + (1,) + value.shape[ax + 1:],
                                        idx.shape[:ax] + (1,) + idx.shape[ax + 1:]))
        value = np.broadcast_to(value, tuple(full[:ax] + [size] + full[ax + 1:]))
        idx = np.broadcast_to(np.where(outside, 0, idx), tuple(full[:ax] + [idx.shape[ax]] + full[ax + 1:]))
        picked = np.where(np.broadcast_to(outside, idx.shape), np.nan, np.take_along_axis(value, idx, ax))
        if step.reduce == "topk":
            picked = np.swapaxes(picked, ax, self.axis[step.as_dim])
        return np.ascontiguousarray(self.unaligned(picked, step.dims))

    def load_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Check and align the inputs (float64, index inputs int64)."""
        checked = check_inputs(self.spec, self.shape, inputs)
        env: dict[str, np.ndarray] = {}
        for inp in self.spec.inputs:
            array = checked[inp.name].astype(np.int64 if inp.is_index else np.float64)
            env[inp.name] = self.aligned(array, inp.dims)
        return env

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every input, param and step part, aligned (params as size-1 arrays)."""
        env = self.load_inputs(inputs)
        ones = (1,) * len(self.spec.dims)
        scalars = bind_scalars(self.spec, self.shape, inputs)  # runtime params ride with the inputs
        for p in self.spec.params:
            value = scalars[p.name] if p.runtime else self.eval_expr(p.expr, env)
            env[p.name] = np.broadcast_to(value, ones).astype(np.float64)
        for step in self.spec.steps:
            if step.is_reduction:
                env.update(self.reduce(step, env))
            else:
                value = self.eval_expr(step.expr, env)
                env[step.name] = np.broadcast_to(value, self.aligned_shape(step.dims)).astype(np.float64)
        return env

    def outputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The spec's output parts, each over its step's own dims in ``step.dims`` order."""
        env = self.run(inputs)
        out = {}
        for part in self.spec.output_parts:
            step = self.spec.step(part.split(".")[0])
            out[part] = np.asarray(self.unaligned(env[part], step.dims), order="C")  # 0-d kept (ascontiguousarray makes it 1-d)
        return out


FLOAT32_TIE = 2.0**-22  # two float32 ulps: values closer than this to the extreme may come out on top in float32


def _near_tie(value: np.ndarray, first: np.ndarray, ax: int, choice: int) -> np.ndarray:
    """The ``choice``-th position (0 = first; the last when fewer) whose value is within
    FLOAT32_TIE (relative) of the extreme at ``first``."""
    extreme = np.take_along_axis(value, first, ax)
    with np.errstate(all="ignore"):
        near = np.abs(value - extreme) <= FLOAT32_TIE * np.abs(extreme)
    near |= np.isnan(value) & np.isnan(extreme)
    rank = np.cumsum(near, axis=ax) - 1  # 0 at the first near position
    wanted = np.minimum(choice, np.sum(near, axis=ax, keepdims=True) - 1)
    hit = near & (rank == wanted)
    return np.where(np.any(hit, axis=ax, keepdims=True), np.argmax(hit, axis=ax, keepdims=True), first)


def check_inputs(spec: Spec, shape: Mapping[str, int], inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every input present, with its bound shape (in its own dims order); index inputs integer.

    Raises :class:`ShapeError` naming the input. Returns the inputs as NumPy arrays.
    """
    names = {i.name for i in spec.inputs} | {p.name for p in spec.runtime_params}  # scalars: bind_scalars
    unknown = [n for n in inputs if n not in names]
    if unknown:
        raise ShapeError("is not an input of the spec", loc=("inputs", str(unknown[0])))
    out: dict[str, np.ndarray] = {}
    for inp in spec.inputs:
        if inp.name not in inputs:
            raise ShapeError("this input is missing", loc=("inputs", inp.name))
        array = np.asarray(inputs[inp.name])
        want = tuple(shape[d] for d in inp.dims)
        if array.shape != want:
            raise ShapeError(f"expected shape {want} over ({', '.join(inp.dims)}), got {array.shape}",
                             loc=("inputs", inp.name))
        if inp.is_index and not np.issubdtype(array.dtype, np.integer):
            raise ShapeError(f"an index input needs integers, got {array.dtype}", loc=("inputs", inp.name))
        out[inp.name] = array
    for rule in index_ranges(spec):  # a label outside its axis is refused, never turned into a number
        if (bad := first_out_of_range(rule, out[rule.name], shape[rule.dim])) is not None:
            raise ShapeError(out_of_range_message(rule, shape[rule.dim], *bad), loc=("inputs", rule.name))
    return out


def evaluate(spec: Spec, shape: Mapping[str, int], inputs: Mapping[str, np.ndarray], *,
             tie_choice: int | None = None,
             rounding: tuple[np.random.Generator, float] | None = None) -> dict[str, np.ndarray]:
    """The spec's outputs (see :meth:`Evaluator.outputs`)."""
    return Evaluator(spec, shape, tie_choice=tie_choice, rounding=rounding).outputs(inputs)


# ---------------------------------------------------------------- random inputs


def random_scalars(spec: Spec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random value for every runtime param (0-d float64 arrays, to ride along with the inputs):
    in [1/4, 4] when declared positive, else standard normal, rounded to float32 as the kernel
    argument is."""
    out = {}
    for p in spec.runtime_params:
        value = rng.uniform(0.25, 4.0) if p.positive else rng.standard_normal()
        out[p.name] = np.asarray(np.float32(value), np.float64)
    return out


def index_input_bound(spec: Spec, name: str, shape: Mapping[str, int]) -> int:
    """Exclusive upper bound for index input ``name``: the size of the dim it is compared
    with through ``index(dim)`` (the smallest such, if several), else 4."""
    sizes = []
    for step in spec.steps:
        for node in ex.walk(step.expr):
            if not isinstance(node, ex.Compare):
                continue
            for a, b in ((node.left, node.right), (node.right, node.left)):
                if any(isinstance(n, ex.Ref) and n.name == name for n in ex.walk(a)):
                    sizes += [shape[n.dim] for n in ex.walk(b) if isinstance(n, ex.Index)]
    return min(sizes, default=4)


def random_inputs(
    spec: Spec,
    shape: Mapping[str, int],
    rng: np.random.Generator,
    dtype: str | Mapping[str, str] = "float32",
) -> dict[str, np.ndarray]:
    """Random inputs in each input's own dims order.

    Float inputs: standard normal rounded to ``dtype`` (one name for all, or a map per input;
    inputs missing from the map are float32), returned as float64 arrays whose values are
    exactly representable in that dtype (float8 values are clipped to +-448 first, which a
    standard normal never reaches in practice). Index inputs: int64 in [0, size(dim)) for the
    dim the input is compared with via ``index(dim)``, else [0, 4).
    """
    bound = bind_shape(spec, shape, allow_empty=True)
    out: dict[str, np.ndarray] = {}
    for inp in spec.inputs:
        dims = tuple(bound[d] for d in inp.dims)
        if inp.is_index:
            out[inp.name] = rng.integers(0, max(index_input_bound(spec, inp.name, bound), 1), size=dims, dtype=np.int64)  # (v = 0: 0)
            continue
        dt = dtype if isinstance(dtype, str) else dtype.get(inp.name, "float32")
        if dt not in FLOAT_DTYPES:
            raise ValueError(f"unknown dtype {dt!r} for input {inp.name!r}; one of {', '.join(FLOAT_DTYPES)}")
        out[inp.name] = consistent(spec, inp.name, cast_to(rng.standard_normal(dims), dt), bound)
    return out
