"""The derivation as a JSON object: what ``foldwise derive --json`` and ``POST /v1/derivations`` return.

Derivations are computed on the *canonical* spec and cached by its canonical JSON (so the
cache key is the ``spec_hash``): a spec that differs only by renaming hits the same entry,
and the cached report is translated back to the caller's own dim, step and param names.
Canonical names (``d0``, ``s1``, ``p0``) never collide with input names
(:func:`fuser_core.canonical.canonical_names`), so renaming the report's text is a plain
token substitution.

Example:
    >>> from fuser_core.spec import load_spec
    >>> spec = load_spec({"foldwise": 1, "name": "lse", "inputs": {"x": {"dims": ["m", "n"]}},
    ...     "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
    ...               {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}],
    ...     "outputs": ["den"]})
    >>> r = derivation_report(spec)
    >>> r["fusible"], r["reductions"][1]["correction"]
    (True, 'multiply by exp(mx[old] - mx[new])')
"""

from __future__ import annotations

import copy
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fuser_core.canonical import canonical_json, canonical_names, hash_canonical_json
from fuser_core.errors import DerivationLimitError, SpecError
from fuser_core.spec import Spec, load_spec

if TYPE_CHECKING:
    from fuser_core.derive import Derivation

REPORT_CACHE_SIZE = 512
CERTIFICATE_TRIALS = 12
_CANONICAL_TOKEN = re.compile(r"\b[sdp]\d+(?:_d\d+)*\b")  # d2_d3: the merged dim of a list "over"


def derivation_report(spec: Spec, derivation: Derivation | None = None) -> dict[str, Any]:
    """The derivation of ``spec`` as a JSON-able dict, in the caller's own names.

    ``derivation`` is the derivation of ``spec``'s canonical spec when the caller already has it
    (the worker derives a job's canonical spec once, for its searches and its bundles): then the
    report is made from it and nothing is derived here. ValueError if it is another spec's, or a
    derivation of a spec not in canonical names (its report would not rename back)."""
    key = spec_key(spec)
    if derivation is not None:
        _check_canonical(derivation, key.canonical)
    try:
        report = _canonical_report(key.canonical, derivation)
    except DerivationLimitError as err:  # raised on the canonical spec: name the caller's step
        raise DerivationLimitError(_rename(str(err), key.back)) from None
    except SpecError as err:  # found while deriving (x / (x - x)): the caller's step, field and names
        raise _user_spec_error(err, spec, key.back) from None
    return _named(report, key)


@dataclass(frozen=True)
class SpecKey:
    """What a spec's cached report needs of the spec, as plain data: made where the spec is
    parsed (the API parses in a child process, off its GIL) and looked up elsewhere."""

    name: str
    canonical: str  # the canonical JSON: the reports' cache key
    back: dict[str, str]  # canonical name -> the spec's own


def spec_key(spec: Spec) -> SpecKey:
    names = canonical_names(spec)
    return SpecKey(spec.name, canonical_json(spec), {canon: user for user, canon in names.items()})


def cached_report(key: SpecKey) -> dict[str, Any] | None:
    """``derivation_report`` of the spec whose key is ``key`` when it is cached (a rename of the
    cached report), else None."""
    with _REPORTS_LOCK:
        report = _REPORTS.get(key.canonical)
        if report is None:
            return None
        _REPORTS.move_to_end(key.canonical)
    return _named(report, key)


def _named(report: dict[str, Any], key: SpecKey) -> dict[str, Any]:
    return {"spec_hash": hash_canonical_json(key.canonical), "name": key.name, **_rename(report, key.back)}


def report_entry(spec: Spec) -> tuple[str, dict[str, Any]]:
    """``spec``'s cache entry: its canonical JSON and its report in canonical names, derived
    (and certified) here unless cached; errors as :func:`derivation_report` raises them.

    For a caller that derives in another process (the API, so that a derivation can be stopped)
    and gives the entry back to its own cache with :func:`remember_report`."""
    derivation_report(spec)  # derives, caches, and names the caller's step in its errors
    canonical = canonical_json(spec)
    return canonical, _canonical_report(canonical, None)  # from the cache


def remember_report(canonical: str, report: dict[str, Any]) -> None:
    """Cache an entry of :func:`report_entry` (made in another process): ``derivation_report``
    of that spec is then a lookup."""
    _store(canonical, report)


def _user_spec_error(err: SpecError, spec: Spec, back: dict[str, str]) -> SpecError:
    loc = list(err.loc)
    step = back.get(err.step, err.step) if err.step else None
    if loc[:1] == ["steps"] and step is not None:
        loc[1] = [s.name for s in spec.steps].index(step)
    elif loc[:1] == ["params"] and len(loc) > 1:
        loc[1] = back.get(str(loc[1]), loc[1])
    return SpecError(_rename(err.message, back), loc=tuple(loc), step=step)


def _check_canonical(derivation: Derivation, canonical: str) -> None:
    derived = derivation.spec
    if canonical_json(derived) != canonical:
        raise ValueError("derivation: it is the derivation of another spec")
    if any(user != canon for user, canon in canonical_names(derived).items()):
        raise ValueError("derivation: it must be the derivation of the canonical spec (fuser_core.canonical_form)")


# The reports by canonical JSON, least recently used first. Not functools.lru_cache: a report
# made from a caller's derivation is stored under the same key as one derived here.
_REPORTS: OrderedDict[str, dict[str, Any]] = OrderedDict()
_REPORTS_LOCK = threading.Lock()  # the API derives in a thread pool


def clear_cache() -> None:
    with _REPORTS_LOCK:
        _REPORTS.clear()


def _canonical_report(canonical: str, derivation: Derivation | None) -> dict[str, Any]:
    with _REPORTS_LOCK:
        report = _REPORTS.get(canonical)
        if report is not None:
            _REPORTS.move_to_end(canonical)
            return report
    # Imported here: validating a spec must not pay for sympy's import.
    from fuser_core.certificate import certify
    from fuser_core.derive import derive_cascade
    from fuser_core.present import present

    if derivation is None:
        derivation = derive_cascade(load_spec(canonical, printed=True))
    report = present(derivation, certify(derivation, trials=CERTIFICATE_TRIALS))
    _store(canonical, report)
    return report


def _store(canonical: str, report: dict[str, Any]) -> None:
    with _REPORTS_LOCK:
        _REPORTS[canonical] = report
        if len(_REPORTS) > REPORT_CACHE_SIZE:
            _REPORTS.popitem(last=False)


def _rename(obj: Any, back: dict[str, str]) -> Any:
    if isinstance(obj, str):
        return _CANONICAL_TOKEN.sub(lambda m: back.get(m.group(), m.group()), obj)
    if isinstance(obj, dict):
        return {(_rename(k, back) if isinstance(k, str) else k): _rename(v, back) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rename(v, back) for v in obj]
    return copy.copy(obj)
