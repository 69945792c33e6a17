"""A scale-down (Kubernetes sends one worker pod SIGTERM) under `pagedserve serve` with two
workers: the worker stops taking requests, its running ones get --drain-timeout to finish,
and what is still running then is handed back to the queue, where the other worker resumes it
from what the client has been sent. The client sees one stream, complete and token-exact.
The whole-server stop (every worker drains, none to hand back to) is
tests/gateway/test_live_server.py::test_sigterm_drains."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from pagedserve import LLM, SamplingParams

from serve_helpers import LiveServer, cluster_workers, stream_completion, wait_until
from tiny_models import build_checkpoint

PROMPT = "A long story begins"
MAX_TOKENS = 1500  # far longer than the drain: the stream is still running when it ends


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("scale-down-llama"), max_position_embeddings=4096)


def test_sigterm_to_one_worker_hands_back_the_requests_it_cannot_finish(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", enforce_eager=True)
    [reference] = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    expected = reference.outputs[0].text
    del llm

    server = LiveServer(model_dir, None, "--num-workers", "2", "--served-model-name", "m", "--attention-backend",
                        "torch", "--enforce-eager", "--num-threads", "1", "--drain-timeout", "1",
                        "--heartbeat-interval", "0.5", "--worker-timeout", "5", "--worker-restart-limit", "0")
    try:
        server.wait_ready()
        wait_until(lambda: sum(w["alive"] for w in cluster_workers(server.base_url)) == 2, "two live workers", timeout=120)
        outcome: dict = {}
        client = threading.Thread(target=stream_completion, args=(server.base_url, PROMPT, MAX_TOKENS, outcome))
        client.start()
        wait_until(lambda: outcome.get("text"), "the first token", timeout=60)
        [holder] = wait_until(lambda: [w for w in cluster_workers(server.base_url) if w["num_running"] == 1],
                              "the worker that holds the request to announce it", timeout=30)
        os.kill(holder["pid"], signal.SIGTERM)  # what the kubelet sends a pod it scales down

        client.join(timeout=120)
        assert not client.is_alive(), "the stream hung"
        assert outcome["errors"] == []
        assert outcome["finish"] == "length"
        assert outcome["text"] == expected  # one stream, token-exact across the hand-back

        workers = cluster_workers(server.base_url)
        [gone] = [w for w in workers if w["worker_id"] == holder["worker_id"]]
        assert not gone["alive"]  # the drained worker left (not restarted: --worker-restart-limit 0)
        [taker] = [w for w in workers if w["alive"]]
        assert taker["taken_over"] == 1
    finally:
        server.stop()
