"""`Cancellations`: how the worker learns that a client went away. The gateway leaves a
marker and publishes the request id on the cancel channel: the worker hears of its running
requests on the channel (`poll`) and checks a request it takes for the marker
(`is_cancelled`). It subscribes at the first `poll`, and again once Redis is back
(`connection_lost`).
"""

from __future__ import annotations

import redis

from pagedserve.common import queue_protocol as q


class Cancellations:
    def __init__(self, client: redis.Redis):
        self.redis = client
        self._pubsub: redis.client.PubSub | None = None

    def is_cancelled(self, request_id: str) -> bool:
        """Whether the client left while the request was queued."""
        return bool(self.redis.exists(q.cancelled_key(request_id)))

    def poll(self) -> list[str]:
        """Request ids whose clients went away since the last call."""
        if self._pubsub is None:
            self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(q.CANCEL_CHANNEL)
        ids = []
        while (message := self._pubsub.get_message(timeout=0)) is not None:
            ids.append(message["data"].decode())
        return ids

    def connection_lost(self) -> None:
        """Redis went away: subscribe again once it is back."""
        self._pubsub = None
