"""The Kubernetes manifests (deploy/kubernetes), validated offline: no cluster runs here.

- every overlay renders with `kubectl kustomize` (skipped, with the reason, without kubectl;
  the local twin checks that the files parse and point at each other consistently);
- every rendered object validates with `kubernetes-validate --strict`, the KEDA ones against
  tests/deploy/keda_schema.json;
- the invariants: grace periods above the drain timeout, every container non-root, read-only
  and limited, probes on routes the gateway and the prefix cache service really have, Secret
  names and keys that create-secrets.sh makes, and a KEDA trigger on the gauge the gateway
  really publishes, the stream and group the workers really read, through the Sentinels the
  Redis URL names.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import msgspec
import pytest
import yaml

from pagedserve.common import queue_protocol as q
from pagedserve.common import redis_clients
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.serve_config import ServeConfig
from pagedserve.gateway.http_metrics import metrics_endpoint
from pagedserve.gateway.routes import ROUTE_HANDLERS
from pagedserve.prefix_cache import http_app as prefix_cache_app
from pagedserve.telemetry.metrics import PREFIX

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
BASE = DEPLOY / "base"
OVERLAYS = ("cpu", "gpu", "observability")
KEDA_SCHEMA = json.loads((Path(__file__).parent / "keda_schema.json").read_text())
#: Kubernetes versions the objects must validate against: an older supported one, and the newest bundled
K8S_VERSIONS = ("1.30.0", "1.37.0")
#: environment the manifests set that is no config field: read elsewhere, by name
KNOWN_ENV = {"PAGEDSERVE_API_KEYS", "PAGEDSERVE_CACHE_DIR", redis_clients.PASSWORD_ENV,
             redis_clients.SENTINEL_PASSWORD_ENV}


def _yaml_documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomize(directory: Path) -> list[dict]:
    result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _base_objects() -> list[dict]:
    """The base's objects as written (the local twin's view: no kustomize)."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [d for name in kustomization["resources"] for d in _yaml_documents(BASE / name)]


# ids that are not marker names: a param id "gpu" would read as the `gpu` marker (tests/conftest.py)
@pytest.fixture(scope="module", params=OVERLAYS, ids=[f"{o}-overlay" for o in OVERLAYS])
def rendered(request) -> tuple[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.skip("needs kubectl for `kubectl kustomize` (test_kustomizations_are_consistent checks the files without it)")
    return request.param, _kustomize(DEPLOY / "overlays" / request.param)


def _find(objects: list[dict], kind: str, name: str) -> dict:
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _pod_specs(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects
            if o["kind"] in ("Deployment", "StatefulSet")}


def _containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _env(container: dict, objects: list[dict]) -> dict[str, str | dict]:
    """A container's environment: its ConfigMaps' data, then its own `env` (a value, or the
    `valueFrom` source)."""
    env: dict[str, str | dict] = {}
    for source in container.get("envFrom", []):
        env.update(_find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", item.get("valueFrom"))
    return env


# -- rendering and schema validation -------------------------------------------------------------

def test_every_overlay_renders_the_whole_stack(rendered):
    overlay, objects = rendered
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects
                   if o["kind"] in ("Deployment", "StatefulSet", "ScaledObject", "PodDisruptionBudget"))
    expected = [("Deployment", "pagedserve-gateway"), ("Deployment", "pagedserve-prefix-cache"),
                ("Deployment", "pagedserve-worker"), ("PodDisruptionBudget", "pagedserve-gateway"),
                ("PodDisruptionBudget", "pagedserve-worker"), ("PodDisruptionBudget", "redis"),
                ("PodDisruptionBudget", "redis-sentinel"), ("ScaledObject", "pagedserve-worker"),
                ("StatefulSet", "redis"), ("StatefulSet", "redis-sentinel")]
    if overlay == "observability":
        expected += [("Deployment", "jaeger"), ("Deployment", "otel-collector")]
    assert kinds == sorted(expected)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"pagedserve"}
    assert _pod_specs(objects)["redis-sentinel"] and _find(objects, "StatefulSet", "redis-sentinel")["spec"]["replicas"] == 3
    assert _find(objects, "Deployment", "pagedserve-gateway")["spec"]["replicas"] > 1


def test_every_rendered_object_validates_strictly(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the dev extra)")
    _, objects = rendered
    keda = 0
    for obj in objects:
        if obj["apiVersion"].startswith("keda.sh/"):
            jsonschema.validate(obj, KEDA_SCHEMA)
            keda += 1
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    assert keda == 2  # the ScaledObject and its TriggerAuthentication


def test_the_keda_schema_rejects_what_keda_would():
    """The schema is strict: a misspelt field, a missing target or a string replica count fail."""
    scaled = _find(_base_objects(), "ScaledObject", "pagedserve-worker")
    jsonschema.validate(scaled, KEDA_SCHEMA)
    broken = []
    for path, value in ((("spec", "maxReplicas"), 3), (("spec", "minReplicaCount"), "1"),
                        (("spec", "triggers", 0, "metadata", "targetvalue"), "1")):
        bad = copy.deepcopy(scaled)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        broken.append(bad)
    no_target = copy.deepcopy(scaled)
    del no_target["spec"]["triggers"][0]["metadata"]["targetValue"]
    no_group = copy.deepcopy(scaled)
    del no_group["spec"]["triggers"][1]["metadata"]["consumerGroup"]
    for bad in [*broken, no_target, no_group]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, KEDA_SCHEMA)


# -- the local twin: the files and their references -------------------------------------------------

def _kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))


def test_kustomizations_are_consistent():
    """Without kubectl: every file parses, every path a kustomization names exists, every patch
    targets an object the base defines, and every JSON patch's path exists in its target."""
    base = _base_objects()
    assert len(_kustomization_dirs()) == 5  # base, 3 overlays, the observability component
    for directory in _kustomization_dirs():
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        for entry in [*kustomization.get("resources", []), *kustomization.get("components", [])]:
            assert (directory / entry).exists(), f"{directory}: {entry} does not exist"
        component_objects = [d for entry in kustomization.get("resources", []) if (directory / entry).is_file()
                             for d in _yaml_documents(directory / entry)]
        for patch in kustomization.get("patches", []):
            documents = yaml.safe_load((directory / patch["path"]).read_text())
            if isinstance(documents, list):  # a JSON patch: its target and every path
                target = _find(base, patch["target"]["kind"], patch["target"]["name"])
                for op in documents:
                    assert op["op"] == "replace"
                    node = target
                    for key in op["path"].strip("/").split("/"):
                        node = node[int(key)] if isinstance(node, list) else node[key]
                    assert type(node) is type(op["value"]), f"{patch['path']}: {op['path']} changes type"
            else:  # a strategic merge patch: an object of the base (or of this component)
                _find([*base, *component_objects], documents["kind"], documents["metadata"]["name"])
    # the container names the worker patches merge on exist
    worker = _pod_specs(base)["pagedserve-worker"]
    for overlay in ("cpu", "gpu"):
        patch = yaml.safe_load((DEPLOY / "overlays" / overlay / "worker-patch.yaml").read_text())
        names = {c["name"] for c in patch["spec"]["template"]["spec"]["containers"]}
        assert names <= {c["name"] for c in worker["containers"]}


# -- the invariants, on every rendered overlay and on the base files ------------------------------

def _secrets_made_by_the_script() -> dict[str, set[str]]:
    """Secret name → keys, read from create-secrets.sh: each `create secret generic NAME
    --from-env-file=".../FILE"` and the `KEY=%s` lines printf writes into FILE."""
    script = (DEPLOY / "create-secrets.sh").read_text()
    files = {m.group(2): m.group(1) for m in re.finditer(r'create secret generic (\S+) --from-env-file="\$dir/(\S+?)"', script)}
    secrets: dict[str, set[str]] = {}
    for m in re.finditer(r"printf '([^']*)' .*> \"\$dir/(\S+?)\"", script):
        secrets[files[m.group(2)]] = set(re.findall(r"(?:^|\\n)([a-z-]+)=%s", m.group(1)))
    return secrets


def _route_paths(handlers) -> set[str]:
    return {path for handler in handlers for path in handler.paths}


def check_invariants(objects: list[dict]) -> None:
    pods = _pod_specs(objects)
    config = _find(objects, "ConfigMap", "pagedserve-config")["data"]
    drain_timeout = float(config.get("PAGEDSERVE_DRAIN_TIMEOUT", ServeConfig().drain_timeout))

    # a pod told to stop drains for drain_timeout, then exits, before the kubelet kills it
    for name in ("pagedserve-gateway", "pagedserve-worker"):
        assert pods[name]["terminationGracePeriodSeconds"] > drain_timeout, name

    # every container: non-root, no privilege escalation, a read-only root, requests and limits
    for name, pod in pods.items():
        for container in _containers(pod):
            where = f"{name}/{container['name']}"
            security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
            assert security.get("runAsNonRoot") is True and security.get("runAsUser", 0) > 0, where
            assert security.get("allowPrivilegeEscalation") is False, where
            assert security.get("readOnlyRootFilesystem") is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            resources = container["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[kind]), where

    # probes on routes that exist
    gateway_routes = _route_paths([*ROUTE_HANDLERS, metrics_endpoint])
    [gateway] = pods["pagedserve-gateway"]["containers"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {gateway[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe", "startupProbe")} <= gateway_routes
    [prefix_cache] = pods["pagedserve-prefix-cache"]["containers"]
    cache_routes = _route_paths([prefix_cache_app.health, prefix_cache_app.lookup, prefix_cache_app.metrics])
    assert {prefix_cache[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")} <= cache_routes
    # the worker's exec probe runs the script the worker image copies to that path
    [worker] = pods["pagedserve-worker"]["containers"]
    probe = worker["livenessProbe"]["exec"]["command"]
    assert probe == ["python3", "/opt/pagedserve/healthcheck.py", "worker"] == worker["startupProbe"]["exec"]["command"]
    assert "COPY ops/healthcheck.py /opt/pagedserve/healthcheck.py" in (ROOT / "ops" / "worker.Dockerfile").read_text()

    # every Secret reference names a Secret and key that create-secrets.sh makes; API keys
    # come from a Secret, never from a ConfigMap
    made = _secrets_made_by_the_script()
    assert made == {"pagedserve-redis": {"redis-password", "sentinel-password"}, "pagedserve-api-keys": {"api-keys"}}
    referenced = set()
    for pod in pods.values():
        for container in _containers(pod):
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    referenced.add((ref["name"], ref["key"]))
    for auth in (o for o in objects if o["kind"] == "TriggerAuthentication"):
        referenced |= {(r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
    assert referenced == {(secret, key) for secret, keys in made.items() for key in keys}
    assert not any("API_KEYS" in key for o in objects if o["kind"] == "ConfigMap" for key in o.get("data", {}))
    assert _env(gateway, objects)["PAGEDSERVE_API_KEYS"] == {"secretKeyRef": {"name": "pagedserve-api-keys", "key": "api-keys"}}

    # every PAGEDSERVE_* variable is a config field (or read by name elsewhere): no typo passes
    fields = {"PAGEDSERVE_" + f.name.upper() for t in (ServeConfig, EngineConfig) for f in msgspec.structs.fields(t)}
    for name, pod in pods.items():
        for container in _containers(pod):
            for variable in _env(container, objects):
                if variable.startswith("PAGEDSERVE_"):
                    assert variable in fields | KNOWN_ENV, f"{name}/{container['name']}: {variable}"

    # the Redis URL names the Sentinel pods, the service name the Sentinels monitor, and the
    # passwords come from the environment the code reads
    target = redis_clients.parse_sentinel_url(config["PAGEDSERVE_REDIS_URL"], environ={})
    sentinels = _find(objects, "StatefulSet", "redis-sentinel")
    governing = sentinels["spec"]["serviceName"]
    assert target.sentinels == tuple((f"redis-sentinel-{i}.{governing}", 26379)
                                     for i in range(sentinels["spec"]["replicas"]))
    scripts = _find(objects, "ConfigMap", "redis-scripts")["data"]
    assert f"sentinel monitor {target.service_name} " in scripts["sentinel-start.sh"]
    for name in ("pagedserve-gateway", "pagedserve-worker", "pagedserve-prefix-cache"):
        env = _env(pods[name]["containers"][0], objects)
        assert env[redis_clients.PASSWORD_ENV] == {"secretKeyRef": {"name": "pagedserve-redis", "key": "redis-password"}}
        assert env[redis_clients.SENTINEL_PASSWORD_ENV] == {"secretKeyRef": {"name": "pagedserve-redis",
                                                                              "key": "sentinel-password"}}
    # Redis keeps an append-only file and never evicts the queue
    assert "appendonly yes" in scripts["redis-start.sh"] and "maxmemory-policy noeviction" in scripts["redis-start.sh"]

    # KEDA: the gauge the gateway publishes, at the gateway's Service; the stream and group
    # the workers read; the Sentinels and service name of the Redis URL; the worker Deployment
    scaled = _find(objects, "ScaledObject", "pagedserve-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "pagedserve-worker"
    triggers = {t["type"]: t for t in scaled["spec"]["triggers"]}
    queued = triggers["metrics-api"]["metadata"]
    assert queued["format"] == "prometheus" and queued["valueLocation"] == PREFIX + "queue_depth"
    assert triggers["metrics-api"]["metricType"] == "AverageValue"  # replicas = ceil(queued / target)
    url = urlsplit(queued["url"])
    service = _find(objects, "Service", "pagedserve-gateway")
    namespace = service["metadata"].get("namespace", "pagedserve")
    assert (url.hostname, url.port, url.path) == (f"pagedserve-gateway.{namespace}.svc.cluster.local",
                                                  service["spec"]["ports"][0]["port"], "/metrics")
    lag = triggers["redis-sentinel-streams"]["metadata"]
    assert (lag["stream"], lag["consumerGroup"], lag["sentinelMaster"]) == (q.REQUESTS, q.GROUP, target.service_name)
    assert lag["addresses"].split(",") == [f"{host}.{namespace}.svc.cluster.local:{port}" for host, port in target.sentinels]
    assert triggers["redis-sentinel-streams"]["authenticationRef"]["name"] == _find(
        objects, "TriggerAuthentication", "pagedserve-redis")["metadata"]["name"]
    assert scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]

    # only pagedserve's own pods (and KEDA) reach Redis and the Sentinels
    policy = _find(objects, "NetworkPolicy", "redis")
    [allowed] = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"]
    assert sorted(allowed["values"]) == ["gateway", "prefix-cache", "redis", "sentinel", "worker"]
    labelled = {o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    assert set(allowed["values"]) <= labelled


def test_invariants_of_every_rendered_overlay(rendered):
    overlay, objects = rendered
    check_invariants(objects)
    [worker] = _pod_specs(objects)["pagedserve-worker"]["containers"]
    gpus = worker["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if overlay == "gpu" else None)  # pagedserve has no tensor parallelism: one GPU a worker
    assert _env(worker, objects)["PAGEDSERVE_DEVICE"] == ("cuda" if overlay == "gpu" else "cpu")
    annotations = _find(objects, "Deployment", "pagedserve-gateway")["spec"]["template"]["metadata"].get("annotations", {})
    assert (annotations.get("prometheus.io/scrape") == "true") == (overlay == "observability")


def test_invariants_of_the_base_files():
    """The local twin of the test above: the same invariants on the base as written."""
    check_invariants(_base_objects())
