"""The gateway when its Redis is full (past `maxmemory`, policy noeviction): admission must
refuse with a 503 and Retry-After, as when the queue is unreachable, not fail with a 500."""

from __future__ import annotations

import time

import pytest
import redis
from litestar.testing import TestClient

from pagedserve.common import queue_protocol as q
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.app import create_app
from pagedserve.gateway.tokenizer import PromptTokenizer

from tiny_models import build_tokenizer


def fill_up(client: redis.Redis) -> None:
    """As if queued requests and outputs had filled Redis: from now on every command that may
    grow its memory is refused with Redis's OOM error (deletes and reads still work)."""
    client.config_set("maxmemory", 1)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("probe", 1)


def test_admission_into_a_full_redis_is_a_503_with_retry_after(tmp_path):
    build_tokenizer(tmp_path)
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.zadd(q.WORKERS, {"w1": time.time() + 60})  # a live worker
        app = create_app(ServeConfig(), server.url, PromptTokenizer(tmp_path), ("tiny",), 64, {})
        try:
            with TestClient(app) as http:
                fill_up(client)
                r = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4})
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "1"
            error = r.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("server_error", "service_unavailable", None)
            assert "memory" in error["message"]
            assert client.xlen(q.REQUESTS) == 0 and int(client.get(q.QUEUED) or 0) == 0  # nothing half-admitted
        finally:
            client.close()
