"""Fairness across tenants, end to end in one worker: a tenant that floods the queue does not
hold back another tenant's request. Counted in engine steps, not seconds: up to the step
whose output carries its first token. How soon the gateway reads that output afterwards is
a matter of seconds (its reader, tests/gateway/test_output_reader.py), not of scheduling."""

from __future__ import annotations

import asyncio
import threading
import time

from pagedserve import LLM
from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import QueuedRequest
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.worker.service import WorkerService


def test_a_flooded_queue_delays_another_tenant_by_a_step_or_two(tiny_checkpoint):
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, max_num_seqs=8).engine
    steps = 0
    step = engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted_step  # type: ignore[method-assign]
    config = ServeConfig(heartbeat_interval=0.2, worker_timeout=2.0)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def queued(request_id: str, tenant: str) -> QueuedRequest:
        return QueuedRequest(request_id=request_id, prompt_token_ids=[5, 6, 7, 8], params=params, tenant=tenant,
                             cache_salt=tenant, deadline=time.time() + 300)

    with EmbeddedRedis() as redis_server:
        service = WorkerService(engine, config, redis_server.url)
        first_step: list[int] = []  # the engine step whose output carried b0's first token
        forward = service.running.forward

        def noted_forward(outputs):
            if not first_step and any(o.request_id == "b0" and o.deltas for o in outputs):
                first_step.append(steps)
            return forward(outputs)

        service.running.forward = noted_forward  # type: ignore[method-assign]
        thread = threading.Thread(target=service.run, daemon=True)
        thread.start()

        async def scenario() -> tuple[int, int, str]:
            queue = QueueClient(redis_server.url, config)
            try:
                while not await queue.live_workers():
                    await asyncio.sleep(0.05)
                for i in range(300):
                    await queue.submit(queued(f"a{i}", "A"))
                while len(service.running) < 8:  # A fills every slot of the engine
                    await asyncio.sleep(0.01)
                await queue.submit(queued("b0", "B"))
                submitted_at = steps
                async for deltas, _ in queue.outputs("b0", 1, time.time() + 120):
                    if deltas:
                        return submitted_at, steps, service.running["b0"].stream if "b0" in service.running else ""
                raise AssertionError("b0 ended without a token")
            finally:
                await queue.close()

        try:
            submitted_at, first_token_at, stream = asyncio.run(scenario())
        finally:
            service.drain()
            service.drain()  # a second signal: stop now
            thread.join(timeout=30)
    print(f"B's first token {first_step[0] - submitted_at} engine steps after its admission, at the gateway "
          f"{first_token_at - submitted_at} (A: 300 requests of 40 tokens queued, 8 slots)")
    # one step for the worker to take B at the next pull, one to prefill it (preempting an A)
    assert first_step[0] - submitted_at <= 3
    assert first_token_at >= first_step[0]
    assert stream in ("", q.requests_key("B"))
    assert engine.scheduler.num_preemptions >= 1
