"""The serve path of a completion request, once it is parsed and authenticated.

Each prompt of a request becomes one `QueuedRequest` (tokenized, checked against the
context length, salted with the caller's tenant), routed to a worker (`routing`) and
admitted into that worker's stream or its tenant's under the tenant's limits by the
queue's Lua script. The
answer is folded from the requests' chunks (read from the gateway's reply stream), merged across prompts, and sent whole
or as server-sent events; a client that goes away has its requests cancelled in the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from functools import partial

from litestar import Request, Response
from litestar.response import Stream

from pagedserve.common.errors import PagedServeError
from pagedserve.common.output_log import OutputLog
from pagedserve.common.queue_protocol import CompletionDelta, QueuedRequest, WireError
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.auth import TenantLimits
from pagedserve.gateway.error_handlers import wire_error_response
from pagedserve.gateway.http_tracing import note_answer, span_of, traceparent_for_queue
from pagedserve.gateway.queue_client import RequestLost, ShuttingDown
from pagedserve.gateway.responses import ResponseBuilder
from pagedserve.gateway.state import GatewayState
from pagedserve.gateway.validation import check_admission

logger = logging.getLogger(__name__)

#: output batches one multi-prompt request may hold before its readers wait for the client
_INBOX_SIZE = 64
#: the limits of a tenant the keys file gives none (and of callers without a tenant)
_DEFAULT_LIMITS = TenantLimits()


async def _admit(state: GatewayState, request: Request, prompts: list[list[int]], params: SamplingParams,
                 tenant: str | None, cache_salt: str | None) -> list[QueuedRequest]:
    """Queue every prompt (all or none) and return the queued requests."""
    params = check_admission(state, prompts, params)
    config = state.config
    base = uuid.uuid4().hex
    now = time.time()
    traceparent = traceparent_for_queue(span_of(request), request.headers.get("traceparent"))
    queued = [
        QueuedRequest(request_id=f"{base}-{i}", prompt_token_ids=ids, params=params, cache_salt=cache_salt,
                      tenant=tenant, deadline=now + config.request_timeout, enqueued_at=now,
                      traceparent=traceparent)
        for i, ids in enumerate(prompts)
    ]
    limits = state.tenant_limits.get(tenant, _DEFAULT_LIMITS) if tenant else _DEFAULT_LIMITS  # None: the config's
    admitted: list[QueuedRequest] = []
    try:
        for qr in queued:
            await state.routing.submit(qr, limits.max_requests, limits.max_queued_tokens)
            admitted.append(qr)
    except PagedServeError:
        for qr in admitted:
            state.spawn(state.queue.cancel(qr.request_id))
        raise
    return queued


async def _merged_outputs(state: GatewayState, queued: list[QueuedRequest]
                          ) -> AsyncGenerator[tuple[int, list[CompletionDelta], OutputLog, bool], None]:
    """(prompt index, new deltas, that prompt's log, whether these are its last) across every
    prompt, as they come. The log may already hold later deltas than the item's (see `pump`):
    whether the prompt ended is the item's flag, not `log.done`."""
    n = queued[0].params.n
    give_up = partial(_drain_expired, state)
    if len(queued) == 1:
        async for deltas, log in state.queue.outputs(queued[0].request_id, n, queued[0].deadline, give_up):
            yield 0, deltas, log, log.done
        return
    # Bounded: a pump waits while the client reads slowly, instead of piling up deltas.
    inbox: asyncio.Queue = asyncio.Queue(maxsize=_INBOX_SIZE)

    async def pump(i: int, qr: QueuedRequest) -> None:
        # A pump runs ahead of the consumer: it folds a whole batch of entries into `log`
        # before the consumer takes the first of them. Whether this item is the prompt's last
        # is noted as of the item; `log.done` read later is True for every item of the batch.
        try:
            async for deltas, log in state.queue.outputs(qr.request_id, n, qr.deadline, give_up):
                await inbox.put((i, deltas, log, log.done, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await inbox.put((i, [], None, False, exc))

    tasks = [asyncio.create_task(pump(i, qr)) for i, qr in enumerate(queued)]
    try:
        remaining = len(queued)
        while remaining:
            i, deltas, log, last, exc = await inbox.get()
            if exc is not None:
                raise exc
            if last:
                remaining -= 1
            yield i, deltas, log, last
    finally:
        for t in tasks:
            t.cancel()


def _drain_expired(state: GatewayState) -> bool:
    return state.drain_deadline is not None and time.monotonic() >= state.drain_deadline


def _wire_error_of(exc: BaseException, config: ServeConfig) -> WireError:
    if isinstance(exc, TimeoutError):
        return WireError(message=f"the request did not finish within the {config.request_timeout:g} s request timeout",
                         type="timeout_error", code="request_timeout", status_code=504)
    if isinstance(exc, ShuttingDown):
        return WireError(message="the server shut down before this request finished", type="server_error",
                         code="shutting_down", status_code=503)
    if isinstance(exc, RequestLost):
        return WireError(message="the request was lost by the queue (Redis restarted without it); retry it",
                         type="server_error", code="request_lost", status_code=503)
    logger.exception("reading outputs failed", exc_info=exc)
    return WireError(message="internal error while reading the outputs", type="server_error", code="internal_error")


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def serve(state: GatewayState, request: Request, body, prompts: list[list[int]], params: SamplingParams,
                tenant: str | None, cache_salt: str | None, builder: ResponseBuilder) -> Response | Stream:
    """Admit the prompts into the tenant's stream, then answer: the whole body, or an SSE
    stream when `body.stream`. `cache_salt` keeps the KV blocks of different salts apart."""
    queued = await _admit(state, request, prompts, params, tenant, cache_salt)
    builder.prompt_lengths = [len(p) for p in prompts]
    events = _merged_outputs(state, queued)

    def cancel_all() -> None:
        for qr in queued:
            state.spawn(state.queue.cancel(qr.request_id))

    async def consume() -> None:
        """Everything when not streaming; only the first event when streaming, so an error
        before the first token still gets its own HTTP status."""
        async for item in events:
            builder.add(*item)
            if body.stream:
                return

    # Until the response starts, a client that goes away is noticed here.
    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        # Cancel first: unwinding the reader (a blocked XREAD) may take a while.
        logger.info("client of %s went away before the answer; cancelling", queued[0].request_id)
        cancel_all()
        work.cancel()
        return Response(content=b"", status_code=499)  # nobody reads it
    if (exc := work.exception()) is not None:
        await events.aclose()
        cancel_all()
        return wire_error_response(_wire_error_of(exc, state.config))
    if builder.error is not None and (not body.stream or not builder.has_content()):
        await events.aclose()  # a whole answer fails whole; a stream fails in-band once it began
        return wire_error_response(builder.error)
    if not body.stream:
        note_answer(span_of(request), builder)
        return Response(content=builder.final_body())

    async def sse() -> AsyncIterator[bytes]:
        finished = builder.all_done()
        try:
            for chunk in builder.stream_chunks():
                yield chunk
            if not finished:
                async for item in events:
                    builder.add(*item)
                    for chunk in builder.stream_chunks():
                        yield chunk
                finished = True
            note_answer(span_of(request), builder)
            for chunk in builder.stream_end():
                yield chunk
        except (TimeoutError, ShuttingDown, RequestLost) as exc:  # tell the client, then [DONE]
            finished = True
            cancel_all()
            yield builder.error_event(_wire_error_of(exc, state.config))
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream
                cancel_all()
            await events.aclose()

    return Stream(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
