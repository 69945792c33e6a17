"""`RequestReader`: how the worker takes new requests from the queue, fairly.

Requests wait in one stream per tenant, and in streams routed to one worker (per worker and
tenant, `queue_protocol.routed_key`). A pull reads in this order (`StreamView`):
1. this worker's own routed streams;
2. the shared tenant streams, and the routed streams of workers no longer live (orphans: a
   dead worker's unread entries are everyone's);
3. with room left and nothing read, the entries of live workers' routed streams that have
   waited longer than `steal_after` (their owner is too busy): a steal.
Each step shares the room among its streams in turn (`fair_shares`), so a tenant that floods
the queue does not push another tenant's request back behind its own. What a pull takes is
counted out of the queue's bounds at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import msgspec
import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.errors import PagedServeError
from pagedserve.common.queue_protocol import QueuedRequest, StreamRead, decode_request
from pagedserve.common.serve_config import ServeConfig
from pagedserve.worker.outbox import Outbox

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TakenEntry:
    """A request this worker took from the queue."""

    stream: str  # the stream it waits in (a tenant stream, or a routed one)
    entry_id: str  # in that stream
    request: QueuedRequest
    attempt: int  # delivery count: 1 unless other workers died with it
    stolen: bool = False  # taken from another worker's routed stream (that worker busy or dead)


@dataclass(frozen=True, slots=True)
class StreamView:
    """The request streams as one worker sees them at one pull."""

    own: list[str]  # routed to this worker
    shared: list[str]  # the tenant streams, and the routed streams of workers no longer live
    others: list[str]  # routed to other live workers: stolen from once their entries wait too long
    orphaned: frozenset[str] = frozenset()  # of `shared`, the routed ones (reading them is a steal)

    @property
    def all(self) -> list[str]:
        return self.own + self.shared + self.others


#: rounds of one pull that hand the room an idle tenant left to the busy ones
_PULL_ROUNDS = 3


def fair_shares(streams: list[str], room: int, start: int) -> dict[str, int]:
    """How many entries to read from each tenant stream: `room` split evenly, round-robin
    from `start`, so a tenant that floods the queue takes no more than its share of a
    pull and every other tenant's next request is taken at the next pull. With less room
    than streams, the first `room` streams in turn get one each (`start` rotates)."""
    if not streams or room <= 0:
        return {}
    order = streams[start % len(streams):] + streams[: start % len(streams)]
    per_stream, extra = divmod(room, len(order))
    return {s: per_stream + (i < extra) for i, s in enumerate(order) if per_stream + (i < extra) > 0}


class RequestReader:
    def __init__(self, client: redis.Redis, config: ServeConfig, worker_id: str, outbox: Outbox,
                 stopped: threading.Event):
        self.redis = client
        self.config = config
        self.worker_id = worker_id
        self._outbox = outbox  # a malformed entry is acknowledged and dropped
        self._stopped = stopped  # the consumer's: an idle wait ends early once it is set
        self._count_taken = client.register_script(q.TAKEN)
        self._steal = client.register_script(q.STEAL)
        self._turn = 0  # the tenant stream the next pull starts from (round-robin)
        self.num_stolen = 0  # entries taken from other workers' routed streams, since start

    def streams(self) -> StreamView:
        """The request streams, sorted into this worker's own, the shared ones and other live
        workers' (one round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(q.TENANTS)
        pipe.zrangebyscore(q.WORKERS, time.time(), "+inf")
        members, live_ids = pipe.execute()
        live = {x.decode() for x in live_ids}
        own: list[str] = []
        shared: list[str] = []
        others: list[str] = []
        orphaned = set()
        for stream in sorted(x.decode() for x in members):
            owner = q.routed_owner(stream)
            if owner is None:
                shared.append(stream)
            elif owner == self.worker_id:
                own.append(stream)
            elif owner in live:
                others.append(stream)
            else:
                shared.append(stream)
                orphaned.add(stream)
        return StreamView(own, shared, others, frozenset(orphaned))

    def pull(self, room: int, block_ms: int | None, view: StreamView | None = None,
             steal: bool = True) -> list[TakenEntry]:
        """Up to `room` new requests: from this worker's own routed streams first, then the
        shared ones, each shared fairly among its streams (`fair_shares`); with room left,
        nothing read and `steal`, stolen from other workers' streams (entries older than steal_after);
        waiting up to `block_ms` for the own and shared streams when none are queued (None:
        do not wait). They are counted out of the queue's bounds at once."""
        view = self.streams() if view is None else view
        entries: list[tuple[str, str, dict[bytes, bytes]]] = []
        try:
            entries += self._read_fairly(view.own, room)
            entries += self._read_fairly(view.shared, room - len(entries))
            if steal and not entries and room > 0 and view.others:
                entries += self._read_stolen(view.others, room)
            if not entries and block_ms:
                entries += self._wait_and_read(view.own + view.shared, room, block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis restarted: the tenant streams come back with their groups (routed ones
            # come back at their next admission)
            self.ensure_groups(s for s in view.shared if q.routed_owner(s) is None)
        if not entries:
            return []
        tenant_tokens: dict[str, int] = {}
        worker_taken: dict[str, tuple[int, int]] = {}  # worker routed to → (requests, tokens)
        for key, _, fields in entries:
            n = int(fields.get(q.PROMPT_TOKENS_FIELD, 0))
            tenant = q.tenant_stream_of(key)
            tenant_tokens[tenant] = tenant_tokens.get(tenant, 0) + n
            if (owner := q.routed_owner(key)) is not None:
                requests, tokens = worker_taken.get(owner, (0, 0))
                worker_taken[owner] = (requests + 1, tokens + n)
        self._count_taken(keys=[q.QUEUED, q.QUEUED_TOKENS, q.TENANT_TOKENS, q.WORKER_TOKENS, q.WORKER_QUEUED],
                          args=[len(entries), sum(tenant_tokens.values()), len(tenant_tokens),
                                *[x for pair in tenant_tokens.items() for x in pair],
                                *[x for worker, (r, t) in worker_taken.items() for x in (worker, r, t)]])
        stolen = set(view.others) | view.orphaned
        taken = self.decoded((key, eid, fields, 1) for key, eid, fields in entries)
        for entry in taken:
            entry.stolen = entry.stream in stolen
        self.num_stolen += sum(entry.stolen for entry in taken)
        return taken

    def _read_fairly(self, streams: list[str], room: int) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """Up to `room` new entries of these streams, shared fairly, without waiting.
        Rounds: the room a stream could not use (it held fewer than its share) goes to the
        streams that filled theirs, so one busy tenant among idle ones still fills it."""
        entries: list[tuple[str, str, dict[bytes, bytes]]] = []
        shares = fair_shares(streams, room, self._turn)
        self._turn += len(shares)
        for _ in range(_PULL_ROUNDS):
            if not shares:
                break
            got = self._read(shares, None)
            entries += got
            counts = Counter(stream for stream, _, _ in got)
            full = [s for s in shares if counts[s] == shares[s]]
            shares = fair_shares(full, room - len(entries), 0)
        return entries

    def _wait_and_read(self, streams: list[str], room: int, block_ms: int) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """Idle: wait up to `block_ms` for the first request of any of these streams, then
        read up to `room` fairly."""
        shares = fair_shares(streams, room, self._turn)
        if not shares:
            self._stopped.wait(block_ms / 1000)
            return []
        self._turn += len(shares)
        entries = self._read(dict.fromkeys(shares, 1), block_ms)
        if entries:
            entries += self._read_fairly(streams, room - len(entries))
        return entries

    def _read_stolen(self, streams: list[str], room: int) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """Up to `room` entries of other live workers' routed streams that waited longer than
        steal_after, plus steal_cached_token_ms for each prompt token their worker holds
        cached (the STEAL script: atomic, so never one younger)."""
        delay_ms = int(self.config.steal_after * 1000)
        reply = self._steal(keys=streams, args=[q.GROUP, self.worker_id, room, delay_ms,
                                                self.config.steal_cached_token_ms])
        entries: list[tuple[str, str, dict[bytes, bytes]]] = []
        for name, read in reply or []:
            for eid, flat in read:
                fields = dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}
                if fields:
                    entries.append((name.decode(), eid.decode(), fields))
        return entries

    def _read(self, shares: dict[str, int], block_ms: int | None) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """New entries of these streams, up to each one's share: (stream, entry id, fields).
        Only the first command blocks (the callers block only with every share 1: one command)."""
        entries: list[tuple[str, str, dict[bytes, bytes]]] = []
        # One XREADGROUP per share size (COUNT applies to each stream of a command).
        for count in sorted(set(shares.values()), reverse=True):
            keys: dict[str | bytes | memoryview, str | int | bytes | memoryview] = {
                s: ">" for s, c in shares.items() if c == count}
            reply = cast(StreamRead, self.redis.xreadgroup(q.GROUP, self.worker_id, keys, count=count,
                                                           block=block_ms if not entries else None))
            for name, read in reply or []:
                entries += [(name.decode(), eid.decode(), fields) for eid, fields in read if fields]
            block_ms = None
        return entries

    def decoded(self, entries: Iterable[tuple[str, str, dict[bytes, bytes], int]]) -> list[TakenEntry]:
        """The requests of these (stream, entry id, fields, attempt): a malformed entry is
        acknowledged and dropped."""
        taken = []
        for stream, entry_id, fields, attempt in entries:
            try:
                request = decode_request(fields[q.REQUEST_FIELD])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError, PagedServeError) as exc:
                logger.error("dropping malformed queue entry %s of %s: %s", entry_id, stream, exc)
                self._outbox.ack(stream, entry_id)
                continue
            taken.append(TakenEntry(stream, entry_id, request, attempt))
        return taken

    def ensure_groups(self, streams: Iterable[str]) -> None:
        for stream in streams:
            try:
                self.redis.xgroup_create(stream, q.GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
