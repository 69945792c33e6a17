"""GET /metrics on the gateway without workers: every answer by route and status, the 429s
and 503s by reason, the queue's depth and live workers; no label holds a request's id."""

from __future__ import annotations

import asyncio
import time

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import QueuedRequest, WorkerInfo, encode
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.app import create_app
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.gateway.tokenizer import PromptTokenizer

from tiny_models import build_tokenizer

BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}


@pytest.fixture(scope="module")
def redis_client():
    import redis

    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.url = server.url
        yield client
        client.close()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _live_worker(redis_client) -> None:
    redis_client.zadd(q.WORKERS, {"w1": time.time() + 60})
    redis_client.set(q.worker_key("w1"), encode(WorkerInfo(worker_id="w1", model="tiny", max_model_len=64, pid=1,
                                                           host="h", max_num_seqs=4)))


def test_rejections_and_answers_are_counted(redis_client, tmp_path):
    build_tokenizer(tmp_path)
    redis_client.flushall()
    config = ServeConfig(max_queued_requests=1)
    app = create_app(config, redis_client.url, PromptTokenizer(tmp_path), ("tiny",), 64, {})
    with TestClient(app) as http:
        assert http.post("/v1/completions", json=BODY).json()["error"]["code"] == "service_unavailable"  # no worker
        assert http.get("/ready").status_code == 503  # a probe's answer: not a refused request
        assert http.get("/v1/nothing").status_code == 404
        assert http.get("/health").status_code == 200
        _live_worker(redis_client)

        async def fill_the_queue():
            queue = QueueClient(redis_client.url, config)
            try:
                await queue.submit(QueuedRequest(request_id="queued-1", prompt_token_ids=[1, 2], deadline=time.time() + 60,
                                                 params=SamplingParams(max_tokens=2)))
            finally:
                await queue.close()

        asyncio.run(fill_the_queue())
        refused = http.post("/v1/completions", json=BODY)
        assert (refused.status_code, refused.json()["error"]["code"]) == (429, "queue_full")

        # the watcher looks at Redis every 2 s; a scrape reads what it saw last
        deadline = time.monotonic() + 10
        while True:
            response = http.get("/metrics")
            samples = _samples(response.text)
            if samples[("pagedserve:workers_alive", ())] == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # once more: a scrape is counted as its answer starts, after its own body was made, so
        # only this one is sure to count the scrapes above (the loop may have ended at its first)
        response = http.get("/metrics")
        samples = _samples(response.text)

    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert samples[("pagedserve:workers_alive", ())] == 1
    assert samples[("pagedserve:queue_depth", ())] == 1
    rejected = {labels: v for (name, labels), v in samples.items() if name == "pagedserve:requests_rejected_total"}
    assert rejected == {(("reason", "service_unavailable"), ("status_code", "503")): 1,
                        (("reason", "queue_full"), ("status_code", "429")): 1}
    answered = {dict(labels)["route"] + " " + dict(labels)["status_code"]: v
                for (name, labels), v in samples.items() if name == "pagedserve:http_requests_total"}
    scrapes = answered.pop("/metrics 200")
    assert scrapes >= 1
    assert answered == {"/v1/completions 503": 1, "/v1/completions 429": 1, "/ready 503": 1, "other 404": 1,
                        "/health 200": 1}
    # labels only from bounded sets: no request id, prompt or path of an unknown route
    label_names = {name for (_, labels) in samples for name, _ in labels}
    assert label_names == {"reason", "status_code", "route"}
    values = " ".join(value for (_, labels) in samples for _, value in labels)
    assert "queued-1" not in values and "nothing" not in values
