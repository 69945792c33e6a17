"""Time limits on how slowly a client may send a request (slowloris), which uvicorn lacks.

uvicorn closes idle keep-alive connections, but waits forever for a request that arrives a
byte at a time, or for a connection that sends nothing at all; each such connection holds a
socket and a place under `--max-connections`. `TimedH11Protocol` is uvicorn's h11 protocol
with two deadlines per request: its headers must arrive within `--header-timeout` of the
connection opening (or of the request's first byte, on a kept-alive connection), and its
body within `--body-timeout` of the headers. A request past either gets a 408 when nothing
was answered yet, and its connection is closed. It also bounds the open connections: a
request on a connection beyond `--max-connections` gets a 503 in OpenAI's shape (uvicorn's
own limit answers in plain text).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.common.http_errors import ErrorBody, ErrorDetail

logger = logging.getLogger(__name__)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with deadlines on receiving a request's headers and body."""

    header_timeout: float = 10.0  # set by `with_request_timeouts`
    body_timeout: float = 60.0
    max_connections: int | None = None  # beyond it, a connection's request gets a 503
    # told of each answer written here (status, error code): the gateway's metrics; None: nobody
    on_answer: Callable[[int, str], None] | None = None

    _over_limit = False  # this connection came beyond max_connections

    _deadline: asyncio.TimerHandle | None = None
    _waiting_for: str | None = None  # "headers" or "body": what the deadline is for

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._over_limit = self.max_connections is not None and len(self.connections) > self.max_connections
        self._expect("headers")

    def data_received(self, data: bytes) -> None:
        if self._over_limit:  # answered once its first bytes are read, so closing resets nothing
            if not self.transport.is_closing():
                self.transport.write(_error_response(
                    503, "Service Unavailable", f"the server holds {self.max_connections} connections, its limit; retry later",
                    "server_error", "too_many_connections", retry_after=True))
                self.transport.close()
                self._answered(503, "too_many_connections")
            return
        if self._waiting_for is None and self.conn.their_state is h11.IDLE:
            self._expect("headers")  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None)
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        """Move the deadline along with what h11 has read of the request."""
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._waiting_for == "headers":
            self._expect("body")
        elif state is not h11.IDLE and state is not h11.SEND_BODY:  # read whole, or the connection ends
            self._expect(None)

    def _expect(self, part: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._waiting_for, self._deadline = part, None
        if part is not None:
            timeout = self.header_timeout if part == "headers" else self.body_timeout
            self._deadline = self.loop.call_later(timeout, self._timed_out)

    def _timed_out(self) -> None:
        part, timeout = self._waiting_for, self.header_timeout if self._waiting_for == "headers" else self.body_timeout
        self._waiting_for, self._deadline = None, None
        if self.transport.is_closing():
            return
        logger.debug("closing a connection from %s: the request %s did not arrive within %g s", self.client, part, timeout)
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None
        if cycle is None or not cycle.response_started:
            self.transport.write(_error_response(408, "Request Timeout", f"the request {part} did not arrive within "
                                                 f"{timeout:g} s", "invalid_request_error", "request_timeout"))
            self._answered(408, "request_timeout")
        if cycle is not None:  # the app, waiting for the body, reads a disconnect and answers no one
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


    def _answered(self, status: int, code: str) -> None:
        if self.on_answer is not None:
            try:
                self.on_answer(status, code)
            except Exception:  # counting must never break a connection
                logger.exception("counting an answer failed")


def _error_response(status: int, reason: str, message: str, type_: str, code: str, retry_after: bool = False) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-shaped error body, closing the connection."""
    body = msgspec.json.encode(ErrorBody(ErrorDetail(message, type_, None, code)))
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + ("retry-after: 1\r\n" if retry_after else "") + f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


def with_request_timeouts(header_timeout: float, body_timeout: float, max_connections: int | None = None,
                          on_answer: Callable[[int, str], None] | None = None) -> type[TimedH11Protocol]:
    """The protocol class for uvicorn's `http=`, with these deadlines and connection limit;
    `on_answer(status, error code)` hears of each answer the protocol writes itself."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": header_timeout, "body_timeout": body_timeout,
                                                          "max_connections": max_connections,
                                                          "on_answer": staticmethod(on_answer) if on_answer else None})
