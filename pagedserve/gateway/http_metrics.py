"""The gateway's Prometheus side: `GET /metrics`, and the hook that counts every answer.

`count_answers` is a Litestar `before_send` hook, so it sees every response the app sends,
whatever produced it (a handler, a guard, an exception handler, the router's 404): its
status, its route template (a request that matched no route counts as "other"), and for a
429 or 503 the `error.code` of its body, the rejection's reason. The answers the HTTP
protocol layer writes itself (`http_timeouts`: beyond --max-connections, slow clients) are
counted there, through the same `GatewayMetrics.count_answer`.

/metrics needs no API key, like the probes: it holds counts, never a prompt, a key or a
tenant; keep the gateway's port off the public network, or filter the path in front of it,
if even counts are not for everyone.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get

from pagedserve.gateway.state import GatewayState
from pagedserve.telemetry.metrics import CONTENT_TYPE, GatewayMetrics, error_code_of, exposition

#: the scope state key where a 429's or 503's status waits for its body (and error code)
_PENDING = "pagedserve_metrics_status"


def count_answers(metrics: GatewayMetrics):
    """The before_send hook: one count per response, at its start (a 429 or 503 at its body)."""

    async def hook(message: Any, scope: Any) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            status = message["status"]
            if status in (429, 503):
                scope["state"][_PENDING] = status  # its reason is in the body
            else:
                metrics.count_answer(scope.get("path_template"), status)
        elif kind == "http.response.body" and (status := scope["state"].pop(_PENDING, None)) is not None:
            metrics.count_answer(scope.get("path_template"), status, error_code_of(message.get("body", b"")))

    return hook


@get("/metrics", summary="Prometheus metrics of the gateway", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    return Response(content=exposition(state.metrics.registry), media_type=CONTENT_TYPE)
