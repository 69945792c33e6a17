"""--queue-without-workers: the gateway admits while no worker is live (an autoscaler starts
them when the queue fills: KEDA from zero), /ready needs Redis alone, and the queue's depth,
the number KEDA scales on, is exactly what waits. Without it: 503 `no_worker`, as before."""

from __future__ import annotations

import asyncio
import time

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.common import queue_protocol as q
from pagedserve.common.errors import ServiceUnavailableError
from pagedserve.common.queue_protocol import QueuedRequest
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.app import create_app
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.gateway.tokenizer import PromptTokenizer

from tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


def _request(i: int) -> QueuedRequest:
    return QueuedRequest(request_id=f"wait-{i}", prompt_token_ids=[1, 2, 3], deadline=time.time() + 60,
                         params=SamplingParams(max_tokens=2))


async def _submit_all(url: str, config: ServeConfig, count: int) -> list[str]:
    queue = QueueClient(url, config)
    try:
        return [await queue.submit(_request(i)) for i in range(count)]
    finally:
        await queue.close()


def test_without_the_option_no_worker_means_503(redis_server):
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    with pytest.raises(ServiceUnavailableError, match="no worker"):
        asyncio.run(_submit_all(redis_server.url, ServeConfig(), 1))


def test_with_it_requests_wait_and_the_gauge_counts_them(redis_server, tmp_path):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    config = ServeConfig(queue_without_workers=True)
    assert asyncio.run(_submit_all(redis_server.url, config, 3)) == [q.REQUESTS] * 3
    assert client.xlen(q.REQUESTS) == 3 and int(client.get(q.QUEUED)) == 3
    build_tokenizer(tmp_path)
    app = create_app(config, redis_server.url, PromptTokenizer(tmp_path), ("tiny",), 64, {})
    with TestClient(app) as http:
        ready = http.get("/ready")
        assert (ready.status_code, ready.json()) == (200, {"status": "ready", "workers": 0})
        deadline = time.monotonic() + 10  # the watcher looks every 2 s
        while True:
            text = http.get("/metrics").text
            depth = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
            if depth.get("pagedserve:queue_depth") == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert depth["pagedserve:queue_depth"] == 3
    assert depth["pagedserve:workers_alive"] == 0
    client.close()
