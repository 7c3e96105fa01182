"""Checks of request values beyond what the Pydantic models say (limits from Settings,
specs through :func:`fuser_core.spec.load_spec`); every failure is a 422 naming the field."""

from __future__ import annotations

import json
from typing import Any

from fuser_core.errors import SpecError
from fuser_core.spec import MAX_SPEC_BYTES, Spec, load_spec
from service.api.problems import error_entry, invalid, invalid_field, spec_problem
from service.api.schemas import JobRequest
from service.settings import Settings
from service.tuning import MEASURERS

MAX_QUERY_SHAPE_CHARS = 2048


def parse_spec(raw: dict[str, Any] | str, field: str = "spec") -> tuple[Spec, str]:
    """(spec, source text as submitted). The spec is parsed by load_spec, never evaluated."""
    source = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False, separators=(",", ":"))
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise invalid_field((field,), f"spec is {size} bytes; the limit is {MAX_SPEC_BYTES}")
    try:
        return load_spec(source), source
    except SpecError as err:
        raise spec_problem(err, body_field=field) from None


def check_job_request(req: JobRequest, spec: Spec, settings: Settings) -> dict[str, Any]:
    """The request's shape (complete, bound), dtype, target and measurer after every check.

    Budget and size limits come from ``settings``; the shape and dtype are checked against
    the spec (``fuser_core.reference.bind_shape``, ``fuser_core.runner.bind_dtypes``).
    """
    from fuser_core.reference import bind_shape, check_sizes
    from fuser_core.runner import bind_dtypes
    from tuner.profiles import PROFILES

    errors = []
    if req.budget.trials > settings.max_trials:
        errors.append(error_entry(("budget", "trials"), f"must be at most {settings.max_trials}, got {req.budget.trials}"))
    if req.budget.seconds > settings.max_seconds:
        errors.append(error_entry(("budget", "seconds"), f"must be at most {settings.max_seconds:g}, got {req.budget.seconds:g}"))
    for dim, size in req.shape.items():
        if not 1 <= size <= settings.max_dim:
            errors.append(error_entry(("shape", dim), f"must be an integer from 1 to {settings.max_dim}, got {size}"))
    target = (req.target or settings.target).strip().lower()
    if target not in PROFILES:
        errors.append(error_entry(("target",), f"unknown target {target!r}; one of {', '.join(sorted(PROFILES))}"))
    measurer = req.measurer or settings.measurer or default_measurer()
    if measurer not in MEASURERS:
        errors.append(error_entry(("measurer",), f"unknown measurer {measurer!r}; one of {', '.join(MEASURERS)}"))
    if errors:
        raise invalid(errors)
    try:
        shape = bind_shape(spec, req.shape)
        check_sizes(spec, shape, max_elements=settings.max_tensor_elements, max_work=settings.max_work)
        bind_dtypes(spec, req.dtype)
    except SpecError as err:
        raise spec_problem(err) from None
    return {"shape": shape, "dtype": req.dtype, "target": target, "measurer": measurer}


_DEFAULT_MEASURER: list[str] = []


def default_measurer() -> str:
    """The server's default measurer when neither the request nor the settings name one
    (cuda with a visible GPU, else model), decided once per process."""
    if not _DEFAULT_MEASURER:
        from service.tuning import default_measurer as pick

        _DEFAULT_MEASURER.append(pick())
    return _DEFAULT_MEASURER[0]


def parse_shape_query(text: str) -> dict[str, int]:
    """``m=4,n=300`` -> {"m": 4, "n": 300}; 422 on the ``shape`` query parameter otherwise."""
    if len(text) > MAX_QUERY_SHAPE_CHARS:
        raise invalid_field(("shape",), f"longer than {MAX_QUERY_SHAPE_CHARS} characters", where="query")
    shape: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value.isdigit() or not value.isascii() or len(value) > 19:
            raise invalid_field(("shape",), f"expected dim=size pairs like m=4,n=300, got {item[:40]!r}", where="query")
        if name in shape:
            raise invalid_field(("shape",), f"dim {name[:40]!r} is given twice", where="query")
        shape[name] = int(value)
    if not shape:
        raise invalid_field(("shape",), "expected dim=size pairs like m=4,n=300", where="query")
    return shape


def parse_dtype_query(text: str) -> str | dict[str, str]:
    """``float16``, or a JSON object input -> dtype (as the client sends it)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise invalid_field(("dtype",), f"not valid JSON: {err.msg}", where="query") from None
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise invalid_field(("dtype",), "expected a JSON object of input name -> dtype", where="query")
        return value
    return text.strip()
