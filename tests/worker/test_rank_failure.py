"""A worker whose tensor-parallel rank died stops, whole, with one log line naming the rank,
instead of retrying its loop: its supervisor restarts it and the queue moves its requests.
(The rank failure itself, from real gloo ranks, is tests/engine/test_tensor_parallel.py's.)"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from pagedserve import LLM, SamplingParams
from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import QueuedRequest
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.engine.tensor_parallel import RankFailure
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.worker.service import WorkerService

from serve_helpers import wait_until


def test_a_rank_failure_ends_the_worker_loop_with_a_log_line(tiny_checkpoint, monkeypatch, caplog):
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, attention_backend="torch").engine
    config = ServeConfig(drain_timeout=5.0, heartbeat_interval=0.2, worker_timeout=5.0)
    redis_server = EmbeddedRedis().start()
    service = WorkerService(engine, config, redis_server.url)

    def dead_rank_step():
        raise RankFailure("tensor-parallel rank 1 (pid 4242) exited with code -9")

    monkeypatch.setattr(engine, "step", dead_rank_step)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            service.run()
        except BaseException as exc:  # noqa: BLE001 - what ended the loop is the assertion
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    request = QueuedRequest(request_id="tp-1", prompt_token_ids=[5, 17, 33], deadline=time.time() + 60,
                            params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    try:
        with caplog.at_level(logging.ERROR, logger="pagedserve.worker.service"):
            thread.start()
            wait_until(lambda: service.queue.redis.zscore(q.WORKERS, service.worker_id), "the worker beating")

            async def submit() -> None:
                client = QueueClient(redis_server.url, config)
                try:
                    await client.submit(request)
                finally:
                    await client.close()

            started = time.monotonic()
            asyncio.run(submit())
            thread.join(timeout=10)
            assert not thread.is_alive(), "the worker kept looping after its rank died"
            assert time.monotonic() - started < 10
        assert len(raised) == 1 and isinstance(raised[0], RankFailure)
        stops = [r.getMessage() for r in caplog.records if "stops" in r.getMessage()]
        assert stops == [f"worker {service.worker_id} stops: tensor-parallel rank 1 (pid 4242) exited with code -9"]
    finally:
        service.queue.stop()
        redis_server.stop()
