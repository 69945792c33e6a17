"""The queue protocol: the output-stream fold that gateway and worker share, the wire
encoding, and the entry fields the admission script writes."""

from __future__ import annotations

import msgspec
import pytest

from pagedserve.common import queue_protocol as q
from pagedserve.common.output_log import OutputLog
from pagedserve.common.outputs import Logprobs, TokenLogprob
from pagedserve.common.queue_protocol import (
    Chunk,
    CompletionDelta,
    QueuedRequest,
    WireError,
    decode_chunk,
    decode_request,
    encode,
)
from pagedserve.common.sampling_params import SamplingParams


def _delta(index, start, tokens, text, finish=None):
    return CompletionDelta(index=index, start=start, token_ids=tokens, text=text, finish_reason=finish)


def test_fold_takes_contiguous_deltas_once():
    log = OutputLog(2)
    assert log.apply(Chunk(attempt=1, deltas=[_delta(0, 0, [5, 6], "ab"), _delta(1, 0, [7], "c")])) != []
    # a replay of tokens the client has is dropped; so is a gap
    assert log.apply(Chunk(attempt=1, deltas=[_delta(0, 0, [5, 6], "ab")])) == []
    assert not log.gap
    assert log.apply(Chunk(attempt=1, deltas=[_delta(0, 3, [9], "z")])) == []
    assert log.gap  # tokens 2.. never arrived: the reader must not pass the rest off as whole
    taken = log.apply(Chunk(attempt=1, deltas=[_delta(0, 2, [8], "d", "length")]))
    assert [d.token_ids for d in taken] == [[8]]
    assert log.apply(Chunk(attempt=1, deltas=[_delta(0, 3, [9], "z")])) == []  # ended
    assert [c.token_ids for c in log.completions] == [[5, 6, 8], [7]]
    assert [c.num_chars for c in log.completions] == [3, 1]
    assert [c.finish_reason for c in log.completions] == ["length", None]
    assert log.num_generated_tokens == 4 and not log.done


def test_a_claim_voids_the_older_attempt():
    log = OutputLog(1)
    log.apply(Chunk(attempt=1, deltas=[_delta(0, 0, [1, 2], "xy")]))
    log.apply(Chunk(attempt=2, claim=True))
    # the old worker, still writing after the takeover, is ignored
    assert log.apply(Chunk(attempt=1, deltas=[_delta(0, 2, [3], "!")])) == []
    assert log.apply(Chunk(attempt=1, done=True)) == [] and not log.done
    taken = log.apply(Chunk(attempt=2, deltas=[_delta(0, 2, [4], "w", "stop")], done=True, num_cached_tokens=16))
    assert [d.token_ids for d in taken] == [[4]]
    assert log.done and log.error is None and log.num_cached_tokens == 16
    assert log.completions[0].token_ids == [1, 2, 4]
    assert log.apply(Chunk(attempt=3, deltas=[_delta(0, 3, [5], "v")])) == []  # nothing after done


def test_error_outcome():
    log = OutputLog(1)
    log.apply(Chunk(attempt=1, done=True, error=WireError(message="boom", code="engine_error")))
    assert log.done and log.error.message == "boom" and log.error.status_code == 500


def test_wire_round_trip_is_msgpack_and_validates():
    request = QueuedRequest(request_id="r1", prompt_token_ids=[1, 2, 3], params=SamplingParams(n=2, seed=5, stop=["x"]),
                            cache_salt="tenant", deadline=10.5, traceparent="00-ab-cd-01")
    data = encode(request)
    assert data[:1] != b"\x80"  # not a pickle protocol header
    assert decode_request(data) == request
    lp = Logprobs(sampled=TokenLogprob(3, -0.5, "a"), top=[TokenLogprob(3, -0.5, "a")])
    chunk = Chunk(attempt=2, deltas=[CompletionDelta(index=1, start=4, token_ids=[3], text="a", logprobs=[lp])])
    assert decode_chunk(encode(chunk)) == chunk
    # the sampling parameters are validated on the way in, too
    bad = msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": [1], "params": {"temperature": -1},
                                  "deadline": 1.0})
    with pytest.raises(Exception, match="temperature"):
        decode_request(bad)


def test_the_admission_script_writes_the_named_request_fields():
    """The Lua script spells the request entry's fields itself: they must be the protocol's."""
    xadd = f"'XADD', stream, '*', '{q.REQUEST_FIELD.decode()}', ARGV[4], '{q.PROMPT_TOKENS_FIELD.decode()}', ARGV[3]"
    assert xadd in q.ADMIT


def test_request_streams_are_the_shared_one_and_every_tenant_and_routed_stream():
    """Where a request's entry may be (tests/ops/test_stack.py finds the running one there)."""
    members = [q.routed_key("w1", None).encode(), q.requests_key("A").encode(), q.routed_key("w2", "A")]
    assert q.request_streams(members) == [q.REQUESTS, "pagedserve:requests:A", "pagedserve:routed:w1",
                                          "pagedserve:routed:w2:A"]
    assert q.request_streams([q.REQUESTS.encode()]) == q.request_streams([]) == [q.REQUESTS]
