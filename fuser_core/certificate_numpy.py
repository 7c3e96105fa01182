"""The derived forms of a certificate compiled to numpy (lambdify), with the functions they call:
broadcasting and/or, rescale and shift terms, IEEE comparisons, NaN handling; compiled once per
derivation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.special
import sympy as sp

from fuser_core.derive import Derivation
from fuser_core.errors import DerivationLimitError
from fuser_core.realisation import RESCALE_FLOOR
from fuser_core.reference import cast_to
from fuser_core.symbolic import CAST_FUNCTIONS, COMPARE_OPS


class _Broadcasting:
    """``logical_or``/``logical_and`` for lambdify, which prints ``Or(a, b)`` as
    ``logical_or.reduce((a, b))``: NumPy cannot stack arrays of different (broadcastable)
    shapes, so reduce pairwise instead."""

    def __init__(self, ufunc: np.ufunc):
        self.ufunc = ufunc

    def __call__(self, *args: Any) -> Any:
        return self.ufunc(*args)

    def reduce(self, arrays: Any) -> Any:
        out = arrays[0]
        for a in arrays[1:]:
            out = self.ufunc(out, a)
        return out


def _rescale(acc: Any, c: Any) -> np.ndarray:
    """:data:`fuser_core.realisation.Rescale` in float64: acc * c with a correction that is not a
    positive finite number taken as RESCALE_FLOOR, as the kernels' ``rescale``."""
    acc, c = np.asarray(acc, dtype=np.float64), np.asarray(c, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return acc * np.where((c > 0.0) & (c < np.inf), c, RESCALE_FLOOR)


def _shift_term(acc: Any, c: Any) -> np.ndarray:
    """:data:`fuser_core.realisation.ShiftTerm` in float64: acc * c, 0 where c is 0 or NaN (an anchor
    that stayed at one infinity), where acc is 0 (nothing seen), or where c is finite and acc infinite,
    as the kernels' ``shift_term``."""
    acc, c = np.asarray(acc, dtype=np.float64), np.asarray(c, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.where((c == 0.0) | np.isnan(c) | (acc == 0.0) | (np.isfinite(c) & np.isinf(acc)), 0.0, acc * c)


_NUMPY_COMPARE = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
                  "!=": np.not_equal}


def _nan_to_zero(d: Any) -> np.ndarray:
    """:data:`fuser_core.realisation.NanToZero` in float64, as the kernels' ``nan_to_zero``."""
    d = np.asarray(d, dtype=np.float64)
    return np.where(np.isnan(d), 0.0, d)


def _inf_compare(k: Any, lhs: Any, rhs: Any) -> np.ndarray:
    """:class:`fuser_core.symbolic.InfCompare` in float64 (IEEE: NaN compares unequal)."""
    return _NUMPY_COMPARE[COMPARE_OPS[int(k)]](lhs, rhs)


def _nan_of(v: Any) -> np.ndarray:
    """0 for a finite v, NaN for an infinite or NaN v, as the kernels' ``nan_of`` (v - v)."""
    v = np.asarray(v, np.float64)
    with np.errstate(invalid="ignore"):
        return v - v


def _unordered(a: Any, b: Any) -> np.ndarray:
    """:class:`fuser_core.symbolic.Unordered` in float64: a or b is NaN."""
    return np.isnan(np.asarray(a, dtype=np.float64)) | np.isnan(np.asarray(b, dtype=np.float64))


_NUMPY_FUNCS = {"InfCompare": _inf_compare, "Unordered": _unordered, "nan_of": _nan_of, "round": np.rint, "rescale": _rescale, "shift_term": _shift_term,
                "nan_to_zero": _nan_to_zero,
                "erf": scipy.special.erf,
                "logical_or": _Broadcasting(np.logical_or), "logical_and": _Broadcasting(np.logical_and)}


class CompiledForms:
    """sympy expressions turned into NumPy functions, once per derivation and mode."""

    def __init__(self, keep_casts: bool):
        self.cache: dict[sp.Expr, tuple[Any, list[sp.Symbol]]] = {}
        funcs: dict[str, Any] = dict(_NUMPY_FUNCS)
        for dtype, fn in CAST_FUNCTIONS.items():
            funcs[str(fn)] = (lambda x, dt=dtype: cast_to(np.asarray(x, dtype=np.float64), dt)) if keep_casts else (lambda x: x)
        self.modules = [funcs, "numpy"]

    def __call__(self, e: sp.Expr, values: dict[sp.Symbol, Any]) -> np.ndarray:
        try:
            hit = self.cache.get(e)
            if hit is None:
                syms = sorted(e.free_symbols, key=str)
                literal, big = _float_literals(e)
                hit = (sp.lambdify(syms + list(big), literal, modules=self.modules), syms, list(big.values()))
                self.cache[e] = hit
            fn, syms, big_values = hit
            return np.asarray(fn(*[values[s] for s in syms], *big_values), dtype=np.float64)
        except RecursionError:  # lambdify rebuilds a where() whose Piecewise.eval recurses without end
            raise DerivationLimitError(
                "the certificate cannot evaluate this derivation: sympy recursed without end rebuilding a where()"
            ) from None
        except (TypeError, ValueError) as err:  # sympy rebuilding max(zoo, ..), numpy.select of a scalar condition
            raise DerivationLimitError(
                f"the certificate cannot evaluate {sp.sstr(e)[:80]}: {type(err).__name__}: {str(err)[:120]}"
            ) from None


EXACT_INTEGER_LIMIT = 2**53  # float64 holds every integer up to here; beyond, an integer literal is a float


def _float_literals(e: sp.Expr) -> tuple[sp.Expr, dict[sp.Dummy, np.float64]]:
    """``e`` with integers beyond float64's exact range as arguments holding their float64 value:
    a spec's ``-1e30`` is an exact sympy Integer, which lambdify prints as a Python int that
    NumPy stores as an object array (where() then cannot select it into float64). They become
    symbols, not sympy Floats, which sympy would fold (``exp(-1e30)`` to a 434-million-digit
    exponent). The reference computes with the float."""
    big = {i: sp.Dummy(f"big{k}") for k, i in enumerate(e.atoms(sp.Integer)) if abs(int(i)) > EXACT_INTEGER_LIMIT}
    if not big:
        return e, {}
    return e.xreplace(big), {d: np.float64(float(i)) for i, d in big.items()}


_COMPILED: dict[tuple[int, bool], CompiledForms] = {}


def compile_forms(derivation: Derivation, keep_casts: bool) -> CompiledForms:
    key = (id(derivation), keep_casts)
    if key not in _COMPILED:
        if len(_COMPILED) > 64:
            _COMPILED.clear()
        _COMPILED[key] = CompiledForms(keep_casts)
    return _COMPILED[key]
