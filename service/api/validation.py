"""The API's side of request checking: the spec through :func:`fuser_core.spec.load_spec`, the
rest of a job request through the one normaliser (:mod:`service.tuning_request`) with the
server's limits; every failure is a 422 naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fuser_core import MAX_SPEC_BYTES, Spec, SpecError, SpecKey, canonical_json, load_spec, spec_key
from service.api.problems import REQUEST_FIELDS, error_entry, invalid, invalid_field, spec_problem
from service.api.schemas import JobRequest
from service.dim_names import DimNames
from service.errors import InvalidRequest
from service.settings import Settings
from service.store.spec_store import parsed_source
from service.tuning_request import Limits, TuningRequest, tuning_request


def spec_text(raw: dict[str, Any] | str, field: str = "spec") -> str:
    """The spec's JSON text: an object as compact JSON, JSON text as is, and a catalog name
    (``"safe_softmax"``, as the CLI and the client take it) as its catalog file's text. Only
    the catalog's folders are read (a name is never a path on the server); 422 naming
    ``field`` for text that is neither JSON nor a catalog name."""
    if not isinstance(raw, str):
        return json.dumps(raw, ensure_ascii=False, separators=(",", ":"))
    if raw.lstrip()[:1] in ("{", "["):
        return raw
    from fuser_core import CatalogError, catalog_entries

    name = raw.strip()
    try:
        entries = catalog_entries()
    except CatalogError as err:
        raise invalid_field((field,), f"{name[:80]!r} is not JSON, and the catalog cannot be read: {err}") from None
    found = next((e for e in entries if e.name == name), None)
    if found is None:
        raise invalid_field((field,), f"{name[:80]!r} is neither a JSON spec nor a catalog spec name; catalog names: "
                                      f"{', '.join(e.name for e in entries) or '(none)'}")
    try:
        return found.path.read_text(encoding="utf-8")[: MAX_SPEC_BYTES + 1]
    except (OSError, UnicodeDecodeError) as err:
        raise invalid_field((field,), f"catalog spec {name!r} cannot be read: {err}") from None


def checked_spec_text(raw: dict[str, Any] | str, field: str = "spec") -> str:
    """:func:`spec_text`, within the spec's size limit (422 naming ``field`` past it)."""
    source = spec_text(raw, field)
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise invalid_field((field,), f"spec is {size} bytes; the limit is {MAX_SPEC_BYTES}")
    return source


def parse_spec(raw: dict[str, Any] | str, field: str = "spec") -> tuple[Spec, str]:
    """(spec, source text as submitted, or the catalog file's text for a catalog name). The
    spec is parsed by load_spec, never evaluated."""
    source = checked_spec_text(raw, field)
    try:
        return load_spec(source), source
    except SpecError as err:
        raise spec_problem(err, body_field=field) from None


class ParsedSpecs:
    """Specs parsed from request text, by the exact text (a spec is a value: the same text always
    parses to the same spec), so a repeated submission does not parse it again. The cache is the
    spec store's (:func:`service.store.spec_store.parsed_source`): storing the spec then checks its
    text without a parse."""

    def get(self, raw: dict[str, Any] | str) -> tuple[Spec, str, str]:
        """(spec, source text, spec_hash); HttpProblem 422 for an invalid spec."""
        source = checked_spec_text(spec_text(raw))  # a catalog name is read each time: its file may change
        try:
            spec, shash = parsed_source(source)
        except SpecError as err:
            raise spec_problem(err, body_field="spec") from None
        return spec, source, shash


def job_request(parsed: ParsedSpecs, req: JobRequest, settings: Settings) -> TuningRequest:
    """A ``POST /v1/jobs`` body as a checked :class:`~service.tuning_request.TuningRequest`: the
    spec parsed (once per distinct text, ``parsed``), then every other field checked and bound
    once; a 422 naming every bad field otherwise."""
    spec, source, shash = parsed.get(req.spec)
    return check_job_request(req, spec, source, shash, settings)


@dataclass(frozen=True)
class CheckedJob:
    """A ``POST /v1/jobs`` body checked, with what the API would otherwise parse the spec again for
    (each parse of a 12-step spec is milliseconds of its GIL): computed in the spec parser's child
    (:mod:`service.api.spec_child`)."""

    request: TuningRequest
    key: SpecKey  # the spec's key in the derivation reports' cache
    canonical: Spec  # the canonical spec, as :func:`service.store.spec_store.job_spec` parses it
    names: DimNames  # the submitter's dim names against the canonical ones


def checked_job(req: JobRequest, settings: Settings) -> CheckedJob:
    """:func:`job_request`, and the spec's key, canonical form and names (in the child)."""
    request = job_request(ParsedSpecs(), req, settings)
    return CheckedJob(request, spec_key(request.spec), load_spec(canonical_json(request.spec), printed=True),
                      DimNames.of(request.spec))


def check_job_request(req: JobRequest, spec: Spec, source: str, spec_hash: str, settings: Settings) -> TuningRequest:
    """The request, checked and bound once (:func:`service.tuning_request.tuning_request`), with
    the server's defaults (target, measurer) and limits (budget, sizes) from ``settings``;
    a 422 naming every bad field otherwise."""
    measurer = req.measurer or settings.measurer or default_measurer()
    try:
        return tuning_request(spec, source, req.shape, req.dtype, req.target or settings.target, measurer,
                              req.budget.trials, req.budget.seconds, limits=Limits.of(settings), spec_hash=spec_hash,
                              allow_uncertified=req.allow_uncertified, batch_invariant=req.batch_invariant)
    except InvalidRequest as err:
        raise invalid([error_entry(e.loc if e.loc[:1] and e.loc[0] in REQUEST_FIELDS else ("spec", *e.loc), e.message,
                                   step=e.step) for e in err.errors]) from None


_DEFAULT_MEASURER: list[str] = []


def default_measurer() -> str:
    """The server's default measurer when neither the request nor the settings name one
    (cuda with a visible GPU, else model), decided once per process."""
    if not _DEFAULT_MEASURER:
        from service.worker.tuning import default_measurer as pick

        _DEFAULT_MEASURER.append(pick())
    return _DEFAULT_MEASURER[0]


def query_value(parse: Callable[[str], Any], text: str) -> Any:
    """A query parameter read by one of :mod:`service.bundle`'s text readers (``parse_shape_text``,
    ``parse_dtype_text``); 422 naming the parameter otherwise."""
    try:
        return parse(text)
    except SpecError as err:
        raise invalid_field(err.loc, err.message, where="query") from None
