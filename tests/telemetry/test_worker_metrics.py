"""WorkerMetrics fed by a real tiny engine's StepStats and FinishedRequestStats: exact counts
read back from the registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pagedserve import LLM, SamplingParams
from pagedserve.telemetry.metrics import FINISHED_REASONS, WorkerMetrics

MODEL = {"model_name": "tiny"}


def _run(engine, metrics: WorkerMetrics) -> list:
    """Step until done, observing as the worker service does; returns the steps' StepStats."""
    steps = []
    engine.stats.keep_finished = True  # as the worker service does
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step is not None:
            metrics.observe_step(engine.last_step)
            steps.append(engine.last_step)
        for finished in engine.pop_finished():
            metrics.observe_finished(finished)
    return steps


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value("pagedserve:" + name, {**MODEL, **labels})
    assert value is not None, name
    return value


def test_tokens_requests_prefix_hits_and_aborts(tiny_checkpoint):
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, block_size=16,
                 max_num_batched_tokens=64).engine
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "tiny", block_size=16)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    shared = list(range(3, 3 + 40))  # two full blocks and 8 tokens
    engine.add_request("a", shared, greedy)
    _run(engine, metrics)
    engine.add_request("b", shared + [99], greedy)  # its two full blocks come from the prefix cache
    _run(engine, metrics)
    engine.add_request("c", [7, 8, 9], SamplingParams(n=2, max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.add_request("gone", [8, 9], greedy)
    engine.step()
    metrics.observe_step(engine.last_step)
    engine.abort_request("gone")  # after its first token
    _run(engine, metrics)

    assert _value(registry, "prompt_tokens_total") == 40 + 41 + 3 + 2
    assert _value(registry, "generation_tokens_total") == 4 + 4 + 2 * 3 + 1
    assert {r: _value(registry, "request_success_total", finished_reason=r) for r in FINISHED_REASONS} == {
        "stop": 0, "length": 1 + 1 + 2, "abort": 1, "error": 0}
    # a: 2 blocks looked up, none found; b: 2 found; c, gone: no full block (counted in tokens)
    assert _value(registry, "prefix_cache_queries_total") == (2 + 2) * 16
    assert _value(registry, "prefix_cache_hits_total") == 2 * 16
    assert _value(registry, "num_preemptions_total") == 0
    assert _value(registry, "time_to_first_token_seconds_count") == 4
    assert _value(registry, "e2e_request_latency_seconds_count") == 4
    # one per request and step after its first token: a 3, b 3, c 3 (its second completion starts a
    # step after the first, to share its prompt blocks), gone 0
    assert _value(registry, "inter_token_latency_seconds_count") == 3 + 3 + 3
    assert _value(registry, "request_queue_time_seconds_count") == 0
    assert (_value(registry, "num_requests_running"), _value(registry, "num_requests_waiting"),
            _value(registry, "kv_cache_usage_perc")) == (0, 0, 0.0)
    # the bucket counts of a histogram add up to its count
    assert _value(registry, "e2e_request_latency_seconds_bucket", le="+Inf") == 4


def test_preemptions_are_counted(tiny_checkpoint):
    # 8 blocks of 4 tokens: three 5-token prompts growing to 17 tokens (5 blocks each) cannot all stay
    model_dir = str(tiny_checkpoint("llama-gqa"))
    probe = LLM(model_dir, kv_cache_memory=1 << 20, block_size=4).engine
    bytes_per_block = (1 << 20) // probe.kv_manager.num_blocks
    engine = LLM(model_dir, kv_cache_memory=8 * bytes_per_block, block_size=4, max_model_len=32).engine
    assert engine.kv_manager.num_blocks == 8
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "tiny", block_size=4)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(10 * i + 1, 10 * i + 6)),
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    preempted_in_steps = sum(step.num_preempted for step in _run(engine, metrics))
    assert engine.scheduler.num_preemptions > 0
    assert _value(registry, "num_preemptions_total") == preempted_in_steps == engine.scheduler.num_preemptions
    assert _value(registry, "request_success_total", finished_reason="length") == 3
    assert _value(registry, "generation_tokens_total") == 3 * 12


def test_queue_time_and_exposition_has_no_request_ids():
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "tiny", block_size=16)
    metrics.observe_queue_time(0.4)
    metrics.observe_queue_time(-0.01)  # another machine's clock, a little ahead: 0
    assert _value(registry, "request_queue_time_seconds_count") == 2
    assert _value(registry, "request_queue_time_seconds_bucket", le="0.3") == 1
    assert _value(registry, "request_queue_time_seconds_sum") == 0.4
    metrics.count_finished("something else")  # never a label value of its own
    assert _value(registry, "request_success_total", finished_reason="error") == 1
    from prometheus_client import generate_latest

    labels = {name for family in text_string_to_metric_families(generate_latest(registry).decode())
              for sample in family.samples for name in sample.labels}
    assert labels == {"model_name", "finished_reason", "le", "event", "direction"}  # each with a fixed set of values


def test_kv_tier_totals_become_counters_that_grow_by_the_change():
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "tiny", block_size=16)
    metrics.observe_kv_tier({"blocks_saved": 3, "blocks_loaded": 0, "bytes_out": 300, "bytes_in": 0, "errors": 1})
    metrics.observe_kv_tier({"blocks_saved": 5, "blocks_loaded": 2, "bytes_out": 500, "bytes_in": 200, "errors": 1})
    assert _value(registry, "kv_tier_blocks_total", event="saved") == 5
    assert _value(registry, "kv_tier_blocks_total", event="loaded") == 2
    assert _value(registry, "kv_tier_bytes_total", direction="out") == 500
    assert _value(registry, "kv_tier_bytes_total", direction="in") == 200
    assert _value(registry, "kv_tier_errors_total") == 1


def test_metrics_server_serves_the_registry_and_a_busy_port_is_logged(caplog):
    import socket

    import httpx

    from pagedserve.telemetry.metrics import serve_metrics

    registry = CollectorRegistry()
    WorkerMetrics(registry, "tiny", block_size=16).count_finished("stop")
    server = serve_metrics(registry, "127.0.0.1", 0)
    assert server is not None
    try:
        port = server.server_address[1]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'pagedserve:request_success_total{finished_reason="stop",model_name="tiny"} 1.0' in text
        # what a Prometheus server asks for: still the text format, the names unchanged
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10, headers={
            "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3"})
        assert scraped.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert scraped.text == text
        with caplog.at_level("ERROR"):  # the port is taken: no server, an error, and the worker goes on
            assert serve_metrics(registry, "127.0.0.1", port) is None
        assert f"cannot listen on 127.0.0.1:{port}" in caplog.text
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # closed


def test_speculative_decoding_counters(tiny_checkpoint):
    """The spec_decode counters equal the speculator's own counts; a plain worker has none."""
    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22,
              speculative={"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    engine = llm.engine
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "tiny", block_size=16, proposer="ngram")
    repeated = [5, 6, 7, 8] * 8  # prompt lookup finds matches everywhere
    engine.add_request("a", repeated, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    steps = _run(engine, metrics)
    counters = engine.speculator.counters
    assert counters.num_drafts > 0
    assert _value(registry, "spec_decode_num_drafts_total", proposer="ngram") == counters.num_verifications
    assert _value(registry, "spec_decode_num_draft_tokens_total", proposer="ngram") == counters.num_drafts
    assert _value(registry, "spec_decode_num_accepted_tokens_total", proposer="ngram") == counters.num_accepted
    assert sum(s.num_accepted_tokens for s in steps) == counters.num_accepted
    # every step yields one token plus those accepted
    assert _value(registry, "generation_tokens_total") == 24 == sum(s.num_generated_tokens for s in steps)
    plain = CollectorRegistry()
    WorkerMetrics(plain, "tiny", block_size=16)
    assert plain.get_sample_value("pagedserve:spec_decode_num_drafts_total", {**MODEL, "proposer": "ngram"}) is None
