"""The prefix cache service's HTTP API, a small Litestar app (`create_app`; the service runs
it under uvicorn in a thread of its own, http_server.py).

    POST /lookup   body: a prompt's chained block hashes, 32 bytes each, concatenated
                   → {"workers": {worker id: leading blocks held}}
    GET /health    → {"status": "ok", "workers": N, "blocks": M}
    GET /metrics   → Prometheus text: index size, event lag, batches, gaps, malformed
    GET /docs/openapi.json → the OpenAPI schema (/lookup's body and answer)

Errors have the gateway's shape (`common/http_errors.py`): a body over `max_body_bytes` is a
413, one that is not whole hashes a 400, an unknown path a 404, each
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.spec import (
    OpenAPIFormat,
    OpenAPIMediaType,
    OpenAPIType,
    Operation,
    RequestBody,
    Schema,
)

from pagedserve.common.errors import PagedServeError
from pagedserve.common.http_errors import (
    ErrorBody,
    InvalidBodyError,
    http_error_handler,
    internal_error_handler,
    paged_error_handler,
)


class IndexQueries(Protocol):
    """What the app asks of the service (index_service.py), which builds it around itself."""

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]: ...

    def index_size(self) -> tuple[int, int]: ...

    def metrics_text(self) -> bytes: ...


HASH_BYTES = 32  # SHA-256
#: the most hashes one lookup may send by default (a 1M-token prompt at block size 16)
MAX_LOOKUP_HASHES = 65_536


class LookupTooLargeError(PagedServeError):
    """A lookup's body beyond the service's `max_body_bytes`."""

    code = "request_too_large"
    status_code = 413


class LookupAnswer(msgspec.Struct):
    workers: dict[str, int]  # worker id → how many of the prompt's leading blocks it holds


class Health(msgspec.Struct):
    status: str
    workers: int  # known to the index
    blocks: int  # distinct block hashes indexed


@dataclass
class _LookupOperation(Operation):
    """/lookup's schema: its body is raw bytes, which Litestar cannot infer from a `data` field."""

    def __post_init__(self) -> None:
        hashes = Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY,
                        description=f"the prompt's chained block hashes, {HASH_BYTES} bytes each, concatenated")
        self.request_body = RequestBody(content={"application/octet-stream": OpenAPIMediaType(schema=hashes)},
                                        required=True)


_ERRORS = {400: ResponseSpec(ErrorBody, generate_examples=False, description=f"not whole {HASH_BYTES}-byte hashes"),
           413: ResponseSpec(ErrorBody, generate_examples=False, description="a body over the service's limit")}


@post("/lookup", status_code=200, summary="Which workers hold a prompt's leading blocks",
      operation_class=_LookupOperation, responses=_ERRORS)
async def lookup(request: Request) -> LookupAnswer:
    service: IndexQueries = request.app.state.service
    try:
        body = await request.body()
    except HTTPException as exc:  # Litestar's 413 beyond request_max_body_size: say what the limit is
        if exc.status_code != 413:
            raise
        limit: int = request.app.state.max_body_bytes
        raise LookupTooLargeError(f"a lookup's body is at most {limit} bytes ({limit // HASH_BYTES} hashes of "
                                  f"{HASH_BYTES} bytes); send fewer blocks") from None
    if len(body) % HASH_BYTES:
        raise InvalidBodyError(f"the body must be block hashes of {HASH_BYTES} bytes each, concatenated; "
                               f"got {len(body)} bytes")
    return LookupAnswer(service.lookup([body[i : i + HASH_BYTES] for i in range(0, len(body), HASH_BYTES)]))


@get("/health", summary="The service is alive: how many workers and blocks it indexes")
async def health(request: Request) -> Health:
    workers, blocks = request.app.state.service.index_size()
    return Health("ok", workers, blocks)


@get("/metrics", summary="Prometheus metrics of the index", include_in_schema=False)
async def metrics(request: Request) -> Response:
    # Litestar appends "; charset=utf-8" to a text/ type: this is Prometheus's text format 0.0.4
    return Response(content=request.app.state.service.metrics_text(), media_type="text/plain; version=0.0.4")


def create_app(service: IndexQueries, max_body_bytes: int) -> Litestar:
    """The service's HTTP API over `service` (its index, under its lock)."""
    return Litestar(
        route_handlers=[lookup, health, metrics],
        state=State({"service": service, "max_body_bytes": max_body_bytes}),
        exception_handlers={PagedServeError: paged_error_handler, HTTPException: http_error_handler,
                            Exception: internal_error_handler},
        request_max_body_size=max_body_bytes,
        openapi_config=OpenAPIConfig(title="pagedserve prefix cache", version="0.1.0", path="/docs"),
        logging_config=None,  # the process configures logging once (cli.py)
    )
