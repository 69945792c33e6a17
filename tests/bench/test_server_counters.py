"""`bench serve --metrics-url`: counters of several endpoints summed, a run's changes, hit sources."""

from __future__ import annotations

from pagedserve.bench import server_counters as sc

WORKER = """# TYPE pagedserve:prefix_cache_queries counter
pagedserve:prefix_cache_queries_total{{model_name="m"}} {q}
# TYPE pagedserve:prefix_cache_hits counter
pagedserve:prefix_cache_hits_total{{model_name="m"}} {h}
# TYPE pagedserve:prefix_cache_tier_hits counter
pagedserve:prefix_cache_tier_hits_total{{model_name="m"}} {t}
# TYPE pagedserve:kv_tier_blocks counter
pagedserve:kv_tier_blocks_total{{model_name="m",event="loaded"}} {t}
# TYPE pagedserve:generation_tokens counter
pagedserve:generation_tokens_total{{model_name="m"}} 99
"""
SERVICE = """# TYPE pagedserve:prefix_index_blocks gauge
pagedserve:prefix_index_blocks {n}
"""


def test_changes_sum_workers_and_split_hits_by_source():
    before = sc.parse(WORKER.format(q=100, h=50, t=0))
    for text in (WORKER.format(q=10, h=0, t=0), SERVICE.format(n=3)):
        for key, value in sc.parse(text).items():
            before[key] = before.get(key, 0.0) + value
    after = sc.parse(WORKER.format(q=300, h=200, t=40))
    for text in (WORKER.format(q=110, h=60, t=10), SERVICE.format(n=7)):
        for key, value in sc.parse(text).items():
            after[key] = after.get(key, 0.0) + value
    counts = sc.changes(before, after)
    assert counts == {
        "kv_tier_blocks{event=loaded}": 50.0,
        "prefix_cache_hits": 210.0,
        "prefix_cache_queries": 300.0,
        "prefix_cache_tier_hits": 50.0,
        "prefix_index_blocks": 7.0,  # a gauge: where the run left it
    }
    shares = sc.hit_sources(counts)
    assert shares == {"hit_own_pool": 160 / 300, "hit_tier": 50 / 300, "miss": 90 / 300}
    text = sc.format_changes(counts)
    assert "hit_tier" in text and "16.7% of looked-up prompt tokens" in text


def test_an_endpoint_that_does_not_answer_adds_nothing():
    assert sc.scrape(["http://127.0.0.1:1/metrics"]) == {}
