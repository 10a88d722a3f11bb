"""deploy/grafana: dashboards are valid, every expression is PromQL that promtool parses, and every
dashboard queries only metrics the app exports."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.deploy.helpers import DEPLOY, SYNTHETIC, promql_metric_names, promtool

DASHBOARDS = DEPLOY / "grafana" / "dashboards"
# Grafana fills these in before Prometheus sees the query.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def load(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text())


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def names(dashboard: dict) -> set[str]:
    return set().union(*(promql_metric_names(e) for e in expressions(dashboard)))


def test_there_are_two_dashboards():
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == ["fleet.json", "scheduling-billing.json"]


@pytest.mark.parametrize("name", ["fleet.json", "scheduling-billing.json"])
def test_dashboard_structure(name):
    d = load(name)
    assert d["uid"] and d["title"].startswith("gpupool") and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len(panels) >= 8
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
        assert p["gridPos"]["x"] >= 0 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]


def test_every_expression_is_valid_promql(tmp_path):
    exprs = expressions(load("fleet.json")) + expressions(load("scheduling-billing.json"))
    records = []
    for i, expr in enumerate(exprs):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        records.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboards.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": records}]}))
    result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(records)} rules found" in result.stdout


def test_fleet_dashboard_covers_the_issue_and_queries_exported_metrics(exported):
    d = load("fleet.json")
    titles = " ".join(p["title"] for p in d["panels"]).lower()
    for topic in ("utilisation by model", "utilisation by region", "heartbeats", "samples"):
        assert topic in titles, topic
    used = names(d)
    missing = used - exported - SYNTHETIC
    assert not missing, f"fleet.json queries metrics /metrics does not have: {sorted(missing)}"
    assert {
        "gpupool_gpu_util_percent_sum",
        "gpupool_nodes",
        "gpupool_gpus",
        "gpupool_heartbeats_total",
    } <= used


def test_scheduling_billing_dashboard_covers_the_issue_and_queries_exported_metrics(exported):
    d = load("scheduling-billing.json")
    titles = " ".join(p["title"] for p in d["panels"]).lower()
    for topic in ("allocated", "fragmentation", "queue depth", "wait", "cycle duration", "revenue"):
        assert topic in titles, topic
    used = names(d)
    missing = used - exported - SYNTHETIC
    assert not missing, f"scheduling-billing.json queries metrics /metrics does not have: {sorted(missing)}"
    assert {
        "gpupool_gpus_allocated",
        "gpupool_scheduling_fragmentation",
        "gpupool_celery_queue_length",
        "gpupool_scheduling_queue_wait_seconds_bucket",
        "gpupool_scheduling_cycle_duration_seconds_bucket",
        "gpupool_revenue_month_to_date",
    } <= used
