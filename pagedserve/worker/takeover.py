"""`Takeover`: how a worker takes over the requests of a worker that stopped. Its heartbeat
stopped, so its entries went idle: `reclaim` moves them to this worker (XAUTOCLAIM, from
every request stream), each with its delivery count. Before it resumes them, `claim_outputs`
fences the old owner off and asks each request's gateway what its client has been sent: a
claim chunk goes into the gateway's reply stream, after everything the old owner wrote
there, so the gateway voids what comes later from older attempts and answers with its fold
of the rest (`Fold`, on fold_key). The gateway is the record of what a client was sent. One
that does not answer within `takeover_fold_timeout` is gone with its clients, or too far
behind: the request ends with request_lost (the step loop waits that long, for all the
requests taken over together). A failed claim leaves the entries to be taken over again. (The other
way round, an entry of this worker that another one took, is what the heartbeat reports:
`Heartbeat.lost_entries`.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import cast

import redis

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import Chunk, Fold, decode_fold
from pagedserve.common.serve_config import ServeConfig
from pagedserve.worker.outbox import Outbox
from pagedserve.worker.request_reader import RequestReader, TakenEntry

logger = logging.getLogger(__name__)


class Takeover:
    def __init__(self, client: redis.Redis, config: ServeConfig, worker_id: str, reader: RequestReader,
                 outbox: Outbox):
        self.redis = client
        self.config = config
        self.worker_id = worker_id
        self._reader = reader  # decodes what it reclaims
        self._outbox = outbox  # writes the claims, after what waits there

    def reclaim(self, room: int) -> list[TakenEntry]:
        """Up to `room` entries of workers whose heartbeat stopped, now this worker's (from
        every request stream: the tenant ones and the routed ones, of any worker)."""
        claimed: list[tuple[str, str, dict[bytes, bytes], int]] = []
        for stream in q.request_streams(cast("set[bytes]", self.redis.smembers(q.TENANTS))):
            if len(claimed) >= room:
                break
            try:
                reply = self.redis.xautoclaim(stream, q.GROUP, self.worker_id, count=room - len(claimed),
                                              min_idle_time=int(self.config.worker_timeout * 1000))
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                continue
            for entry_id, fields in reply[1]:
                if not fields:
                    continue
                entry_id = entry_id.decode()
                pending = self.redis.xpending_range(stream, q.GROUP, min=entry_id, max=entry_id, count=1)
                attempt = cast(int, pending[0]["times_delivered"]) if pending else 2
                logger.warning("worker %s takes over entry %s of %s (delivery %d)", self.worker_id, entry_id, stream, attempt)
                claimed.append((stream, entry_id, fields, attempt))
        return self._reader.decoded(claimed)

    def claim_outputs(self, requests: Sequence[tuple[str, str, int]]) -> dict[str, Fold | None]:
        """Claim each (request id, reply stream, attempt) and wait, up to takeover_fold_timeout
        for them all, for their gateways' answers. Returns the answers by request id, None where
        none came."""
        if not requests:
            return {}
        for request_id, reply_to, attempt in requests:
            self._outbox.send(request_id, reply_to, Chunk(attempt=attempt, claim=True))
        self._outbox.flush()  # pending writes first, then the claims
        keys = {q.fold_key(request_id, attempt): request_id for request_id, _, attempt in requests}
        answers: dict[str, Fold | None] = {}
        timeout = min(self.config.takeover_fold_timeout, self.config.worker_timeout / 2)
        deadline = time.monotonic() + timeout
        while len(answers) < len(keys) and (left := deadline - time.monotonic()) > 0:
            waiting = [k for k, r in keys.items() if r not in answers]
            # BLPOP's timeout is whole or fractional seconds; 0 would block forever
            reply = cast("tuple[bytes, bytes] | None", self.redis.blpop(waiting, timeout=max(left, 0.01)))
            if reply is None:
                break
            key, data = reply[0].decode(), reply[1]
            answers[keys[key]] = decode_fold(data)
        for request_id in keys.values():
            if request_id not in answers:
                logger.warning("worker %s: no gateway answered the claim of request %s within %g s",
                               self.worker_id, request_id, timeout)
                answers[request_id] = None
        return answers
