"""The gateway's own error answers in OpenAI's shape (`{"error": {"message", "type", "param",
"code"}}`): a worker's or the queue's `WireError`, and a request body that fails its schema.
The shape and the handlers the prefix cache service shares live in `common/http_errors.py`."""

from __future__ import annotations

import re

from litestar import Request, Response
from litestar.exceptions import ValidationException

from pagedserve.common.http_errors import error_response
from pagedserve.common.queue_protocol import WireError


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
