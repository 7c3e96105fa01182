"""The dashboard's CPU work, as pure functions of plain data: run in a child process.

``GET /v1/specs/{h}/math`` derives the spec and prints it as LaTeX; ``GET /v1/specs/{h}/source``
derives it and generates a module. Both are seconds of sympy for a large spec, and in the API's
process they held the GIL against the event loop: a cheap GET's p99 rose 45x under 5 cold
``/math`` and 59x under 12 ``/source`` (issue 37, 2). So the route reads what it needs from the
database (:mod:`service.dashboard.views`: plain data), and these functions run in the
derivations' child processes (:meth:`service.api.derive.DerivationPool.compute`: the same
deadline, pool, queue, memory cap and kill when the client leaves). Every argument and answer
pickles: texts, numbers, dicts. A request these functions cannot answer raises
:class:`DashboardError`, which crosses back to the API as itself.

This module imports no database code: a child imports it (the forkserver preloads it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from fuser_core import SpecError
from service.dim_names import DimNames

DEFAULT_DIM = 128  # a dim's size for generated source when no job or kernel gives one


class DashboardError(Exception):
    """A request the dashboard views cannot answer: ``status`` 404 or 422, ``loc`` the field.
    It pickles with its fields (it crosses from a child process)."""

    def __init__(self, status: int, message: str, loc: tuple[str | int, ...] = ()):
        self.status, self.message, self.loc = status, message, tuple(loc)
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return (DashboardError, (self.status, self.message, self.loc))


@lru_cache(maxsize=16)
def loaded(source: str) -> tuple[Any, Any]:
    """(Spec, Derivation) of a stored spec's source; cached in the process that derives (a child
    serves one request; the cache is for a caller that runs these functions in its own process)."""
    from fuser_core import derive_cascade, load_spec

    spec = load_spec(source)
    return spec, derive_cascade(spec)


def spec_math(source: str) -> dict[str, Any]:
    """The derivation of the spec whose stored JSON text is ``source`` as LaTeX per reduction
    (:func:`service.dashboard.mathtex.derivation_math`)."""
    from service.dashboard.mathtex import derivation_math

    return derivation_math(loaded(source)[1])


def _query_value(parse: Any, text: str) -> Any:
    """A query parameter or stored text read by one of :mod:`service.bundle`'s text readers
    (``parse_shape_text``, ``parse_dtype_text``); DashboardError naming the parameter otherwise."""
    try:
        return parse(text)
    except SpecError as err:
        raise DashboardError(422, err.message, ("query", *err.loc)) from None


def spec_source(source: str, spec_hash: str, origin: Mapping[str, Any] | None, kernel: Mapping[str, Any] | None,
                strategy: str | None = None, shape: str | None = None, dtype: str | None = None) -> dict[str, Any]:
    """Generated Triton source for the spec whose stored JSON text is ``source``.

    ``origin``: the newest kernel's or else the newest job's ``{"shape", "dtype"}`` as stored
    (canonical dim names), None when neither exists; ``kernel``: the newest kernel's ``{"id",
    "strategy", "config", "time_ms", "measurer"}`` or None. Defaults: the tuned kernel's shape,
    dtype, strategy and configuration, else the newest job's shape and dtype with the preferred
    valid strategy and its default configuration, else ``DEFAULT_DIM`` per dim in float32.
    """
    from fuser_core import (
        FALLBACK, GENERATOR_VERSION, PREFERENCE, NotValid, bind_dtypes, bind_shape, default_config, generate,
        valid_strategies,
    )
    from service.bundle import parse_dtype_text, parse_shape_text

    spec, derivation = loaded(source)
    # stored shapes and tuned configs use the canonical dim names (service.store.spec_store); show the spec's own
    names = DimNames.of_source(source)
    defaults = {d: DEFAULT_DIM for d in spec.dims if not any(s.as_dim == d for s in spec.steps)}
    raw_shape: Mapping[str, int] = (
        _query_value(parse_shape_text, shape) if shape else names.user_shape(origin["shape"]) if origin is not None
        else defaults
    )
    raw_dtype: str | dict[str, str] = (
        _query_value(parse_dtype_text, dtype) if dtype else _query_value(parse_dtype_text, origin["dtype"])
        if origin is not None else "float32"
    )
    fallback_note = ""
    try:
        bound = bind_shape(spec, raw_shape)
    except SpecError as err:
        if shape:
            raise DashboardError(422, err.message, ("query", *err.loc)) from None
        # a stored shape the generator cannot take (larger than the reference's limits): show the code anyway
        fallback_note = f"The stored shape cannot be generated here ({err}); showing {DEFAULT_DIM} per dim. "
        bound = bind_shape(spec, defaults)
        kernel = None
    try:
        dtypes = bind_dtypes(spec, raw_dtype)
    except SpecError as err:
        raise DashboardError(422, err.message, ("query", *err.loc)) from None
    valid = valid_strategies(spec, derivation, bound)
    module = None
    if kernel is not None and not shape and not dtype and strategy in (None, kernel["strategy"]):
        module, config = _tuned_module(spec, derivation, kernel, bound, dtypes, names)
    if module is not None:
        assert kernel is not None
        chosen, kernel_id = kernel["strategy"], kernel["id"]
        note = f"The tuned kernel {kernel['id'][:12]} ({kernel['time_ms']:.4g} ms, {kernel['measurer']})."
    else:
        kernel_id = None
        chosen = strategy or next((s for s in PREFERENCE if valid.get(s) is None), FALLBACK)
        if chosen not in valid:
            raise DashboardError(422, f"unknown strategy {chosen!r}; one of {', '.join(valid)}", ("query", "strategy"))
        if valid[chosen] is not None:
            raise DashboardError(422, f"{chosen} is not valid here: {valid[chosen]}", ("query", "strategy"))
        config = default_config(spec, derivation, chosen, bound)
        note = fallback_note + "The strategy's default configuration (before tuning)."
        try:
            module = generate(spec, derivation, chosen, bound, config, dtypes)
        except (NotValid, ValueError) as err:
            raise DashboardError(422, str(err), ("query", "strategy")) from None
    return {
        "spec_hash": spec_hash,
        "strategy": chosen,
        "strategies": valid,
        "shape": bound,
        "dtype_key": raw_dtype if isinstance(raw_dtype, str) else json.dumps(raw_dtype, sort_keys=True),
        "config": config.to_dict(),
        "generator_version": GENERATOR_VERSION,
        "kernel_id": kernel_id,
        "note": note,
        "source": module.source,
    }


def _tuned_module(spec: Any, derivation: Any, kernel: Mapping[str, Any], bound: dict[str, int],
                  dtypes: dict[str, str], names: DimNames) -> tuple[Any, Any]:
    """(module, config) of a stored kernel's strategy and configuration (its blocks renamed from the
    canonical dims), or (None, None) when this code cannot generate it (an older generator's config)."""
    from fuser_core import KernelConfig, NotValid, generate

    raw = dict(kernel["config"] or {})
    raw["blocks"] = names.user_shape(raw.get("blocks") or {})
    try:
        config = KernelConfig.from_dict(raw)
        return generate(spec, derivation, kernel["strategy"], bound, config, dtypes), config
    except (NotValid, ValueError, KeyError):
        return None, None
