"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every
Litestar app of pagedserve (the gateway, the prefix cache service): the body, and the
exception handlers that turn a typed error, an HTTP error and an unexpected one into it."""

from __future__ import annotations

import logging

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from pagedserve.common.errors import PagedServeError

logger = logging.getLogger(__name__)


class InvalidBodyError(PagedServeError):
    """The request body as a whole is refused (no one field is to blame)."""

    code = "invalid_request"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None  # the request field to blame, if one is
    code: str | None


class ErrorBody(msgspec.Struct):
    """OpenAI's error shape; apps name it in their OpenAPI schemas."""

    error: ErrorDetail


def error_response(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(content=ErrorBody(ErrorDetail(message, type_, param, code)), status_code=status, headers=headers)


def paged_error_handler(_: Request, exc: PagedServeError) -> Response:
    headers = {"Retry-After": "1"} if exc.status_code in (429, 503) else None
    return error_response(exc.status_code, exc.message, exc.error_type, exc.code, exc.param, headers)


def http_error_handler(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    kinds = {400: ("invalid_request_error", "invalid_request"), 404: ("not_found_error", "not_found"),
             405: ("invalid_request_error", "method_not_allowed"), 413: ("invalid_request_error", "request_too_large")}
    type_, code = kinds.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return error_response(status, str(exc.detail), type_, code)


def internal_error_handler(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error", "server_error", "internal_error")
