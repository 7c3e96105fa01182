"""Bounds on what a client can make ``foldwise serve`` hold before its request reaches the app
(issue 37, 3): the ASGI app, authentication included, only sees a request once its head (the
request line and headers) is parsed, so a head has limits of its own, set here at the HTTP
protocol:

- **Size.** uvicorn's httptools protocol has no limit on a head: one unfinished 200 MB header took
  the server from 89 to 485 MB, and 4 x 60 MB stalled its event loop for up to 24 s. A head is
  counted as it arrives; past ``max_header_bytes`` (default 64 KiB, as nginx's large buffers) the
  connection is answered 431 and closed, the bytes never parsed.
- **Time.** A head that is not complete ``header_timeout_seconds`` (default 10 s) after its first
  byte is answered 408 and closed: a slow client (a byte a second) no longer holds a connection
  open for as long as it likes. The app's own time (a derivation of a minute) is not counted: the
  clock stops when the head is complete, and starts again at the next request's first byte.
- **Connections.** At most ``max_connections`` (default 1,000) are served at once, uvicorn's
  ``limit_concurrency``, and the process's open-file limit is raised to its hard limit at start,
  so 1,100 slow connections under a 1,024-descriptor limit are accepted. At the limit, a request
  whose head is complete closes the oldest connections that have not sent one (503 and closed) and
  is served: slow heads no longer refuse every other client until the head timeout drops them.

The protocol is :class:`service.http.protocol.BoundedHttpToolsProtocol`. Without httptools
(uvicorn's h11 protocol) the head's size is bounded by h11 itself (``h11_max_incomplete_event_size``);
the head timeout needs httptools.
"""

from __future__ import annotations

import importlib.util
import resource
from typing import Any

MAX_HEADER_BYTES = 64 * 1024
HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1000


def raise_open_file_limit() -> int:
    """The soft limit on open files raised to the hard one (capped at 65,536); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):
            return soft
    return soft


def uvicorn_http_options(max_header_bytes: int, header_timeout_s: float, max_connections: int) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.Config``/``uvicorn.run`` that apply these bounds, the
    limits set for this process's protocol (:func:`set_head_limits`; each HTTP process sets its own)."""
    options: dict[str, Any] = {"limit_concurrency": max_connections, "h11_max_incomplete_event_size": max_header_bytes}
    set_head_limits(max_header_bytes, header_timeout_s)
    if importlib.util.find_spec("httptools") is not None:
        # by name: uvicorn's supervisor pickles its config into spawned processes
        options["http"] = "service.http.protocol:BoundedHttpToolsProtocol"
    return options


HEAD_LIMITS = {"max_header_bytes": MAX_HEADER_BYTES, "header_timeout_s": HEADER_TIMEOUT_S}  # of this process


def set_head_limits(max_header_bytes: int, header_timeout_s: float) -> None:
    HEAD_LIMITS.update(max_header_bytes=max_header_bytes, header_timeout_s=header_timeout_s)
