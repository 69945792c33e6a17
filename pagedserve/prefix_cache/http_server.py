"""uvicorn serving an ASGI app from a thread of this process, as the prefix cache service
serves its HTTP API (http_app.py) beside its consumer thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn


class HTTPServerThread:
    """uvicorn serving `app` from a daemon thread with its own event loop, on a socket bound
    here: a port in use raises `OSError` from the constructor, and `port` is known at once
    (also for port 0)."""

    def __init__(self, app, host: str, port: int, keep_alive_timeout: int):
        self._socket = _listening_socket(host, port)
        # keep_alive_timeout: longer than a client keeps an idle connection (httpx: 5 s), so a
        # gateway's kept-alive connection is not closed under a lookup it is sending
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_keep_alive=keep_alive_timeout, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="prefix-cache-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    def start(self, timeout: float = 10.0) -> None:
        """Start serving; return once uvicorn accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self._server.started:
            self.stop()
            raise RuntimeError("the prefix cache service's HTTP server did not start")

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._socket]))

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._socket.close()


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port. Its protocol is named (IPPROTO_TCP, not 0, as
    `socket.create_server` leaves it) because asyncio sets TCP_NODELAY only on the accepted
    sockets of such a one; without it, a kept-alive connection waits for the client's
    delayed ACK (40 ms) between an answer's headers and its body, which uvicorn writes apart."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
