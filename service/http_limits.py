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
  ``limit_concurrency`` (503 past it), and the process's open-file limit is raised to its hard
  limit at start, so 1,100 slow connections under a 1,024-descriptor limit no longer refuse
  everyone else (they are dropped after the head timeout instead).

Without httptools (uvicorn's h11 protocol) the head's size is bounded by h11 itself
(``h11_max_incomplete_event_size``); the head timeout needs httptools.
"""

from __future__ import annotations

import asyncio
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
    """The keyword arguments of ``uvicorn.Config``/``uvicorn.run`` that apply these bounds."""
    options: dict[str, Any] = {"limit_concurrency": max_connections, "h11_max_incomplete_event_size": max_header_bytes}
    if importlib.util.find_spec("httptools") is not None:
        options["http"] = bounded_protocol(max_header_bytes, header_timeout_s)
    return options


def bounded_protocol(max_header_bytes: int, header_timeout_s: float) -> type:
    """uvicorn's httptools protocol with the head's size and time bounded (module docstring)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._in_head, self._head_bytes, self._head_timer = True, 0, None
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if self._in_head:  # bytes of a head not yet complete: counted before httptools buffers them
                if self._head_timer is None:
                    self._head_timer = self.loop.call_later(header_timeout_s, self._head_too_slow)
                self._head_bytes += len(data)
                if self._head_bytes > max_header_bytes:
                    self._refuse(431, "Request Header Fields Too Large",
                                 f"the request line and headers are over {max_header_bytes} bytes")
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            self._stop_head_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)  # a next request already parsed: its head is done
            super().on_response_complete()
            self._in_head = not pipelined  # else what arrives next is the next request's head

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                self._refuse(408, "Request Timeout", f"the request line and headers took over {header_timeout_s:g} s")

        def _refuse(self, status: int, reason: str, message: str) -> None:
            self._in_head = False
            self._stop_head_timer()
            body = message.encode("ascii")
            self.transport.write(b"".join([
                f"HTTP/1.1 {status} {reason}\r\n".encode("ascii"),
                b"content-type: text/plain; charset=utf-8\r\n",
                b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                b"connection: close\r\n\r\n", body]))
            self.transport.close()

    return BoundedHttpToolsProtocol
