"""`pagedserve bench redis-load`: what the queue costs Redis per generated token and per
request, and from that how many workers one Redis core carries.

    pagedserve bench redis-load [--workers 2] [--streams 64] [--step-ms 40] [--duration 20]
                                [--output-tokens 128] [--tokens-per-step 1]
                                [--shape-streams 256] [--shape-steps-per-s 25] [--json]

It starts its own redis-server (`EmbeddedRedis`) and, in this process, `--workers` real
`WorkerService`s, each around a `ClockEngine` (no model: `--streams` requests at a time, one
step every `--step-ms`, `--tokens-per-step` tokens per request and step), so every Redis
command is the real worker's: intake, output chunks, acks, heartbeats. The requests come in
through the gateway's own `QueueClient.submit` (the ADMIT script) and their outputs are read
back through `QueueClient.outputs`, as the gateway streams them, and checked token by token.
Once every worker holds its streams, `INFO commandstats` and `INFO cpu` are read, the load
runs `--duration` seconds, and they are read again: the differences, divided by the tokens
and the requests the workers made in between, are the costs. The budget is the Redis main
thread's CPU time (what one core gives), not the sum of the commands' own times: that
leaves out reading and writing the sockets, and a script's time holds its commands' time
again (`INFO commandstats` counts the commands scripts call too, marked below).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

# Only the standard library at import: `pagedserve --help` builds this parser. The rest is
# imported when the benchmark runs.
if TYPE_CHECKING:
    import redis

    from pagedserve.bench.fake_engine import ClockEngine
    from pagedserve.common.serve_config import ServeConfig
    from pagedserve.gateway.queue_client import QueueClient

logger = logging.getLogger(__name__)

#: commands the queue's Lua scripts call (counted again inside the evalsha that ran them)
_SCRIPT_ONLY = {"xpending", "xack", "xdel", "hincrby", "hdel", "incr", "incrby", "decrby", "zcount", "zscore",
                "xgroup|create", "sadd", "xclaim", "xlen", "hget", "zadd", "zremrangebyscore", "time"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="fake workers (threads of this process)")
    parser.add_argument("--streams", type=int, default=64, help="requests each worker runs at once (S)")
    parser.add_argument("--step-ms", type=float, default=40.0, help="milliseconds between a worker's steps (T)")
    parser.add_argument("--tokens-per-step", type=int, default=1,
                        help="tokens each request gets per step (above 1: as speculative decoding makes)")
    parser.add_argument("--output-tokens", type=int, default=128,
                        help="mean tokens per request (each drawn evenly from half to one and a half times it)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds measured, after the warm-up")
    parser.add_argument("--shape-streams", type=int, default=256,
                        help="the worker shape the budget is given for: its streams")
    parser.add_argument("--shape-steps-per-s", type=float, default=25.0, help="... and its steps per second")
    parser.add_argument("--output-poll-ms", type=float, default=None,
                        help="the gateway's read of its reply stream every this many ms (default: ServeConfig's)")
    parser.add_argument("--output-interval-ms", type=float, default=None,
                        help="a worker writes a running request's tokens at most this often (default: ServeConfig's, "
                             "0: every step)")
    parser.add_argument("--stream-node-max-entries", type=int, default=None,
                        help="the Redis stream-node-max-entries to run with (CONFIG SET; default: the server's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")


@dataclass
class _Tally:
    """What the gateway side saw."""

    completed: int = 0  # requests read to their end, token-exact
    wrong: int = 0  # requests whose tokens were not exactly what the engine made
    errors: int = 0  # requests that ended with an error
    retries: int = 0  # admissions refused (full queue, no worker) and tried again


def _info(client: redis.Redis) -> tuple[dict[str, tuple[int, int]], float]:
    """(command → (calls, usec)) from INFO commandstats, and the main thread's CPU seconds."""
    stats = cast(dict, client.info("commandstats"))
    commands = {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in stats.items()}
    cpu = cast(dict, client.info("cpu"))
    main = cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"]) + cpu.get("used_cpu_sys_main_thread",
                                                                                 cpu["used_cpu_sys"])
    return commands, float(main)


async def _client_loop(queue: QueueClient, stop: asyncio.Event, rng: random.Random, mean_tokens: int,
                       tally: _Tally) -> None:
    """One client: admit a request, read its output to the end and check it, again until stopped."""
    from pagedserve.bench.fake_engine import expected_token
    from pagedserve.common.errors import PagedServeError
    from pagedserve.common.queue_protocol import QueuedRequest
    from pagedserve.common.sampling_params import SamplingParams

    while not stop.is_set():
        max_tokens = rng.randint(max(1, mean_tokens // 2), max(1, mean_tokens * 3 // 2))
        prompt = [rng.randrange(1, 50_000), 11, 12, 13]
        now = time.time()
        request = QueuedRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                                params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                deadline=now + 600, enqueued_at=now)
        try:
            await queue.submit(request)
        except PagedServeError:
            tally.retries += 1
            await asyncio.sleep(0.05)
            continue
        log = None
        async for _deltas, out in queue.outputs(request.request_id, 1, request.deadline):
            log = out
        if log is None or log.error is not None:
            tally.errors += 1
            continue
        tokens = log.completions[0].token_ids
        if tokens == [expected_token(prompt, i) for i in range(max_tokens)]:
            tally.completed += 1
        else:
            tally.wrong += 1


def _budget(args: argparse.Namespace, cpu_us_per_token: float) -> float:
    """Workers of the shape one Redis core carries, at this cost per token."""
    per_worker_us = cpu_us_per_token * args.shape_streams * args.shape_steps_per_s * args.tokens_per_step
    return 1e6 / per_worker_us if per_worker_us else math.inf


def run(args: argparse.Namespace) -> int:
    import msgspec
    import redis

    from pagedserve.bench.fake_engine import ClockEngine
    from pagedserve.common.redis_server import EmbeddedRedis
    from pagedserve.common.serve_config import ServeConfig
    from pagedserve.engine.engine import Engine
    from pagedserve.worker.service import WorkerService

    logging.basicConfig(level=logging.WARNING)
    for name in ("workers", "streams", "tokens_per_step", "output_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    slots = args.workers * args.streams
    config = ServeConfig(max_queued_requests=slots * 2, tenant_max_requests=slots * 2, heartbeat_interval=1.0)
    if args.output_poll_ms is not None:
        config = msgspec.structs.replace(config, output_poll_interval=args.output_poll_ms / 1000)
    if args.output_interval_ms is not None:
        config = msgspec.structs.replace(config, output_interval=args.output_interval_ms / 1000)
    with EmbeddedRedis(maxmemory=4 << 30) as server:
        admin = redis.Redis.from_url(server.url)
        if args.stream_node_max_entries is not None:
            admin.config_set("stream-node-max-entries", args.stream_node_max_entries)
        node_entries = int(cast(dict, admin.config_get("stream-node-max-entries"))["stream-node-max-entries"])
        engines = [ClockEngine(max_num_seqs=args.streams, step_ms=args.step_ms, tokens_per_step=args.tokens_per_step)
                   for _ in range(args.workers)]
        services = [WorkerService(cast(Engine, engine), config, server.url, worker_id=f"load{i}")
                    for i, engine in enumerate(engines)]
        threads = [threading.Thread(target=s.run, name=f"worker-{i}", daemon=True) for i, s in enumerate(services)]
        for t in threads:
            t.start()
        try:
            result = asyncio.run(_measure(args, server.url, config, engines, admin))
            result["stream_node_max_entries"] = node_entries
        finally:
            for s in services:
                s.drain.deadline = 0.0  # stop now: nothing is waiting for the rest
            for t in threads:
                t.join(timeout=10)
            admin.close()
    _print(args, result)
    return 0 if result["wrong"] == 0 and result["errors"] == 0 else 1


async def _measure(args: argparse.Namespace, url: str, config: ServeConfig, engines: list[ClockEngine],
                   admin: redis.Redis) -> dict[str, Any]:
    from pagedserve.gateway.queue_client import QueueClient

    queue = QueueClient(url, config)
    rng = random.Random(args.seed)
    stop = asyncio.Event()
    tally = _Tally()
    clients = [asyncio.create_task(_client_loop(queue, stop, random.Random(rng.random()), args.output_tokens, tally))
               for _ in range(args.workers * args.streams)]
    try:
        deadline = time.monotonic() + 30
        while sum(e.scheduler.num_running for e in engines) < args.workers * args.streams:
            if time.monotonic() > deadline:
                raise SystemExit("the workers did not fill their streams within 30 s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # one heartbeat, so its cost is in the steady state too
        before, cpu_before = _info(admin)
        tokens_before = sum(e.num_tokens for e in engines)
        finished_before = sum(e.num_finished for e in engines)
        steps_before = sum(e.num_steps for e in engines)
        started = time.monotonic()
        await asyncio.sleep(args.duration)
        after, cpu_after = _info(admin)
        elapsed = time.monotonic() - started
        tokens = sum(e.num_tokens for e in engines) - tokens_before
        finished = sum(e.num_finished for e in engines) - finished_before
        steps = sum(e.num_steps for e in engines) - steps_before
    finally:
        stop.set()
        for c in clients:
            c.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await queue.close()
    commands = {}
    for name, (calls, usec) in after.items():
        calls0, usec0 = before.get(name, (0, 0))
        if name != "info" and calls > calls0:
            commands[name] = (calls - calls0, usec - usec0)
    cpu_us = (cpu_after - cpu_before) * 1e6
    top_level = sum(c for name, (c, _) in commands.items() if name not in _SCRIPT_ONLY)
    return {
        "workers": args.workers, "streams": args.streams, "step_ms": args.step_ms,
        "output_poll_ms": config.output_poll_interval * 1000, "output_interval_ms": config.output_interval * 1000,
        "tokens_per_step": args.tokens_per_step, "output_tokens": args.output_tokens,
        "seconds": round(elapsed, 2), "tokens": tokens, "requests": finished, "steps": steps,
        "steps_per_s_per_worker": round(steps / elapsed / args.workers, 2),
        "redis_cpu_s": round(cpu_us / 1e6, 3), "redis_cpu_share": round(cpu_us / 1e6 / elapsed, 3),
        "commands": {name: {"calls": c, "usec": u} for name, (c, u) in sorted(commands.items(), key=lambda x: -x[1][1])},
        "commands_per_token": round(top_level / tokens, 3) if tokens else None,
        "commands_per_request": round(top_level / finished, 1) if finished else None,
        "cpu_us_per_token": round(cpu_us / tokens, 3) if tokens else None,
        "entries_per_stream_step": round(commands.get("xadd", (0, 0))[0] * args.tokens_per_step / tokens, 3)
        if tokens else None,
        "cpu_us_per_request": round(cpu_us / finished, 1) if finished else None,
        "shape": {"streams": args.shape_streams, "steps_per_s": args.shape_steps_per_s},
        "workers_per_core": round(_budget(args, cpu_us / tokens), 1) if tokens else None,
        "completed": tally.completed, "wrong": tally.wrong, "errors": tally.errors, "retries": tally.retries,
    }


def _print(args: argparse.Namespace, r: dict[str, Any]) -> None:
    print(f"redis-load: {r['workers']} workers x {r['streams']} streams, a step every {r['step_ms']:g} ms "
          f"({r['steps_per_s_per_worker']} steps/s made per worker), {r['tokens_per_step']} token(s) per stream "
          f"and step, {r['output_tokens']} tokens per request on average, the gateway reading every "
          f"{r['output_poll_ms']:g} ms, a worker writing a stream every {r['output_interval_ms']:g} ms at most "
          f"(0: every step), stream-node-max-entries {r['stream_node_max_entries']}; {r['seconds']} s measured")
    print(f"  made {r['tokens']} tokens, finished {r['requests']} requests; Redis main thread busy "
          f"{r['redis_cpu_s']} s ({100 * r['redis_cpu_share']:.1f}% of one core)")
    tokens, requests = r["tokens"] or 1, r["requests"] or 1
    print(f"  {'command':<22}{'calls':>10}{'per token':>11}{'per request':>13}{'usec/call':>11}{'usec/token':>12}")
    for name, v in r["commands"].items():
        mark = " (in scripts)" if name in _SCRIPT_ONLY else ""
        print(f"  {name:<22}{v['calls']:>10}{v['calls'] / tokens:>11.3f}{v['calls'] / requests:>13.2f}"
              f"{v['usec'] / v['calls']:>11.2f}{v['usec'] / tokens:>12.3f}{mark}")
    print(f"  commands sent (not counting those scripts call): {r['commands_per_token']} per token, "
          f"{r['commands_per_request']} per request")
    print(f"  Redis CPU: {r['cpu_us_per_token']} us per token, {r['cpu_us_per_request']} us per request "
          f"(each request's own costs included, at this request length)")
    shape = r["shape"]
    print(f"  entries written per stream and step: {r['entries_per_stream_step']}")
    print(f"  one Redis core carries {r['workers_per_core']} workers of {shape['streams']} streams at "
          f"{shape['steps_per_s']:g} steps/s ({args.tokens_per_step} token(s) per stream and step)")
    print(f"  gateway side: {r['completed']} requests read token-exact, {r['wrong']} not, {r['errors']} with an "
          f"error, {r['retries']} admissions retried")
    if args.json:
        print(json.dumps(r))
