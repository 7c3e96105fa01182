"""The spec's formula evaluated step by step in the run's dtype (every rounding operation rounded
to it, sums pairwise or in a loop's order; optionally with random roundings), and the dtype's
unit roundoff and ulp floor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from fuser_core.reference import FLOAT_DTYPES, Evaluator, cast_to
from fuser_core.spec import Spec

FLOOR_ULPS = 4  # units in the last place of the output dtype below which errors count as equal
# unit roundoff (half an ulp at 1): the relative rounding error of one operation
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8, "float8_e4m3fn": 2.0**-4,
                 "float64": 2.0**-53}


def formula_dtype(dtypes: Mapping[str, str]) -> str:
    """The dtype the spec's formula is evaluated in: the float inputs' common dtype as torch
    promotes it (float16 with bfloat16, or anything with float32, is float32); float8 inputs
    count as float32 (nobody computes in float8: it is a storage format); no float input: float32;
    a float64 input makes it float64."""
    floats = {("float32" if d == "float8_e4m3fn" else d) for d in dtypes.values() if d in FLOAT_DTYPES}
    return "float64" if "float64" in floats else floats.pop() if len(floats) == 1 else "float32"


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
