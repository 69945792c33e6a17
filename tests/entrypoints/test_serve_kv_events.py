"""`pagedserve serve --kv-events`: the worker's cached blocks reach the prefix cache service
that `serve` runs, and leave it with the worker."""

from __future__ import annotations

import httpx
import pytest

from serve_helpers import API_KEYS, LiveServer, free_port


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


def test_a_served_worker_publishes_its_cached_blocks(tiny_checkpoint):
    port = free_port()
    live = LiveServer(tiny_checkpoint("llama-gqa"), None, "--num-workers", "1", "--kv-events",
                      "--prefix-cache-port", str(port))
    service = f"http://127.0.0.1:{port}"
    key = next(iter(API_KEYS))
    try:
        live.wait_ready()
        assert _health(service) == {"status": "ok", "workers": 0, "blocks": 0}  # nothing cached yet

        def complete(prompt: list[int]) -> None:
            body = {"model": live.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
            r = httpx.post(live.base_url + "/v1/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text

        complete(list(range(3, 3 + 64)))  # 64 computed tokens: 4 full blocks of 16
        live.wait_for(lambda: _health(service)["blocks"] == 4, what="the first 4 blocks")
        complete(list(range(3, 3 + 64)) + list(range(100, 132)))  # the same 4 (a hit) and 2 more
        live.wait_for(lambda: _health(service)["blocks"] == 6, what="6 blocks")
        assert _health(service)["workers"] == 1
        metrics = httpx.get(service + "/metrics", timeout=5).text
        assert "pagedserve:prefix_index_malformed_total 0.0" in metrics
        assert "pagedserve:prefix_index_gaps_total 0.0" in metrics
    finally:
        assert live.stop() == 0
    with pytest.raises(httpx.HTTPError):  # the service stopped with the server
        httpx.get(service + "/health", timeout=1)
