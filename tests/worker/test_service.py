"""The worker process's loop, in-process: it drains and exits with Redis gone; a worker whose
step loop hangs stops beating and its request moves to another worker."""

from __future__ import annotations

import asyncio
import threading
import time

from pagedserve import LLM, SamplingParams
from pagedserve.common import queue_protocol as q
from pagedserve.common.output_log import OutputLog
from pagedserve.common.queue_protocol import QueuedRequest
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.worker.service import WorkerService

from serve_helpers import chunks_of, wait_until


def test_a_worker_drains_and_exits_when_redis_is_gone(tiny_checkpoint):
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22).engine
    redis_server = EmbeddedRedis().start()
    service = WorkerService(engine, ServeConfig(drain_timeout=1.0, heartbeat_interval=0.2, worker_timeout=1.0),
                            redis_server.url)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not service.queue.redis.zscore("pagedserve:workers", service.worker_id):
            assert time.monotonic() < deadline, "the worker never beat"
            time.sleep(0.05)
    finally:
        redis_server.stop()  # Redis goes first, as a terminal's Ctrl-C once made it
    time.sleep(0.5)  # the loop now meets a closed connection
    started = time.monotonic()
    service.drain()
    thread.join(timeout=1.0 + 5)
    assert not thread.is_alive(), "the worker kept retrying Redis instead of draining"
    assert time.monotonic() - started < 6


def test_a_request_that_times_out_while_draining_gets_its_error_and_its_ack(tiny_checkpoint, monkeypatch):
    """The last running request of a draining worker ends by its deadline: the worker writes
    its timeout error and acknowledges its entry before it leaves, so no other worker takes
    the entry over and nothing waits for an answer that never comes."""
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, attention_backend="torch").engine
    config = ServeConfig(drain_timeout=60.0, heartbeat_interval=0.2, worker_timeout=5.0)
    redis_server = EmbeddedRedis().start()
    service = WorkerService(engine, config, redis_server.url)
    step = engine.step

    def slow_step():
        time.sleep(0.05)  # 1,000 tokens would take 50 s: the deadline comes first
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    thread = threading.Thread(target=service.run, daemon=True)
    request = QueuedRequest(request_id="late-1", prompt_token_ids=[5, 17, 33], deadline=time.time() + 3,
                            params=SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    try:
        thread.start()
        wait_until(lambda: service.queue.redis.zscore(q.WORKERS, service.worker_id), "the worker beating")

        async def submit() -> None:
            client = QueueClient(redis_server.url, config, "g-late")
            try:
                await client.submit(request)
            finally:
                await client.close()

        asyncio.run(submit())
        wait_until(lambda: "late-1" in service.running, "the worker running the request")
        service.drain()  # the request is still running: the drain waits for it, up to 60 s
        thread.join(timeout=30)
        assert not thread.is_alive(), "the drained worker did not leave once its last request timed out"
        redis = service.queue.redis
        chunks = chunks_of(redis, q.reply_key("g-late"), "late-1")
        assert chunks[-1].error is not None and chunks[-1].error.code == "request_timeout"
        pending = sum(redis.xpending(stream, q.GROUP)["pending"]
                      for stream in redis.scan_iter(match="pagedserve:*", _type="stream")
                      if any(g["name"] == q.GROUP.encode() for g in redis.xinfo_groups(stream)))
        assert pending == 0
    finally:
        service.drain()
        thread.join(timeout=10)
        redis_server.stop()


def _read_request(redis_url: str, config: ServeConfig, request: QueuedRequest) -> tuple[str, OutputLog]:
    """Admit the request the way the gateway does, and read its outputs to the end."""
    async def run() -> tuple[str, OutputLog]:
        client = QueueClient(redis_url, config)
        try:
            await client.submit(request)
            text, final = "", OutputLog(1)
            async for deltas, log in client.outputs(request.request_id, 1, request.deadline):
                text, final = text + "".join(d.text for d in deltas), log
            return text, final
        finally:
            await client.close()

    return asyncio.run(run())


def test_a_frozen_step_loop_stops_beating_and_its_request_moves(tiny_checkpoint, monkeypatch):
    """A worker whose engine step hangs looks dead: its heartbeat stops, the other worker takes
    the request over and finishes it exactly, and the frozen one drops it when it wakes."""
    path = str(tiny_checkpoint("llama-gqa"))
    llms = [LLM(path, kv_cache_memory=1 << 22, attention_backend="torch") for _ in range(2)]
    prompt, max_tokens = [5, 17, 33, 101, 7], 100
    expected = llms[0].generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    config = ServeConfig(heartbeat_interval=0.2, worker_timeout=1.0, drain_timeout=1.0)
    redis_server = EmbeddedRedis().start()
    services = [WorkerService(llm.engine, config, redis_server.url) for llm in llms]
    frozen: list[WorkerService] = []  # the first worker to run the request, once it hangs
    wake = threading.Event()
    lock = threading.Lock()

    def slow_and_freezing(service: WorkerService):
        step, steps = service.engine.step, [0]

        def wrapped():
            if service.running:
                steps[0] += 1
                time.sleep(0.03)  # slow enough that the takeover happens long before the end
                with lock:
                    freeze = steps[0] == 4 and not frozen
                    if freeze:
                        frozen.append(service)
                if freeze:
                    wake.wait()
            return step()
        return wrapped

    for service in services:
        monkeypatch.setattr(service.engine, "step", slow_and_freezing(service))
    threads = [threading.Thread(target=s.run, daemon=True) for s in services]
    for t in threads:
        t.start()
    result: dict[str, tuple[str, OutputLog]] = {}
    request = QueuedRequest(request_id="frozen-1", prompt_token_ids=prompt, deadline=time.time() + 120,
                            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    reader = threading.Thread(target=lambda: result.setdefault("out", _read_request(redis_server.url, config, request)),
                              daemon=True)
    try:
        wait_until(lambda: all(s.queue.redis.zscore(q.WORKERS, s.worker_id) for s in services), "both workers beating")
        reader.start()
        hung = wait_until(lambda: frozen, "a worker hanging in its step")[0]
        other = services[1 - services.index(hung)]
        wait_until(lambda: other.running.num_taken_over == 1, "the other worker taking the request over")
        # The hung worker stopped beating: out of the live set, its info expired.
        assert not hung.loop_alive()
        assert hung.queue.redis.zscore(q.WORKERS, hung.worker_id) < time.time()
        assert not hung.queue.redis.exists(q.worker_key(hung.worker_id))
        assert "frozen-1" in other.running
        wake.set()
        # It wakes, learns from its heartbeat that the request is another's, and drops it.
        wait_until(lambda: not hung.running and not hung.engine.has_unfinished_requests(), "the woken worker dropping it")
        assert "frozen-1" in other.running  # dropped, not finished: the other still runs it
        reader.join(timeout=60)
        text, log = result["out"]
        assert text == expected[0].outputs[0].text
        assert log.completions[0].token_ids == expected[0].outputs[0].token_ids
        assert (log.completions[0].finish_reason, log.error) == ("length", None)
        assert (hung.running.num_taken_over, other.running.num_taken_over) == (0, 1)
    finally:
        wake.set()
        for s in services:
            s.drain()
        for t in threads:
            t.join(timeout=10)
        redis_server.stop()
    assert not any(t.is_alive() for t in threads)


def test_a_worker_that_reclaims_its_own_running_request_carries_on(tiny_checkpoint, monkeypatch):
    """One slow step past worker_timeout, with no other worker: the heartbeat paused, the
    entry went idle, and the worker's own XAUTOCLAIM hands it back. It is already running
    here: it must finish once, exactly, with no error (it used to fail as 'already running')."""
    path = str(tiny_checkpoint("llama-gqa"))
    llm = LLM(path, kv_cache_memory=1 << 22, attention_backend="torch")
    prompt, max_tokens = [5, 17, 33, 101, 7], 30
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].outputs[0]
    config = ServeConfig(heartbeat_interval=0.2, worker_timeout=1.0, drain_timeout=1.0)
    redis_server = EmbeddedRedis().start()
    service = WorkerService(llm.engine, config, redis_server.url)
    step, steps = service.engine.step, [0]

    def one_slow_step():
        if service.running:
            steps[0] += 1
            if steps[0] == 3:
                time.sleep(2.0)  # the loop misses worker_timeout once
        return step()

    monkeypatch.setattr(service.engine, "step", one_slow_step)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    request = QueuedRequest(request_id="slow-1", prompt_token_ids=prompt, deadline=time.time() + 120, params=params)
    try:
        wait_until(lambda: service.queue.redis.zscore(q.WORKERS, service.worker_id), "the worker beating")
        text, log = _read_request(redis_server.url, config, request)
        assert (log.error, log.completions[0].finish_reason) == (None, "length")
        assert log.completions[0].token_ids == expected.token_ids
        assert text == expected.text
        assert steps[0] > 3 and service.running.num_taken_over == 0
    finally:
        service.drain()
        thread.join(timeout=10)
        redis_server.stop()
