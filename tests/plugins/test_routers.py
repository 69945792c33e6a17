"""The built-in routers as pure functions of their inputs."""

from __future__ import annotations

from pagedserve.common.contracts import RouteDecision, RoutingInput, WorkerCandidate
from pagedserve.common.serve_config import ServeConfig
from pagedserve.plugins.routers import CacheAwareRouter, LeastLoadedRouter, load

REQUEST = RoutingInput(prompt_tokens=100, tenant=None)


def worker(worker_id: str, cached: int = 0, running: int = 0, waiting: int = 0, queued: int = 0,
           queued_tokens: int = 0, slots: int = 4) -> WorkerCandidate:
    return WorkerCandidate(worker_id=worker_id, cached_tokens=cached, num_running=running, num_waiting=waiting,
                           queued_tokens=queued_tokens, max_num_seqs=slots, queued_requests=queued)


def test_load_is_the_share_of_slots_taken_or_promised():
    assert load(worker("a", running=1, waiting=1, queued=2, slots=8)) == 0.5
    assert load(worker("a", slots=0)) == 0.0  # never a division by zero


def test_no_live_worker_goes_to_the_shared_queue():
    assert LeastLoadedRouter().route(REQUEST, []) == RouteDecision(None, "shared")
    assert CacheAwareRouter().route(REQUEST, []) == RouteDecision(None, "shared")


def test_least_loaded_compares_load_relative_to_capacity_then_breaks_ties_deterministically():
    router = LeastLoadedRouter(ServeConfig())
    # 2 of 8 slots (0.25) is less loaded than 1 of 2 (0.5)
    assert router.route(REQUEST, [worker("small", running=1, slots=2), worker("big", running=2, slots=8)]) \
        == RouteDecision("big", "load")
    # the same load: fewer queued tokens, then the smaller id, whatever the order given
    tied = [worker("b", queued=1, queued_tokens=50), worker("a", queued=1, queued_tokens=50),
            worker("c", queued=1, queued_tokens=10)]
    assert router.route(REQUEST, tied) == RouteDecision("c", "load")
    assert router.route(REQUEST, tied[:2]) == router.route(REQUEST, tied[1::-1]) == RouteDecision("a", "load")
    # the prompt's cached prefix plays no part
    assert router.route(REQUEST, [worker("a", cached=96, running=1), worker("b")]) == RouteDecision("b", "load")


def test_cache_aware_takes_the_longest_prefix_within_the_load_margin():
    router = CacheAwareRouter(load_margin=0.5)
    workers = [worker("a", cached=32, running=1), worker("b", cached=64, running=2), worker("c")]
    # b holds the most; its load 0.5 is within 0.5 of c's 0
    assert router.route(REQUEST, workers) == RouteDecision("b", "cache")
    # b past the margin (0.75 > 0 + 0.5): the next longest prefix within it
    workers[1] = worker("b", cached=64, running=3)
    assert router.route(REQUEST, workers) == RouteDecision("a", "cache")
    # every holder past the margin: by load
    assert router.route(REQUEST, [worker("a", cached=64, running=3), worker("c")]) == RouteDecision("c", "load")
    # queued requests count as load too
    assert router.route(REQUEST, [worker("a", cached=64, queued=3), worker("c")]) == RouteDecision("c", "load")
    # the same prefix: the lower load, then the smaller id
    assert router.route(REQUEST, [worker("b", cached=64), worker("a", cached=64, running=1)]) \
        == RouteDecision("b", "cache")
    assert router.route(REQUEST, [worker("b", cached=64), worker("a", cached=64)]) == RouteDecision("a", "cache")


def test_cache_aware_with_nothing_cached_is_least_loaded():
    workers = [worker("a", running=2), worker("b", running=1), worker("c", running=1, queued_tokens=5)]
    assert CacheAwareRouter().route(REQUEST, workers) == LeastLoadedRouter().route(REQUEST, workers) \
        == RouteDecision("b", "load")


def test_the_margin_comes_from_the_config():
    assert CacheAwareRouter(ServeConfig(router_load_margin=2.0)).load_margin == 2.0
    assert CacheAwareRouter().load_margin == ServeConfig().router_load_margin
    # margin 0: a holder must be as little loaded as the least-loaded worker
    strict = CacheAwareRouter(ServeConfig(router_load_margin=0.0))
    assert strict.route(REQUEST, [worker("a", cached=64, running=1), worker("b")]) == RouteDecision("b", "load")
    assert strict.route(REQUEST, [worker("a", cached=64), worker("b")]) == RouteDecision("a", "cache")
