"""The gateway's server span: one per completion request, kind SERVER, continuing the client's
`traceparent`, from the request's arrival until its answer's last byte (for an SSE stream,
when the stream ends), with the HTTP status and the GenAI request and usage attributes.

`ServerSpanMiddleware` (mounted by `create_app` only when tracing is on) starts it before the
guard and the body checks, so 401s, 413s and 400s get their span too, and keeps it in the
connection's state, where the handler finds it (`span_of`) to add the request's attributes
and to put its context in each `QueuedRequest.traceparent`. When tracing is off there is no
middleware and `span_of` returns None: the helpers below then do nothing.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.telemetry import tracing as t
from pagedserve.telemetry.tracing import Tracing

if TYPE_CHECKING:
    from litestar.connection import ASGIConnection
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

    from pagedserve.gateway.responses import ResponseBuilder

#: the routes that get a server span → their gen_ai.operation.name
TRACED_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
#: the key of the request's span in the connection's state
_SPAN = "pagedserve_span"


def _status_of(exc: BaseException) -> int:
    """The status the app's exception handlers answer an exception with (ours and Litestar's
    carry it; anything else is a 500)."""
    status = getattr(exc, "status_code", 500)
    return status if isinstance(status, int) else 500


def _end(span: Span, status: int | None) -> None:
    if status is not None:
        span.set_attribute(t.HTTP_STATUS, status)
        if status >= 400:
            span.set_attribute(t.ERROR_TYPE, str(status))
        if status >= 500:  # a 4xx is the client's error, not the server span's (HTTP semantic conventions)
            span.set_status(Status(StatusCode.ERROR))
    span.end()


class ServerSpanMiddleware:
    """ASGI middleware: the server span of each request to a `TRACED_ROUTES` route."""

    def __init__(self, app: ASGIApp, tracing: Tracing):
        assert tracing.tracer is not None, "the server span middleware needs tracing on"
        self.app = app
        self.tracer = tracing.tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope.get("path", "")
        if scope["type"] != "http" or route not in TRACED_ROUTES:
            await self.app(scope, receive, send)
            return
        headers = {k: v for k, v in scope["headers"] if k in (b"traceparent", b"tracestate")}
        parent = t.extract(_text(headers.get(b"traceparent")), _text(headers.get(b"tracestate")))
        method = str(scope.get("method", "POST"))
        span = self.tracer.start_span(f"{method} {route}", context=parent, kind=SpanKind.SERVER, attributes={
            t.HTTP_METHOD: method, t.HTTP_ROUTE: route, t.GEN_AI_OPERATION: TRACED_ROUTES[route]})
        scope.setdefault("state", {})[_SPAN] = span
        status: int | None = None
        ended = False

        async def traced_send(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False) and not ended:
                ended = True  # the answer's last bytes: the span ends as they leave
                _end(span, status)
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            if status is None and isinstance(exc, asyncio.CancelledError):
                status = 499  # the client went away before the answer: not the server's error
            elif status is None:  # raised before an answer began: the exception handlers answer it
                status = _status_of(exc)
                span.record_exception(exc)
            raise
        finally:
            if not ended:  # an error, or a client gone mid-stream
                ended = True
                _end(span, status)


def server_span_middleware(tracing: Tracing):
    """The middleware factory Litestar mounts (it calls it with the next ASGI app)."""
    def factory(app: ASGIApp) -> ASGIApp:
        return ServerSpanMiddleware(app, tracing)
    return factory


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


# -- what the handler adds -----------------------------------------------------------------------
def span_of(connection: ASGIConnection) -> Span | None:
    """The request's server span; None when tracing is off (or the route is not traced)."""
    state: dict[str, Any] = connection.scope.get("state", {})
    return state.get(_SPAN)


def note_request(span: Span | None, model: str, params: SamplingParams) -> None:
    """The GenAI request attributes, once the body is parsed and its parameters checked."""
    if span is not None:
        span.set_attributes({t.GEN_AI_MODEL: model, **t.sampling_attributes(params)})


def note_answer(span: Span | None, builder: ResponseBuilder) -> None:
    """The usage and finish reasons of a complete answer."""
    if span is None:
        return
    usage = builder.usage()
    span.set_attributes({
        t.GEN_AI_RESPONSE_ID: builder.id, t.GEN_AI_INPUT_TOKENS: usage["prompt_tokens"],
        t.GEN_AI_OUTPUT_TOKENS: usage["completion_tokens"],
        t.GEN_AI_CACHED_TOKENS: usage["prompt_tokens_details"]["cached_tokens"],
        t.GEN_AI_FINISH_REASONS: [r for r in builder.finish_reasons if r is not None],
    })


def traceparent_for_queue(span: Span | None, client_traceparent: str | None) -> str | None:
    """What goes in `QueuedRequest.traceparent`: the server span's context, so that the worker's
    spans are its children; with tracing off here, the client's header as it came."""
    return client_traceparent if span is None else t.traceparent_of(span)
