"""uvicorn's httptools protocol with a request head's size and time bounded (service/http/limits.py
says why and what the limits are). A class of its own module, named to uvicorn by its import path,
so that uvicorn's supervisor can hand it to the HTTP processes it spawns; each process reads the
limits its settings set (:func:`service.http.limits.set_head_limits`)."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.http.limits import HEAD_LIMITS


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._in_head, self._head_bytes, self._head_timer = True, 0, None
        self._head_since = self.loop.time()  # when it began to wait for a head (the oldest is closed first)
        self._max_head, self._head_timeout = HEAD_LIMITS["max_header_bytes"], HEAD_LIMITS["header_timeout_s"]
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        # A head not yet complete is counted chunk by chunk (a chunk is at most the transport's read
        # size): past the limit before a chunk, or still incomplete past it after one, the connection is
        # refused, so httptools never buffers more than the limit and a chunk. A chunk that completes the
        # head may carry the body's first bytes: they are the body's, not counted.
        if self._in_head:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self._head_timeout, self._head_too_slow)
            if self._head_bytes > self._max_head:
                self._too_large()
                return
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self._max_head and not self.transport.is_closing():
            self._too_large()

    def _too_large(self) -> None:
        self._refuse(431, "Request Header Fields Too Large",
                     f"the request line and headers are over {self._max_head} bytes")

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        self._stop_head_timer()
        self._make_room()
        super().on_headers_complete()

    def _make_room(self) -> None:
        """At the connection limit, a complete request is served by closing the connections that
        have not sent one (a head in progress or an idle keep-alive), oldest first, not refused
        503 behind them: 1,100 slow heads under the limit of 1,000 refused every other client
        until the head timeout dropped them (issue 37, 3)."""
        limit = self.limit_concurrency
        if limit is None or len(self.connections) < limit:
            return
        waiting = sorted((c for c in self.connections if c is not self and getattr(c, "_in_head", False)
                          and not c.transport.is_closing()), key=lambda c: c._head_since)
        for victim in waiting[: len(self.connections) - limit + 1]:
            victim._refuse(503, "Service Unavailable", "the server is at its connection limit and closed this "
                                                        "connection, which had not sent a complete request")
            self.connections.discard(victim)  # uvicorn discards it again when the transport closes

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a next request already parsed: its head is done
        super().on_response_complete()
        self._in_head = not pipelined  # else what arrives next is the next request's head
        self._head_since = self.loop.time()

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
            self._refuse(408, "Request Timeout", f"the request line and headers took over {self._head_timeout:g} s")

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
