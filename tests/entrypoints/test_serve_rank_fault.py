"""A tensor-parallel rank killed mid-generation under `pagedserve serve` with two workers of
two ranks each: its worker goes down within 10 s (rank 0 sees the rank exit while it waits
on the shared-memory all-reduce), and the queue's reclaim finishes its requests on the other
worker, resumed from what each client was sent. Every client sees one complete stream,
token-exact against a single-rank engine. (A restart by the supervisor is the same for any
worker that exits: tests/entrypoints/test_launcher.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams

from serve_helpers import LiveServer, cluster_workers, stream_completion, wait_until
from tiny_models import build_checkpoint

PROMPTS = [f"Story number {i} begins" for i in range(4)]
MAX_TOKENS = 400  # still running when the rank dies


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("rank-fault-llama"), max_position_embeddings=1024)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a worker's ranks 1..N-1)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_killed_rank_takes_its_worker_down_and_every_request_finishes_token_exact(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", enforce_eager=True)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [out.outputs[0].text for out in llm.generate(PROMPTS, greedy)]
    del llm

    server = LiveServer(model_dir, None, "--num-workers", "2", "--tensor-parallel-size", "2", "--served-model-name",
                        "m", "--attention-backend", "torch", "--enforce-eager", "--num-threads", "1",
                        "--heartbeat-interval", "0.5", "--worker-timeout", "5", "--worker-restart-limit", "0")
    try:
        server.wait_ready()
        wait_until(lambda: sum(w["alive"] for w in cluster_workers(server.base_url)) == 2, "two live workers", timeout=180)
        outcomes: list[dict] = [{} for _ in PROMPTS]
        clients = [threading.Thread(target=stream_completion, args=(server.base_url, p, MAX_TOKENS, o))
                   for p, o in zip(PROMPTS, outcomes)]
        for client in clients:
            client.start()
        wait_until(lambda: all(o.get("text") for o in outcomes), "every stream's first token", timeout=90)
        wait_until(lambda: sum(w["num_running"] for w in cluster_workers(server.base_url)) == len(PROMPTS),
                   "the workers to announce every request", timeout=30)
        holder = max(cluster_workers(server.base_url), key=lambda w: w["num_running"])
        [rank1] = _children(holder["pid"])
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: _gone(holder["pid"]), "the worker whose rank died to exit", timeout=10)
        assert time.monotonic() - killed < 10

        for client in clients:
            client.join(timeout=180)
        assert not any(client.is_alive() for client in clients), "a stream hung"
        for outcome, text in zip(outcomes, expected):
            assert outcome["errors"] == []
            assert outcome["finish"] == "length"
            assert outcome["text"] == text  # one stream, token-exact across the takeover

        workers = cluster_workers(server.base_url)
        [gone] = [w for w in workers if w["worker_id"] == holder["worker_id"]]
        assert not gone["alive"]  # not restarted: --worker-restart-limit 0
        [taker] = [w for w in workers if w["alive"]]
        assert taker["taken_over"] == holder["num_running"]
        assert len(_children(taker["pid"])) == 1  # still a rank 0 with its rank 1
    finally:
        server.stop()
