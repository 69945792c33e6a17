"""ops/grafana/: the dashboard's every PromQL expression names only metrics that
docs/metrics.md lists, its data source is the provisioned Prometheus, and compose mounts
the provisioning where Grafana reads it. Checked on the files (Grafana itself cannot be
pulled where no image registry is reachable)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from compose_model import load_compose

ROOT = Path(__file__).parents[2]
GRAFANA = ROOT / "ops" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "pagedserve.json"

#: what a PromQL expression may hold besides metric names: functions, aggregations, keywords
PROMQL_WORDS = {"sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by",
                "without", "clamp_min", "clamp_max", "topk", "bottomk", "and", "or", "unless", "on", "ignoring",
                "offset", "delta", "deriv", "abs", "vector", "scalar", "time"}
#: the series a histogram exports besides its name
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def documented_metrics() -> set[str]:
    return set(re.findall(r"`(pagedserve:[a-z0-9_:]+)`", (ROOT / "docs" / "metrics.md").read_text()))


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: every identifier outside label matchers,
    grouping lists, ranges and strings that is not a PromQL word."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)  # label matchers
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", r"\1", bare)  # grouping labels
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # ranges ($__rate_interval, 5m)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare))
    return words - PROMQL_WORDS


def test_every_expression_names_only_documented_metrics():
    documented = documented_metrics()
    assert len(documented) > 30
    exprs = expressions()
    assert len(exprs) >= 20
    unknown = {}
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        for name in names:
            base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
            if name not in documented and base not in documented:
                unknown[name] = expr
    assert unknown == {}


def test_the_check_catches_a_metric_not_in_the_docs():
    assert metric_names('sum by (le) (rate(pagedserve:made_up_bucket{job="x"}[5m])) / vllm:other') == {
        "pagedserve:made_up_bucket", "vllm:other"}
    assert "pagedserve:made_up" not in documented_metrics()


def test_the_dashboard_covers_what_the_issue_asks():
    text = " ".join(expressions())
    for metric in ("generation_tokens_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "queue_depth", "kv_cache_usage_perc", "prefix_cache_hits_total",
                   "num_preemptions_total", "spec_decode_num_accepted_tokens_total", "requests_rejected_total"):
        assert "pagedserve:" + metric in text, metric


def test_provisioning_points_at_the_dashboard_and_the_data_sources():
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "pagedserve.yaml").read_text())["datasources"]
    by_type = {s["type"]: s for s in sources}
    assert by_type["prometheus"]["url"] == "http://prometheus:9090"
    assert by_type["jaeger"]["url"] == "http://jaeger:16686"
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    assert uids == {by_type["prometheus"]["uid"]}
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "pagedserve.yaml").read_text())["providers"][0]
    grafana = load_compose()["services"]["grafana"]
    assert grafana["profiles"] == ["observability"]
    assert grafana["image"] == "${GRAFANA_IMAGE:-grafana/grafana:11.4.0}"
    assert "./ops/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert f"./ops/grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
