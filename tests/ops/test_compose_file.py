"""compose.yaml, .env and ops/prometheus.yml hold what the stack needs, checked on the files
with PyYAML (no Docker needed); `docker compose config` / `docker-compose config` reads the
same file where either exists."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from compose_model import (
    COMPOSE_FILE,
    PROMETHEUS_FILE,
    ROOT,
    active_services,
    dotenv,
    load_compose,
    resolve,
    variables,
)

#: service → (its image variable, the public image or the local build tag it defaults to)
IMAGES = {
    "redis": ("REDIS_IMAGE", "redis:7.4"),
    "models": ("PAGEDSERVE_WORKER_CPU_IMAGE", "pagedserve-worker:0.1.0-cpu"),
    "gateway": ("PAGEDSERVE_GATEWAY_IMAGE", "pagedserve-gateway:0.1.0"),
    "prefix-cache": ("PAGEDSERVE_GATEWAY_IMAGE", "pagedserve-gateway:0.1.0"),  # torch-free, like the gateway
    "worker": ("PAGEDSERVE_WORKER_GPU_IMAGE", "pagedserve-worker:0.1.0-cuda"),
    "worker-tp": ("PAGEDSERVE_WORKER_GPU_IMAGE", "pagedserve-worker:0.1.0-cuda"),  # --profile gpu-tp
    "worker-cpu": ("PAGEDSERVE_WORKER_CPU_IMAGE", "pagedserve-worker:0.1.0-cpu"),
    "jaeger": ("JAEGER_IMAGE", "jaegertracing/all-in-one:1.62.0"),
    "prometheus": ("PROMETHEUS_IMAGE", "prom/prometheus:v3.1.0"),
    "grafana": ("GRAFANA_IMAGE", "grafana/grafana:11.4.0"),  # --profile observability
}
MODEL_MOUNT = "${PAGEDSERVE_MODEL_SOURCE:-models}:/models"
WORKER_METRICS_PORT = "9400"


@pytest.fixture(scope="module")
def compose():
    return load_compose()


def test_services_and_their_images_are_variables_defaulting_to_public_images(compose):
    assert set(compose["services"]) == set(IMAGES)
    for name, (variable, default) in IMAGES.items():
        assert compose["services"][name]["image"] == f"${{{variable}:-{default}}}", name


def test_every_variable_has_a_default():
    text = COMPOSE_FILE.read_text()
    found = variables(text)
    assert len(found) >= 20
    assert [name for name, default in found if default is None] == []
    # an empty default only where empty means "off/unset" to pagedserve
    assert sorted({name for name, default in found if default == ""}) == ["PAGEDSERVE_API_KEYS", "PAGEDSERVE_NUM_THREADS"]


def test_redis_keeps_an_append_only_file_on_a_volume_and_has_a_healthcheck(compose):
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[:3] == ["redis-server", "--appendonly", "yes"]
    assert command[command.index("--dir") + 1] == "/data"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert redis["volumes"] == ["redis-data:/data"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert "redis-data" in compose["volumes"]


def test_gateway_waits_for_redis_and_the_model_and_is_healthy_when_ready(compose):
    gateway = compose["services"]["gateway"]
    assert gateway["command"] == ["gateway"]
    assert gateway["depends_on"] == {"redis": {"condition": "service_healthy"},
                                     "models": {"condition": "service_completed_successfully"}}
    assert gateway["healthcheck"]["test"] == ["CMD", "python3", "/opt/pagedserve/healthcheck.py", "gateway"]
    assert gateway["ports"] == ["${PAGEDSERVE_PUBLISH_HOST:-127.0.0.1}:${GATEWAY_PORT:-8000}:8000"]
    assert gateway["volumes"] == [MODEL_MOUNT + ":ro"]
    env = gateway["environment"]
    assert env["OTEL_SERVICE_NAME"] == "pagedserve-gateway"
    assert env["PAGEDSERVE_HOST"] == "0.0.0.0"
    assert env["PAGEDSERVE_REDIS_URL"] == "redis://redis:6379/0"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-http://jaeger:4318}"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "${OTEL_EXPORTER_OTLP_PROTOCOL:-http/protobuf}"


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_workers_scale_and_expose_metrics_and_traces(compose, name):
    worker = compose["services"][name]
    assert worker["command"] == ["worker"]
    # --scale needs no fixed name and no host port
    assert "container_name" not in worker and "ports" not in worker
    assert worker["depends_on"] == {"redis": {"condition": "service_healthy"},
                                    "models": {"condition": "service_completed_successfully"}}
    assert worker["volumes"] == [MODEL_MOUNT + ":ro"]
    env = worker["environment"]
    assert env["OTEL_SERVICE_NAME"] == "pagedserve-worker"
    assert env["PAGEDSERVE_WORKER_METRICS_PORT"] == WORKER_METRICS_PORT
    assert env["PAGEDSERVE_WORKER_METRICS_HOST"] == "0.0.0.0"
    assert env["PAGEDSERVE_QUANTIZATION"] == "${PAGEDSERVE_QUANTIZATION:-auto}"  # int8 on CPU, as `serve`
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-http://jaeger:4318}"
    assert env["PAGEDSERVE_MODEL"] == "${PAGEDSERVE_MODEL:-smollm2-135m-instruct}"


def test_the_gpu_worker_reserves_a_gpu_and_the_cpu_worker_none(compose):
    gpu, cpu = compose["services"]["worker"], compose["services"]["worker-cpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "PAGEDSERVE_TENSOR_PARALLEL_SIZE" not in gpu["environment"]
    # the tensor-parallel worker reserves every GPU of the host (Compose v1 takes no variable
    # for `count`) and runs the ranks it is told
    tp = compose["services"]["worker-tp"]
    assert tp["profiles"] == ["gpu-tp"]
    assert tp["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    size = tp["environment"]["PAGEDSERVE_TENSOR_PARALLEL_SIZE"]
    assert (resolve(size), resolve(size, {"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "4"})) == ("2", "4")
    assert tp["image"] == gpu["image"] and tp["environment"]["PAGEDSERVE_DEVICE"] == "cuda"
    assert gpu["environment"]["PAGEDSERVE_DEVICE"] == "cuda"
    assert gpu["build"]["args"]["BASE_IMAGE"] == "${CUDA_BASE_IMAGE:-nvidia/cuda:12.8.1-runtime-ubuntu24.04}"
    assert cpu["profiles"] == ["cpu"]
    assert "deploy" not in cpu
    assert cpu["environment"]["PAGEDSERVE_DEVICE"] == "cpu"
    # both answer to `worker`, the name Prometheus resolves
    assert cpu["networks"] == {"default": {"aliases": ["worker"]}}


def test_the_cpu_worker_image_holds_its_kernels_and_the_gpu_image_builds_none(compose):
    """ops/worker.Dockerfile compiles the CPU kernels unless PREBUILD_CPU_KERNELS is 0: the CPU
    service builds with the default, the GPU services (which run none) turn it off."""
    dockerfile = (ROOT / "ops" / "worker.Dockerfile").read_text()
    assert "ARG PREBUILD_CPU_KERNELS=1\n" in dockerfile
    # the build runs as the worker's user, so the extension lands in the cache its workers read
    assert dockerfile.index("USER pagedserve") < dockerfile.index("ARG PREBUILD_CPU_KERNELS")
    assert "from pagedserve.kernels.cpu_attention import cpu_kernels" in dockerfile
    services = compose["services"]
    assert "PREBUILD_CPU_KERNELS" not in services["worker-cpu"]["build"]["args"]
    assert [services[name]["build"]["args"]["PREBUILD_CPU_KERNELS"] for name in ("worker", "worker-tp")] == ["0", "0"]


def test_profiles_plain_up_starts_gpu_workers_and_profile_cpu_only_cpu_workers(compose):
    env = dotenv()
    assert env == {"COMPOSE_PROFILES": "gpu"}
    common = {"redis", "models", "gateway", "prefix-cache", "jaeger", "prometheus"}
    assert active_services(compose, [], env) == common | {"worker"}
    assert active_services(compose, ["cpu"], env) == common | {"worker-cpu"}
    assert active_services(compose, ["cpu"], {}) == common | {"worker-cpu"}
    # a shell's COMPOSE_PROFILES=cpu (it wins over .env) does the same as --profile cpu
    assert active_services(compose, [], {**env, "COMPOSE_PROFILES": "cpu"}) == common | {"worker-cpu"}
    # Grafana joins only with its profile
    assert active_services(compose, ["cpu", "observability"], env) == common | {"worker-cpu", "grafana"}
    # the tensor-parallel worker only with its own
    assert active_services(compose, ["gpu-tp"], {}) == common | {"worker-tp"}


def test_the_models_service_pulls_an_alias_once_or_takes_a_checkpoint_directory(compose):
    models = compose["services"]["models"]
    assert models["entrypoint"] == ["sh", "-c"]
    assert models["command"] == ['if [ -d "$$PAGEDSERVE_MODEL" ]; then echo "checkpoint $$PAGEDSERVE_MODEL"; '
                                 'else pagedserve models pull "$$PAGEDSERVE_MODEL"; fi']
    assert models["volumes"] == [MODEL_MOUNT]  # the one writer: the others mount it read-only
    assert models["restart"] == "no"
    assert "models" in compose["volumes"]


def test_the_prefix_cache_service_feeds_the_gateways_routing(compose):
    service = compose["services"]["prefix-cache"]
    assert service["command"] == ["prefix-cache", "--host", "0.0.0.0", "--port", "8300"]
    assert service["environment"]["PAGEDSERVE_REDIS_URL"] == "redis://redis:6379/0"
    assert service["depends_on"] == {"redis": {"condition": "service_healthy"}}
    gateway = compose["services"]["gateway"]["environment"]
    assert gateway["PAGEDSERVE_PREFIX_CACHE_URL"] == "http://prefix-cache:8300"
    for name in ("worker", "worker-cpu"):
        env = compose["services"][name]["environment"]
        assert env["PAGEDSERVE_KV_EVENTS"] == "true"
        assert env["PAGEDSERVE_KV_TIER_MEMORY"] == "${PAGEDSERVE_KV_TIER_MEMORY:-0}"


def test_jaeger_and_prometheus(compose):
    jaeger, prometheus = compose["services"]["jaeger"], compose["services"]["prometheus"]
    assert jaeger["expose"] == ["4317", "4318"]
    assert jaeger["ports"] == ["${PAGEDSERVE_PUBLISH_HOST:-127.0.0.1}:${JAEGER_UI_PORT:-16686}:16686"]
    assert prometheus["ports"] == ["${PAGEDSERVE_PUBLISH_HOST:-127.0.0.1}:${PROMETHEUS_PORT:-9090}:9090"]
    assert prometheus["volumes"][0] == "./ops/prometheus.yml:/etc/prometheus/prometheus.yml:ro"


def test_prometheus_scrapes_the_gateway_and_every_worker():
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"pagedserve-gateway", "pagedserve-prefix-cache", "pagedserve-worker"}
    assert jobs["pagedserve-gateway"]["static_configs"] == [{"targets": ["gateway:8000"]}]
    assert jobs["pagedserve-prefix-cache"]["static_configs"] == [{"targets": ["prefix-cache:8300"]}]
    assert jobs["pagedserve-worker"]["dns_sd_configs"] == [
        {"names": ["worker"], "type": "A", "port": int(WORKER_METRICS_PORT), "refresh_interval": "15s"}]


def test_resolve_takes_the_environment_over_the_default():
    assert resolve("${REDIS_IMAGE:-redis:7.4}") == "redis:7.4"
    assert resolve("${REDIS_IMAGE:-redis:7.4}", {"REDIS_IMAGE": "local/redis:bookworm"}) == "local/redis:bookworm"


def _compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(_compose_command() is None, reason="neither `docker compose` nor `docker-compose`")
@pytest.mark.parametrize("profile_args", [[], ["--profile", "cpu"]], ids=["plain", "profile-cpu"])
def test_docker_compose_config_reads_the_file(profile_args):
    """Compose itself: the file is valid, the variables resolve to the public images, and
    an image variable set in the environment wins. Plain, .env's profile is `gpu`."""
    command = _compose_command()
    assert command is not None
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "REDIS_IMAGE": "local/redis:bookworm"}
    result = subprocess.run([*command, "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), *profile_args,
                             "config"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    images = {name: service["image"] for name, service in config["services"].items()}
    expected = {name: default for name, (_, default) in IMAGES.items()} | {"redis": "local/redis:bookworm"}
    # docker compose v2 leaves out the services of inactive profiles; docker-compose v1 keeps them
    assert {name: expected[name] for name in images} == images
    assert {"redis", "models", "gateway", "jaeger", "prometheus", "worker-cpu" if profile_args else "worker"} <= set(images)
    assert config["services"]["gateway"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
