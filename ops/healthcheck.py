"""The containers' health checks, with no curl or redis-cli in the images.

    python3 /opt/pagedserve/healthcheck.py gateway   # 0 when GET /ready answers 200
    python3 /opt/pagedserve/healthcheck.py worker    # 0 when this container's worker beats

The gateway is ready when Redis answers and at least one worker beats (its /ready), so a
gateway marked healthy can serve. A worker is healthy while its heartbeat in Redis is
current: its id starts with the container's hostname (worker/queue_consumer.new_worker_id),
and the heartbeat set scores each worker with the time its beat expires.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request

TIMEOUT = 5.0  # seconds one check may take; the compose healthcheck's own timeout is longer


def gateway_ready() -> bool:
    port = os.environ.get("PAGEDSERVE_PORT", "8000")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=TIMEOUT) as reply:
            return reply.status == 200
    except OSError:  # refused, timed out, or an HTTP error status (HTTPError is an OSError)
        return False


def worker_beats() -> bool:
    import redis

    from pagedserve.common.queue_protocol import WORKERS
    from pagedserve.common.redis_clients import sync_client  # redis:// and redis+sentinel:// alike

    client = sync_client(os.environ["PAGEDSERVE_REDIS_URL"], socket_timeout=TIMEOUT)
    try:
        alive = client.zrangebyscore(WORKERS, time.time(), "+inf")
    except redis.RedisError:
        return False
    finally:
        client.close()
    prefix = socket.gethostname() + "-"
    return any(member.decode().startswith(prefix) for member in alive)


def main(argv: list[str]) -> int:
    checks = {"gateway": gateway_ready, "worker": worker_beats}
    if len(argv) != 1 or argv[0] not in checks:
        print(f"usage: healthcheck.py {'|'.join(checks)}", file=sys.stderr)
        return 2
    return 0 if checks[argv[0]]() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
