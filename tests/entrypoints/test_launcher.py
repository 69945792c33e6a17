"""`pagedserve serve` as a process tree: it stops whole and in time on Ctrl-C or SIGTERM (while
streaming, while loading), restarts a worker that is killed, and keeps the Redis URL out of
argv and logs. Plus the launcher's pure parts: URL redaction, restart policy, exit reasons."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from pagedserve.common.redis_server import EmbeddedRedis, redact_url
from pagedserve.entrypoints.process_signals import exit_reason
from pagedserve.entrypoints.worker_supervisor import RestartPolicy

from serve_helpers import LiveServer
from tiny_models import build_checkpoint

DRAIN = 3.0
#: one small CPU worker, quick to load, quick to stop
FLAGS = ("--num-workers", "1", "--attention-backend", "torch", "--num-threads", "1", "--drain-timeout", str(DRAIN),
         "--heartbeat-interval", "0.5", "--worker-timeout", "2")
AUTH = {"Authorization": "Bearer sk-test-a"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A long context, so one stream can outlast the drain.
    return build_checkpoint("llama", tmp_path_factory.mktemp("launcher-llama"), max_position_embeddings=4096)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _roles(processes: list[psutil.Process]) -> dict[str, list[psutil.Process]]:
    roles: dict[str, list[psutil.Process]] = {"launcher": [], "worker": [], "redis": []}
    for p in processes:
        cmdline = p.cmdline()
        if p.name().startswith("redis-server"):
            roles["redis"].append(p)
        elif "worker" in cmdline:
            roles["worker"].append(p)
        elif "serve" in cmdline:
            roles["launcher"].append(p)
    return roles


def _wait_for_tree(server: LiveServer, timeout: float = 60.0) -> dict[str, list[psutil.Process]]:
    """The launcher, its worker and its Redis, once all three exist."""
    deadline = time.monotonic() + timeout
    while True:
        assert server.process.poll() is None, f"pagedserve serve exited with {server.process.returncode}"
        roles = _roles(_tree(server.process.pid))
        if all(roles.values()):
            return roles
        assert time.monotonic() < deadline, f"the server did not start its processes: {roles}"
        time.sleep(0.05)


def _assert_all_gone(server: LiveServer, processes: list[psutil.Process], since: float) -> float:
    """The launcher and every other process end within drain + 5 s of `since`; returns how
    long that took. The launcher exits 0."""
    limit = since + DRAIN + 5
    assert server.process.wait(timeout=max(0.1, limit - time.monotonic())) == 0
    others = [p for p in processes if p.pid != server.process.pid]
    _, alive = psutil.wait_procs(others, timeout=max(0.1, limit - time.monotonic()))
    for p in alive:
        p.kill()
    assert not alive, f"still running {DRAIN + 5:g} s after the signal: {[p.pid for p in alive]}"
    return time.monotonic() - since


def _assert_no_redis_url_in_argv(workers: list[psutil.Process]) -> None:
    for worker in workers:
        cmdline = " ".join(worker.cmdline())
        assert "redis://" not in cmdline and "--redis-url" not in cmdline, cmdline


# -- pure parts ---------------------------------------------------------------------------------
def test_redact_url():
    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("rediss://alice:p%40ss:w@cache.internal:6380/2") == "rediss://alice:***@cache.internal:6380/2"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("redis://alice@h:1/0") == "redis://alice@h:1/0"  # a user name is no secret
    assert redact_url("redis://h:1/0?password=pw&db=3") == "redis://h:1/0?password=***&db=3"
    assert redact_url("unix://:pw@/run/redis.sock?db=1") == "unix://:***@/run/redis.sock?db=1"
    assert "pw" not in redact_url("redis://:pw@[::1")  # does not parse: nothing of it is shown


def test_restart_policy_backs_off_and_gives_up():
    policy = RestartPolicy(limit=4, window=60.0, backoff_max=3.0)
    assert [policy.next_delay(t) for t in (0.0, 5.0, 10.0, 15.0)] == [1.0, 2.0, 3.0, 3.0]
    assert policy.next_delay(20.0) is None  # a fifth exit within 60 s: it stays down
    # restarts older than the window no longer count
    assert policy.next_delay(60.5) == 3.0  # 5, 10, 15 still count: 3 recent restarts
    assert RestartPolicy(limit=2, window=10.0, backoff_max=30.0).next_delay(0.0) == 1.0
    assert RestartPolicy(limit=0, window=10.0, backoff_max=30.0).next_delay(0.0) is None


def test_exit_reason():
    assert exit_reason(0) == "exit code 0"
    assert exit_reason(3) == "exit code 3"
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(-signal.SIGSEGV) == "killed by SIGSEGV"


# -- the process tree ---------------------------------------------------------------------------
def test_ctrl_c_during_a_stream_stops_every_process_in_time(model_dir):
    """Ctrl-C (SIGINT to the process group) while a stream runs: the stream ends visibly, and
    the launcher, its worker and its own Redis are all gone within drain + 5 s."""
    server = LiveServer(model_dir, None, *FLAGS, new_session=True)
    processes: list[psutil.Process] = []
    try:
        server.wait_ready()
        roles = _roles(processes := _tree(server.process.pid))
        assert (len(roles["launcher"]), len(roles["worker"]), len(roles["redis"])) == (1, 1, 1), roles
        _assert_no_redis_url_in_argv(roles["worker"])
        max_tokens = 4000
        body = {"model": server.model, "prompt": "The capital of France is", "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True, "logprobs": 0}
        lines: list[str] = []
        first_tokens = threading.Event()

        def stream() -> None:
            with httpx.Client(timeout=60) as http, \
                    http.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) >= 3:
                        first_tokens.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first_tokens.wait(60), "no tokens came"
        signalled = time.monotonic()
        os.killpg(server.process.pid, signal.SIGINT)
        took = _assert_all_gone(server, processes, signalled)
        reader.join(timeout=10)
        assert not reader.is_alive()
        print(f"\nCtrl-C: every process gone {took:.1f} s after the signal (drain {DRAIN:g} s)")
        # the stream ended visibly: [DONE] last, after an error event or after every token
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        # (the finish event carries no logprobs)
        tokens = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events
                     if e.get("choices") and e["choices"][0]["logprobs"])
        if "error" in events[-1]:
            assert events[-1]["error"]["code"] in ("worker_shutdown", "shutting_down"), events[-1]
            assert 0 < tokens < max_tokens
            print(f"the stream ended with {events[-1]['error']['code']} after {tokens} tokens")
        else:  # it finished within the drain
            assert (tokens, events[-1]["choices"][0]["finish_reason"]) == (max_tokens, "length")
    finally:
        for p in processes:
            if p.is_running():
                p.kill()
        server.stop()


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_stop_while_the_model_loads(model_dir, how):
    """SIGTERM to the launcher, or Ctrl-C to its group, before the worker is ready: nothing is
    left running (the launcher's cleanup runs, its worker and Redis stop)."""
    server = LiveServer(model_dir, None, *FLAGS, new_session=True)
    processes: list[psutil.Process] = []
    try:
        roles = _wait_for_tree(server)
        processes = [p for group in roles.values() for p in group]
        _assert_no_redis_url_in_argv(roles["worker"])
        with pytest.raises(httpx.ConnectError):  # the gateway starts once the worker is loaded
            httpx.get(server.base_url + "/health", timeout=2)
        signalled = time.monotonic()
        if how == "sigterm":
            server.process.send_signal(signal.SIGTERM)
        else:
            os.killpg(server.process.pid, signal.SIGINT)
        took = _assert_all_gone(server, processes, signalled)
        print(f"\n{how} while loading: every process gone {took:.1f} s after the signal")
    finally:
        for p in processes:
            if p.is_running():
                p.kill()
        server.stop()


def test_a_killed_worker_is_restarted_until_the_limit(model_dir, tmp_path):
    """kill -9 of the only worker: the launcher logs why, starts a new one, and requests work
    again. With --worker-restart-limit 1, a second kill leaves it down, loudly."""
    log_path = tmp_path / "serve.log"
    with EmbeddedRedis() as redis_server, open(log_path, "w") as log:
        server = LiveServer(model_dir, redis_server.url, *FLAGS, "--worker-restart-limit", "1", log=log)
        try:
            server.wait_ready()
            [first] = server.workers()
            worker = psutil.Process(first.pid)
            assert worker.ppid() == server.process.pid
            _assert_no_redis_url_in_argv([worker])
            assert worker.environ()["PAGEDSERVE_REDIS_URL"] == redis_server.url  # the way it gets there

            os.kill(first.pid, signal.SIGKILL)
            [second] = server.wait_for(lambda: [w for w in server.workers() if w.pid != first.pid], 120,
                                       "a new worker")
            assert psutil.Process(second.pid).ppid() == server.process.pid
            assert (first.activity.restarts, second.activity.restarts) == (0, 1)  # what the console shows
            out = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=60,
                             json={"model": server.model, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
            assert out.status_code == 200, out.text
            assert out.json()["usage"]["completion_tokens"] == 4

            os.kill(second.pid, signal.SIGKILL)  # past the limit: it stays down
            server.wait_for(lambda: httpx.get(server.base_url + "/ready").status_code == 503, 30, "/ready failing")
            server.wait_for(lambda: "no worker is left" in log_path.read_text(), 10, "the loud log line")
            text = log_path.read_text()
            assert f"worker 0 exited (pid {first.pid}, killed by SIGKILL); restarting it in 1 s" in text
            assert f"worker 0 restarted as pid {second.pid}" in text
            assert f"worker 0 exited (pid {second.pid}, killed by SIGKILL) after 1 restart(s) within 300 s; " \
                   "it stays down" in text
            assert server.process.poll() is None  # the gateway still answers (503s)
        finally:
            assert server.stop() == 0


def test_the_workers_of_a_killed_launcher_drain_and_exit(model_dir):
    """kill -9 of the launcher (no cleanup runs): its worker notices and exits by itself
    instead of serving on as an orphan."""
    with EmbeddedRedis() as redis_server:
        server = LiveServer(model_dir, redis_server.url, *FLAGS)
        try:
            server.wait_ready()
            [info] = server.workers()
            assert (info.quantization, info.kv_model_id) == ("", str(model_dir))  # --quantization none
            worker = psutil.Process(info.pid)
            server.process.kill()
            server.process.wait()
            worker.wait(timeout=15)  # it polls for its launcher every second
            assert not [w for w in server.workers() if w.pid == info.pid]  # it left the worker set
        finally:
            server.stop()


def test_serve_runs_int8_weights_on_cpu_unless_told_otherwise(model_dir):
    """No --quantization: a CPU worker quantizes the float32 checkpoint to int8 with its LM
    head (#30 item 5), announces it, keys its KV blocks apart from float32 ones, and answers
    what the in-process engine with the same weights answers."""
    from pagedserve import LLM, SamplingParams

    with EmbeddedRedis() as redis_server:
        server = LiveServer(model_dir, redis_server.url, *FLAGS, quantization=None)
        try:
            server.wait_ready()
            [info] = server.workers()
            assert (info.quantization, info.kv_model_id) == ("int8", f"{model_dir}#int8")
            reply = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=60, json={
                "model": str(model_dir), "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}).json()
        finally:
            assert server.stop() == 0
    llm = LLM(str(model_dir), attention_backend="torch", num_threads=1, quantization="int8", quantize_lm_head=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert reply["choices"][0]["text"] == llm.generate(["The quick brown fox"], params)[0].outputs[0].text
