"""`pagedserve bench serve`: an online benchmark client for any OpenAI-compatible server.

    pagedserve bench serve --base-url URL [--request-rate 1,2,inf] [--max-concurrency 64] [--plot FILE.png]

Sends a workload of bench/workloads.py (`serve`: token-id prompts of the `mixed` shapes;
`multi-turn`: conversations whose turns go one after another; `many-prefixes`: 32 shared
system prompts) to `/v1/completions` with streaming, at Poisson arrivals of a given rate
(or all at once) and at most `max_concurrency` in flight, and reports what vLLM's benchmark
client reports (TTFT, TPOT, ITL, E2E, goodput; see pagedserve.bench.request_stats) and, where the
server reports cached prompt tokens in its usage, the prefix hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections.abc import Sequence

from pagedserve.bench import server_counters
from pagedserve.bench.request_stats import RequestRecord, format_summary, parse_slo, summarize
from pagedserve.bench.workloads import Conversation, conversations


async def _send(client, url: str, model: str, prompt: list[int], max_tokens: int, headers: dict) -> RequestRecord:
    record = RequestRecord(prompt_tokens=len(prompt), start=time.perf_counter())
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    chunks_with_text = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:  # an error after the stream began
                    record.error = str(event["error"].get("message", event["error"]))
                    return record
                if event.get("choices") and event["choices"][0].get("text"):
                    record.chunk_times.append(time.perf_counter())
                    chunks_with_text += 1
                if event.get("usage"):
                    record.output_tokens = event["usage"].get("completion_tokens", 0)
                    details = event["usage"].get("prompt_tokens_details") or {}
                    if "cached_tokens" in details:
                        record.cached_tokens = details["cached_tokens"]
        record.end = time.perf_counter()
        if not record.output_tokens:
            record.output_tokens = chunks_with_text  # servers without usage: one token a chunk
    except Exception as exc:  # a failed request is counted, never fatal to the run
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def run_benchmark(
    base_url: str,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    request_rate: float = math.inf,
    max_concurrency: int = 64,
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send every request, each on its own; return their records and the run's wall time."""
    return await run_conversations(base_url, [[(p, n)] for p, n in zip(prompts, output_lens)], request_rate,
                                   max_concurrency, model, api_key, seed, progress)


async def run_conversations(
    base_url: str,
    conversations: Sequence[Conversation],
    request_rate: float = math.inf,
    max_concurrency: int = 64,
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send every conversation's turns in order, each when the previous one finished;
    conversations start at Poisson arrivals of `request_rate` and run concurrently, at most
    `max_concurrency` requests at a time. Returns the records, conversation by conversation,
    and the wall time of the whole run."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=max_concurrency)) as client:
        if model is None:
            listing = (await client.get(f"{base}/v1/models", headers=headers)).json()
            model = listing["data"][0]["id"]
        semaphore = asyncio.Semaphore(max_concurrency)
        rng = random.Random(seed)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(len(c) for c in conversations), desc="requests", unit="req")

        async def one(conversation: Conversation) -> list[RequestRecord]:
            records = []
            for prompt, n in conversation:
                async with semaphore:
                    record = await _send(client, f"{base}/v1/completions", model, prompt, n, headers)
                records.append(record)
                if bar is not None:
                    bar.update(1)
            return records

        start = time.perf_counter()
        tasks = []
        for conversation in conversations:
            tasks.append(asyncio.create_task(one(conversation)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        records = [r for rs in await asyncio.gather(*tasks) for r in rs]
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return list(records), duration


def run(args: argparse.Namespace) -> int:
    """`pagedserve bench serve`: one run per request rate of the comma list."""
    slo = parse_slo(args.slo)
    work = conversations(args.workload, args.vocab_size, args.num_requests)
    num_requests = sum(len(c) for c in work)
    summaries = []
    metrics_urls = [u.strip() for u in (args.metrics_url or "").split(",") if u.strip()]
    for rate_text in args.request_rate.split(","):
        rate = math.inf if rate_text.strip() == "inf" else float(rate_text)
        before = server_counters.scrape(metrics_urls) if metrics_urls else {}
        records, duration = asyncio.run(run_conversations(
            args.base_url, work, rate, args.max_concurrency, args.model, args.api_key,
            progress=not args.no_progress,
        ))
        summary = {"request_rate": rate_text.strip(), **summarize(records, duration, slo)}
        print(f"workload={args.workload} requests={num_requests} rate={rate_text.strip()} max_concurrency={args.max_concurrency}")
        print(format_summary(summary))
        if metrics_urls:
            counts = server_counters.changes(before, server_counters.scrape(metrics_urls))
            print(server_counters.format_changes(counts))
            summary["server_counters"] = counts
        summaries.append(summary)
    if args.plot:
        from pagedserve.bench.plots import plot_latency_curve

        points = [{"label": f"rate={s['request_rate']}", **s} for s in summaries]
        plot_latency_curve(points, args.plot, f"pagedserve bench serve: {args.base_url}, concurrency {args.max_concurrency}")
    if args.json:
        print(json.dumps(summaries if len(summaries) > 1 else summaries[0]))
    return 0 if all(s["failed"] == 0 for s in summaries) else 1
