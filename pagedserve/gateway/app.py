"""The Litestar app: OpenAI routes, SSE streaming, errors in OpenAI's shape, auth, drain.

Each prompt of a request becomes one `QueuedRequest` (tokenized, checked against the
context length, salted with the caller's tenant), admitted by the queue's Lua script. The
answer is folded from the request's output stream; a client that goes away has its
request cancelled in the worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Any

from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.enums import RequestEncodingType
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.params import Body
from litestar.response import Stream

from pagedserve.common.config import ServeConfig
from pagedserve.common.errors import (
    AuthenticationError,
    InvalidParameterError,
    PagedServeError,
    ServiceUnavailableError,
    UnknownModelError,
    check_context,
)
from pagedserve.common.messages import ChoiceDelta, OutputLog, QueuedRequest, WireError
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.gateway.auth import tenant_for
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.gateway.queue_client import QueueClient, ShuttingDown
from pagedserve.gateway.responses import ResponseBuilder
from pagedserve.gateway.tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)

_JSON = Body(media_type=RequestEncodingType.JSON)


@dataclass(slots=True)
class GatewayState:
    """What the routes share; one per app."""

    config: ServeConfig
    queue: QueueClient
    tokenizer: PromptTokenizer
    model_names: tuple[str, ...]  # names clients may ask for; the first is announced
    max_model_len: int  # tightened to the smallest a live worker announces
    vocab_size: int  # token ids a prompt may hold
    api_keys: dict[str, str]  # key → tenant; empty: no auth
    drain_deadline: float | None = None  # monotonic; set on SIGTERM
    background: set[asyncio.Task] = field(default_factory=set)

    def begin_drain(self) -> None:
        if self.drain_deadline is None:
            logger.info("gateway draining: no new requests, %g s for running ones", self.config.drain_timeout)
            self.drain_deadline = time.monotonic() + self.config.drain_timeout

    def spawn(self, coro) -> None:
        """Fire and forget, kept referenced until done (cancellations from finally blocks)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


# -- errors, in OpenAI's shape ------------------------------------------------------------
def error_response(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(content=body, status_code=status, headers=headers)


def _wire_error_response(e: WireError) -> Response:
    return error_response(e.status_code, e.message, e.type, e.code, e.param)


def _paged_error(_: Request, exc: PagedServeError) -> Response:
    headers = {"Retry-After": "1"} if exc.status_code in (429, 503) else None
    return error_response(exc.status_code, exc.message, exc.error_type, exc.code, exc.param, headers)


def _validation_error(_: Request, exc: ValidationException) -> Response:
    extra = exc.extra if isinstance(exc.extra, list) else []
    first = extra[0] if extra and isinstance(extra[0], dict) else {}
    param = first.get("key") or None
    message = first.get("message") or exc.detail
    missing = re.search(r"missing required field `([^`]+)`", message)
    if missing:
        param = missing.group(1)
    elif param == "data":  # the body as a whole
        param = None
    if param:
        message = f"{param}: {message}"
    return error_response(400, message, "invalid_request_error", "invalid_parameter", param)


def _http_error(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    kinds = {400: ("invalid_request_error", "invalid_request"), 404: ("not_found_error", "not_found"),
             405: ("invalid_request_error", "method_not_allowed"), 413: ("invalid_request_error", "request_too_large")}
    type_, code = kinds.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return error_response(status, str(exc.detail), type_, code)


def _internal_error(_: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in the gateway", exc_info=exc)
    return error_response(500, "internal server error", "server_error", "internal_error")


# -- the request path ------------------------------------------------------------------------
def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


def _authenticate(state: GatewayState, request: Request) -> str | None:
    """The caller's tenant (the prefix-cache salt); None when the server has no keys."""
    if not state.api_keys:
        return None
    tenant = tenant_for(state.api_keys, request.headers.get("authorization"))
    if tenant is None:
        raise AuthenticationError("a valid API key is required (Authorization: Bearer KEY)")
    return tenant


def _check_model(state: GatewayState, model: str) -> None:
    if model not in state.model_names:
        raise UnknownModelError(f"the model {model!r} does not exist; this server serves {state.model_names[0]!r}", param="model")


def _check_prompt(state: GatewayState, token_ids: list[int], params: SamplingParams) -> None:
    config, limit = state.config, state.max_model_len
    if not token_ids:
        raise InvalidParameterError("prompt", "the prompt is empty")
    vocab = state.vocab_size
    if not all(0 <= t < vocab for t in token_ids):
        raise InvalidParameterError("prompt", f"token ids must be integers in [0, {vocab})")
    if config.max_prompt_tokens is not None and len(token_ids) > config.max_prompt_tokens:
        raise InvalidParameterError("prompt", f"has {len(token_ids)} tokens; this server takes at most {config.max_prompt_tokens}")
    check_context(len(token_ids), limit, params.max_tokens)


async def _admit(state: GatewayState, request: Request, prompts: list[list[int]], params: SamplingParams,
                 tenant: str | None) -> list[QueuedRequest]:
    """Queue every prompt (all or none) and return the queued requests."""
    if state.drain_deadline is not None:
        raise ServiceUnavailableError("the server is shutting down")
    config = state.config
    if config.max_tokens_limit is not None and params.max_tokens is not None and params.max_tokens > config.max_tokens_limit:
        raise InvalidParameterError("max_tokens", f"must be <= {config.max_tokens_limit}")
    for ids in prompts:
        _check_prompt(state, ids, params)
    base = uuid.uuid4().hex
    now = time.time()
    traceparent = request.headers.get("traceparent")
    queued = [
        QueuedRequest(request_id=f"{base}-{i}", prompt_token_ids=ids, params=params, cache_salt=tenant,
                      deadline=now + config.request_timeout, enqueued_at=now, traceparent=traceparent)
        for i, ids in enumerate(prompts)
    ]
    admitted: list[QueuedRequest] = []
    try:
        for qr in queued:
            await state.queue.submit(qr)
            admitted.append(qr)
    except PagedServeError:
        for qr in admitted:
            state.spawn(state.queue.cancel(qr.request_id))
        raise
    return queued


async def _merged_outputs(state: GatewayState, queued: list[QueuedRequest]) -> AsyncIterator[tuple[int, list[ChoiceDelta], OutputLog]]:
    """(prompt index, new deltas, that prompt's log) across every prompt, as they come."""
    n = queued[0].params.n
    give_up = partial(_drain_expired, state)
    if len(queued) == 1:
        async for deltas, log in state.queue.outputs(queued[0].request_id, n, queued[0].deadline, give_up):
            yield 0, deltas, log
        return
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, qr: QueuedRequest) -> None:
        try:
            async for deltas, log in state.queue.outputs(qr.request_id, n, qr.deadline, give_up):
                await inbox.put((i, deltas, log, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await inbox.put((i, [], None, exc))

    tasks = [asyncio.create_task(pump(i, qr)) for i, qr in enumerate(queued)]
    try:
        remaining = len(queued)
        while remaining:
            i, deltas, log, exc = await inbox.get()
            if exc is not None:
                raise exc
            if log.done:
                remaining -= 1
            yield i, deltas, log
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
    logger.exception("reading outputs failed", exc_info=exc)
    return WireError(message="internal error while reading the outputs", type="server_error", code="internal_error")


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _serve(state: GatewayState, request: Request, body, prompts: list[list[int]], params: SamplingParams,
                 tenant: str | None, builder: ResponseBuilder) -> Response | Stream:
    queued = await _admit(state, request, prompts, params, tenant)
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
    if work.exception() is not None:
        await events.aclose()
        cancel_all()
        return _wire_error_response(_wire_error_of(work.exception(), state.config))
    if builder.error is not None and (not body.stream or not builder.has_content()):
        await events.aclose()  # a whole answer fails whole; a stream fails in-band once it began
        return _wire_error_response(builder.error)
    if not body.stream:
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
            for chunk in builder.stream_end():
                yield chunk
        except (TimeoutError, ShuttingDown) as exc:  # tell the client, then [DONE]
            finished = True
            cancel_all()
            yield builder.error_event(_wire_error_of(exc, state.config))
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream
                cancel_all()
            await events.aclose()

    return Stream(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@post("/v1/completions", status_code=200, summary="Create a completion (OpenAI)")
async def create_completion(request: Request, data: Annotated[CompletionRequest, _JSON]) -> Response | Stream:
    return await _handle(request, data, "completion",
                         lambda tok: [p if isinstance(p, list) else tok.encode(p) for p in data.prompts()])


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion (OpenAI)")
async def create_chat_completion(request: Request, data: Annotated[ChatCompletionRequest, _JSON]) -> Response | Stream:
    return await _handle(request, data, "chat",
                         lambda tok: [tok.encode_chat(data.template_messages(), data.add_generation_prompt)])


async def _handle(request: Request, data: CompletionRequest | ChatCompletionRequest, kind: str,
                  prompts_of: Callable[[PromptTokenizer], list[list[int]]]) -> Response | Stream:
    """What both routes do: auth, model, parameters, prompts, then serve."""
    state = _state(request)
    tenant = _authenticate(state, request)
    _check_model(state, data.model)
    params = data.sampling_params()
    prompts = prompts_of(state.tokenizer)
    builder = ResponseBuilder(kind, data.model, params.n, len(prompts), data.include_usage, params.logprobs)
    return await _serve(state, request, data, prompts, params, tenant, builder)


@get("/v1/models", summary="List the served models (OpenAI)")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    _authenticate(state, request)
    return {"object": "list", "data": [{"id": state.model_names[0], "object": "model", "created": 0,
                                        "owned_by": "pagedserve", "max_model_len": state.max_model_len}]}


@get("/health", summary="The gateway process is alive")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/ready", summary="Redis answers and at least one worker beats")
async def ready(request: Request) -> Response:
    state = _state(request)
    if state.drain_deadline is not None:
        return error_response(503, "the server is shutting down", "server_error", "shutting_down")
    if not await state.queue.ping():
        return error_response(503, "redis is unreachable", "server_error", "redis_unavailable")
    try:
        workers = await state.queue.live_workers()
    except Exception:  # noqa: BLE001 - any Redis trouble means not ready
        workers = []
    if not workers:
        return error_response(503, "no live worker", "server_error", "no_worker")
    return Response(content={"status": "ready", "workers": len(workers)})


async def _watch_workers(state: GatewayState) -> None:
    """Keep the context length at the smallest a live worker announces; keep the group."""
    configured = state.max_model_len
    while True:
        try:
            await state.queue.ensure_group()
            lens = [w.max_model_len for w in await state.queue.live_workers()]
            state.max_model_len = min([configured, *lens])
        except Exception as exc:  # noqa: BLE001 - Redis away: keep the last value
            logger.debug("worker watch: %s", exc)
        await asyncio.sleep(2.0)


def create_app(config: ServeConfig, redis_url: str, tokenizer: PromptTokenizer, model_names: tuple[str, ...],
               max_model_len: int, api_keys: dict[str, str], vocab_size: int | None = None) -> Litestar:
    """The gateway for one model; `vocab_size` defaults to the tokenizer's."""
    vocab_size = vocab_size or tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    state = GatewayState(config, QueueClient(redis_url, config), tokenizer, model_names, max_model_len, vocab_size, api_keys)

    async def startup(app: Litestar) -> None:
        state.spawn(_watch_workers(state))

    async def shutdown(app: Litestar) -> None:
        for task in list(state.background):
            task.cancel()
        await state.queue.close()

    return Litestar(
        route_handlers=[create_completion, create_chat_completion, list_models, health, ready],
        state=State({"gateway": state}),
        on_startup=[startup],
        on_shutdown=[shutdown],
        exception_handlers={
            PagedServeError: _paged_error,
            ValidationException: _validation_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        request_max_body_size=config.max_body_bytes,
        openapi_config=OpenAPIConfig(title="pagedserve", version="0.1.0", path="/docs"),
        debug=bool(os.environ.get("PAGEDSERVE_DEBUG")),
        logging_config=None,  # the process configures logging once (cli.py)
    )
