"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, and the
exception handlers that turn every failure of a route into one."""

from __future__ import annotations

import logging
import re

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from pagedserve.common.errors import PagedServeError
from pagedserve.common.queue_protocol import WireError

logger = logging.getLogger(__name__)


class InvalidBodyError(PagedServeError):
    """The request body as a whole is refused (no one field is to blame)."""

    code = "invalid_request"


def error_response(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(content=body, status_code=status, headers=headers)


def wire_error_response(e: WireError) -> Response:
    """A worker's or the queue's error; a 429 or 503 tells the client when to retry."""
    headers = {"Retry-After": "1"} if e.status_code in (429, 503) else None
    return error_response(e.status_code, e.message, e.type, e.code, e.param, headers)


# -- exception handlers (create_app maps exception types to them) ---------------------------
def paged_error_handler(_: Request, exc: PagedServeError) -> Response:
    headers = {"Retry-After": "1"} if exc.status_code in (429, 503) else None
    return error_response(exc.status_code, exc.message, exc.error_type, exc.code, exc.param, headers)


def validation_error_handler(_: Request, exc: ValidationException) -> Response:
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


def http_error_handler(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    kinds = {400: ("invalid_request_error", "invalid_request"), 404: ("not_found_error", "not_found"),
             405: ("invalid_request_error", "method_not_allowed"), 413: ("invalid_request_error", "request_too_large")}
    type_, code = kinds.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return error_response(status, str(exc.detail), type_, code)


def internal_error_handler(_: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in the gateway", exc_info=exc)
    return error_response(500, "internal server error", "server_error", "internal_error")
