"""`QueueConsumer`: the worker's side of the Redis queue, mirroring the gateway's
`QueueClient`. It holds one connection and one worker id, and the parts that use them, one
job each:
- `reader` (request_reader.py): takes new requests, fairly across the tenant and routed
  streams, stealing from a busy worker's when idle;
- `takeover` (takeover.py): takes over the entries of dead workers;
- `outbox` (outbox.py): writes output chunks and acknowledges entries;
- `cancellations` (cancellations.py): hears of clients that went away;
- `heartbeat` (heartbeat.py): tells the cluster the worker lives, and keeps its entries.

Its promises (the gateway relies on them):
- an entry is acknowledged only at its final outcome, and only by the worker that owns it;
- a heartbeat thread keeps the worker's entries fresh, so XAUTOCLAIM moves only the entries
  of a worker that stopped; before a new owner resumes a request it fences the old owner
  off in the reply stream and asks the gateway what the client has been sent;
- writes are batched into one round trip per pass and kept for a retry while Redis is away.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid

from pagedserve.common import queue_protocol as q
from pagedserve.common import redis_clients
from pagedserve.common.serve_config import ServeConfig
from pagedserve.worker.cancellations import Cancellations
from pagedserve.worker.heartbeat import Heartbeat
from pagedserve.worker.outbox import Outbox
from pagedserve.worker.request_reader import RequestReader
from pagedserve.worker.takeover import Takeover


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class QueueConsumer:
    def __init__(self, redis_url: str, config: ServeConfig, worker_id: str | None = None):
        self.config = config
        self.worker_id = q.check_worker_id(worker_id or new_worker_id())
        self.redis = redis_clients.sync_client(redis_url, socket_connect_timeout=2, health_check_interval=10)
        self._stop = threading.Event()
        self.outbox = Outbox(self.redis, self.worker_id, config.output_interval, config.reply_stream_max_len)
        self.reader = RequestReader(self.redis, config, self.worker_id, self.outbox, self._stop)
        self.takeover = Takeover(self.redis, config, self.worker_id, self.reader, self.outbox)
        self.cancellations = Cancellations(self.redis)
        self.heartbeat = Heartbeat(self.redis, config, self.worker_id, self._stop)

    def connection_lost(self) -> None:
        """Redis went away: subscribe again once it is back."""
        self.cancellations.connection_lost()

    def wait(self, seconds: float) -> bool:
        """Sleep, unless stopped; True when stopped."""
        return self._stop.wait(seconds)

    def stop(self) -> None:
        """Stop the heartbeat and leave the worker set."""
        self._stop.set()
        self.heartbeat.leave()
