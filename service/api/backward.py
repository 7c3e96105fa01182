"""``POST /v1/backward``'s CPU work, as a pure function of the spec's text: run in a derivation
child process (:meth:`service.api.derive.DerivationPool.compute`), as the dashboard's LaTeX is,
so the shift test's float64 evaluations and the certificate's autograd never hold the API's GIL.

This module imports no database code: a child imports it."""

from __future__ import annotations

from typing import Any


def backward_answer(source: str) -> dict[str, Any]:
    """``foldwise backward --json --no-derive`` of the spec ``source`` (JSON text), or
    ``{"error": {"message", "loc", "step"}}`` for a spec it refuses (a SpecError: the route
    answers 422 naming the field; an exception's own pickling would drop its fields)."""
    from fuser_core import SpecError, backward_report, load_spec

    try:
        return backward_report(load_spec(source), derive_specs=False)
    except SpecError as err:
        return {"error": {"message": err.message, "loc": list(err.loc), "step": err.step}}
