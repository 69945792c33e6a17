"""The HTTP routes: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, and the
/health and /ready probes.

What a request goes through, in order, so that the cheap refusals come first:
1. `require_api_key` (a guard): the API key, before the body is read; the tenant is kept in
   the connection's state.
2. `check_body` (before the handler): the body is read (413 beyond `--max-body-bytes`) and
   its nesting and integers are checked on the bytes (`json_limits`), before Litestar parses it.
3. The handler: model, tools and the output constraint, sampling parameters, the request's
   size, the constraint compiled (in a thread, cached: `grammar_check`), then the prompts are
   tokenized in a thread (`GatewayState.run_blocking`), then `streaming.serve`.
The probes and /docs need no key.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.enums import RequestEncodingType
from litestar.handlers.base import BaseRouteHandler
from litestar.params import Body
from litestar.response import Stream

from pagedserve.common.http_errors import error_response
from pagedserve.gateway.chat_rendering import chat_inputs
from pagedserve.gateway.http_tracing import note_request, span_of
from pagedserve.gateway.json_limits import check_json_body
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.gateway.responses import ResponseBuilder
from pagedserve.gateway.state import GatewayState
from pagedserve.gateway.streaming import serve
from pagedserve.gateway.tokenizer import PromptTokenizer
from pagedserve.gateway.tool_calls import ToolPlan
from pagedserve.gateway.tool_output import ToolOutput
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
                         lambda tok, _: [p if isinstance(p, list) else tok.encode(p) for p in data.prompts()])


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion (OpenAI)", guards=[require_api_key],
      before_request=check_body)
async def create_chat_completion(request: Request, data: Annotated[ChatCompletionRequest, _JSON]) -> Response | Stream:
    state = _state(request)

    def prompts_of(tok: PromptTokenizer, plan: ToolPlan | None) -> list[list[int]]:
        assert plan is not None
        messages, tools = chat_inputs(data.template_messages(), plan, state.tool_parser, tok.template_uses_tools,
                                      tok.template_knows_tool_role)
        return [tok.encode_chat(messages, data.add_generation_prompt, tools)]

    return await _handle(request, data, "chat", 1, prompts_of)


async def _handle(request: Request, data: CompletionRequest | ChatCompletionRequest, kind: str, num_prompts: int,
                  prompts_of: Callable[[PromptTokenizer, ToolPlan | None], list[list[int]]]) -> Response | Stream:
    """What both routes do once the caller is known: model, tools, the output constraint,
    parameters, size, prompts (in a thread), then serve, salted with the caller's tenant and
    `cache_salt`."""
    state = _state(request)
    check_model(state, data.model)
    chat = isinstance(data, ChatCompletionRequest)
    plan = data.tool_plan(state.config.max_tools) if isinstance(data, ChatCompletionRequest) else None
    structured, constraint_field = data.output_constraint(plan)
    params = data.sampling_params(structured)
    note_request(span_of(request), data.model, params)
    num_messages = len(data.messages) if isinstance(data, ChatCompletionRequest) else 0
    check_request_size(state, params, num_prompts, num_messages)
    if structured is not None:
        await state.grammar.check(structured, constraint_field)
    call_end = state.tool_parser.call_end
    if plan is not None and plan.mode == "auto" and not plan.parallel and call_end:
        # parallel_tool_calls: false with tool_choice auto: the parser's closing tag is a stop
        # string, so generation ends at the end of the first complete call and the model never
        # writes a second one (the parser reads a last call left unclosed)
        params = msgspec.structs.replace(params, stop=[*params.stop_strings, call_end])
    tenant = _tenant(request)
    salt = prefix_cache_salt(state, tenant, data.cache_salt)
    prompts = await state.run_blocking(prompts_of, state.tokenizer, plan)
    tool_output = partial(ToolOutput, plan, state.tool_parser) if chat and plan is not None and plan.mode != "none" else None
    builder = ResponseBuilder(kind, data.model, params.n, len(prompts), data.include_usage, params.logprobs,
                              tool_output)
    return await serve(state, request, data, prompts, params, tenant, salt, builder)


@get("/v1/models", summary="List the served models (OpenAI)", guards=[require_api_key])
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {"object": "list", "data": [{"id": state.model_names[0], "object": "model", "created": 0,
                                        "owned_by": "pagedserve", "max_model_len": state.max_model_len}]}


@get("/health", summary="The gateway process is alive")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/ready", summary="Redis answers and at least one worker beats (Redis alone with --queue-without-workers)")
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
    if not workers and not state.config.queue_without_workers:
        return error_response(503, "no live worker", "server_error", "no_worker")
    return Response(content={"status": "ready", "workers": len(workers)})


#: every route, as create_app mounts them
ROUTE_HANDLERS = [create_completion, create_chat_completion, list_models, health, ready]
