"""The accuracy bar's input families (what real models feed a kernel: offsets, scales, peaks, near
ties, masks, NaN, ...) and the small shapes and inputs each family is checked on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fuser_core.merged import consistent
from fuser_core.problem import bind_shape
from fuser_core.reference import cast_to
from fuser_core.spec import Spec

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
    if fam.transform is None or np.size(x) == 0:  # an empty tensor has no rows to transform
        return x
    if fam.affine:
        return _affine(np.asarray(x, np.float64), rng, fam)
    return fam.transform(np.asarray(x, np.float64), rng)


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
