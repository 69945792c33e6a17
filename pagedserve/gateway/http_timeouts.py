"""Time limits on how slowly a client may send a request (slowloris), which uvicorn lacks.

uvicorn closes idle keep-alive connections, but waits forever for a request that arrives a
byte at a time, or for a connection that sends nothing at all; each such connection holds a
socket and a place under `--max-connections`. `TimedH11Protocol` is uvicorn's h11 protocol
with two deadlines per request: its headers must arrive within `--header-timeout` of the
connection opening (or of the request's first byte, on a kept-alive connection), and its
body within `--body-timeout` of the headers. A request past either gets a 408 when nothing
was answered yet, and its connection is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with deadlines on receiving a request's headers and body."""

    header_timeout: float = 10.0  # set by `with_request_timeouts`
    body_timeout: float = 60.0

    _deadline: asyncio.TimerHandle | None = None
    _waiting_for: str | None = None  # "headers" or "body": what the deadline is for

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._expect("headers")

    def data_received(self, data: bytes) -> None:
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
            self.transport.write(_timeout_response(f"the request {part} did not arrive within {timeout:g} s"))
        if cycle is not None:  # the app, waiting for the body, reads a disconnect and answers no one
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def _timeout_response(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    head = ("HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


def with_request_timeouts(header_timeout: float, body_timeout: float) -> type[TimedH11Protocol]:
    """The protocol class for uvicorn's `http=`, with these deadlines."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": header_timeout, "body_timeout": body_timeout})
