"""`ComposeStack`: compose.yaml brought up for one test module, under a project name of its
own, with tests/ops/compose.test.yaml on top and a tiny checkpoint as the model; `down -v`
at the end, whatever happened.

Images: where the base image `local/debian:bookworm` exists (a machine that reaches no image
registry), ops/build-local.sh builds them; elsewhere `compose build` does, from the public
bases. Docker's layer cache makes a rebuild without changes take seconds.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
from compose_model import ROOT

LOCAL_BASE_IMAGE = "local/debian:bookworm"
LOCAL_REDIS_IMAGE = "local/redis:bookworm"
LOCAL_PROMETHEUS_IMAGE = "local/prometheus:bookworm"
#: seconds `up` waits for the first worker, then for all. The worker image holds the CPU
#: kernels compiled for this machine (ops/worker.Dockerfile, PREBUILD_CPU_KERNELS); before it
#: did, each worker compiled them at its first start, and two workers building side by side
#: on 2 cores once took over 600 s
READY_DEADLINE_S = 600


def compose_command() -> list[str]:
    """`docker compose` (v2) where the plugin exists, else the v1 `docker-compose`."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError("neither `docker compose` nor `docker-compose` is installed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


class ComposeStack:
    """The CPU stack with `num_workers` workers, the model from `model_dir` (mounted as /models)."""

    def __init__(self, model_dir: Path, num_workers: int):
        self.project = f"pagedserve-test-{uuid.uuid4().hex[:8]}"
        self.num_workers = num_workers
        self.gateway_port, self.receiver_port, prometheus_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.receiver_url = f"http://127.0.0.1:{self.receiver_port}"
        self.prometheus_url = f"http://127.0.0.1:{prometheus_port}"
        self.env = {**os.environ, "PAGEDSERVE_MODEL_SOURCE": str(model_dir), "PAGEDSERVE_MODEL": "/models",
                    "GATEWAY_PORT": str(self.gateway_port), "RECEIVER_PORT": str(self.receiver_port),
                    "PROMETHEUS_PORT": str(prometheus_port)}
        self.local = _image_exists(LOCAL_BASE_IMAGE)
        if self.local:
            self.env["REDIS_IMAGE"] = LOCAL_REDIS_IMAGE
            self.env["PROMETHEUS_IMAGE"] = LOCAL_PROMETHEUS_IMAGE
        self.command = [*compose_command(), "-p", self.project, "--project-directory", str(ROOT),
                        "-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "tests" / "ops" / "compose.test.yaml"),
                        "--profile", "cpu"]
        self.up_seconds: float | None = None  # from `up` to /ready answering 200
        self.all_workers_seconds: float | None = None  # from `up` to /ready counting every worker

    def compose(self, *args: str, timeout: float = 300) -> str:
        result = subprocess.run([*self.command, *args], capture_output=True, text=True, env=self.env,
                                timeout=timeout, cwd=ROOT)
        if result.returncode != 0:
            raise RuntimeError(f"compose {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def build(self) -> None:
        if self.local:
            subprocess.run([str(ROOT / "ops" / "build-local.sh"), "gateway", "worker", "redis", "prometheus"],
                           check=True,
                           capture_output=True, timeout=1800, env=self.env)
        else:
            self.compose("build", "gateway", "worker-cpu", timeout=1800)

    def up(self) -> None:
        start = time.monotonic()
        self.compose("up", "-d", "--scale", f"worker-cpu={self.num_workers}")
        self.wait_ready(deadline_s=READY_DEADLINE_S)
        self.up_seconds = time.monotonic() - start
        self.wait_ready(deadline_s=READY_DEADLINE_S, workers=self.num_workers)
        self.all_workers_seconds = time.monotonic() - start

    def wait_ready(self, deadline_s: float, workers: int = 1) -> dict:
        """Poll GET /ready until it answers 200 with at least `workers` live workers (its
        JSON), or fail after `deadline_s`."""
        end = time.monotonic() + deadline_s
        last: object = None
        while time.monotonic() < end:
            try:
                reply = httpx.get(self.url + "/ready", timeout=5)
                if reply.status_code == 200 and reply.json()["workers"] >= workers:
                    return reply.json()
                last = reply.text
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.5)
        raise AssertionError(f"/ready never answered 200 within {deadline_s} s; last: {last!r}\n{self.logs()}")

    def containers(self, service: str) -> list[str]:
        """The ids of the service's running containers (`compose ps -q` also lists stopped ones)."""
        result = subprocess.run(["docker", "ps", "-q", "--no-trunc",
                                 "--filter", f"label=com.docker.compose.project={self.project}",
                                 "--filter", f"label=com.docker.compose.service={service}"],
                                capture_output=True, text=True, check=True)
        return sorted(result.stdout.split())

    def exec_python(self, container: str, code: str) -> str:
        result = subprocess.run(["docker", "exec", container, "python3", "-c", code], capture_output=True, text=True,
                                timeout=60)
        if result.returncode != 0:
            raise RuntimeError(result.stderr)
        return result.stdout

    def logs(self) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", "40", timeout=60)
        except Exception as exc:  # noqa: BLE001 - best effort, for a failure message
            return f"(no logs: {exc})"

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", timeout=180)
