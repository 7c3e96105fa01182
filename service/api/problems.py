"""Errors as ``application/problem+json`` (RFC 9457), each naming the field at fault.

Every error answer of the API has ``type``, ``title``, ``status`` and ``detail``; a validation
error (422) also has ``errors``: one entry per problem, with ``field`` (a readable path such
as ``spec.steps[2].expr`` or ``shape.n``), ``loc`` (the same path as a list), ``in`` (body,
query, path or header) and ``message``; an error inside a spec step also names the step.
``detail`` repeats the first error in one line, so a client that shows only ``detail`` still
names the field.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from fuser_core import SpecError

PROBLEM_JSON = "application/problem+json"
# fields of a job request besides the spec: a SpecError located there is not inside the spec
REQUEST_FIELDS = ("shape", "dtype", "target", "measurer", "budget", "batch_invariant")
log = logging.getLogger("foldwise.api")


def field_path(loc: Sequence[str | int]) -> str:
    """``("spec", "steps", 2, "expr")`` -> ``spec.steps[2].expr``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def error_entry(loc: Sequence[str | int], message: str, *, where: str = "body", step: str | None = None) -> dict:
    entry: dict[str, Any] = {"field": field_path(loc), "loc": list(loc), "in": where, "message": message}
    if step is not None:
        entry["step"] = step
    return entry


class HttpProblem(Exception):
    """An error answer. Raise it from plain functions and routes; the app's handler renders it."""

    def __init__(self, status: int, title: str, detail: str, *, kind: str | None = None,
                 errors: list[dict] | None = None, headers: Mapping[str, str] | None = None, **extra: Any):
        self.status, self.title, self.detail = status, title, detail
        self.kind, self.errors, self.headers, self.extra = kind, errors, dict(headers or {}), extra
        super().__init__(detail)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": f"urn:foldwise:problem:{self.kind}" if self.kind else "about:blank",
            "title": self.title, "status": self.status, "detail": self.detail,
        }
        if self.errors:
            out["errors"] = self.errors
        out.update(self.extra)
        return out

    def response(self) -> Response:
        return Response(json.dumps(self.body(), default=str), status_code=self.status, media_type=PROBLEM_JSON,
                        headers=self.headers)


def invalid(errors: list[dict]) -> HttpProblem:
    """422 for one or more field errors (entries from :func:`error_entry`)."""
    first = errors[0]
    detail = f"{first['field']}: {first['message']}" if first["field"] else first["message"]
    return HttpProblem(422, "Invalid request", detail, kind="validation", errors=errors)


def invalid_field(loc: Sequence[str | int], message: str, *, where: str = "body") -> HttpProblem:
    return invalid([error_entry(loc, message, where=where)])


def spec_problem(err: SpecError, *, body_field: str = "spec") -> HttpProblem:
    """422 for a SpecError. Its ``loc`` is a path in the spec (``steps, 2, expr``), or in the
    request for shape and dtype errors (``shape, n``); a step error names the step."""
    loc = tuple(err.loc)
    if not loc or loc[0] not in REQUEST_FIELDS:
        loc = (body_field, *loc)
    message = err.message
    problem = invalid([error_entry(loc, message, step=err.step)])
    if err.step is not None:  # name the step as the CLI does, keeping the field path greppable
        problem.detail = f"{field_path(loc)} (step {err.step}): {message}"
    return problem


def not_found(what: str, ident: str) -> HttpProblem:
    return HttpProblem(404, "Not found", f"no {what} {ident!r}", kind="not-found")


# ----------------------------------------------------------------------------- handlers


async def problem_handler(request: Request, exc: HttpProblem) -> Response:
    return exc.response()


UNION_PREFIX = "Input should be "  # pydantic's wording of a type error, said once for a union's branches


async def validation_handler(request: Request, exc: RequestValidationError) -> Response:
    """FastAPI's request validation errors, with the location as a field path (no ``body.`` prefix).

    Errors about the body as a whole name the field ``body`` (never a character offset, which
    FastAPI puts in ``loc`` for malformed JSON), or ``content-type`` when the body was not sent
    as JSON."""
    errors = []
    for e in exc.errors():
        loc = list(e.get("loc", ()))
        where = str(loc.pop(0)) if loc and loc[0] in ("body", "query", "path", "header", "cookie") else "body"
        # a union (spec: dict | str) reports each branch as a loc part like "dict[str,any]": drop them
        loc = [p for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")))]
        message = e.get("msg", "invalid")
        if e.get("type") == "json_invalid":
            position = loc[0] if loc and isinstance(loc[0], int) else None
            loc, message = ["body"], json_error_message(exc.body, position, e.get("ctx", {}).get("error", message))
        elif where == "body" and not loc:
            loc, where, message = whole_body_error(request, message)
        entry = error_entry(loc, message, where=where)
        same = next((x for x in errors if (x["field"], x["in"]) == (entry["field"], entry["in"])), None)
        if same is None:
            errors.append(entry)
        elif message not in same["message"]:  # each branch of a union (int | range) failed: one error, both reasons
            joined = message.removeprefix(UNION_PREFIX) if message.startswith(UNION_PREFIX) else message
            same["message"] += f" or {joined}"
    if not errors:
        errors = [error_entry(["body"], "invalid request")]
    return invalid(errors).response()


def json_error_message(body: Any, position: int | None, reason: str) -> str:
    """Why a body is not JSON, with where: the key whose value is missing (the README's curl
    sends ``{"spec": , ...}`` when the command inside ``$(...)`` fails), else line, column and
    the text around the error."""
    text = body if isinstance(body, str) else body.decode("utf-8", "replace") if isinstance(body, bytes) else ""
    if position is None or not text:
        return f"the request body is not valid JSON: {reason}"
    position = min(position, len(text))
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    where = f"line {line} column {column}"
    key = re.search(r'"([^"\\]{1,64})"\s*:\s*\Z', text[max(0, position - 80):position])
    if reason == "Expecting value" and key:
        return (f"the request body is not valid JSON: the value of {key.group(1)!r} is missing ({where}); "
                f"was it made by a command that failed?")
    near = text[max(0, position - 20):position + 20].replace("\n", " ")
    return f"the request body is not valid JSON: {reason} at {where}, near {near!r}"


def whole_body_error(request: Request, message: str) -> tuple[list[str], str, str]:
    """(loc, in, message) for an error about the whole body: a content type that is not JSON
    names the header, anything else the body."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        shown = f"got {content_type[:60]!r}" if content_type else "none was sent"
        return ["content-type"], "header", f"must be application/json (the body is a JSON object); {shown}"
    if message == "Field required":
        return ["body"], "body", "the request body is empty; expected a JSON object"
    return ["body"], "body", f"expected a JSON object: {message}"


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
        # FastAPI's "error parsing the body": json.loads gave up on a deeply nested document
        return invalid_field(["body"], "the request body is not valid JSON: nested too deeply (a spec needs "
                                       "a few levels; the parser's limit is about 1,000)").response()
    titles = {404: "Not found", 405: "Method not allowed", 413: "Request too large", 401: "Unauthorized"}
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no such resource: {request.method} {request.url.path}"
    return HttpProblem(exc.status_code, titles.get(exc.status_code, "Error"), detail,
                       headers=getattr(exc, "headers", None)).response()


async def unhandled_handler(request: Request, exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc, extra={"path": request.url.path, "method": request.method})
    return HttpProblem(500, "Internal server error", "the server failed to answer this request; see its log",
                       kind="internal").response()
