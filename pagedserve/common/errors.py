"""Typed errors for user mistakes. The gateway maps each to one OpenAI-shaped body."""

from __future__ import annotations


class PagedServeError(Exception):
    """Base of every error a caller can cause."""

    #: OpenAI error `type`
    error_type = "invalid_request_error"
    #: OpenAI error `code`
    code: str | None = None
    status_code = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidParameterError(PagedServeError):
    """A sampling or request field is out of range or of the wrong kind."""

    code = "invalid_parameter"

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}", param=param)


class ContextLengthExceededError(PagedServeError):
    """The prompt (plus what it asks to generate) does not fit in the model's context."""

    code = "context_length_exceeded"

    def __init__(self, num_prompt_tokens: int, max_model_len: int, detail: str = ""):
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens, "
            f"but the prompt has {num_prompt_tokens} tokens{detail}.",
            param="prompt",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


def check_context(num_prompt_tokens: int, max_model_len: int, max_tokens: int | None = None) -> None:
    """Raise ContextLengthExceededError unless the prompt leaves room for at least one token
    (and, when given, for max_tokens more)."""
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthExceededError(num_prompt_tokens, max_model_len, " (at least one token must be generated)")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthExceededError(num_prompt_tokens, max_model_len, f" and max_tokens asks for {max_tokens} more")


class UnknownModelError(PagedServeError):
    """A model name that is neither a known alias nor a checkpoint directory."""

    error_type = "not_found_error"
    code = "model_not_found"
    status_code = 404


class PluginError(PagedServeError):
    """An unknown plugin name, or a plugin that failed to load."""

    error_type = "invalid_request_error"
    code = "unknown_plugin"


class AuthenticationError(PagedServeError):
    """A missing or unknown API key, when the server has keys."""

    error_type = "authentication_error"
    code = "invalid_api_key"
    status_code = 401


class QueueFullError(PagedServeError):
    """Admission refused: the queue holds as many requests or prompt tokens as it may."""

    error_type = "rate_limit_error"
    code = "queue_full"
    status_code = 429


class TenantLimitError(QueueFullError):
    """Admission refused: the caller's tenant is at one of its own limits (`code` says which)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class ServiceUnavailableError(PagedServeError):
    """No live worker, Redis unreachable, or the server is shutting down."""

    error_type = "server_error"
    code = "service_unavailable"
    status_code = 503
