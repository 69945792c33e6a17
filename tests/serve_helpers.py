"""A live `pagedserve serve` for the tests: started the way a user starts it, as a process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from pagedserve.common import queue_protocol as q
from pagedserve.common import redis_clients
from pagedserve.common.queue_protocol import (
    Chunk,
    QueuedRequest,
    Reply,
    WorkerInfo,
    decode_request,
    decode_worker_info,
)


def write_reply(client, request: QueuedRequest, chunk: Chunk) -> None:
    """What a worker writes for `request`: an entry of its gateway's reply stream."""
    client.xadd(request.reply_to, {q.REPLIES_FIELD: q.encode_replies([Reply(request.request_id, chunk)])})


def chunks_of(client, reply_to: str, request_id: str) -> list[Chunk]:
    """The chunks of one request in a reply stream, in order."""
    return [r.chunk for _, fields in client.xrange(reply_to) for r in q.decode_replies(fields[q.REPLIES_FIELD])
            if r.request_id == request_id]


API_KEYS = {"sk-test-a": "tenant-a", "sk-test-b": "tenant-b"}


def wait_until(predicate, what: str, timeout: float = 30.0):
    """Poll `predicate` until it returns something true (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`redis_url` None: the server starts its own Redis (and `workers()` cannot look).
    `new_session`: its own process group, as a terminal's job is; `log`: a file for its output.
    `quantization`: the weights' (default "none": float32, which the tests compare against
    transformers and the in-process engine; None: the server's own default, int8 on CPU)."""

    def __init__(self, model_dir, redis_url: str | None, *flags: str, new_session: bool = False, log=None,
                 quantization: str | None = "none"):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.redis_url = redis_url
        self.model = str(model_dir)
        env = dict(os.environ, PAGEDSERVE_API_KEYS=",".join(f"{k}:{t}" for k, t in API_KEYS.items()))
        args = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--model", self.model, "--port", str(self.port),
                *(["--redis-url", redis_url] if redis_url else []), "--log-level", "warning", *(["--quantization", quantization] if quantization else []), *flags]
        self.process = subprocess.Popen(args, env=env, start_new_session=new_session, stdout=log, stderr=log)
        # redis:// or redis+sentinel:// (passwords from the URL or the environment), as the server reads it
        self.redis = redis_clients.sync_client(redis_url) if redis_url else None

    def wait_ready(self, timeout: float = 300.0) -> LiveServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"pagedserve serve exited with {self.process.returncode}"
            try:
                if httpx.get(self.base_url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError("the server did not become ready")

    def workers(self) -> list[WorkerInfo]:
        ids = self.redis.zrangebyscore(q.WORKERS, time.time(), "+inf")
        infos = self.redis.mget([q.worker_key(i.decode()) for i in ids]) if ids else []
        return [decode_worker_info(x) for x in infos if x]

    def wait_for(self, predicate, timeout: float = 60.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.redis is not None:
            self.redis.close()
        return self.process.returncode


def fake_worker(redis_client, chunks: list[Chunk], taken: list[QueuedRequest] | None = None) -> threading.Thread:
    """A thread that answers the next request queued (within 10 s) with these chunks, as a
    worker would, for gateway tests without a model; the request it took goes into `taken`."""
    def run():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if entries := redis_client.xrange(q.REQUESTS):
                request = decode_request(entries[-1][1][q.REQUEST_FIELD])
                if taken is not None:
                    taken.append(request)
                redis_client.delete(q.REQUESTS)
                for chunk in chunks:
                    write_reply(redis_client, request, chunk)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def stream_completion(base_url: str, prompt: str, max_tokens: int, outcome: dict, key: str = "sk-test-a") -> None:
    """Stream a greedy completion of `prompt` (model "m", EOS ignored) into `outcome`: the
    text, the finish reason, and the codes of any error events."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    outcome.update(text="", finish=None, errors=[])
    with httpx.stream("POST", base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=180) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                outcome["errors"].append(event["error"]["code"])
                continue
            [choice] = event["choices"]
            outcome["text"] += choice["text"]
            outcome["finish"] = choice["finish_reason"] or outcome["finish"]


def cluster_workers(base_url: str, key: str = "sk-test-a") -> list[dict]:
    """The workers as the gateway's /v1/cluster shows them."""
    return httpx.get(base_url + "/v1/cluster", headers={"Authorization": f"Bearer {key}"}, timeout=5).json()["workers"]
