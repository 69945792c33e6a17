"""`pagedserve bench chaos`: the stream classifier and the comparison on hand-written events,
then a short run against a live server whose accounting must be exact."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from pagedserve.bench.chaos import (
    COMPLETED,
    DIFFERENT,
    DUPLICATED,
    ERROR,
    EXACT,
    LOST,
    MISSING,
    PROMPTS,
    RESET_BEFORE_ANSWER,
    RETRY,
    ChaosRun,
    Outcome,
    Reference,
    Tally,
    compare,
    gateway_answer_bounds,
    read_stream,
    resets_verdict,
    retry_after_seconds,
    rss_growth,
)
from pagedserve.entrypoints.cli import main

REFERENCE = Reference(text="abc", tokens=("a", "b", "c"))


def _chunk(text: str, tokens: list[str] | None = None, finish_reason: str | None = None) -> str:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason,
              "logprobs": {"tokens": tokens if tokens is not None else [text]} if text else None}
    return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [choice], "usage": None})


def _stream(tokens: list[str], done: bool = True) -> list[str]:
    """The lines of a stream that sends one token a chunk, then `length`, usage and [DONE]."""
    lines = []
    for t in tokens:
        lines += [_chunk(t), ""]
    lines += [_chunk("", finish_reason="length"), ""]
    lines += ["data: " + json.dumps({"choices": [], "usage": {"completion_tokens": len(tokens)}}), ""]
    if done:
        lines += ["data: [DONE]", ""]
    return lines


def test_a_stream_with_done_is_completed_and_matches_its_reference():
    reading = read_stream(_stream(["a", "b", "c"]))
    assert reading.outcome() == COMPLETED
    assert (reading.text, reading.tokens, reading.finish_reason) == ("abc", ["a", "b", "c"], "length")
    assert reading.usage == {"completion_tokens": 3}
    assert compare(reading, REFERENCE) == EXACT


def test_chunks_of_several_tokens_fold_in_order():
    lines = [_chunk("ab", ["a", "b"]), "", _chunk("c", ["c"], finish_reason="length"), "", "data: [DONE]"]
    reading = read_stream(lines)
    assert reading.tokens == ["a", "b", "c"] and compare(reading, REFERENCE) == EXACT


def test_an_error_event_is_a_visible_error_even_before_done():
    error = {"error": {"message": "worker lost", "type": "server_error", "param": None, "code": "worker_lost"}}
    lines = [_chunk("a"), "", "data: " + json.dumps(error), "", "data: [DONE]", ""]
    reading = read_stream(lines)
    assert reading.done and reading.outcome() == ERROR
    assert reading.error_kind() == "event_worker_lost"
    assert reading.text == "a"  # what came before the error is kept, never compared


def test_a_stream_cut_without_done_is_lost():
    reading = read_stream(_stream(["a", "b", "c"], done=False))
    assert reading.outcome() == LOST
    assert read_stream([]).outcome() == LOST
    assert read_stream([_chunk("a"), ""]).outcome() == LOST


def test_lines_after_done_are_ignored():
    reading = read_stream([*_stream(["a", "b", "c"]), _chunk("d"), ""])
    assert reading.tokens == ["a", "b", "c"] and reading.outcome() == COMPLETED


def test_an_event_that_is_not_json_raises():
    with pytest.raises(ValueError):
        read_stream(["data: {not json"])


def test_duplicated_missing_and_different_tokens_are_told_apart():
    assert compare(read_stream(_stream(["a", "b", "b", "c"])), REFERENCE) == DUPLICATED  # one token replayed
    assert compare(read_stream(_stream(["a", "b", "a", "b", "c"])), REFERENCE) == DUPLICATED  # resumed from the start
    assert compare(read_stream(_stream(["a", "c"])), REFERENCE) == MISSING
    assert compare(read_stream(_stream([])), REFERENCE) == MISSING  # [DONE] with nothing before it
    assert compare(read_stream(_stream(["a", "x", "c"])), REFERENCE) == DIFFERENT
    no_finish = [_chunk("a"), _chunk("b"), _chunk("c"), "data: [DONE]"]
    assert compare(read_stream(no_finish), REFERENCE) == DIFFERENT  # every token, but no `length`


def test_retry_after():
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds("0.5") == 0.5
    assert retry_after_seconds(None) == 1.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 1.0
    assert retry_after_seconds("-4") == 0.0
    assert retry_after_seconds("86400") == 60.0


def test_tally_files_each_request_once():
    tally = Tally(sent=6)
    tally.record(Outcome(COMPLETED, reading=read_stream(_stream(["a", "b", "c"]))), REFERENCE, 0, 1.0, 1.5)
    tally.record(Outcome(COMPLETED, reading=read_stream(_stream(["a", "a", "b", "c"]))), REFERENCE, 1, 2.0, 2.7)
    tally.record(Outcome(ERROR, "event_worker_lost"), REFERENCE, 2, 3.0, 3.1)
    tally.record(Outcome(ERROR, "http_500"), REFERENCE, 3, 3.0, 3.1)
    tally.record(Outcome(LOST, "cut_before_done", read_stream([_chunk("a"), ""])), REFERENCE, 4, 4.0, 4.5)
    f = tally.figures()
    assert (f["completed"], f["visible_errors"], f["lost"]) == (2, 2, 1)
    assert not f["balanced"]  # one request is still open
    tally.record(Outcome(LOST, "silent_10s"), REFERENCE, 5, 5.0, 15.0)
    f = tally.figures()
    assert f["balanced"] and f["lost_by_reason"] == {"cut_before_done": 1, "silent_10s": 1}
    assert f["streams"] == {EXACT: 1, DUPLICATED: 1, MISSING: 0, DIFFERENT: 0} and f["bad_streams"] == 1
    assert [(m["verdict"], m["sent_s"], m["tokens"]) for m in f["mismatches"]] == [(DUPLICATED, 2.0, 4)]
    assert f["losses"] == [{"prompt": 4, "sent_s": 4.0, "ended_s": 4.5, "reason": "cut_before_done", "tokens": 1},
                           {"prompt": 5, "sent_s": 5.0, "ended_s": 15.0, "reason": "silent_10s", "tokens": 0}]
    assert f["e2e"]["mean_ms"] == pytest.approx(600)


def _attempt_against(handler, tmp_path, stall_timeout: float = 5.0,
                     server_saw: asyncio.Event | None = None) -> tuple[Outcome, Tally]:
    """One attempt of the chaos client against a hand-written HTTP server: its outcome, and
    the client's tally (its counts of answers). With `server_saw`, the attempt's outcome waits
    (at most 5 s) for the server to set it."""
    async def attempt() -> tuple[Outcome, Tally]:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        args = argparse.Namespace(serve_log=None, seed=0, max_tokens=4, stall_timeout=stall_timeout)
        bench = ChaosRun(args, "model", tmp_path)
        bench.base_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with httpx.AsyncClient(timeout=stall_timeout) as http:
                outcome = await bench.attempt(http, 0)
            if server_saw is not None:
                await asyncio.wait_for(server_saw.wait(), 5)
            return outcome, bench.tally
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(attempt())


def test_a_connection_cut_before_any_answer_is_sent_again_and_one_cut_after_is_lost(tmp_path):
    async def cut_unanswered(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    async def cut_after_the_headers(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        writer.close()

    outcome, tally = _attempt_against(cut_unanswered, tmp_path)
    assert (outcome.kind, outcome.detail, outcome.retry_after, tally.answered) == (RETRY, RESET_BEFORE_ANSWER, 0.0, 0)
    outcome, tally = _attempt_against(cut_after_the_headers, tmp_path)
    assert (outcome.kind, outcome.detail, tally.answered) == (LOST, "cut_RemoteProtocolError", 1)
    assert tally.timed_out_unanswered == 0


def test_an_attempt_given_up_before_any_answer_is_counted_for_the_gateways_499(tmp_path):
    """The gateway holds a stream's status line until its first token: a client that gives
    up first is lost, and the gateway answers its closed connection with a 499 no one reads,
    which its count of answers holds. The client counts such attempts apart."""
    closed = asyncio.Event()

    async def silent(reader, writer):  # reads the request, answers nothing, sees the client leave
        await reader.readuntil(b"\r\n\r\n")
        await reader.read()  # until the client closes the connection
        closed.set()
        writer.close()

    async def silent_after_the_headers(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await reader.read()
        writer.close()

    # the server saw the client close the connection (the gateway answers it then, with a 499)
    outcome, tally = _attempt_against(silent, tmp_path, stall_timeout=0.5, server_saw=closed)
    assert (outcome.kind, outcome.detail) == (LOST, "silent_0.5s")
    assert (tally.answered, tally.timed_out_unanswered, tally.cancelled_unanswered) == (0, 1, 0)
    outcome, tally = _attempt_against(silent_after_the_headers, tmp_path, stall_timeout=0.5)
    assert (outcome.kind, outcome.detail) == (LOST, "silent_0.5s")
    assert (tally.answered, tally.timed_out_unanswered) == (1, 0)  # answered: counted once, as the gateway does


def test_the_gateways_count_of_answers_tells_whether_a_cut_request_reached_it():
    f = {"gateway_answers": 100, "answered": 100, "timed_out_unanswered": 0, "cancelled_unanswered": 0}
    assert gateway_answer_bounds(f) == (100, 100)
    assert resets_verdict(f).startswith("so the gateway read none")
    assert resets_verdict({**f, "gateway_answers": 102, "cancelled_unanswered": 2}).startswith("so the gateway read none")
    assert resets_verdict({**f, "gateway_answers": 100, "cancelled_unanswered": 2}).startswith("so the gateway read none")
    # attempts given up before an answer: the gateway's 499s, counted, never seen by a client
    given_up = {**f, "gateway_answers": 108, "timed_out_unanswered": 8}
    assert gateway_answer_bounds(given_up) == (108, 108)
    assert resets_verdict(given_up).startswith("so the gateway read none")
    assert resets_verdict({**given_up, "gateway_answers": 107}).startswith("NOT matching: the gateway counted fewer")
    assert resets_verdict({**given_up, "gateway_answers": 109}).startswith("NOT matching: requests cut")
    assert resets_verdict({**f, "gateway_answers": 101}).startswith("NOT matching: requests cut")
    assert resets_verdict({**f, "gateway_answers": 99}).startswith("NOT matching: the gateway counted fewer")
    assert resets_verdict({**f, "gateway_answers": None}) == "the gateway's count could not be read"


def test_rss_growth_between_the_first_and_the_last_window():
    samples = [{"t": t, "gateway_rss_mib": m} for t, m in [(0, 100.0), (30, 102.0), (60, 104.0), (90, 110.0), (120, 112.0)]]
    g = rss_growth(samples, window_s=30)
    assert (g["first_mib"], g["last_mib"], g["growth_mib"], g["max_mib"]) == (101.0, 111.0, 10.0, 112.0)
    assert g["growth_pct"] == pytest.approx(9.9)
    assert rss_growth([{"t": 0, "gateway_rss_mib": None}], 30)["growth_mib"] is None


def test_a_short_chaos_run_accounts_for_every_request(tiny_checkpoint, tmp_path, capsys):
    """Two worker kills and a Redis restart in 16 s. The accounting must be exact; how many
    requests today's server loses is printed, not asserted (the hardening is not done)."""
    out = tmp_path / "chaos.json"
    max_tokens = 24
    code = main(["bench", "chaos", "--model", str(tiny_checkpoint("llama-gqa")), "--duration", "16", "--clients", "8",
                 "--kill-every", "6", "--redis-restart-at", "9", "--redis-downtime", "0.5", "--max-tokens", str(max_tokens),
                 "--stall-timeout", "8", "--grace", "8", "--sample-every", "2", "--shutdown-timeout", "30",
                 "--serve-flags", "--heartbeat-interval 0.5 --worker-timeout 3 --drain-timeout 5", "--json", str(out)])
    report = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + report.split("\n{")[0])
    f = json.loads(out.read_text())
    assert json.loads(report.strip().splitlines()[-1]) == f
    assert code == (0 if f["targets_met"] else 1)
    assert f["sent"] >= 8  # every client sent at least one request
    assert f["balanced"] and f["sent"] == f["completed"] + f["visible_errors"] + f["lost"]
    assert sum(f["streams"].values()) == f["completed"]
    assert sum(f["errors_by_kind"].values()) == f["visible_errors"]
    assert sum(f["lost_by_reason"].values()) == f["lost"]
    assert len(f["losses"]) == min(f["lost"], 50)
    assert f["bad_streams"] == f["completed"] - f["streams"][EXACT]
    # the chaos happened when asked: kills at 6 and 12 s, Redis down at 9 s and up again
    attempts = [e for e in f["events"] if e["event"] in ("kill", "kill_skipped")]
    assert len(attempts) == 2 and 6 <= attempts[0]["t"] < 12 <= attempts[1]["t"] < 16
    assert attempts[0]["event"] == "kill"  # two workers were up
    redis = [e for e in f["events"] if e["event"].startswith("redis")]
    assert [e["event"] for e in redis] == ["redis_stop", "redis_started"] and 9 <= redis[0]["t"] < redis[1]["t"]
    assert not any(e["event"] == "serve_exited" for e in f["events"])
    # the gateway was sampled from start to end, and the run used the prompts asked for
    assert f["samples"][0]["t"] == 0 and f["samples"][-1]["t"] >= 15.9
    assert all(s["gateway_rss_mib"] > 0 for s in f["samples"])
    assert f["gateway_rss"]["first_mib"] > 0 and f["gateway_rss"]["window_s"] == pytest.approx(16 / 3)
    assert f["config"]["max_tokens"] == max_tokens and f["config"]["prompts"] == len(PROMPTS)
    # the gateway counted every answer the clients got, and one (a 499) for each attempt a
    # client gave up on, silent, before any answer; more only for attempts the grace period
    # cancelled unanswered. A request cut before an answer and sent again reached it never.
    low, high = gateway_answer_bounds(f)
    assert high == low + f["cancelled_unanswered"]
    assert low == f["answered"] + f["timed_out_unanswered"] <= f["gateway_answers"] <= high
    assert resets_verdict(f) == "so the gateway read none of the requests cut before an answer"
    assert resets_verdict(f) in report
