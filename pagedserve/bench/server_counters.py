"""The server's own counters around a benchmark run: `bench serve --metrics-url` reads the
Prometheus text of the gateway, the workers and the prefix cache service before and after
each run, and prints what the run changed (counters) and where it ended (gauges).

Samples of one name and label set are summed over the URLs (two workers' hits add up);
the `model_name` label is dropped for that.
"""

from __future__ import annotations

from collections.abc import Sequence

#: what the prefix-cache issue asks to see: hits by source, routing, steals, index, lag, tier
COUNTERS = (
    "pagedserve:prefix_cache_queries",
    "pagedserve:prefix_cache_hits",
    "pagedserve:prefix_cache_tier_hits",
    "pagedserve:requests_routed",
    "pagedserve:prefix_lookup_fallbacks",
    "pagedserve:requests_stolen",
    "pagedserve:kv_tier_blocks",
    "pagedserve:kv_tier_bytes",
    "pagedserve:kv_tier_errors",
    "pagedserve:prefix_index_gaps",
)
GAUGES = ("pagedserve:prefix_index_blocks", "pagedserve:prefix_index_event_lag_seconds")

Key = tuple[str, tuple[tuple[str, str], ...]]


def parse(text: str) -> dict[Key, float]:
    """The samples of one exposition, by (name without `_total`, labels without model_name)."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(name, labels)] = out.get((name, labels), 0.0) + sample.value
    return out


def scrape(urls: Sequence[str]) -> dict[Key, float]:
    """Every URL's samples, summed; a URL that does not answer adds nothing."""
    import httpx  # noqa: PLC0415

    total: dict[Key, float] = {}
    for url in urls:
        try:
            text = httpx.get(url, timeout=5.0).text
        except httpx.HTTPError:
            continue
        for key, value in parse(text).items():
            total[key] = total.get(key, 0.0) + value
    return total


def changes(before: dict[Key, float], after: dict[Key, float]) -> dict[str, float]:
    """The run's counter changes and its final gauges, as `name{label=value}` → number."""
    out: dict[str, float] = {}
    for key in sorted(after):
        name, labels = key
        if name in COUNTERS:
            value = after[key] - before.get(key, 0.0)
        elif name in GAUGES:
            value = after[key]
        else:
            continue
        label_text = ",".join(f"{k}={v}" for k, v in labels)
        out[f"{name.removeprefix('pagedserve:')}{{{label_text}}}" if label_text else name.removeprefix("pagedserve:")] \
            = value
    return out


def hit_sources(counts: dict[str, float]) -> dict[str, float]:
    """Prompt tokens looked up, split by where they came from: own pool, tier, miss."""
    queries = counts.get("prefix_cache_queries", 0.0)
    hits = counts.get("prefix_cache_hits", 0.0)
    tier = counts.get("prefix_cache_tier_hits", 0.0)
    if not queries:
        return {}
    return {"hit_own_pool": (hits - tier) / queries, "hit_tier": tier / queries, "miss": (queries - hits) / queries}


def format_changes(counts: dict[str, float]) -> str:
    lines = ["server counters (this run):"]
    for name, value in counts.items():
        lines.append(f"  {name:<52} {value:,.3f}" if not value.is_integer() else f"  {name:<52} {int(value):,}")
    for name, share in hit_sources(counts).items():
        lines.append(f"  {name:<52} {share:.1%} of looked-up prompt tokens")
    return "\n".join(lines)
