"""What a request must pass before anything is queued: the caller's API key, the model name,
the request's size, each prompt, and the admission limits (drain, max_tokens). Each check
raises the `PagedServeError` the client sees."""

from __future__ import annotations

import msgspec
from litestar.connection import ASGIConnection

from pagedserve.common.errors import (
    AuthenticationError,
    InvalidParameterError,
    ServiceUnavailableError,
    UnknownModelError,
    check_context,
)
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.gateway.auth import tenant_for
from pagedserve.gateway.state import GatewayState


def authenticate(state: GatewayState, request: ASGIConnection) -> str | None:
    """The caller's tenant (the prefix-cache salt); None when the server has no keys."""
    if not state.api_keys:
        return None
    tenant = tenant_for(state.api_keys, request.headers.get("authorization"))
    if tenant is None:
        raise AuthenticationError("a valid API key is required (Authorization: Bearer KEY)")
    return tenant


def check_model(state: GatewayState, model: str) -> None:
    if model not in state.model_names:
        raise UnknownModelError(f"the model {model!r} does not exist; this server serves {state.model_names[0]!r}", param="model")


def check_prompt(state: GatewayState, token_ids: list[int], params: SamplingParams) -> None:
    config, limit = state.config, state.max_model_len
    if not token_ids:
        raise InvalidParameterError("prompt", "the prompt is empty")
    vocab = state.vocab_size
    if not all(0 <= t < vocab for t in token_ids):
        raise InvalidParameterError("prompt", f"token ids must be integers in [0, {vocab})")
    if config.max_prompt_tokens is not None and len(token_ids) > config.max_prompt_tokens:
        raise InvalidParameterError("prompt", f"has {len(token_ids)} tokens; this server takes at most {config.max_prompt_tokens}")
    check_context(len(token_ids), limit, params.max_tokens)


def check_request_size(state: GatewayState, params: SamplingParams, num_prompts: int, num_messages: int = 0) -> None:
    """The bounds that keep one request from taking a worker or the gateway, checked before
    any prompt is tokenized: n, prompts, prompts × n, chat messages, stop strings and stop
    token ids."""
    config = state.config
    if params.n > state.max_n:
        raise InvalidParameterError("n", f"must be an integer in [1, {state.max_n}], got {params.n}")
    if num_messages > config.max_chat_messages:
        raise InvalidParameterError("messages", f"has {num_messages} messages; this server takes at most "
                                                f"{config.max_chat_messages}")
    if num_prompts > config.max_prompts_per_request:
        raise InvalidParameterError("prompt", f"has {num_prompts} prompts; this server takes at most "
                                              f"{config.max_prompts_per_request} per request")
    if num_prompts * params.n > config.max_choices_per_request:
        raise InvalidParameterError("n", f"{num_prompts} prompts × n={params.n} is more than the "
                                         f"{config.max_choices_per_request} completions a request may ask for")
    stop = params.stop_strings
    if len(stop) > config.max_stop_strings:
        raise InvalidParameterError("stop", f"has {len(stop)} entries; at most {config.max_stop_strings}")
    if any(len(s) > config.max_stop_string_length for s in stop):
        raise InvalidParameterError("stop", f"a stop string is longer than {config.max_stop_string_length} characters")
    if params.stop_token_ids and len(params.stop_token_ids) > config.max_stop_token_ids:
        raise InvalidParameterError("stop_token_ids", f"has {len(params.stop_token_ids)} entries; at most "
                                                      f"{config.max_stop_token_ids}")


def prefix_cache_salt(state: GatewayState, tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt of the request's prefix-cache blocks: the tenant alone when the request gives
    no `cache_salt` (as before there was one), else both, JSON-encoded so that no pair of
    (tenant, salt) reads as another; None when there is neither."""
    if cache_salt is None:
        return tenant
    if not cache_salt:
        raise InvalidParameterError("cache_salt", "must not be empty")
    limit = state.config.max_cache_salt_length
    if len(cache_salt) > limit:
        raise InvalidParameterError("cache_salt", f"has {len(cache_salt)} characters; at most {limit}")
    return msgspec.json.encode([tenant, cache_salt]).decode()


def check_admission(state: GatewayState, prompts: list[list[int]], params: SamplingParams) -> SamplingParams:
    """May these prompts be queued: not draining, max_tokens within bounds, every prompt valid.
    Returns the parameters to queue: a null max_tokens is capped to `--max-tokens-limit`
    (the worker still stops at the context length)."""
    if state.drain_deadline is not None:
        raise ServiceUnavailableError("the server is shutting down")
    config = state.config
    limit = config.max_tokens_limit
    if limit is not None and params.max_tokens is not None and params.max_tokens > limit:
        raise InvalidParameterError("max_tokens", f"must be <= {limit}")
    for ids in prompts:
        check_prompt(state, ids, params)
    if limit is not None and params.max_tokens is None:
        params = msgspec.structs.replace(params, max_tokens=limit)
    return params
