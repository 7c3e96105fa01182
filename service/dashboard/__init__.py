"""The internal dashboard (issue 6): a static single-page app served by the API itself.

``mount_dashboard(app)`` adds:

- ``GET /``: ``static/index.html`` (the app; pages are hash routes ``#/jobs``, ``#/jobs/<id>``,
  ``#/specs/<hash>``, ``#/kernels``, ``#/kernels/<id>``, ``#/workers``, ``#/submit``), with a Content-Security-Policy
  that allows nothing but this server: the page must work on an isolated network, and the
  policy proves it loads nothing from elsewhere;
- ``/static/...``: the app's JS/CSS (``Cache-Control: no-cache``, revalidated by ETag, so a new
  release is picked up at once) and the vendored libraries under ``static/vendor/``
  (uPlot, KaTeX, highlight.js, with their licences; cached for a day);
- the dashboard's own JSON endpoints (:mod:`service.dashboard.api`).

There is no build step: the JS is plain ES modules. Every page reads the /v1 JSON API with
the bearer token the user pasted (kept in local storage), so what a page shows is exactly
what that token may read.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC_DIR = Path(__file__).resolve().parent / "static"
VENDOR_MAX_AGE_S = 86400

# 'unsafe-inline' for styles only: KaTeX's output and uPlot size elements with style attributes.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "font-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


class DashboardStatic(StaticFiles):
    """StaticFiles with caching and security headers (ETag / If-None-Match come from Starlette)."""

    def file_response(self, full_path, stat_result, scope: Scope, status_code: int = 200) -> Response:  # type: ignore[override]
        response = super().file_response(full_path, stat_result, scope, status_code)
        path = scope.get("path", "")
        vendored = "/vendor/" in path
        response.headers["Cache-Control"] = f"public, max-age={VENDOR_MAX_AGE_S}" if vendored else "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


def _index_response(request: Request) -> Response:
    body = (STATIC_DIR / "index.html").read_bytes()  # small; read each time so edits show without a restart
    headers = {"Cache-Control": "no-cache", **SECURITY_HEADERS}
    return Response(b"" if request.method == "HEAD" else body, media_type="text/html; charset=utf-8", headers=headers)


def mount_dashboard(app: FastAPI) -> None:
    """Serve the dashboard at ``/`` and ``/static``, and add its JSON endpoints to ``app``."""
    from service.dashboard.api import router

    app.include_router(router)
    app.add_api_route("/", _index_response, methods=["GET", "HEAD"], include_in_schema=False)
    app.mount("/static", DashboardStatic(directory=STATIC_DIR), name="dashboard-static")


__all__ = ["CSP", "STATIC_DIR", "mount_dashboard"]
