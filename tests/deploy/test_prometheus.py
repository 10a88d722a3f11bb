"""deploy/prometheus: promtool accepts the configuration and the rules, and the rules query only
metrics the app exports."""

from __future__ import annotations

import re
import shutil

import yaml

from tests.deploy.helpers import DEPLOY, SYNTHETIC, promql_metric_names, promtool

PROM = DEPLOY / "prometheus"
ISSUE_ALERTS = {
    "gpupool.yml": {
        "GpupoolNodeDown",
        "GpupoolGpuUnhealthy",
        "GpupoolStripeWebhookFailures",
        "GpupoolQueueWaitP95High",
        "GpupoolSchedulingCycleFailing",
        "GpupoolSchedulingCycleStale",
        "GpupoolCeleryQueueBacklog",
        "GpupoolInvoiceRunFailed",
        "GpupoolBillingAlertOpen",
    },
}


def rules(name: str) -> list[dict]:
    groups = yaml.safe_load((PROM / "rules" / name).read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def names_in(name: str) -> set[str]:
    return set().union(*(promql_metric_names(rule["expr"]) for rule in rules(name)))


def test_promtool_accepts_the_configuration(tmp_path):
    # As deployed: the metrics token's file beside the configuration (promtool checks it exists).
    shutil.copytree(PROM, tmp_path / "prometheus")
    (tmp_path / "prometheus" / "secrets").mkdir()
    (tmp_path / "prometheus" / "secrets" / "gpupool-metrics-token").write_text("token\n")
    result = promtool("check", "config", tmp_path / "prometheus" / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "prometheus.yml is valid prometheus config file syntax" in result.stdout
    assert "SUCCESS: 1 rule files found" in result.stdout
    assert sorted(p.name for p in (PROM / "rules").glob("*.yml")) == ["gpupool.yml"]


def test_every_gpupool_job_sends_the_metrics_token():
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    jobs = [j for j in config["scrape_configs"] if j["job_name"].startswith("gpupool-")]
    assert len(jobs) == 4
    for job in jobs:
        assert job["authorization"]["credentials_file"] == "secrets/gpupool-metrics-token", job["job_name"]


def test_every_web_tier_is_scraped_by_a_job_the_rules_read():
    """Both uvicorn tiers, web and agent-web (where the agents' heartbeat, ingest and request
    counters are counted), in Kubernetes (their headless Services) and in compose: the rules and
    dashboards select job=~"gpupool-web.*"."""
    jobs = yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]
    scraped = set()
    for job in jobs:
        if re.fullmatch(r"gpupool-web.*", job["job_name"]):
            for sd in job.get("dns_sd_configs", []):
                scraped.update(f"{name}:{sd['port']}" for name in sd["names"])
            for static in job.get("static_configs", []):
                scraped.update(static["targets"])
    headless = [
        doc
        for path in (DEPLOY / "k8s").glob("*.yaml")
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] == "Service" and doc["spec"].get("clusterIP") == "None"
    ]
    components = {doc["spec"]["selector"]["app.kubernetes.io/component"] for doc in headless}
    assert components == {"web", "agent-web"}
    for doc in headless:
        (port,) = doc["spec"]["ports"]
        assert f"{doc['metadata']['name']}.gpupool.svc.cluster.local:{port['port']}" in scraped
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    for name in ("web", "agent-web"):
        port = next(a.split("=", 1)[1] for a in services[name]["command"] if a.startswith("--port="))
        assert f"{name}:{port}" in scraped, name


def test_promtool_accepts_the_rules():
    result = promtool("check", "rules", PROM / "rules" / "gpupool.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == 1


def test_promtool_rejects_a_broken_rule(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: sum(rate(x[5m])\n")
    assert promtool("check", "rules", broken).returncode != 0


def test_the_issue_alerts_are_there():
    for name, alerts in ISSUE_ALERTS.items():
        assert alerts <= {rule["alert"] for rule in rules(name)}, name
    for name in ISSUE_ALERTS:
        for rule in rules(name):
            assert rule["labels"]["severity"] in ("page", "warning") and rule["annotations"]["summary"]


def test_metric_name_extraction():
    expr = (
        'sum by (le, plan) (rate(gpupool_x_bucket{job=~"a.*", le!="1"}[5m])) / on () '
        "max without (instance) (gpupool_nodes) > 0 and time() - y_total offset 5m"
    )
    assert promql_metric_names(expr) == {"gpupool_x_bucket", "gpupool_nodes", "y_total"}


def test_active_rules_query_exported_metrics(exported):
    missing = names_in("gpupool.yml") - exported - SYNTHETIC
    assert not missing, f"rules/gpupool.yml queries metrics /metrics does not have: {sorted(missing)}"
