"""The local twin of the compose metrics check: `pagedserve serve` as a process with two
workers, each serving its metrics on --worker-metrics-port + i, and the gateway's /metrics;
N completions of known lengths give exact counts on both."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_helpers import LiveServer
from tiny_models import build_checkpoint

KEY = "sk-test-a"  # serve_helpers.API_KEYS
PROMPT_LENGTHS = [5, 9, 13, 17, 21, 25]
MAX_TOKENS = 6


def _two_free_ports() -> int:
    """A port p with p + 1 free too (for two workers)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(scrapes: list[dict], name: str, **labels: str) -> float:
    """A sample summed over the workers (each has its own model_name label: the checkpoint path)."""
    return sum(v for samples in scrapes for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("metrics-llama"))


def test_worker_and_gateway_metrics_count_a_known_load(model_dir):
    port = _two_free_ports()
    live = LiveServer(model_dir, None, "--num-workers", "2", "--worker-metrics-port", str(port))
    try:
        live.wait_ready()
        worker_urls = [f"http://127.0.0.1:{port + i}/metrics" for i in range(2)]

        def complete(length: int) -> int:
            body = {"model": live.model, "prompt": list(range(3, 3 + length)), "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "temperature": 0.0}
            r = httpx.post(live.base_url + "/v1/completions", json=body, timeout=120,
                           headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]

        with ThreadPoolExecutor(len(PROMPT_LENGTHS)) as pool:
            assert list(pool.map(complete, PROMPT_LENGTHS)) == [MAX_TOKENS] * len(PROMPT_LENGTHS)
        n = len(PROMPT_LENGTHS)

        # a worker answers, then records the pass's metrics: wait for the last of them, and idle
        def settled():
            scrapes = [_scrape(url) for url in worker_urls]
            done = _total(scrapes, "pagedserve:request_success_total", finished_reason="length") == n
            return scrapes if done and _total(scrapes, "pagedserve:num_requests_running") == 0 else None

        scrapes = live.wait_for(settled, timeout=30, what="the workers' metrics")
        assert _total(scrapes, "pagedserve:request_success_total") == n  # no stop, abort or error
        assert _total(scrapes, "pagedserve:generation_tokens_total") == n * MAX_TOKENS
        assert _total(scrapes, "pagedserve:prompt_tokens_total") == sum(PROMPT_LENGTHS)
        assert _total(scrapes, "pagedserve:e2e_request_latency_seconds_count") == n
        assert _total(scrapes, "pagedserve:time_to_first_token_seconds_count") == n
        assert _total(scrapes, "pagedserve:request_queue_time_seconds_count") == n
        assert _total(scrapes, "pagedserve:inter_token_latency_seconds_count") == n * (MAX_TOKENS - 1)
        assert _total(scrapes, "pagedserve:num_requests_waiting") == 0
        assert all(samples for samples in scrapes)  # both workers serve their own port
        labels = {k for samples in scrapes for (_, ls) in samples for k, _ in ls}
        assert labels == {"model_name", "finished_reason", "le", "event", "direction"}  # each with fixed values

        gateway = _scrape(live.base_url + "/metrics")
        assert _total([gateway], "pagedserve:http_requests_total", route="/v1/completions", status_code="200") == n
        assert _total([gateway], "pagedserve:requests_rejected_total") == 0
    finally:
        assert live.stop() == 0
    # the workers' metrics servers stopped with them: nobody listens there (closed scrapes may linger)
    for i in range(2):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port + i))


def test_each_worker_gets_its_own_metrics_port_through_the_environment():
    from pagedserve.common.engine_config import EngineConfig
    from pagedserve.common.errors import InvalidParameterError
    from pagedserve.common.serve_config import ServeConfig
    from pagedserve.entrypoints.worker_plan import worker_plan

    config = ServeConfig(num_workers=3, worker_metrics_port=9100, worker_metrics_host="0.0.0.0")
    argv, envs = worker_plan(config, EngineConfig(device="cpu"), "redis://x")
    assert [env["PAGEDSERVE_WORKER_METRICS_PORT"] for env in envs] == ["9100", "9101", "9102"]
    assert "--worker-metrics-port" not in argv  # a flag would win over each worker's variable
    assert argv[argv.index("--worker-metrics-host") + 1] == "0.0.0.0"
    _, envs = worker_plan(ServeConfig(num_workers=2), EngineConfig(device="cpu"), "redis://x")
    assert all("PAGEDSERVE_WORKER_METRICS_PORT" not in env for env in envs)
    with pytest.raises(InvalidParameterError, match="65535"):
        worker_plan(ServeConfig(num_workers=2, worker_metrics_port=65535), EngineConfig(device="cpu"), "redis://x")
    for bad in (0, 65536):
        with pytest.raises(InvalidParameterError, match="worker_metrics_port"):
            ServeConfig(worker_metrics_port=bad)


def test_the_kv_tier_url_reaches_workers_through_the_environment_never_argv(monkeypatch):
    from pagedserve.common.engine_config import EngineConfig
    from pagedserve.common.serve_config import ServeConfig
    from pagedserve.entrypoints.worker_plan import worker_count, worker_plan

    monkeypatch.delenv("PAGEDSERVE_KV_TIER_URL", raising=False)
    engine = EngineConfig(device="cpu", kv_tier_memory=1 << 30, kv_tier_url="redis://:secret@tier:6379/0")
    argv, envs = worker_plan(ServeConfig(num_workers=2), engine, "redis://x")
    assert not any("secret" in arg for arg in argv)
    assert argv[argv.index("--kv-tier-memory") + 1] == str(1 << 30)
    assert [env["PAGEDSERVE_KV_TIER_URL"] for env in envs] == ["redis://:secret@tier:6379/0"] * 2
    # no URL of its own: a worker uses the queue's Redis (worker/service.py), so none is passed
    _, envs = worker_plan(ServeConfig(num_workers=1), EngineConfig(device="cpu", kv_tier_memory=1 << 30), "redis://x")
    assert "PAGEDSERVE_KV_TIER_URL" not in envs[0]
    assert worker_count(ServeConfig(num_workers=3), EngineConfig(device="cpu")) == 3
    assert worker_count(ServeConfig(), EngineConfig(device="cpu")) == 1
