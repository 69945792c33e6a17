"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, and the
exception handlers that turn every failure of a route into one. The shape and the handlers
the prefix cache service shares live in `common/http_errors.py`; the gateway's own are here."""

from __future__ import annotations

import re

from litestar import Request, Response
from litestar.exceptions import ValidationException

from pagedserve.common.http_errors import (
    InvalidBodyError,
    error_response,
    http_error_handler,
    internal_error_handler,
    paged_error_handler,
)
from pagedserve.common.queue_protocol import WireError

__all__ = ["InvalidBodyError", "error_response", "http_error_handler", "internal_error_handler",
           "paged_error_handler", "validation_error_handler", "wire_error_response"]


def wire_error_response(e: WireError) -> Response:
    """A worker's or the queue's error; a 429 or 503 tells the client when to retry."""
    headers = {"Retry-After": "1"} if e.status_code in (429, 503) else None
    return error_response(e.status_code, e.message, e.type, e.code, e.param, headers)


# -- exception handlers (create_app maps exception types to them) ---------------------------
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
