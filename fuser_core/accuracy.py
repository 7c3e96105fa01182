"""The accuracy bar: every strategy on the inputs real models produce, against what the dtype can do.

The float64 check (:func:`fuser_core.runner.judge`) draws standard-normal inputs and holds every
output to a fixed tolerance. Issue 23 adds a second bar, relative to the dtype: on each input
*family* below, a strategy's error (:func:`fuser_core.runner.rel_err` against the float64
reference, the kernel check's measure) may be at most ``BAR`` (2) times

- the error of the **spec's formula evaluated step by step in the run's dtype**
  (:class:`FormulaEvaluator`: the float64 reference's evaluator with every rounding operation's
  result rounded to that dtype; a sum as additions in that dtype, pairwise or in a loop's order), the
  largest over round-to-nearest and ``FORMULA_SAMPLES`` evaluations with random roundings (|d| <= u): one input set's
  error is one draw of the formula's rounding errors, and a strategy whose arithmetic is the
  formula's lands up to 3x either side of a single draw (:func:`formula_outputs`), and
- where torch has the op (``TORCH_OPS``: the catalog's safe_softmax, logsumexp, layernorm,
  rmsnorm and cross_entropy, matched by spec hash), the error of **torch's own op** on the same
  inputs in the same dtype,

each floored at ``FLOOR_ULPS`` units in the last place of the output's dtype (below that both are
exact, and a ratio of two roundings means nothing). The float64 check stays as it was; this is an
additional verdict, reported per family (``foldwise run``'s ``accuracy`` section, the tuner's
correctness gate, the fuzzers).

**Families** (``FAMILIES``; each has one job, named in ``Family.job``). Value families transform
every float input (along the loop axis where the input has it, else its last axis):
``normal`` (as drawn), ``offset100`` and ``offset1000`` (x + 100, x + 1000: cancellation in
``x - max`` and ``x - mean``), ``scale30`` (x * 30: a wide dynamic range in ``exp``), ``peaked``
(one value per row 20 above the rest: softmax ~ one-hot) and ``near_ties`` (a few levels, 1e-6
apart within each: max/argmax ties, variances of near-equal values). Special families check the
special-value pattern (:func:`fuser_core.edge_rows.special_mismatches`: NaN, +inf and -inf where
the reference has them) as well as the bar: ``masked`` (row 0 of the first float input over the
loop axis fully -inf, row 1 half -inf: attention masks), ``nan`` (one NaN in row 0, row 1 all NaN:
NaN propagates as torch propagates it), ``axis1`` (the loop axis of length 1) and ``empty`` (a
zero-size dim: first a lane dim, then the loop axis; the outputs must be the reference's (an empty
tensor, or a reduction's identity through the formula), or the run refuses with the same
``ShapeError`` the reference raises (an argmax over nothing), never another exception).

Index outputs (argmax/argmin/topk indices) are left to the float64 check, which judges a selection
by what it selects; the bar covers float outputs. A fused strategy of a cascade whose derivation is
inexact (a cast inside a fused reduction: fp8_quant_gemm) rounds its casts with running values, so
it does not compute the formula as written: the bar does not apply (each family says so), and the
float64 check judges it normwise.

Example:
    >>> import numpy as np
    >>> apply_family("offset100", np.zeros((2, 3)), np.random.default_rng(0)).tolist()
    [[100.0, 100.0, 100.0], [100.0, 100.0, 100.0]]
    >>> formula_dtype({"x": "bfloat16", "w": "bfloat16"}), formula_dtype({"x": "float16", "w": "float32"})
    ('bfloat16', 'float32')
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import math

import numpy as np

from fuser_core.merged import consistent
from fuser_core.problem import bind_shape
from fuser_core.reference import FLOAT_DTYPES, Evaluator, cast_to
from fuser_core.spec import Spec

BAR = 2.0  # a strategy may err at most this many times the formula's (and torch's) error
FLOOR_ULPS = 4  # units in the last place of the output dtype below which errors count as equal
# unit roundoff (half an ulp at 1): the relative rounding error of one operation
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8, "float8_e4m3fn": 2.0**-4}
# the accuracy check's shape: small enough for the interpreter, several tiles and a tail on the loop axis
AXIS_LIMIT = 300  # the loop axis (300: no power-of-two tile divides it)
LANE_LIMIT = 4  # every other independent dim
INNER_LIMIT = 16  # other reduced axes (attention's d): tl.dot's minimum
FREE_LIMIT = 20  # free dims of a contraction: a tile of 16 and a tail


@dataclass(frozen=True)
class Family:
    """One input family: ``transform`` moves a standard-normal float input (rows along its last
    axis) to the family; ``special`` families are also judged on the special-value pattern;
    ``shape`` (for ``axis1``/``empty``) changes the problem's shape instead."""

    name: str
    job: str
    special: bool = False
    transform: Callable[[np.ndarray, np.random.Generator], np.ndarray] | None = None
    target_only: bool = False  # the transform touches only the first float input over the loop axis
    # an affine family, as data (the GPU measurer applies it to device tensors, tuner.device.inputs):
    # x * scale + shift, plus ``peak`` at one random position of each row
    scale: float = 1.0
    shift: float = 0.0
    peak: float = 0.0

    @property
    def affine(self) -> bool:
        return self.transform is _affine


def _affine(x: np.ndarray, rng: np.random.Generator, fam: Family) -> np.ndarray:
    out = x * fam.scale + fam.shift
    rows = out.reshape(-1, out.shape[-1])
    if fam.peak and rows.size:
        rows[np.arange(rows.shape[0]), rng.integers(0, rows.shape[1], rows.shape[0])] += fam.peak
    return out


def _near_ties(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.round(x * 2.0) / 2.0 + rng.normal(0.0, 1e-6, x.shape)


def _masked(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out = x.copy()
    rows = out.reshape(-1, out.shape[-1])
    if rows.shape[0] > 0:
        rows[0, :] = -np.inf
    if rows.shape[0] > 1:
        rows[1, rows.shape[1] // 2:] = -np.inf
    return out


def _nan(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out = x.copy()
    rows = out.reshape(-1, out.shape[-1])
    if rows.shape[0] > 0 and rows.shape[1] > 0:
        rows[0, rows.shape[1] // 3] = np.nan
    if rows.shape[0] > 1:
        rows[1, :] = np.nan
    return out


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("normal", "standard normal: the float64 check's inputs", transform=_affine),
    Family("offset100", "x + 100: cancellation in x - max and x - mean", transform=_affine, shift=100.0),
    Family("offset1000", "x + 1000: the same, three more bits lost", transform=_affine, shift=1000.0),
    Family("scale30", "x * 30: a wide dynamic range through exp", transform=_affine, scale=30.0),
    Family("peaked", "one value per row 20 above the rest: softmax ~ one-hot", transform=_affine, peak=20.0),
    Family("near_ties", "a few levels 1e-6 apart: ties in max/argmax, variances of near-equal values",
           transform=_near_ties),
    Family("masked", "row 0 fully -inf, row 1 half -inf: the special values must be the reference's",
           special=True, transform=_masked, target_only=True),
    Family("nan", "one NaN in row 0, row 1 all NaN: NaN propagates as torch propagates it",
           special=True, transform=_nan, target_only=True),
    Family("axis1", "the loop axis of length 1", special=True),
    Family("empty", "a zero-size dim (a lane, then the loop axis): an empty output or a clear error, never a crash",
           special=True),
)}
VALUE_FAMILIES = tuple(n for n, f in FAMILIES.items() if not f.special)
SPECIAL_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.special)
# what `foldwise run` checks unless told otherwise (--families), and what the tuner's gate checks
RUN_FAMILIES = ("normal", "offset100", "offset1000", "scale30", "peaked", "near_ties", "masked", "nan", "axis1", "empty")
GATE_FAMILIES = ("offset100", "offset1000", "peaked")


def parse_families(text: str | None, default: Sequence[str] = RUN_FAMILIES) -> tuple[str, ...]:
    """``"offset100,peaked"`` (or ``all``, ``values``, ``specials``, ``none``) -> family names; ValueError naming
    an unknown one."""
    if text is None:
        return tuple(default)
    names: list[str] = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        if word == "all":
            names += list(FAMILIES)
        elif word == "values":
            names += list(VALUE_FAMILIES)
        elif word == "specials":
            names += list(SPECIAL_FAMILIES)
        elif word == "none":
            continue
        elif word in FAMILIES:
            names.append(word)
        else:
            raise ValueError(f"unknown input family {word!r}; one of {', '.join(FAMILIES)}, all, values, specials, none")
    return tuple(dict.fromkeys(names))


def apply_family(name: str, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The family's transform of one standard-normal float array, rows along its last axis."""
    fam = FAMILIES[name]
    if fam.transform is None:
        return x
    if fam.affine:
        return _affine(np.asarray(x, np.float64), rng, fam)
    return fam.transform(np.asarray(x, np.float64), rng)


def formula_dtype(dtypes: Mapping[str, str]) -> str:
    """The dtype the spec's formula is evaluated in: the float inputs' common dtype as torch
    promotes it (float16 with bfloat16, or anything with float32, is float32); float8 inputs
    count as float32 (nobody computes in float8: it is a storage format); no float input: float32."""
    floats = {("float32" if d == "float8_e4m3fn" else d) for d in dtypes.values() if d in FLOAT_DTYPES}
    return floats.pop() if len(floats) == 1 else "float32"


def ulp_floor(store: str) -> float:
    """``FLOOR_ULPS`` units of ``store``'s last place, as a relative error."""
    return FLOOR_ULPS * UNIT_ROUNDOFF.get(store, UNIT_ROUNDOFF["float32"])


class FormulaEvaluator(Evaluator):
    """The spec as written, step by step in ``dtype``: the float64 reference's evaluator with
    every rounding operation's result (arithmetic, math functions, non-integer constants, params,
    sums) rounded to ``dtype``. A sum is a sequence of additions in ``dtype`` too, pairwise (as NumPy's
    and torch's sums and a kernel's tile reductions add): its exact value rounded once would hold a
    kernel to a float32 sum more accurate than any float32 sum (fuzz: a 13-term sum of squares at
    2.3x that). With ``rng``, each result is instead moved by
    a random relative error within the dtype's unit roundoff (the standard model of a rounding,
    exact * (1 + d) with |d| <= u; overflow still overflows; d a function of the value, so equal
    subexpressions round alike): another of the evaluations float arithmetic of the formula may give."""

    def __init__(self, spec: Spec, shape: Mapping[str, int], dtype: str = "float32",
                 rng: np.random.Generator | None = None):
        super().__init__(spec, shape)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(FLOAT_DTYPES)}")
        self.dtype = dtype
        self.rng = rng

    def _noise(self, value: np.ndarray) -> np.ndarray:
        """A pseudo-random number in [-1, 1) that is a function of the value (and of this
        evaluation's salt): float arithmetic is deterministic, so a subexpression evaluated twice
        (``x / t`` in ``max(x / t)`` and again in ``x / t - mx``) must round the same way twice."""
        if not hasattr(self, "_salt"):
            self._salt = np.uint64(int(self.rng.integers(1, 2**62)))
        bits = np.ascontiguousarray(value, np.float64).view(np.uint64)
        with np.errstate(over="ignore"):
            h = (bits ^ self._salt) * np.uint64(0x9E3779B97F4A7C15)
            h ^= h >> np.uint64(31)
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(29)
        return (h >> np.uint64(11)).astype(np.float64) / 2.0**52 - 1.0

    sequential = False  # sums in a loop's order (see summed), not pairwise

    def summed(self, value: np.ndarray, ax: int) -> np.ndarray:
        """Pairwise: halves added and rounded, log2(n) times (zeros pad to a power of two, or to one
        element for an empty axis: exact). With ``sequential``, in the order a loop over the axis adds
        (the unfused chain's tiles): a running sum of tiles, each of a power of two near sqrt(n) elements
        summed pairwise, at most ``SEQUENTIAL_STEPS`` tiles. Both are the formula in the
        dtype; a later step that multiplies a sum's rounding (``sin(q * s)`` at large q, ``size * s``)
        errs by as much as that order's rounding, and a kernel may add in either order."""
        value = np.moveaxis(np.asarray(value, np.float64), ax, -1)
        n = value.shape[-1]
        if self.sequential:  # tiles of a power of two near sqrt(n), at most SEQUENTIAL_STEPS of them
            chunk = 1 << max(math.isqrt(max(n - 1, 0)), -(-n // SEQUENTIAL_STEPS) - 1, 0).bit_length()
            width = -(-max(n, 1) // chunk) * chunk
        else:  # one chunk: the axis padded to a power of two
            width = chunk = 1 << max(n - 1, 0).bit_length()
        if width > n:
            value = np.concatenate([value, np.zeros((*value.shape[:-1], width - n))], axis=-1)
        with np.errstate(all="ignore"):
            value = value.reshape(*value.shape[:-1], width // chunk, chunk)
            while value.shape[-1] > 1:  # pairwise within a chunk (all of the axis unless sequential)
                half = value.shape[-1] // 2
                value = self.rounded(value[..., :half] + value[..., half:])
            running = value[..., 0, 0]
            for k in range(1, value.shape[-2]):  # chunks in order, rounded after each
                running = self.rounded(running + value[..., k, 0])
        return np.moveaxis(np.reshape(running, (*value.shape[:-2], 1)), -1, ax)  # rounded() may add a dim to a 0-d

    def rounded(self, value: np.ndarray) -> np.ndarray:
        value = np.asarray(value, np.float64)
        with np.errstate(all="ignore"):
            if self.rng is not None:  # the standard model of a rounding: exact * (1 + d), |d| <= u
                exact = (value == np.round(value)) & (np.abs(value) < 2.0**24)
                u = UNIT_ROUNDOFF[self.dtype]
                overflow = np.isinf(cast_to(value, self.dtype)) & np.isfinite(value)
                moved = np.where(exact, value, value * (1.0 + u * self._noise(value)))
                return np.where(overflow, cast_to(value, self.dtype), moved)
            return cast_to(value, self.dtype)


FORMULA_SAMPLES = 15  # stochastically rounded evaluations of the formula besides round-to-nearest
SEQUENTIAL_STEPS = 1024  # a sequential sum adds at most this many chunks in turn (a python loop each)


def formula_outputs(spec: Spec, shape: Mapping[str, int], inputs: Mapping[str, np.ndarray], dtype: str,
                    seed: int = 0, make: Callable[[str, np.random.Generator | None], FormulaEvaluator] | None = None,
                    ) -> list[dict[str, np.ndarray]]:
    """The spec's outputs evaluated step by step in ``dtype`` (:class:`FormulaEvaluator`): rounded to
    nearest, then ``FORMULA_SAMPLES`` times with random roundings (|d| <= u). The formula's error is the
    largest of theirs: one input set's error is one draw of the formula's rounding errors (on
    layernorm's peaked rows its own arithmetic, row_resident, measured 0.75x to 3x the
    round-to-nearest formula's over six seeds), and the bar compares a strategy with the spread.
    Half the random evaluations sum in a loop's order (:meth:`FormulaEvaluator.summed`), half pairwise."""
    rng = np.random.default_rng(seed)
    make = make or (lambda d, r: FormulaEvaluator(spec, shape, d, r))  # ``make``: another evaluator (sampled rows)
    with np.errstate(all="ignore"):
        return [_evaluator(make, dtype, rng if i else None, sequential=i % 2 == 0 and i > 0).outputs(inputs)
                for i in range(1 + FORMULA_SAMPLES)]


def _evaluator(make: Callable[[str, np.random.Generator | None], FormulaEvaluator], dtype: str,
               rng: np.random.Generator | None, *, sequential: bool) -> FormulaEvaluator:
    ev = make(dtype, rng)
    ev.sequential = sequential
    return ev


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
                             else torch.from_numpy(a.astype(np.float32)).to(getattr(torch, dtypes[inp.name])))
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


# ---------------------------------------------------------------- inputs and shapes


def accuracy_shape(spec: Spec, shape: Mapping[str, int]) -> dict[str, int]:
    """``shape`` with every dim capped for the interpreter: the loop axis at ``AXIS_LIMIT``, other
    reduced axes at ``INNER_LIMIT``, a contraction's free dims at ``FREE_LIMIT``, the rest at
    ``LANE_LIMIT``; a top-k's ``as`` dim kept at k (the loop axis at least k)."""
    from fuser_core.codegen.plan import capped_shape
    from fuser_core.derive import derive_cascade

    try:
        derivation = derive_cascade(spec)
    except Exception:  # noqa: BLE001 (a spec the derivation refuses: no contraction to keep whole)
        derivation = None
    return capped_shape(spec, derivation, shape, axis=AXIS_LIMIT, inner=INNER_LIMIT, free=FREE_LIMIT,
                        batch=LANE_LIMIT, lane=LANE_LIMIT)


def family_shape(name: str, spec: Spec, shape: Mapping[str, int]) -> list[dict[str, int]]:
    """The shapes the family runs at: ``axis1`` the loop axis at 1; ``empty`` a lane dim at 0 (when
    there is one), then the loop axis at 0; every other family ``shape`` itself."""
    from fuser_core.codegen.plan import loop_axis

    axis, _inner = loop_axis(spec)
    as_dims = {s.as_dim for s in spec.steps if s.as_dim}
    if name == "axis1":
        if any(s.reduce == "topk" and s.k > 1 for s in spec.steps):
            return []  # a top-k of k > 1 needs k values: no axis of length 1
        return [{**shape, axis: 1}]
    if name == "empty":
        lanes = [d for d in spec.dims if d != axis and d not in as_dims and d in _lane_dims(spec)]
        out = [{**shape, lanes[0]: 0}] if lanes else []
        return out + [{**shape, axis: 0}]
    return [dict(shape)]


def _lane_dims(spec: Spec) -> set[str]:
    reduced = {s.over for s in spec.steps if s.is_reduction}
    return set(spec.dims) - reduced


def family_inputs(spec: Spec, shape: Mapping[str, int], name: str, dtypes: Mapping[str, str],
                  seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal inputs (as :func:`fuser_core.reference.random_inputs`) moved to the family,
    each float input rounded to its dtype again (exactly representable, as the kernel reads it)."""
    from fuser_core.codegen.plan import loop_axis
    from fuser_core.reference import random_inputs, random_scalars

    rng = np.random.default_rng(seed)
    inputs = random_inputs(spec, shape, rng, dtypes)
    scalars = random_scalars(spec, np.random.default_rng(seed + 1))  # runtime params (self_check's rule)
    fam = FAMILIES[name]
    if fam.transform is None:
        return {**inputs, **scalars}
    axis, _ = loop_axis(spec)
    target = next((i.name for i in spec.inputs if not i.is_index and axis in i.dims), None)
    out = {}
    for inp in spec.inputs:
        x = inputs[inp.name]
        if inp.is_index or (fam.target_only and inp.name != target):
            out[inp.name] = x
            continue
        if x.ndim == 0:  # a scalar input (dims []): the family's transform of a row of one value
            moved = apply_family(name, np.reshape(x, (1,)), rng).reshape(())
        else:
            pos = inp.dims.index(axis) if axis in inp.dims else x.ndim - 1
            moved = np.moveaxis(apply_family(name, np.moveaxis(x, pos, -1), rng), -1, pos)
        out[inp.name] = consistent(spec, inp.name, cast_to(moved, dtypes[inp.name]), bind_shape(spec, shape, allow_empty=True))
    return {**out, **scalars}


# ---------------------------------------------------------------- the verdict


def _float64(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.astype(np.float64)
    return (t.float() if t.dtype.is_floating_point else t).cpu().numpy().astype(np.float64)


class TermScales:
    """A mixin for an :class:`~fuser_core.reference.Evaluator`: each sum step's terms' magnitudes,
    ``sum |t|`` (in ``scales``, aligned), recorded as the steps run: the scale a sum's rounding errors
    live on whatever the order of its additions."""

    def reduce(self, step: Any, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if step.reduce == "sum":
            edims = self.spec.expr_dims(step.expr)
            with np.errstate(all="ignore"):
                value = np.broadcast_to(self.eval_expr(step.expr, env), self.aligned_shape(edims))
                self.scales = {**getattr(self, "scales", {}),
                               step.name: np.sum(np.abs(value), axis=self.axis[step.over], keepdims=True)}
        return super().reduce(step, env)


class _TermScaled(TermScales, Evaluator):
    pass


def cancellation(spec: Spec, shape: Mapping[str, int], inputs: Mapping[str, np.ndarray],
                 reference: Mapping[str, np.ndarray], evaluator: Any = None) -> dict[str, np.ndarray]:
    """For each output that is a sum step: ``sum |t| / |sum t|`` per element (at least 1), how far its
    terms cancel. No order of additions holds such a sum to better than a few ulps of ``sum |t|``: a
    13-term sum that cancels 22-fold errs 11 units of its result's roundoff in a kernel's tile order and
    2 in the formula's pairwise order, both within 1 unit of its largest partial sum (fuzz seed 61). The
    bar divides both errors by this factor, so the floor is a few ulps of the terms, not of the result.
    Sums whose terms share a sign (every centred square) have factor 1: nothing changes for them."""
    ev = evaluator or _TermScaled(spec, shape)  # ``evaluator``: another TermScales (the GPU measurer's sampled rows)
    with np.errstate(all="ignore"):
        ev.run(inputs)
        out = {}
        for part, ref in reference.items():
            if part in getattr(ev, "scales", {}):
                m = np.ascontiguousarray(ev.unaligned(ev.scales[part], spec.step(part).dims))
                k = m / np.abs(np.asarray(ref, np.float64))
                out[part] = np.where(np.isfinite(k) & (k > 1.0), k, 1.0)
    return out


def _errors_beside_overflow(got: np.ndarray, ref: np.ndarray, formulas: Sequence[np.ndarray], floor: float,
                            ulps: float, cancel: np.ndarray | None = None) -> tuple[float, float]:
    """The kernel's and the formula's errors (:func:`fuser_core.runner.elementwise_err`, the largest
    element), on the elements where the formula in the dtype is not itself infinitely wrong.

    Where the formula's evaluation in the dtype overflows (or gives NaN, or an infinity of the wrong
    sign) against a finite float64 reference, its error there is inf, and a ratio inf/inf (NaN)
    would refuse every kernel, even one that computes exactly what the formula computes: the
    dtype cannot hold the value, and that is the spec's, not the strategy's. So such an element
    is judged apart: the kernel passes there when it gives the value one of the formula's
    evaluations gives (the same infinity, NaN where it is NaN) or is within the bar's floor
    (``BAR`` x ``ulps``) of the reference; an element it fails counts as an infinite error. Every
    other element is judged as always, its ratio against the formula's error on those elements."""
    from fuser_core.runner import elementwise_err

    e_got = elementwise_err(got, ref, floor)
    e_form = np.max([elementwise_err(f, ref, floor) for f in formulas], axis=0)
    if cancel is not None:  # a cancelling sum: errors in units of its terms' magnitude (:func:`cancellation`)
        e_got, e_form = e_got / cancel, e_form / cancel
    over = ~np.isfinite(e_form)
    if over.any():
        g = np.broadcast_to(np.asarray(got, np.float64), e_form.shape)
        same = np.zeros(e_form.shape, bool)
        for f in formulas:
            f = np.broadcast_to(f, e_form.shape)
            same |= (g == f) | (np.isnan(g) & np.isnan(f))
        held = same | (e_got <= BAR * ulps)
        e_got = np.where(over, np.where(held, 0.0, np.inf), e_got)
        e_form = np.where(over, 0.0, e_form)
    return float(np.max(e_got, initial=0.0)), float(np.max(e_form, initial=0.0))


def _special_reference(got: np.ndarray, ref: np.ndarray, store: str, formulas: Sequence[Mapping[str, np.ndarray]],
                       part: str) -> np.ndarray:
    """The special values an output is held to: the float64 reference as the output's dtype holds it (1.3e59 is
    +inf in float32; fuzz seed 73), and where the formula in the dtype gives the kernel's own NaN or infinity (an
    intermediate that overflows there), that: as :func:`_errors_beside_overflow` judges the errors."""
    want = cast_to(np.asarray(ref, np.float64), store)
    g = np.broadcast_to(np.asarray(got, np.float64), want.shape)
    for f in formulas:
        fp = np.broadcast_to(np.asarray(f[part], np.float64), want.shape)
        same = (np.isnan(g) & np.isnan(fp)) | (np.isinf(g) & (g == fp))
        want = np.where(same, g, want)
    return want


def bar_verdict(spec: Spec, outputs: Mapping[str, Any], reference: Mapping[str, np.ndarray],
                formula: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]], stores: Mapping[str, str],
                torch_ref: Mapping[str, np.ndarray] | None = None, *, special: bool = False,
                cancel: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """One family's verdict on ``outputs`` (a strategy's, torch tensors or arrays): per float part,
    ``error`` = :func:`fuser_core.runner.rel_err` against the float64 ``reference``, ``formula_error``
    the same of ``formula`` (:func:`formula_outputs`), ``torch_error`` of ``torch_ref`` (None
    without one); ``ratio`` = error / max(formula error (the largest of ``formula``'s evaluations), floor), ``torch_ratio`` likewise; passed
    when both ratios are at most ``BAR`` and, with ``special``, the special values are the
    reference's. The worst part's numbers are reported at the top level."""
    from fuser_core.edge_rows import special_mismatches
    from fuser_core.runner import FLOOR, rel_err

    formulas = [formula] if isinstance(formula, Mapping) else list(formula)
    parts: dict[str, dict[str, Any]] = {}
    for part, ref in reference.items():
        if part.endswith(".indices") or stores.get(part) == "int32":
            continue
        got = _float64(outputs[part])
        if got.size == np.size(ref):  # a scalar output may come back as () or (1,)
            got = got.reshape(np.shape(ref))
        else:
            parts[part] = {"error": float("inf"), "formula_error": 0.0, "ratio": float("inf"), "torch_error": None,
                           "torch_ratio": None, "spec_torch_ratio": None, "passed": False,
                           "specials": [f"shape {list(got.shape)}, expected {list(np.shape(ref))}"]}
            continue
        floor = FLOOR[stores[part]]
        ulps = ulp_floor(stores[part])
        err, ferr = _errors_beside_overflow(got, ref, [np.asarray(f[part], np.float64) for f in formulas], floor, ulps,
                                            (cancel or {}).get(part))
        ratio = err / max(ferr, ulps)
        terr = rel_err(torch_ref[part], ref, floor) if torch_ref is not None and part in torch_ref else None
        tratio = err / max(terr, ulps) if terr is not None else None
        # the formula as written against torch: past the bar, no strategy of this spec is held to torch's error
        spec_ratio = ferr / max(terr, ulps) if terr is not None else None
        specials = special_mismatches(got, _special_reference(got, ref, stores[part], formulas, part)) if special else []
        torch_holds = tratio is None or tratio <= BAR or spec_ratio > BAR
        ok = ratio <= BAR and torch_holds and not specials
        parts[part] = {"error": err, "formula_error": ferr, "ratio": ratio, "torch_error": terr,
                       "torch_ratio": tratio, "spec_torch_ratio": spec_ratio, "passed": ok, "specials": specials}
    worst = max(parts.values(), key=lambda p: (not p["passed"], max(p["ratio"], p["torch_ratio"] or 0.0)),
                default=None)
    out: dict[str, Any] = {"passed": all(p["passed"] for p in parts.values())}
    for key in ("error", "formula_error", "ratio", "torch_error", "torch_ratio", "spec_torch_ratio", "specials"):
        out[key] = worst[key] if worst else (0.0 if key in ("error", "formula_error", "ratio") else None)
    if out["specials"] is None:
        out["specials"] = []
    worst_spec = max((p["spec_torch_ratio"] for p in parts.values() if p["spec_torch_ratio"] is not None), default=None)
    # the spec's own verdict: its formula as written loses digits that torch's op keeps (every strategy inherits it)
    out["spec_warning"] = (f"the spec's formula as written errs {worst_spec:.3g}x torch's op on these inputs: "
                           f"a rearrangement (torch's) keeps those digits" if worst_spec is not None and worst_spec > BAR
                           else None)
    out["parts"] = parts
    return out


def check_family(spec: Spec, shape: Mapping[str, int], dtypes: Mapping[str, str], name: str, *,
                 strategy: str | None = None, config: Any = None, derivation: Any = None,
                 seed: int = 0) -> dict[str, Any]:
    """Run the strategy on the family's inputs (at each of its shapes) and judge it by the bar:
    ``{"family", "passed", "error", "formula_error", "ratio", "torch_error", "torch_ratio",
    "specials", "shape", "note"}`` (the worst of its shapes)."""
    from fuser_core.problem import ShapeError, output_dtypes
    from fuser_core.reference import evaluate
    from fuser_core.runner import interpreter_quiet, run

    fam = FAMILIES[name]
    shapes = family_shape(name, spec, shape)
    fdtype = formula_dtype(dtypes)
    stores = output_dtypes(spec, dtypes)
    if not shapes:
        return _refused(name, shape, fdtype, "does not apply (a top-k needs k values along its axis)")
    verdicts = []
    for sh in shapes:
        try:
            inputs = family_inputs(spec, sh, name, dtypes, seed)
            with np.errstate(all="ignore"):
                reference = evaluate(spec, sh, inputs)
        except ShapeError as err:  # torch refuses it too (an argmax over nothing): so must the run
            inputs = {i.name: np.zeros([sh[d] for d in i.dims], np.int64 if i.is_index else np.float64)
                      for i in spec.inputs}
            try:
                run(spec, sh, dtypes, inputs, strategy=strategy, config=config, derivation=derivation)
            except ShapeError as run_err:
                verdicts.append(_refused(name, sh, fdtype, f"refused as the reference is: {run_err}"))
                continue
            except Exception as run_err:  # noqa: BLE001 (a crash: the family fails)
                verdicts.append(_crashed(name, sh, fdtype, run_err))
                continue
            verdicts.append({**_refused(name, sh, fdtype, f"ran although the reference refuses: {err}"), "passed": False})
            continue
        try:
            with interpreter_quiet():
                got = run(spec, sh, dtypes, inputs, strategy=strategy, config=config, derivation=derivation).outputs
        except Exception as err:  # noqa: BLE001 (a crash: the family fails, with the exception named)
            verdicts.append(_crashed(name, sh, fdtype, err))
            continue
        formula = formula_outputs(spec, sh, inputs, fdtype, seed)
        torch_ref = torch_outputs(spec, sh, inputs, dtypes) if not fam.special else None
        v = bar_verdict(spec, got, reference, formula, stores, torch_ref, special=fam.special,
                        cancel=cancellation(spec, sh, inputs, reference))
        v.pop("parts")
        verdicts.append({"family": name, **v, "shape": sh, "formula_dtype": fdtype, "note": ""})
    worst = max(verdicts, key=lambda v: (not v["passed"], v["ratio"]))
    notes = [v["note"] for v in verdicts if v["note"]]
    return {**worst, "note": "; ".join(dict.fromkeys(notes))}


def _refused(name: str, shape: Mapping[str, int], fdtype: str, note: str) -> dict[str, Any]:
    return {"family": name, "passed": True, "error": 0.0, "formula_error": 0.0, "ratio": 0.0, "torch_error": None,
            "torch_ratio": None, "spec_torch_ratio": None, "specials": [], "spec_warning": None, "shape": dict(shape),
            "formula_dtype": fdtype, "note": note}


def _crashed(name: str, shape: Mapping[str, int], fdtype: str, err: BaseException) -> dict[str, Any]:
    return {**_refused(name, shape, fdtype, f"crashed: {type(err).__name__}: {str(err)[:300]}"), "passed": False,
            "error": float("inf"), "ratio": float("inf")}


def accuracy_check(spec: Spec, shape: Mapping[str, int], dtype: str | Mapping[str, str] = "float32", *,
                   families: Iterable[str] = RUN_FAMILIES, strategy: str | None = None, config: Any = None,
                   derivation: Any = None, seed: int = 0, reduce_shape: bool = True) -> dict[str, Any]:
    """The bar on each family: ``{"passed", "bar", "floor_ulps", "shape", "formula_dtype",
    "families": [check_family's verdicts], "failed": [names]}``. ``reduce_shape`` caps the shape
    with :func:`accuracy_shape` first (the interpreter's cost)."""
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import bind_dtypes, bind_shape

    bound = bind_shape(spec, shape, allow_empty=True)
    dtypes = bind_dtypes(spec, dtype)
    small = accuracy_shape(spec, bound) if reduce_shape else dict(bound)
    derivation = derivation or derive_cascade(spec)
    if strategy is None:
        from fuser_core.runner import choose_strategy

        strategy = choose_strategy(spec, derivation, small)
    if strategy in ("streaming_fused", "split_fused") and not derivation.exact:
        # a cast inside a fused reduction rounds with running values (docs/THEORY.md 5): the kernel does not compute
        # the formula as written, so it has no formula to be held to; the float64 check judges it normwise
        rows = [_refused(f, small, formula_dtype(dtypes), "not applicable: the fused form rounds its casts with "
                         "running values (judged normwise by the float64 check)") for f in families]
    else:
        rows = [check_family(spec, small, dtypes, f, strategy=strategy, config=config, derivation=derivation,
                             seed=seed) for f in families]
    failed = [r["family"] for r in rows if not r["passed"]]
    warnings = {r["family"]: r["spec_warning"] for r in rows if r.get("spec_warning")}
    return {"passed": not failed, "strategy": strategy, "bar": BAR, "floor_ulps": FLOOR_ULPS, "shape": small,
            "formula_dtype": formula_dtype(dtypes), "torch_op": torch_op_name(spec), "families": rows,
            "failed": failed, "spec_warnings": warnings}


def refusal(strategy: str, verdict: Mapping[str, Any]) -> str:
    """One line naming the first failing family, its ratio and what it was measured against."""
    row = next(r for r in verdict["families"] if not r["passed"])
    return f"{strategy} fails the accuracy bar on the {row['family']} family: " + describe(row)


def describe(row: Mapping[str, Any]) -> str:
    """A family's verdict in words."""
    if row.get("note") and row["ratio"] in (0.0, float("inf")) and not row["specials"]:
        return row["note"]
    text = (f"error {row['error']:.3g} is {row['ratio']:.3g}x the formula's in {row['formula_dtype']} "
            f"({row['formula_error']:.3g})")
    if row.get("torch_ratio") is not None:
        text += f" and {row['torch_ratio']:.3g}x torch's ({row['torch_error']:.3g})"
    text += f"; the bar is {BAR:g}x, floored at {FLOOR_ULPS} ulps"
    if row["specials"]:
        text += "; special values differ from the reference's: " + ", ".join(row["specials"])
    return text


def table(verdict: Mapping[str, Any]) -> str:
    """The per-family lines ``foldwise run`` prints."""
    lines = [f"accuracy bar ({verdict['strategy']}, shape {verdict['shape']}, formula in {verdict['formula_dtype']}"
             + (f", torch op {verdict['torch_op']}" if verdict.get("torch_op") else "") + f"): error <= {BAR:g} x "
             f"max(formula error, {FLOOR_ULPS} ulps)" + (" and <= 2 x torch's" if verdict.get("torch_op") else ""),
             f"  {'family':<11} {'error':>9} {'formula':>9} {'ratio':>8} {'torch':>9} {'ratio':>8}  verdict"]
    for r in verdict["families"]:
        t = "" if r["torch_error"] is None else f"{r['torch_error']:.2e}"
        tr = "" if r["torch_ratio"] is None else f"{r['torch_ratio']:.2f}"
        word = "pass" if r["passed"] else "FAIL"
        extra = r["note"] or ("special values differ: " + ", ".join(r["specials"]) if r["specials"] else "")
        lines.append(f"  {r['family']:<11} {r['error']:>9.2e} {r['formula_error']:>9.2e} {r['ratio']:>8.2f} "
                     f"{t:>9} {tr:>8}  {word}" + (f"  ({extra})" if extra else ""))
    for fam, text in verdict.get("spec_warnings", {}).items():
        lines.append(f"  note ({fam}): {text}")
    lines.append("accuracy: " + ("passed" if verdict["passed"] else "FAILED on " + ", ".join(verdict["failed"])))
    return "\n".join(lines)
