"""Pure ASGI middleware (cheaper than Starlette's BaseHTTPMiddleware on every request).

- :class:`BodyLimit`: refuses request bodies larger than a limit with 413, by the declared
  ``Content-Length`` and, for chunked bodies, by reading them here up to the limit before the
  app sees them, so an oversized request is never read into memory past the limit.
- :class:`OneAuthorization`: refuses a request with more than one ``Authorization`` header
  (400 naming the header) before any route or the bundle fast path reads one: two readers
  could otherwise pick different ones (the first, the last).
- :class:`NoNulBytes`: refuses a URL whose path or query holds a NUL byte (``%00``) with 422:
  every route's text parameters are then free of it, and none reaches a database filter
  (PostgreSQL refuses NUL in text with a DataError: a ``target=h1%0000`` filter answered 500).
- :class:`AccessLog`: adds ``X-Content-Type-Options: nosniff`` to every answer, times every request, records it in the latency histogram (by route
  template, so ids in paths do not multiply the series) and logs one JSON line.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from service.api.problems import HttpProblem, error_entry

log = logging.getLogger("foldwise.api.access")


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _problem(self) -> HttpProblem:
        return HttpProblem(413, "Request too large", f"the request body is larger than {self.max_bytes} bytes",
                           kind="too-large")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunked = False
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (not value.isdigit() or int(value) > self.max_bytes):
                await self._problem().response()(scope, receive, send)
                return
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if chunked:
            # No declared length: read the body here, up to the limit, before the app sees it.
            # (An exception raised from inside the app's receive would be caught by FastAPI's
            # body parsing and answered as a 400; the limit is small, so buffering is cheap.)
            buffered: list[dict] = []
            seen = 0
            while True:
                message = await receive()
                buffered.append(message)
                if message["type"] != "http.request":
                    break
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    await self._problem().response()(scope, receive, send)
                    return
                if not message.get("more_body", False):
                    break

            async def replay() -> dict:
                return buffered.pop(0) if buffered else await receive()

            await self.app(scope, replay, send)
            return
        seen = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._problem().response()(scope, receive, send)


class OneAuthorization:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and sum(name == b"authorization" for name, _ in scope.get("headers", ())) > 1:
            message = "more than one Authorization header; send one"
            problem = HttpProblem(400, "Bad request", f"Authorization: {message}", kind="header",
                                  errors=[error_entry(["Authorization"], message, where="header")])
            await problem.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class NoNulBytes:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            parts = (("query", scope.get("query_string", b"")), ("path", scope.get("raw_path") or b""))
            for where, text in parts:
                if b"%00" in text or b"\x00" in text:
                    message = "holds a NUL byte (%00)"
                    problem = HttpProblem(422, "Invalid request", f"the URL's {where} {message}", kind="validation",
                                          errors=[error_entry([where], message, where=where)])
                    await problem.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class AccessLog:
    def __init__(self, app: Any, metrics: Any):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        request_id = uuid.uuid4().hex[:16]

        async def tracking_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                headers = [*message["headers"], (b"x-request-id", request_id.encode())]
                # nosniff: a browser never reads a JSON (or any) answer as another type; once (the
                # dashboard's pages carry it with their other security headers)
                if not any(name.lower() == b"x-content-type-options" for name, _ in headers):
                    headers.append((b"x-content-type-options", b"nosniff"))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            elapsed = time.perf_counter() - start
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_request(scope["method"], template, status, elapsed)
            if log.isEnabledFor(logging.INFO):
                log.info("request", extra={"method": scope["method"], "path": scope["path"], "route": template,
                                           "status": status, "duration_ms": round(elapsed * 1e3, 3),
                                           "request_id": request_id})
