"""`pagedserve bench serve`: metrics on synthetic timelines, and the client against a stream."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedserve.bench.request_stats import RequestRecord, parse_slo, percentile, summarize
from pagedserve.bench.workloads import serve_workload
from pagedserve.common.errors import InvalidParameterError
from pagedserve.entrypoints.cli import main


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10.0], 99) == 10.0
    assert percentile([0, 100], 99) == 99.0
    assert math.isnan(percentile([], 50))


def test_metrics_on_a_synthetic_timeline():
    a = RequestRecord(prompt_tokens=10, start=0.0, chunk_times=[0.5, 0.7, 1.0], output_tokens=3, end=1.0)
    b = RequestRecord(prompt_tokens=20, start=1.0, chunk_times=[1.2, 1.3], output_tokens=5, end=2.0)
    c = RequestRecord(prompt_tokens=5, start=1.5, error="HTTP 429: queue full")
    s = summarize([a, b, c], duration=4.0, slo_ms={"ttft": 300})
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["request_throughput"] == 0.5
    assert s["output_throughput"] == 8 / 4 and s["total_throughput"] == (8 + 30) / 4
    assert s["ttft"]["mean_ms"] == pytest.approx(350) and s["ttft"]["median_ms"] == pytest.approx(350)
    # TPOT: a = (1.0 - 0.5) / 2 = 0.25 s, b = (1.0 - 0.2) / 4 = 0.2 s
    assert s["tpot"]["mean_ms"] == pytest.approx(225)
    # ITL pools every gap: 0.2, 0.3 (a) and 0.1 (b)
    assert s["itl"]["mean_ms"] == pytest.approx(200) and s["itl"]["median_ms"] == pytest.approx(200)
    assert s["e2e"]["mean_ms"] == pytest.approx(1000)
    assert s["goodput"] == 1 / 4  # only b met TTFT <= 300 ms
    assert s["errors"] == ["HTTP 429: queue full"]
    assert parse_slo("ttft=500,tpot=50") == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(InvalidParameterError):
        parse_slo("ttft=fast")


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams one chunk per requested token, like an OpenAI server, and counts requests."""

    requests: list[dict] = []
    cached_tokens = None  # prompt -> cached tokens to report in usage (None: report none)

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = request["max_tokens"]
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": len(request["prompt"]), "completion_tokens": n}}
        if type(self).cached_tokens is not None:
            usage["usage"]["prompt_tokens_details"] = {"cached_tokens": type(self).cached_tokens(request["prompt"])}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


def test_client_against_a_streaming_server(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        _FakeOpenAI.requests = []
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code = main(["bench", "serve", "--base-url", url, "--num-requests", "12", "--max-concurrency", "4",
                     "--request-rate", "50", "--no-progress", "--json", "--slo", "ttft=60000"])
    finally:
        server.shutdown()
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prompts, outputs = serve_workload(12)
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(outputs)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    sent = sorted((len(r["prompt"]), r["max_tokens"]) for r in _FakeOpenAI.requests)
    assert sent == sorted(zip(map(len, prompts), outputs))
    assert all(r["stream"] and r["model"] == "fake-model" and r["temperature"] == 0.0 for r in _FakeOpenAI.requests)


def test_rate_sweep_with_plot(tmp_path, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    plot = tmp_path / "serve.png"
    try:
        code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{server.server_address[1]}", "--num-requests", "6",
                     "--request-rate", "100,inf", "--no-progress", "--json", "--plot", str(plot)])
    finally:
        server.shutdown()
    assert code == 0
    summaries = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["request_rate"] for s in summaries] == ["100", "inf"]
    assert all(s["completed"] == 6 for s in summaries)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_server_counts_failures(capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-requests", "3",
                 "--no-progress", "--json"])
    assert code == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["completed"], summary["failed"]) == (0, 3)
    assert summary["errors"][0].startswith("ConnectError")


def test_multi_turn_sends_each_turn_after_the_previous_one(capsys):
    """Turn t of a conversation is sent only once turn t-1 has finished (its prompt extends
    turn t-1's), and the hit rate is the cached prompt tokens the server reports over all."""
    from pagedserve.bench.workloads import multi_turn_conversations

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen: list[list[int]] = []

    def cached(prompt):  # the longest earlier prompt this one extends counts as cached
        best = max((len(p) for p in seen if prompt[: len(p)] == p), default=0)
        seen.append(prompt)
        return best

    _FakeOpenAI.requests, _FakeOpenAI.cached_tokens = [], staticmethod(cached)
    try:
        code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{server.server_address[1]}",
                     "--workload", "multi-turn", "--num-requests", "3", "--max-concurrency", "2", "--no-progress",
                     "--json", "--vocab-size", "320"])
    finally:
        server.shutdown()
        _FakeOpenAI.cached_tokens = None
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    work = multi_turn_conversations(3, vocab_size=320)
    assert summary["completed"] == 18
    sent = [r["prompt"] for r in _FakeOpenAI.requests]
    for conversation in work:
        order = [sent.index(prompt) for prompt, _ in conversation]
        assert order == sorted(order)  # in turn order
    prompt_tokens = sum(len(p) for c in work for p, _ in c)
    cached_tokens = sum(len(c[i][0]) for c in work for i in range(5))  # each turn reuses the previous prompt
    assert summary["prefix_hit_rate"] == pytest.approx(cached_tokens / prompt_tokens)
