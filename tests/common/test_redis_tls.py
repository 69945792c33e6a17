"""An external Redis behind TLS and a password: the gateway's QueueClient (redis.asyncio)
and the worker's QueueConsumer (redis) both work with a `rediss://` URL, and neither gets in
without the CA, the client certificate or the password.

The Redis here listens on TLS only (`port 0`), so every command that succeeds went over TLS.
It asks for client certificates (`tls-auth-clients yes`, Redis's default), as a managed or
hardened Redis would. Certificates are made with the `openssl` CLI: a CA, a server
certificate for 127.0.0.1 and a client certificate, each signed by the CA."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagedserve.common import queue_protocol as q
from pagedserve.common.queue_protocol import Chunk, CompletionDelta, QueuedRequest, WorkerInfo
from pagedserve.common.redis_server import find_redis_server, redact_url
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.queue_client import QueueClient
from pagedserve.worker.queue_consumer import QueueConsumer


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_certificates(directory: Path) -> None:
    """ca.pem; server.pem/.key for 127.0.0.1 and localhost; client.pem/.key. EC keys: fast."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=pagedserve test CA", cwd=directory)
    for name, extensions in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
                             ("client", "extendedKeyUsage=clientAuth\n")):
        (directory / f"{name}.ext").write_text(extensions)
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=pagedserve {name}",
                 cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=directory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TLSRedis:
    """redis-server on a TLS port only, with a password and client certificates required."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.port = _free_port()
        self.password = secrets.token_urlsafe(24)
        config = directory / "redis.conf"
        config.write_text("\n".join([
            "port 0", f"tls-port {self.port}", "bind 127.0.0.1", f"requirepass {self.password}",
            f"tls-cert-file {directory / 'server.pem'}", f"tls-key-file {directory / 'server.key'}",
            f"tls-ca-cert-file {directory / 'ca.pem'}", "tls-auth-clients yes",
            'save ""', "appendonly no", f"dir {directory}", f"logfile {directory / 'redis.log'}",
        ]) + "\n")
        config.chmod(0o600)
        self.process = subprocess.Popen([find_redis_server(), str(config)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis.from_url(self.url(), retry=Retry(NoBackoff(), 0)) as client:
                    client.ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = (directory / "redis.log").read_text() if (directory / "redis.log").exists() else ""
                    self.stop()
                    raise RuntimeError(f"the TLS redis-server did not start: {log[-500:]}") from None
                time.sleep(0.05)

    def url(self, password: str | None = None, ca: bool = True, client_cert: bool = True) -> str:
        query = []
        if ca:
            query.append(f"ssl_ca_certs={self.directory / 'ca.pem'}")
        if client_cert:
            query += [f"ssl_certfile={self.directory / 'client.pem'}", f"ssl_keyfile={self.directory / 'client.key'}"]
        return f"rediss://:{password or self.password}@127.0.0.1:{self.port}/0?" + "&".join(query)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        if self.process.stderr:
            self.process.stderr.close()


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make certificates")
    directory = tmp_path_factory.mktemp("tls")
    os.chmod(directory, 0o700)
    _make_certificates(directory)
    server = _TLSRedis(directory)
    yield server
    server.stop()


def test_gateway_and_worker_round_trip_over_tls(tls_redis):
    """Admission, a heartbeat, a pull, the output and its acknowledgement, all over TLS."""
    config = ServeConfig(heartbeat_interval=0.2, worker_timeout=1.0)
    url = tls_redis.url()
    assert redact_url(url).startswith(f"rediss://:***@127.0.0.1:{tls_redis.port}/0?ssl_ca_certs=")
    consumer = QueueConsumer(url, config)
    consumer.reader.ensure_groups([q.REQUESTS])
    consumer.heartbeat.start(lambda: WorkerInfo(worker_id=consumer.worker_id, model="tiny", max_model_len=64,
                                                 pid=os.getpid(), host="test", max_num_seqs=4))

    async def scenario() -> list[int]:
        gateway = QueueClient(url, config)
        try:
            assert await gateway.ping()
            deadline = time.monotonic() + 10
            while not await gateway.live_workers():
                assert time.monotonic() < deadline, "the worker's heartbeat never arrived"
                await asyncio.sleep(0.05)
            request = QueuedRequest(request_id="tls-1", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2),
                                    deadline=time.time() + 60)
            await gateway.submit(request)
            [taken] = await asyncio.to_thread(consumer.reader.pull, 1, 1000)
            assert taken.request.prompt_token_ids == [1, 2, 3]
            consumer.outbox.send("tls-1", taken.request.reply_to, Chunk(attempt=1, deltas=[CompletionDelta(index=0, start=0, token_ids=[7, 8], text="hi",
                                                                                   finish_reason="length")], done=True))
            consumer.outbox.ack(taken.stream, taken.entry_id)
            await asyncio.to_thread(consumer.outbox.flush)
            tokens = []
            async for deltas, _ in gateway.outputs("tls-1", 1, time.time() + 10):
                tokens += [t for d in deltas for t in d.token_ids]
            return tokens
        finally:
            await gateway.close()

    try:
        assert asyncio.run(scenario()) == [7, 8]
        with redis.Redis.from_url(url) as client:
            assert client.xlen(q.REQUESTS) == 0  # acknowledged and deleted
            assert client.config_get("tls-auth-clients") == {"tls-auth-clients": "yes"}
    finally:
        consumer.stop()


def test_no_way_in_without_the_ca_the_client_certificate_or_the_password(tls_redis):
    once = Retry(NoBackoff(), 0)
    refused = {
        "no CA": tls_redis.url(ca=False),  # the system's CAs do not know this server
        "no client certificate": tls_redis.url(client_cert=False),
        "wrong password": tls_redis.url(password="not-" + tls_redis.password),
        "plain TCP": f"redis://:{tls_redis.password}@127.0.0.1:{tls_redis.port}/0",
    }
    for what, url in refused.items():
        with redis.Redis.from_url(url, retry=once, socket_timeout=2) as client, pytest.raises(redis.ConnectionError) as info:
            client.ping()
        print(what, "->", type(info.value).__name__, info.value)
        if what == "no CA":
            assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)
        if what == "wrong password":
            assert isinstance(info.value, redis.AuthenticationError)

    async def gateway_ping(url: str) -> bool:
        gateway = QueueClient(url, ServeConfig())
        try:
            return await gateway.ping()
        finally:
            await gateway.close()

    assert asyncio.run(gateway_ping(tls_redis.url())) is True
    assert asyncio.run(gateway_ping(tls_redis.url(ca=False))) is False
