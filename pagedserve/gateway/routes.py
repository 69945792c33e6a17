"""The HTTP routes: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, and the
/health and /ready probes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from litestar import Request, Response, get, post
from litestar.enums import RequestEncodingType
from litestar.params import Body
from litestar.response import Stream

from pagedserve.gateway.errors import error_response
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.gateway.responses import ResponseBuilder
from pagedserve.gateway.streaming import serve
from pagedserve.gateway.tokenizer import PromptTokenizer
from pagedserve.gateway.validation import authenticate, check_model, check_request_size

if TYPE_CHECKING:
    from pagedserve.gateway.app import GatewayState

_JSON = Body(media_type=RequestEncodingType.JSON)


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


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
    tenant = authenticate(state, request)
    check_model(state, data.model)
    params = data.sampling_params()
    check_request_size(state, params, data.num_prompts if isinstance(data, CompletionRequest) else 1)
    prompts = prompts_of(state.tokenizer)
    builder = ResponseBuilder(kind, data.model, params.n, len(prompts), data.include_usage, params.logprobs)
    return await serve(state, request, data, prompts, params, tenant, builder)


@get("/v1/models", summary="List the served models (OpenAI)")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    authenticate(state, request)
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
