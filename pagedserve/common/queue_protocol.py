"""The queue protocol between gateway and workers: the Redis keys, the fields of each stream
entry, and the msgspec Structs that travel in them as msgpack. Both sides import this module;
the Lua scripts that keep the queue consistent live in `queue_scripts` and are exported here.

    gateway ── QueuedRequest ──> pagedserve:requests[:{tenant}] ──────────> any worker
                             └─> pagedserve:routed:{worker_id}[:{tenant}] ──> that worker first
    worker  ── Reply(request id, Chunk) ──> pagedserve:replies:{gateway_id} ──> that gateway
    gateway ── Fold (a takeover's claim answered) ──> pagedserve:fold:{request_id}:{attempt}

Keys:

    pagedserve:requests            stream of QueuedRequest of callers without a tenant
    pagedserve:requests:{tenant}   the same, one stream per tenant; consumer group "workers"
                                   in each. An entry lives until its final outcome, so a
                                   stream's length is its tenant's requests in flight
    pagedserve:routed:{worker_id}[:{tenant}]
                                   the same, routed to one worker (gateway/request_routing.py): that
                                   worker reads it before the shared streams; another worker
                                   takes its entries when it is dead, or when they wait
                                   longer than steal_after (a steal)
    pagedserve:tenants             set of the request streams (tenant and routed) that may
                                   hold entries
    pagedserve:queued              requests admitted and not yet pulled by a worker
    pagedserve:queued_tokens       their prompt tokens
    pagedserve:tenant_tokens       hash: tenant stream → its queued prompt tokens (routed ones too)
    pagedserve:tenant_routed       hash: tenant stream → its entries in routed streams (in flight)
    pagedserve:worker_tokens       hash: worker id → queued prompt tokens routed to it
    pagedserve:worker_queued       hash: worker id → queued requests routed to it
    pagedserve:replies:{gateway_id}
                                   stream of the outputs of every request one gateway admitted
                                   (QueuedRequest.reply_to): a worker adds one entry per step,
                                   the Replies of that gateway's requests; the gateway reads
                                   it with one XREAD and trims what it read
    pagedserve:fold:{id}:{attempt} list: the gateway's answer (Fold) to a worker that takes
                                   the request over as that attempt: what the client has
                                   been sent, short-lived
    pagedserve:workers             sorted set: worker id → heartbeat expiry (unix seconds)
    pagedserve:worker:{worker_id}  WorkerInfo, expiring with the heartbeat
    pagedserve:cancel              pub/sub channel of request ids to abort
    pagedserve:cancelled:{id}      set when a request was cancelled before a worker took it
    pagedserve:admitted:{id}       set at admission, so a retried admission queues nothing;
                                   renewed by the heartbeat of the worker running it, so
                                   the gateway can tell a request that no longer exists

Both sides fold a request's chunks with the same `OutputLog` (common/output_log.py). The gateway's fold is the
record of what a client has been sent: a worker that takes over a request from a dead one
writes a claim chunk into the request's reply stream, and the gateway answers it with its
fold (`Fold`), from which the worker resumes. There is no per-request output stream: a
step's chunks for one gateway are one entry, the unit of Redis's cost (docs/scaling.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from pagedserve.common.outputs import CompletionDelta
from pagedserve.common.queue_scripts import ACK_IF_OWNER as ACK_IF_OWNER
from pagedserve.common.queue_scripts import ADMIT as ADMIT
from pagedserve.common.queue_scripts import HEARTBEAT as HEARTBEAT
from pagedserve.common.queue_scripts import RECONCILE as RECONCILE
from pagedserve.common.queue_scripts import STEAL as STEAL
from pagedserve.common.queue_scripts import TAKEN as TAKEN
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.worker_activity import WorkerActivity

# -- keys ---------------------------------------------------------------------------------
REQUESTS = "pagedserve:requests"  # the stream of callers without a tenant
GROUP = "workers"
TENANTS = "pagedserve:tenants"
QUEUED = "pagedserve:queued"
QUEUED_TOKENS = "pagedserve:queued_tokens"
TENANT_TOKENS = "pagedserve:tenant_tokens"
WORKERS = "pagedserve:workers"
CANCEL_CHANNEL = "pagedserve:cancel"
#: how long a reply stream lives after a worker last wrote to it (seconds; renewed at half),
#: and a cancelled marker
OUTPUT_TTL = 600
#: how long a gateway's answer to a claim (fold_key) waits for its worker (seconds)
FOLD_TTL = 60


ROUTED = "pagedserve:routed"  # the prefix of the streams of requests routed to one worker
TENANT_ROUTED = "pagedserve:tenant_routed"
WORKER_TOKENS = "pagedserve:worker_tokens"
WORKER_QUEUED = "pagedserve:worker_queued"


def requests_key(tenant: str | None) -> str:
    """The stream a tenant's requests wait in (and live in until their final outcome)."""
    return REQUESTS if tenant is None else f"{REQUESTS}:{tenant}"


def routed_key(worker_id: str, tenant: str | None) -> str:
    """The stream of a tenant's requests routed to one worker. Worker ids hold no ':'
    (`check_worker_id`), so the worker id and the tenant can be read back from the name."""
    return f"{ROUTED}:{worker_id}" if tenant is None else f"{ROUTED}:{worker_id}:{tenant}"


def request_streams(tenants: Iterable[bytes | str]) -> list[str]:
    """Every stream a request's entry may be in, queued or running, from the members of
    TENANTS: the stream of callers without a tenant, each tenant's stream and each stream
    routed to a worker. A running request is a pending entry of GROUP in one of them, its
    consumer the worker running it."""
    return sorted({REQUESTS, *(t.decode() if isinstance(t, bytes) else t for t in tenants)})


def routed_owner(stream: str) -> str | None:
    """The worker a routed stream belongs to; None for a tenant (shared) stream."""
    if not stream.startswith(ROUTED + ":"):
        return None
    return stream[len(ROUTED) + 1:].split(":", 1)[0]


def tenant_stream_of(stream: str) -> str:
    """The tenant stream whose limits an entry of `stream` counts against (itself, unless routed)."""
    if not stream.startswith(ROUTED + ":"):
        return stream
    rest = stream[len(ROUTED) + 1:]
    return REQUESTS if ":" not in rest else requests_key(rest.split(":", 1)[1])


def check_worker_id(worker_id: str) -> str:
    """A worker id names streams (`routed_key`): it must be non-empty and hold no ':'."""
    if not worker_id or ":" in worker_id:
        raise ValueError(f"a worker id must be non-empty and hold no ':', got {worker_id!r}")
    return worker_id


def reply_key(gateway_id: str) -> str:
    return f"pagedserve:replies:{gateway_id}"


def fold_key(request_id: str, attempt: int) -> str:
    return f"pagedserve:fold:{request_id}:{attempt}"


def cancelled_key(request_id: str) -> str:
    return f"pagedserve:cancelled:{request_id}"


def admitted_key(request_id: str) -> str:
    return f"pagedserve:admitted:{request_id}"


def worker_key(worker_id: str) -> str:
    return f"pagedserve:worker:{worker_id}"


# -- fields of the stream entries ---------------------------------------------------------
# Bytes, as redis-py returns field names; it writes them unchanged, so the same constant
# names a field on XADD and on read.

#: an entry of REQUESTS: the encoded QueuedRequest (written by the ADMIT script)
REQUEST_FIELD = b"m"
#: an entry of REQUESTS: its number of prompt tokens, a decimal string (written by ADMIT)
PROMPT_TOKENS_FIELD = b"t"
#: an entry of a routed stream: the prompt tokens its worker held cached when it was routed
#: (a decimal string, written by ADMIT; the STEAL script waits longer for more of them)
CACHED_TOKENS_FIELD = b"c"
#: an entry of a reply stream (reply_key): the encoded Replies of one worker's step
REPLIES_FIELD = b"r"

# Stream replies as both sides' clients return them (decode_responses off: ids, names and
# fields are bytes). redis-py types them as wide unions (bytes or str, RESP2 or RESP3
# shapes); the callers cast its replies to these at the call.
#: one entry of a stream: (entry id, fields)
StreamEntry = tuple[bytes, dict[bytes, bytes]]
#: an XREAD / XREADGROUP reply: (stream name, entries) per stream read; [] when the block ran out
StreamRead = list[tuple[bytes, list[StreamEntry]]]


# -- messages -----------------------------------------------------------------------------
class QueuedRequest(msgspec.Struct, kw_only=True):
    """One prompt's request, tokenized and validated by the gateway."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # validated again on decode (SamplingParams.__post_init__)
    cache_salt: str | None = None  # requests with different salts share no KV block (tenant, caller's salt)
    tenant: str | None = None  # whose share of the workers it uses (the API key's tenant)
    deadline: float  # unix seconds: past it the request ends with a timeout error
    enqueued_at: float | None = None  # unix seconds of its admission (the queue-time metric and span)
    traceparent: str | None = None  # W3C trace context of the gateway's span
    reply_to: str = ""  # the reply stream of the gateway that waits on its outputs (reply_key)


class WireError(msgspec.Struct, kw_only=True):
    """An error the client must see, in OpenAI's terms."""

    message: str
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    status_code: int = 500


class Chunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A request's output of one engine step (or of several, merged), in its gateway's reply stream."""

    attempt: int  # the delivery this comes from: 1, then 2, … after a worker died
    deltas: list[CompletionDelta] = []  # as the worker's output processor made them
    claim: bool = False  # a worker takes the request over from here: older attempts are void
    done: bool = False  # the final entry: every completion ended, or `error`
    error: WireError | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (on `done`)


class Reply(msgspec.Struct, array_like=True):
    """One request's chunk in an entry of a reply stream."""

    request_id: str
    chunk: Chunk


class WorkerInfo(msgspec.Struct, kw_only=True):
    """What a worker announces with each heartbeat."""

    worker_id: str
    model: str
    max_model_len: int
    pid: int
    host: str
    max_num_seqs: int
    # load, as of the heartbeat
    num_running: int = 0  # requests in the engine (the waiting ones too)
    num_waiting: int = 0  # of those, the ones the engine has not started (or preempted)
    num_free_blocks: int = 0  # KV blocks not held by a running request
    num_blocks: int = 0
    num_cancelled: int = 0  # requests aborted because their client went away, since start
    num_taken_over: int = 0  # requests this worker resumed after another worker died
    num_stolen: int = 0  # requests it took from another worker's routed stream, since start
    draining: bool = False  # stopping (SIGTERM): takes nothing new, hands back what it cannot finish
    # what the gateway needs to compute the block hashes this worker's KV cache uses
    # (prefix_cache.block_hash.prompt_block_hashes); 0 / "": not announced (no cache routing)
    block_size: int = 0  # tokens per KV block
    kv_model_id: str = ""  # the model id its block hashes include (EngineConfig.model)
    kv_dtype: str = ""  # the quantized KV dtype its block hashes include (int8, fp8_e4m3); "": none (float cache)
    #: the quantization method its weights got at load (int8, int4...: `pagedserve serve` on CPU
    #: quantizes to int8 unless told otherwise); "": none (float weights, or a GPTQ/AWQ checkpoint's own)
    quantization: str = ""
    activity: WorkerActivity = msgspec.field(default_factory=WorkerActivity)  # running sums since it started (the cluster view's rates)


class CompletionLog(msgspec.Struct, kw_only=True):
    """What the client has been sent of one completion."""

    token_ids: list[int] = []
    num_chars: int = 0
    finish_reason: str | None = None


class Fold(msgspec.Struct, kw_only=True):
    """A gateway's answer to a takeover's claim (fold_key): what the client has been sent."""

    waiting: bool  # False: no client waits on the request at this gateway any more (nothing to resume)
    completions: list[CompletionLog] = []  # per completion, as `OutputLog` holds them
    done: bool = False  # the request had its final chunk already


# -- encoding -----------------------------------------------------------------------------
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(QueuedRequest)
_chunk_decoder = msgspec.msgpack.Decoder(Chunk)
_replies_decoder = msgspec.msgpack.Decoder(list[Reply])
_fold_decoder = msgspec.msgpack.Decoder(Fold)
_info_decoder = msgspec.msgpack.Decoder(WorkerInfo)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> QueuedRequest:
    return _request_decoder.decode(data)


def decode_chunk(data: bytes) -> Chunk:
    return _chunk_decoder.decode(data)


def encode_replies(replies: list[Reply]) -> bytes:
    return _encoder.encode(replies)


def decode_replies(data: bytes) -> list[Reply]:
    return _replies_decoder.decode(data)


def decode_fold(data: bytes) -> Fold:
    return _fold_decoder.decode(data)


def decode_worker_info(data: bytes) -> WorkerInfo:
    return _info_decoder.decode(data)
