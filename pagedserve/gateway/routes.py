"""The HTTP routes: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, and the
/health and /ready probes.

What a request goes through, in order, so that the cheap refusals come first:
1. `require_api_key` (a guard): the API key, before the body is read; the tenant is kept in
   the connection's state.
2. `check_body` (before the handler): the body is read (413 beyond `--max-body-bytes`) and
   its nesting and integers are checked on the bytes (`json_limits`), before Litestar parses it.
3. The handler: model, sampling parameters, the request's size, then the prompts are
   tokenized in a thread (`GatewayState.run_blocking`), then `streaming.serve`.
The probes and /docs need no key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from litestar import Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.enums import RequestEncodingType
from litestar.handlers.base import BaseRouteHandler
from litestar.params import Body
from litestar.response import Stream

from pagedserve.common.http_errors import error_response
from pagedserve.gateway.http_tracing import note_request, span_of
from pagedserve.gateway.json_limits import check_json_body
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.gateway.responses import ResponseBuilder
from pagedserve.gateway.state import GatewayState
from pagedserve.gateway.streaming import serve
from pagedserve.gateway.tokenizer import PromptTokenizer
from pagedserve.gateway.validation import (
    authenticate,
    check_model,
    check_request_size,
    prefix_cache_salt,
)

_JSON = Body(media_type=RequestEncodingType.JSON)


_TENANT = "pagedserve_tenant"  # the key of the caller's tenant in the connection's state


def _state(request: ASGIConnection) -> GatewayState:
    return request.app.state.gateway


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Guard: a 401 for a missing or unknown key, before the body is read or parsed. The
    caller's tenant (None without keys) is kept in the scope's state for the handler."""
    tenant = authenticate(_state(connection), connection)
    connection.scope.setdefault("state", {})[_TENANT] = tenant


def _tenant(request: Request) -> str | None:
    """The tenant `require_api_key` found; a route without the guard fails here, never open."""
    return request.scope["state"][_TENANT]


async def check_body(request: Request) -> None:
    """Read the body (bounded by `--max-body-bytes`) and refuse one too deeply nested or
    holding an integer beyond 64 bits, before Litestar parses it."""
    state = _state(request)
    body = await request.body()
    await state.run_blocking(check_json_body, body, state.config.max_json_depth)


@post("/v1/completions", status_code=200, summary="Create a completion (OpenAI)", guards=[require_api_key],
      before_request=check_body)
async def create_completion(request: Request, data: Annotated[CompletionRequest, _JSON]) -> Response | Stream:
    return await _handle(request, data, "completion", data.num_prompts,
                         lambda tok: [p if isinstance(p, list) else tok.encode(p) for p in data.prompts()])


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion (OpenAI)", guards=[require_api_key],
      before_request=check_body)
async def create_chat_completion(request: Request, data: Annotated[ChatCompletionRequest, _JSON]) -> Response | Stream:
    return await _handle(request, data, "chat", 1,
                         lambda tok: [tok.encode_chat(data.template_messages(), data.add_generation_prompt)])


async def _handle(request: Request, data: CompletionRequest | ChatCompletionRequest, kind: str, num_prompts: int,
                  prompts_of: Callable[[PromptTokenizer], list[list[int]]]) -> Response | Stream:
    """What both routes do once the caller is known: model, parameters, size, prompts (in a
    thread), then serve, salted with the caller's tenant and `cache_salt`."""
    state = _state(request)
    check_model(state, data.model)
    params = data.sampling_params()
    note_request(span_of(request), data.model, params)
    num_messages = len(data.messages) if isinstance(data, ChatCompletionRequest) else 0
    check_request_size(state, params, num_prompts, num_messages)
    tenant = _tenant(request)
    salt = prefix_cache_salt(state, tenant, data.cache_salt)
    prompts = await state.run_blocking(prompts_of, state.tokenizer)
    builder = ResponseBuilder(kind, data.model, params.n, len(prompts), data.include_usage, params.logprobs)
    return await serve(state, request, data, prompts, params, tenant, salt, builder)


@get("/v1/models", summary="List the served models (OpenAI)", guards=[require_api_key])
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
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


#: every route, as create_app mounts them
ROUTE_HANDLERS = [create_completion, create_chat_completion, list_models, health, ready]
