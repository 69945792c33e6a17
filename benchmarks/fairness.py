"""Fairness between tenants, measured over HTTP: tenant B's time to first token on an idle
server, then while tenant A has flooded the queue.

    python benchmarks/fairness.py --base-url URL --key-a KEY_A --key-b KEY_B [--flood 300]

A and B are two API keys of different tenants (the server's keys file or
PAGEDSERVE_API_KEYS). B sends `--samples` requests one after another, alone; then A sends
`--flood` streaming requests at once (the server may refuse some with 429: they are counted)
and B sends its requests again while A's run. The report is B's median TTFT in both phases
and their ratio (the issue's target: within 2x), with A's admitted/refused counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections import Counter

import httpx

from pagedserve.bench.serve import _send


async def _b_ttfts(client: httpx.AsyncClient, url: str, model: str, key: str, samples: int, max_tokens: int) -> list[float]:
    ttfts = []
    for i in range(samples):
        record = await _send(client, url, model, [11 + i % 200, 12, 13, 14], max_tokens,
                             {"Authorization": f"Bearer {key}"})
        if not record.ok:
            raise RuntimeError(f"tenant B's request failed: {record.error}")
        ttfts.append(record.ttft)
    return ttfts


async def _run(args: argparse.Namespace) -> dict:
    url = args.base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=args.flood + 16, max_keepalive_connections=args.flood + 16)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        model = args.model or (await client.get(args.base_url.rstrip("/") + "/v1/models",
                                                headers={"Authorization": f"Bearer {args.key_b}"})).json()["data"][0]["id"]
        await _b_ttfts(client, url, model, args.key_b, 2, args.max_tokens)  # warm
        idle = await _b_ttfts(client, url, model, args.key_b, args.samples, args.max_tokens)
        flood = [asyncio.create_task(_send(client, url, model, [21 + i % 200, 22, 23, 24], args.flood_max_tokens,
                                           {"Authorization": f"Bearer {args.key_a}"})) for i in range(args.flood)]
        await asyncio.sleep(args.settle)  # A's requests are admitted and fill the workers
        loaded = await _b_ttfts(client, url, model, args.key_b, args.samples, args.max_tokens)
        a_running = sum(1 for t in flood if not t.done())
        for task in flood:
            task.cancel()
        results = await asyncio.gather(*flood, return_exceptions=True)
    refused = sum(1 for r in results if not isinstance(r, BaseException) and r.error and "HTTP 429" in r.error)
    failed = Counter((r.error or "")[:60] for r in results if not isinstance(r, BaseException) and r.error
                     and "HTTP 429" not in r.error)
    idle_ms, loaded_ms = statistics.median(idle) * 1000, statistics.median(loaded) * 1000
    return {"b_ttft_idle_ms": round(idle_ms, 1), "b_ttft_loaded_ms": round(loaded_ms, 1),
            "b_ttft_loaded_max_ms": round(max(loaded) * 1000, 1), "b_ttft_loaded_ms_each": [round(t * 1000, 1) for t in loaded],
            "ratio": round(loaded_ms / idle_ms, 2), "a_sent": args.flood, "a_refused_429": refused,
            "a_still_running_when_b_measured": a_running, "a_failed": dict(failed), "samples": args.samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--key-a", required=True, help="the flooding tenant's API key")
    parser.add_argument("--key-b", required=True, help="the other tenant's API key")
    parser.add_argument("--model", default=None)
    parser.add_argument("--flood", type=int, default=300, help="A's requests, sent at once")
    parser.add_argument("--flood-max-tokens", type=int, default=3000,
                        help="long enough that A's requests outlast B's measurement")
    parser.add_argument("--max-tokens", type=int, default=8, help="B's requests")
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds between A's flood and B's requests")
    args = parser.parse_args(argv)
    figures = asyncio.run(_run(args))
    print(f"tenant B TTFT, median of {figures['samples']}: idle {figures['b_ttft_idle_ms']} ms, "
          f"with tenant A's {figures['a_sent']} requests in flight {figures['b_ttft_loaded_ms']} ms "
          f"-> {figures['ratio']}x (target <= 2x), the slowest {figures['b_ttft_loaded_max_ms']} ms; "
          f"A refused with 429: {figures['a_refused_429']}, "
          f"A still running at the end: {figures['a_still_running_when_b_measured']}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
