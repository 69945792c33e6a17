"""The figures of the benchmarks, with the definitions of vLLM's benchmark client:

- TTFT: from sending a request to its first streamed token;
- TPOT: per request, (E2E − TTFT) / (output tokens − 1), then averaged over requests;
- ITL: every gap between consecutive streamed chunks, pooled over all requests;
- E2E: from sending a request to its last token;
- goodput: completed requests per second that met every SLO given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.common.errors import InvalidParameterError


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline (time.perf_counter seconds) and outcome."""

    prompt_tokens: int
    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk with tokens
    output_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens the server served from its prefix cache, if it said
    end: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        assert self.end is not None, "e2e of an unfinished request"
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(values: Sequence[float]) -> dict[str, float]:
    """mean, median and p99 in milliseconds."""
    if not values:
        return {"mean_ms": math.nan, "median_ms": math.nan, "p99_ms": math.nan}
    return {
        "mean_ms": 1000 * sum(values) / len(values),
        "median_ms": 1000 * percentile(values, 50),
        "p99_ms": 1000 * percentile(values, 99),
    }


def summarize(records: Sequence[RequestRecord], duration: float, slo_ms: dict[str, float] | None = None) -> dict:
    """The benchmark's figures from the request timelines."""
    done = [r for r in records if r.ok]
    itls = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpots = [t for r in done if (t := r.tpot) is not None]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    good = done
    for metric, limit in (slo_ms or {}).items():
        if metric == "ttft":
            good = [r for r in good if 1000 * r.ttft <= limit]
        elif metric == "tpot":
            good = [r for r in good if r.tpot is None or 1000 * r.tpot <= limit]
        elif metric == "e2e":
            good = [r for r in good if 1000 * r.e2e <= limit]
        else:
            raise InvalidParameterError("slo", f"unknown SLO metric {metric!r}; known: ttft, tpot, e2e")
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (prompt_tokens + output_tokens) / duration,
        "total_output_tokens": output_tokens,
        "ttft": latency_stats([r.ttft for r in done]),
        "tpot": latency_stats(tpots),
        "itl": latency_stats(itls),
        "e2e": latency_stats([r.e2e for r in done]),
        "goodput": len(good) / duration if slo_ms else None,
        # cached prompt tokens over prompt tokens, where the server reports them (usage.prompt_tokens_details)
        "prefix_hit_rate": (sum(r.cached_tokens or 0 for r in done) / prompt_tokens
                            if done and prompt_tokens and all(r.cached_tokens is not None for r in done) else None),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500,tpot=50' → {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise InvalidParameterError("slo", f"cannot read {part!r}; write e.g. ttft=500,tpot=50") from None
    return out


def format_summary(s: dict) -> str:
    lines = [
        f"{'completed / failed':28} {s['completed']} / {s['failed']}",
        f"{'duration':28} {s['duration_s']:.2f} s",
        f"{'request throughput':28} {s['request_throughput']:.2f} req/s",
        f"{'output throughput':28} {s['output_throughput']:.1f} tok/s",
        f"{'total throughput':28} {s['total_throughput']:.1f} tok/s",
    ]
    if s["goodput"] is not None:
        lines.append(f"{'goodput':28} {s['goodput']:.2f} req/s")
    if s.get("prefix_hit_rate") is not None:
        lines.append(f"{'prefix hit rate':28} {s['prefix_hit_rate']:.1%} of prompt tokens")
    for metric in ("ttft", "tpot", "itl", "e2e"):
        m = s[metric]
        lines.append(f"{metric.upper() + ' mean/median/p99':28} {m['mean_ms']:.1f} / {m['median_ms']:.1f} / {m['p99_ms']:.1f} ms")
    for error in s["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
