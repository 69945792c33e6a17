"""`pagedserve bench chaos`: streaming load against `pagedserve serve` while its workers are
killed and its Redis restarts, accounting for the fate of every request.

    python -m pagedserve.bench.chaos [--duration 300] [--clients 256] [--kill-every 60]
                                     [--redis-restart-at 150] [--model DIR] [--json FILE]

The script owns everything it breaks. It starts a redis-server (pagedserve's EmbeddedRedis,
kept on one port for the whole run) and `pagedserve serve --num-workers 2` against it (the
URL goes through PAGEDSERVE_REDIS_URL, never argv). Without --model it first writes a tiny
random Llama checkpoint. Before the chaos, it asks the server for a reference answer to
each of a few fixed prompts (greedy, EOS ignored, a fixed max_tokens, not streamed). Then
every client loops: stream one completion of the next prompt, read the events to the end,
and file the request under exactly one outcome:

- completed: the stream ended with [DONE] and no error event. Its tokens (logprobs=0 names
  each one) are compared with the reference: exact, duplicated (more tokens), missing
  (fewer), or different (as many, not the same);
- visible error: an HTTP error other than 429/503, an error event in the stream, a
  refused connection, or 429/503 still answered when the run ended;
- lost: the stream was cut without [DONE], went silent for --stall-timeout seconds, or
  was still open when the grace period after the run ran out.

The clients' count of answers (status lines received) is set beside the gateway's own
(/metrics). The gateway answers every request it reads, and a client that gives up first
does not see the answer: an attempt silent for --stall-timeout before any status line (the
gateway holds a stream's status line until its first token or error) is filed lost, and the
gateway, seeing the connection close, answers it with a 499 that no one reads. So the
gateway's count is the clients' count plus those attempts, plus at most the attempts still
unanswered when the grace period cancelled them.

A 429 or 503 is not an outcome: the client waits its Retry-After and sends the request
again. Meanwhile a worker is killed with SIGKILL every --kill-every seconds, Redis is
stopped and started once at --redis-restart-at, and the gateway's resident memory is
sampled every --sample-every seconds (the `serve` process runs the gateway in its main
thread). The targets are 0 lost requests and 0 completed streams unlike their reference.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pagedserve.bench.request_stats import latency_stats
from pagedserve.common.errors import InvalidParameterError

#: the fixed prompts; client i starts at prompt i and walks through them in turn
PROMPTS = (
    "The capital of France is",
    "Hello world, hello tokens.",
    "Once upon a time",
    "héllo wörld ✓",
    "The quick brown fox jumps over",
    "1, 2, 3, 4,",
    "Paris. Paris. Paris.",
    "A B C D E F G",
)

#: the outcomes of a request: every request sent ends in exactly one of them
COMPLETED, ERROR, LOST = "completed", "error", "lost"
#: an attempt whose connection broke before any answer came back: the gateway never read the
#: request (the figures check it against the gateway's own count of answers), so the client
#: sends it again, as HTTP clients do with a request cut on a reused connection
RESET_BEFORE_ANSWER = "reset_before_answer"
#: what an attempt answered with 429 or 503 asks for instead: wait and send again
RETRY = "retry"

#: how a completed stream compares with its prompt's reference answer
EXACT, DUPLICATED, MISSING, DIFFERENT = "exact", "duplicated", "missing", "different"

#: seconds a client waits on a 429/503 without a readable Retry-After
DEFAULT_RETRY_AFTER = 1.0
#: the longest Retry-After honoured, so that one odd header cannot park a client for the run
MAX_RETRY_AFTER = 60.0

MIB = 1024 * 1024


# -- reading one stream ------------------------------------------------------------------------
@dataclass
class StreamReading:
    """What one server-sent-event stream of /v1/completions said, folded line by line."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)  # from each chunk's logprobs, in order
    finish_reason: str | None = None
    error: dict | None = None  # the "error" object of an error event
    done: bool = False  # "data: [DONE]" arrived
    usage: dict | None = None

    def feed(self, line: str) -> None:
        """Fold one line of the stream in; raises ValueError on an event that is not JSON."""
        if self.done or not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if "error" in event:
            if self.error is None:
                self.error = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            return
        for choice in event.get("choices") or []:
            self.text += choice.get("text") or ""
            logprobs = choice.get("logprobs") or {}
            self.tokens.extend(logprobs.get("tokens") or [])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if event.get("usage"):
            self.usage = event["usage"]

    def outcome(self) -> str:
        """An error event makes a visible error, even when [DONE] follows it; [DONE] alone a
        completed request; a stream that stopped before either is lost."""
        if self.error is not None:
            return ERROR
        return COMPLETED if self.done else LOST

    def error_kind(self) -> str:
        assert self.error is not None, "error_kind of a stream without an error event"
        return "event_" + str(self.error.get("code") or self.error.get("type") or "unknown")


def read_stream(lines: Iterable[str]) -> StreamReading:
    """Fold a whole stream (for tests and for anything that has its lines at hand)."""
    reading = StreamReading()
    for line in lines:
        reading.feed(line)
    return reading


@dataclass(frozen=True)
class Reference:
    """The server's non-streamed greedy answer to one prompt."""

    text: str
    tokens: tuple[str, ...]


def compare(reading: StreamReading, reference: Reference) -> str:
    """exact, or how a completed stream differs from the reference: with a fixed max_tokens
    and EOS ignored, a stream holds exactly the reference's tokens and stops for `length`;
    more tokens mean some were sent twice, fewer that some never came."""
    if reading.tokens == list(reference.tokens) and reading.text == reference.text and reading.finish_reason == "length":
        return EXACT
    if len(reading.tokens) > len(reference.tokens):
        return DUPLICATED
    if len(reading.tokens) < len(reference.tokens):
        return MISSING
    return DIFFERENT


def retry_after_seconds(value: str | None) -> float:
    """The seconds of a Retry-After header (a number of seconds; pagedserve sends no dates)."""
    try:
        seconds = float(value) if value is not None else DEFAULT_RETRY_AFTER
    except ValueError:
        return DEFAULT_RETRY_AFTER
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


# -- accounting ----------------------------------------------------------------------------------
@dataclass
class Outcome:
    """How one attempt at a request ended."""

    kind: str  # COMPLETED, ERROR, LOST or RETRY
    detail: str = ""  # the error kind, the reason it was lost, or the retried status
    reading: StreamReading | None = None
    retry_after: float = 0.0


@dataclass
class Tally:
    """Every request sent, filed under one outcome; sent == completed + errors + lost once
    every request has ended."""

    sent: int = 0
    completed: Counter = field(default_factory=Counter)  # comparison verdict → requests
    errors: Counter = field(default_factory=Counter)  # error kind → requests
    lost: Counter = field(default_factory=Counter)  # reason → requests
    retried: Counter = field(default_factory=Counter)  # "429" / "503" → answers waited out
    retry_wait_s: float = 0.0  # Retry-After seconds slept, over all clients
    answered: int = 0  # attempts that got a status line back (the reference requests too)
    # attempts given up silent (--stall-timeout) before any status line: the gateway read them
    # and answers each, with a 499 if nothing sooner, that no client reads
    timed_out_unanswered: int = 0
    cancelled_unanswered: int = 0  # attempts still without an answer when the grace period ended
    e2e_s: list[float] = field(default_factory=list)  # send to [DONE] of completed requests, retries included
    mismatches: list[dict] = field(default_factory=list)  # the first few streams unlike their reference
    losses: list[dict] = field(default_factory=list)  # the first few lost requests, to set beside the chaos events

    def record(self, outcome: Outcome, reference: Reference, prompt_index: int, sent_s: float, ended_s: float) -> None:
        """File one request's outcome; `sent_s` and `ended_s` are seconds since the load began."""
        when = {"prompt": prompt_index, "sent_s": round(sent_s, 2), "ended_s": round(ended_s, 2)}
        if outcome.kind == COMPLETED:
            assert outcome.reading is not None
            verdict = compare(outcome.reading, reference)
            self.completed[verdict] += 1
            self.e2e_s.append(ended_s - sent_s)
            if verdict != EXACT and len(self.mismatches) < 10:
                self.mismatches.append({
                    **when, "verdict": verdict, "tokens": len(outcome.reading.tokens),
                    "reference_tokens": len(reference.tokens), "finish_reason": outcome.reading.finish_reason,
                    "usage": outcome.reading.usage, "text": outcome.reading.text[:200],
                    "reference_text": reference.text[:200]})
        elif outcome.kind == ERROR:
            self.errors[outcome.detail] += 1
        else:
            assert outcome.kind == LOST, outcome.kind
            self.lost[outcome.detail] += 1
            if len(self.losses) < 50:
                tokens = len(outcome.reading.tokens) if outcome.reading is not None else 0
                self.losses.append({**when, "reason": outcome.detail, "tokens": tokens})

    @property
    def ended(self) -> int:
        return sum(self.completed.values()) + sum(self.errors.values()) + sum(self.lost.values())

    def figures(self) -> dict[str, Any]:
        completed = sum(self.completed.values())
        return {
            "sent": self.sent,
            "completed": completed,
            "visible_errors": sum(self.errors.values()),
            "lost": sum(self.lost.values()),
            "balanced": self.sent == self.ended,
            "streams": {v: self.completed.get(v, 0) for v in (EXACT, DUPLICATED, MISSING, DIFFERENT)},
            "bad_streams": completed - self.completed.get(EXACT, 0),
            "errors_by_kind": dict(self.errors),
            "lost_by_reason": dict(self.lost),
            "answered": self.answered,
            "timed_out_unanswered": self.timed_out_unanswered,
            "cancelled_unanswered": self.cancelled_unanswered,
            "resets_before_answer": self.retried.get(RESET_BEFORE_ANSWER, 0),
            "answers_429": self.retried.get("429", 0),
            "answers_503": self.retried.get("503", 0),
            "retry_wait_s": round(self.retry_wait_s, 1),
            "e2e": {k: None if math.isnan(v) else round(v, 1) for k, v in latency_stats(self.e2e_s).items()},
            "mismatches": self.mismatches,
            "losses": self.losses,
        }


# -- processes -------------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int | None:
    """A process's resident set size (VmRSS of /proc/PID/status), or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def worker_children(parent: int) -> list[int]:
    """The pids of `parent`'s children that run `pagedserve ... worker` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the fields after "(comm)": state, ppid
        if ppid == parent and b"worker" in argv:
            found.append(int(entry.name))
    return sorted(found)


def rss_growth(samples: Sequence[dict], window_s: float) -> dict[str, float | None]:
    """The gateway's mean RSS over the first and the last `window_s` seconds, and the growth."""
    rss = [(s["t"], s["gateway_rss_mib"]) for s in samples if s["gateway_rss_mib"] is not None]
    if not rss:
        return {"window_s": window_s, "first_mib": None, "last_mib": None, "growth_mib": None,
                "growth_pct": None, "max_mib": None}
    first = [m for t, m in rss if t <= rss[0][0] + window_s]
    last = [m for t, m in rss if t >= rss[-1][0] - window_s]
    first_mib, last_mib = sum(first) / len(first), sum(last) / len(last)
    return {"window_s": window_s, "first_mib": round(first_mib, 1), "last_mib": round(last_mib, 1),
            "growth_mib": round(last_mib - first_mib, 1), "growth_pct": round(100 * (last_mib / first_mib - 1), 1),
            "max_mib": round(max(m for _, m in rss), 1)}


def build_tiny_checkpoint(out_dir: Path) -> Path:
    """A tiny random Llama with a byte-level tokenizer, for a run without --model. Its weights
    are drawn wide, so greedy decoding is decided by clear margins, not by rounding."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab_size = 320
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([" ".join(PROMPTS)] * 3, trainer)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.25 if p.dim() > 1 else 0.1)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(str(out_dir))
    return out_dir


# -- the run -----------------------------------------------------------------------------------------
class ChaosRun:
    """One benchmark: the Redis and the server it starts, the clients, the chaos, the figures."""

    def __init__(self, args: argparse.Namespace, model_dir: str, work_dir: Path):
        self.args = args
        self.model_dir = model_dir
        self.log_path = Path(args.serve_log) if args.serve_log else work_dir / "serve.log"
        self.api_key = "sk-chaos-" + secrets.token_hex(12)  # this run's only key, given through the environment
        self.tally = Tally()
        self.samples: list[dict] = []
        self.events: list[dict] = []  # kills and the Redis restart, with their times
        self.references: list[Reference] = []
        self.rng = random.Random(args.seed)
        self.redis: Any = None  # the EmbeddedRedis
        self.gateway_answers: int | None = None  # answers the gateway counted, read after the load
        self.serve: subprocess.Popen | None = None
        self.base_url = ""
        self.model_name = ""
        self.in_flight = 0  # requests sent and not yet ended
        self.start = 0.0  # time.monotonic() when the load began
        self.stop_at = 0.0  # no request starts after this; a server that exits brings it forward
        self.over = asyncio.Event()  # set when the load ends: the chaos stops, the clients finish

    # -- the server ------------------------------------------------------------------------------
    def start_server(self) -> None:
        from pagedserve.common.redis_server import EmbeddedRedis

        self.redis = EmbeddedRedis(port=self.args.redis_port or None, appendonly=self.args.redis_aof).start()
        port = _free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, PAGEDSERVE_REDIS_URL=self.redis.url, PAGEDSERVE_API_KEYS=f"{self.api_key}:chaos")
        argv = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--model", self.model_dir,
                "--port", str(port), "--num-workers", str(self.args.workers), "--device", self.args.device,
                "--log-level", "warning", *shlex.split(self.args.serve_flags)]
        with open(self.log_path, "ab") as log:
            self.serve = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        import httpx

        assert self.serve is not None
        deadline = time.monotonic() + self.args.startup_timeout
        while time.monotonic() < deadline:
            if self.serve.poll() is not None:
                raise RuntimeError(f"pagedserve serve exited with {self.serve.returncode} while starting:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/ready", timeout=2).status_code == 200:
                    listing = httpx.get(self.base_url + "/v1/models", headers=self.headers, timeout=10).json()
                    self.model_name = listing["data"][0]["id"]
                    return
            time.sleep(0.25)
        raise RuntimeError(f"pagedserve serve was not ready within {self.args.startup_timeout:g} s:\n{self.log_tail()}")

    def stop_server(self) -> None:
        """SIGTERM to the server (it drains, then stops its workers), SIGKILL past the timeout."""
        if self.serve is not None:
            workers = worker_children(self.serve.pid)
            if self.serve.poll() is None:
                self.serve.send_signal(signal.SIGTERM)
                try:
                    self.serve.wait(timeout=self.args.shutdown_timeout)
                except subprocess.TimeoutExpired:
                    self.serve.kill()
                    self.serve.wait()
            for pid in workers:  # only the server's own workers, should it have left any behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.redis is not None:
            self.redis.stop()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no server log)"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def body(self, prompt_index: int, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_name, "prompt": PROMPTS[prompt_index], "max_tokens": self.args.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "logprobs": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    # -- the reference answers -------------------------------------------------------------------
    def fetch_references(self) -> None:
        """Each prompt's non-streamed answer, asked twice at once (the two may run on different
        workers): the two must agree, or comparing streams with them would mean nothing."""
        import httpx

        async def answer(client: httpx.AsyncClient, i: int) -> Reference:
            response = await client.post(self.base_url + "/v1/completions", json=self.body(i, stream=False),
                                         headers=self.headers)
            self.tally.answered += 1
            response.raise_for_status()
            choice = response.json()["choices"][0]
            return Reference(text=choice["text"], tokens=tuple(choice["logprobs"]["tokens"]))

        async def both() -> list[tuple[Reference, Reference]]:
            async with httpx.AsyncClient(timeout=120) as client:
                pairs = await asyncio.gather(*(asyncio.gather(answer(client, i), answer(client, i)) for i in range(len(PROMPTS))))
            return [(a, b) for a, b in pairs]

        for i, (a, b) in enumerate(asyncio.run(both())):
            if a != b:
                raise RuntimeError(f"two greedy answers to prompt {i} differ; the server is not deterministic "
                                   f"on this model, so streams cannot be checked against a reference")
            if len(a.tokens) != self.args.max_tokens:
                raise RuntimeError(f"the reference for prompt {i} has {len(a.tokens)} tokens, not max_tokens="
                                   f"{self.args.max_tokens} (a context too short for it?)")
            self.references.append(a)

    # -- the load ----------------------------------------------------------------------------------
    async def attempt(self, http: Any, prompt_index: int) -> Outcome:
        """Send the request once and read its answer to the end."""
        import httpx

        reading = StreamReading()
        answered = False
        try:
            async with http.stream("POST", self.base_url + "/v1/completions", json=self.body(prompt_index, stream=True),
                                   headers=self.headers) as response:
                answered = True
                self.tally.answered += 1
                if response.status_code in (429, 503):
                    await response.aread()
                    return Outcome(RETRY, str(response.status_code), retry_after=retry_after_seconds(response.headers.get("retry-after")))
                if response.status_code != 200:
                    await response.aread()
                    return Outcome(ERROR, f"http_{response.status_code}")
                async for line in response.aiter_lines():
                    reading.feed(line)
                    if reading.done:
                        break
        except (httpx.ConnectError, httpx.ConnectTimeout):
            return Outcome(ERROR, "connect_error")
        except httpx.ReadTimeout:
            # unanswered, the client gives up and closes the connection: the gateway answers 499
            self.tally.timed_out_unanswered += not answered
            return self.ended(reading, f"silent_{self.args.stall_timeout:g}s")
        except httpx.HTTPError as exc:  # the connection broke: RemoteProtocolError, ReadError, ...
            if not answered:
                return Outcome(RETRY, RESET_BEFORE_ANSWER, retry_after=0.0)
            return self.ended(reading, "cut_" + type(exc).__name__)
        except ValueError:  # an event that was not JSON
            return self.ended(reading, "malformed_event")
        except asyncio.CancelledError:
            self.tally.cancelled_unanswered += not answered  # the gateway may still answer it (a 499)
            raise
        return self.ended(reading, "cut_before_done")

    @staticmethod
    def ended(reading: StreamReading, lost_reason: str) -> Outcome:
        """The outcome of a stream as far as it was read; `lost_reason` if it is lost."""
        kind = reading.outcome()
        if kind == ERROR:
            return Outcome(ERROR, reading.error_kind(), reading)
        return Outcome(kind, "" if kind == COMPLETED else lost_reason, reading)

    async def until_answered(self, http: Any, prompt_index: int) -> Outcome:
        """Attempts at one request, waiting out each 429/503, until one ends otherwise."""
        while True:
            outcome = await self.attempt(http, prompt_index)
            if outcome.kind != RETRY:
                return outcome
            self.tally.retried[outcome.detail] += 1
            if time.monotonic() + outcome.retry_after >= self.stop_at:
                # The run ends before the next try: refused for good, at the end (not earlier,
                # or the client would send a new request in the time left).
                await asyncio.sleep(max(0.0, self.stop_at - time.monotonic()))
                return Outcome(ERROR, f"http_{outcome.detail}_at_end")
            self.tally.retry_wait_s += outcome.retry_after
            await asyncio.sleep(outcome.retry_after)

    async def request(self, http: Any, prompt_index: int) -> None:
        """One request, from sent to its one outcome in the tally."""
        self.tally.sent += 1
        self.in_flight += 1
        sent_s = time.monotonic() - self.start

        def file(outcome: Outcome) -> None:
            self.tally.record(outcome, self.references[prompt_index], prompt_index, sent_s, time.monotonic() - self.start)

        try:
            outcome = await self.until_answered(http, prompt_index)
        except asyncio.CancelledError:  # still open when the grace period ran out
            file(Outcome(LOST, "open_at_end"))
            raise
        except Exception as exc:  # noqa: BLE001 - a fault of this client is filed and shown, not fatal
            outcome = Outcome(LOST, f"client_{type(exc).__name__}")
        finally:
            self.in_flight -= 1
        file(outcome)
        if outcome.detail == "connect_error":
            await asyncio.sleep(1.0)  # the gateway is down: no tight loop of refused connections

    async def client(self, http: Any, index: int) -> None:
        prompt_index = index % len(PROMPTS)
        while time.monotonic() < self.stop_at:
            await self.request(http, prompt_index)
            prompt_index = (prompt_index + 1) % len(PROMPTS)

    # -- the chaos ---------------------------------------------------------------------------------
    def pick_worker(self) -> int | None:
        """A worker of our server to kill: one that beats in Redis if Redis answers, else any."""
        assert self.serve is not None
        children = worker_children(self.serve.pid)
        live = set(self.live_worker_pids() or [])
        candidates = [pid for pid in children if pid in live] or children
        return self.rng.choice(candidates) if candidates else None

    def live_worker_pids(self) -> list[int] | None:
        """The pids of the workers beating in Redis, or None when Redis does not answer."""
        import redis

        from pagedserve.common import queue_protocol as q

        client = redis.Redis.from_url(self.redis.url, socket_timeout=2, socket_connect_timeout=2)
        try:
            # decode_responses is off: members and values come back as bytes
            ids = cast("list[bytes]", client.zrangebyscore(q.WORKERS, time.time(), "+inf"))
            infos = cast("list[bytes | None]", client.mget([q.worker_key(i.decode()) for i in ids]) if ids else [])
            return [q.decode_worker_info(x).pid for x in infos if x]
        except redis.RedisError:
            return None
        finally:
            client.close()

    def mark(self, event: str, **details: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.start, 2), "event": event, **details})

    async def pause_until(self, when: float) -> bool:
        """Sleep until `when` (time.monotonic()); False when the run ended first."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.over.wait(), max(0.0, when - time.monotonic()))
        return not self.over.is_set()

    async def kill_workers(self) -> None:
        """SIGKILL one worker every --kill-every seconds until the run ends."""
        k = 1
        while self.start + k * self.args.kill_every < self.stop_at:
            if not await self.pause_until(self.start + k * self.args.kill_every):
                return
            pid = await asyncio.to_thread(self.pick_worker)
            if pid is None:
                self.mark("kill_skipped", why="no worker process")
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.mark("kill", pid=pid)
            k += 1

    async def restart_redis(self) -> None:
        """Stop Redis and start it on the same port: all it held is gone, or with --redis-aof
        it comes back with what its append-only file holds."""
        if not await self.pause_until(self.start + self.args.redis_restart_at):
            return
        self.mark("redis_stop")
        await asyncio.to_thread(self.redis.stop, keep_data=self.args.redis_aof)
        await asyncio.sleep(self.args.redis_downtime)
        await asyncio.to_thread(self.redis.start)
        self.mark("redis_started")

    async def sample(self) -> None:
        """Every --sample-every seconds: the gateway's RSS, the workers, the requests."""
        assert self.serve is not None
        while True:
            now = time.monotonic()
            rss = rss_bytes(self.serve.pid)
            live = await asyncio.to_thread(self.live_worker_pids)
            self.samples.append({
                "t": round(now - self.start, 2),
                "gateway_rss_mib": round(rss / MIB, 1) if rss is not None else None,
                "worker_processes": len(worker_children(self.serve.pid)),
                "live_workers": len(live) if live is not None else None,
                "in_flight": self.in_flight, "sent": self.tally.sent, "completed": sum(self.tally.completed.values()),
            })
            if self.serve.poll() is not None:
                self.mark("serve_exited", returncode=self.serve.returncode)
                self.stop_at = min(self.stop_at, now)
                break
            if now >= self.stop_at:
                break
            await asyncio.sleep(max(0.0, min(now + self.args.sample_every, self.stop_at) - time.monotonic()))
        self.over.set()

    async def load(self) -> float:
        """The clients and the chaos, for --duration seconds, then up to --grace seconds for the
        requests still open. Returns the seconds the load ran."""
        import httpx

        timeout = httpx.Timeout(connect=10.0, read=self.args.stall_timeout, write=10.0, pool=None)
        limits = httpx.Limits(max_connections=self.args.clients, max_keepalive_connections=self.args.clients)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            self.start = time.monotonic()
            self.stop_at = self.start + self.args.duration
            chaos = [asyncio.create_task(self.sample())]
            if self.args.kill_every > 0:
                chaos.append(asyncio.create_task(self.kill_workers()))
            if 0 < self.args.redis_restart_at < self.args.duration:
                chaos.append(asyncio.create_task(self.restart_redis()))
            clients = [asyncio.create_task(self.client(http, i)) for i in range(self.args.clients)]
            await asyncio.gather(*chaos)
            ran = time.monotonic() - self.start
            _, still_open = await asyncio.wait(clients, timeout=max(0.0, self.stop_at + self.args.grace - time.monotonic()))
            for task in still_open:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
        return ran

    def count_gateway_answers(self, settle_s: float = 5.0) -> None:
        """The answers the gateway counted (its /metrics: /v1/completions, and "other", where the
        HTTP layer's own answers go, as a 503 beyond --max-connections): set
        beside the clients' count, it says whether a request whose connection broke before
        any answer had reached the gateway (it would have answered it, if only with a 499).

        The gateway counts the 499 of an attempt given up at the end of the run a moment after
        the client closed its connection, so the count is read again, for up to `settle_s`
        seconds, until it holds at least what the clients' figures say it must."""
        import httpx

        expected = self.tally.answered + self.tally.timed_out_unanswered
        deadline = time.monotonic() + settle_s
        while True:
            try:
                text = httpx.get(self.base_url + "/metrics", timeout=10).text
            except httpx.HTTPError:
                return
            total = 0.0
            for line in text.splitlines():
                if line.startswith("pagedserve:http_requests_total{") and any(
                        f'route="{route}"' in line for route in ("/v1/completions", "other")):
                    total += float(line.rsplit(" ", 1)[1])
            self.gateway_answers = int(total)
            if self.gateway_answers >= expected or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    # -- the report ----------------------------------------------------------------------------------
    def figures(self, ran_s: float) -> dict[str, Any]:
        a = self.args
        window = min(60.0, a.duration / 3)
        figures = {
            "config": {"duration_s": a.duration, "clients": a.clients, "kill_every_s": a.kill_every,
                       "redis_restart_at_s": a.redis_restart_at, "redis_downtime_s": a.redis_downtime,
                       "workers": a.workers, "device": a.device, "max_tokens": a.max_tokens, "model": self.model_dir,
                       "serve_flags": a.serve_flags, "stall_timeout_s": a.stall_timeout, "grace_s": a.grace,
                       "prompts": len(PROMPTS), "redis_aof": a.redis_aof},
            "ran_s": round(ran_s, 1),
            **self.tally.figures(),
            "completed_per_s": round(sum(self.tally.completed.values()) / ran_s, 2) if ran_s else None,
            "gateway_answers": self.gateway_answers,
            "events": self.events,
            "gateway_rss": rss_growth(self.samples, window),
            "samples": self.samples,
        }
        figures["targets_met"] = figures["balanced"] and figures["lost"] == 0 and figures["bad_streams"] == 0
        return figures


def gateway_answer_bounds(f: dict[str, Any]) -> tuple[int, int]:
    """What the gateway's count of answers must be, given the clients' figures: it answers
    every request it reads (a 499 if its client left), so it counts every answer a client got,
    and the attempts the clients gave up on, silent, before any answer; plus at most the
    attempts the grace period cut off unanswered (the gateway may not have read them yet)."""
    low = f["answered"] + f["timed_out_unanswered"]
    return low, low + f["cancelled_unanswered"]


def resets_verdict(f: dict[str, Any]) -> str:
    """Whether the requests cut before any answer reached the gateway: then the gateway's count
    of answers would be above what the clients' figures account for."""
    gateway = f["gateway_answers"]
    if gateway is None:
        return "the gateway's count could not be read"
    low, high = gateway_answer_bounds(f)
    if low <= gateway <= high:
        return "so the gateway read none of the requests cut before an answer"
    return "NOT matching: requests cut before an answer reached the gateway" if gateway > high \
        else "NOT matching: the gateway counted fewer answers than the clients got"


def format_report(f: dict[str, Any]) -> str:
    """The summary table of a run's figures."""
    c = f["config"]
    kills = [e for e in f["events"] if e["event"] == "kill"]
    restarts = [e for e in f["events"] if e["event"].startswith("redis")]
    skipped = sum(1 for e in f["events"] if e["event"] == "kill_skipped")
    rss = f["gateway_rss"]
    kill_times = ", ".join(f"{e['t']:g}" for e in kills)
    restart_times = ", ".join(f"{e['event'].removeprefix('redis_')} at {e['t']:g} s" for e in restarts)
    e2e = {k: "-" if v is None else f"{v:.0f}" for k, v in f["e2e"].items()}

    def by(counter: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "-"

    lines = [
        f"chaos: {c['clients']} clients for {c['duration_s']:g} s, {c['workers']} {c['device']} workers, "
        f"a worker killed every {c['kill_every_s']:g} s, Redis restarted at {c['redis_restart_at_s']:g} s, "
        f"max_tokens {c['max_tokens']}",
        f"{'requests sent':30} {f['sent']}",
        f"{'  completed':30} {f['completed']}   ({by(f['streams'])})",
        f"{'  visible errors':30} {f['visible_errors']}   ({by(f['errors_by_kind'])})",
        f"{'  lost (target 0)':30} {f['lost']}   ({by(f['lost_by_reason'])})",
        f"{'accounting':30} {'balanced' if f['balanced'] else 'NOT BALANCED'}: sent == completed + visible errors + lost",
        f"{'streams unlike the reference':30} {f['bad_streams']} (target 0)",
        f"{'429 / 503 answers waited out':30} {f['answers_429']} / {f['answers_503']} ({f['retry_wait_s']:g} s of Retry-After)",
        f"{'resets before any answer':30} {f['resets_before_answer']}, sent again; answers: the clients got "
        f"{f['answered']}, gave up on {f['timed_out_unanswered']} unanswered (silent) and "
        f"{f['cancelled_unanswered']} at the end, the gateway counted {f['gateway_answers']} ({resets_verdict(f)})",
        f"{'completed per second':30} {f['completed_per_s']}",
        f"{'E2E mean/median/p99':30} {e2e['mean_ms']} / {e2e['median_ms']} / {e2e['p99_ms']} ms",
        f"{'workers killed':30} {len(kills)} at {kill_times or '-'} s"
        + (f" ({skipped} skipped: no worker left)" if skipped else ""),
        f"{'Redis':30} {restart_times or 'not restarted'}",
    ]
    for e in f["events"]:
        if e["event"] == "serve_exited":
            lines.append(f"{'SERVER EXITED':30} at {e['t']:g} s with {e['returncode']}")
    if rss["first_mib"] is not None:
        lines.append(f"{'gateway RSS':30} {rss['first_mib']:.1f} MiB (first {rss['window_s']:.0f} s) -> "
                     f"{rss['last_mib']:.1f} MiB (last {rss['window_s']:.0f} s): {rss['growth_mib']:+.1f} MiB "
                     f"({rss['growth_pct']:+.1f}%), max {rss['max_mib']:.1f} MiB")
    lines.append("t (s) | gateway RSS (MiB) | worker processes | live workers | in flight | sent | completed")
    for s in f["samples"]:
        lines.append(f"{s['t']:7.1f} | {s['gateway_rss_mib']} | {s['worker_processes']} | {s['live_workers']} | "
                     f"{s['in_flight']} | {s['sent']} | {s['completed']}")
    for m in f["mismatches"]:
        lines.append(f"mismatch: {m}")
    if f["losses"]:
        lines.append("lost (sent at / ended at, seconds): " + ", ".join(
            f"{x['sent_s']:g}/{x['ended_s']:g} {x['reason']} after {x['tokens']} tokens" for x in f["losses"][:20]))
    lines.append("targets " + ("met" if f["targets_met"] else "NOT met") + ": 0 lost, 0 streams unlike the reference")
    return "\n".join(lines)


def check_arguments(args: argparse.Namespace) -> None:
    for name in ("duration", "clients", "max_tokens", "workers", "sample_every", "stall_timeout"):
        if getattr(args, name) <= 0:
            raise InvalidParameterError(name, "must be > 0")
    for name in ("kill_every", "redis_restart_at", "redis_downtime", "grace"):
        if getattr(args, name) < 0:
            raise InvalidParameterError(name, "must be >= 0")


def run(args: argparse.Namespace) -> int:
    """`pagedserve bench chaos`: 0 when no request was lost and every stream was exact."""
    check_arguments(args)
    began = time.monotonic()

    def progress(what: str) -> None:  # on stderr, so stdout holds only the report
        print(f"[chaos {time.monotonic() - began:6.1f} s] {what}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="pagedserve-chaos-") as tmp:
        if args.model is None:
            progress("building a tiny random Llama")
        model_dir = args.model or str(build_tiny_checkpoint(Path(tmp) / "tiny-llama"))
        bench = ChaosRun(args, model_dir, Path(tmp))
        try:
            progress("starting Redis and pagedserve serve")
            bench.start_server()
            bench.wait_ready()
            progress("server ready; asking for the reference answers")
            bench.fetch_references()
            progress(f"load for {args.duration:g} s, then up to {args.grace:g} s for open requests")
            ran = asyncio.run(bench.load())
            bench.count_gateway_answers()
            progress("stopping the server")
        finally:
            bench.stop_server()
        progress("stopped")
        figures = bench.figures(ran)
    print(format_report(figures))
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["targets_met"] else 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagedserve bench chaos` (and of `python -m pagedserve.bench.chaos`)."""
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=256, help="concurrent streaming clients")
    parser.add_argument("--kill-every", type=float, default=60.0, help="SIGKILL a worker this often (seconds; 0: never)")
    parser.add_argument("--redis-restart-at", type=float, default=150.0,
                        help="stop and start Redis once, this many seconds in (0: never)")
    parser.add_argument("--redis-downtime", type=float, default=1.0, help="seconds Redis stays down at its restart")
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: a tiny random Llama built here)")
    parser.add_argument("--workers", type=int, default=2, help="--num-workers of the server")
    parser.add_argument("--device", default="cpu", help="--device of the workers")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of every answer (EOS ignored)")
    parser.add_argument("--serve-flags", default="", help="more flags for `pagedserve serve`, e.g. '--worker-timeout 5'")
    parser.add_argument("--stall-timeout", type=float, default=120.0,
                        help="a stream silent this many seconds is lost (the client gives up on it)")
    parser.add_argument("--grace", type=float, default=120.0, help="seconds after the run for open requests to end")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples of the gateway RSS")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--shutdown-timeout", type=float, default=90.0, help="after SIGTERM, seconds before SIGKILL")
    parser.add_argument("--redis-port", type=int, default=0, help="the Redis port (default: a free one)")
    parser.add_argument("--redis-aof", action="store_true",
                        help="Redis with its append-only file on (as compose runs it): a restart keeps what it held")
    parser.add_argument("--serve-log", default=None, help="file for the server's output (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the choice of the worker to kill")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every figure to FILE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.bench.chaos", description=(__doc__ or "").split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
