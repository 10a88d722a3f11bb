from __future__ import annotations

import pytest

from portal import health
from tests.conftest import python_run


def test_healthz_answers_json(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_checks_database_and_broker(client):
    response = client.get("/readyz")
    body = response.json()
    assert response.status_code == 200, body
    assert body["status"] == "ok"
    assert body["checks"]["database"]["ok"] and body["checks"]["broker"]["ok"]


@pytest.mark.django_db
def test_readyz_is_503_when_the_broker_is_unreachable(client, monkeypatch):
    from kombu import Connection

    from portal.celery import app

    # A real connection attempt to a port where no broker listens.
    monkeypatch.setattr(
        app, "connection_for_write", lambda: Connection("redis://127.0.0.1:1/0", connect_timeout=1)
    )
    response = client.get("/readyz")
    body = response.json()
    assert response.status_code == 503
    assert body["checks"]["broker"]["ok"] is False
    assert body["checks"]["database"]["ok"] is True
    assert "127.0.0.1" not in response.content.decode()  # which check, never its detail


@pytest.mark.django_db
def test_readyz_says_which_check_failed_and_logs_the_detail(client, monkeypatch, caplog):
    from django.db import OperationalError

    def refused():
        raise OperationalError('connection to server at "db.internal" failed: password for user "gpupool"')

    monkeypatch.setattr(health.connection, "cursor", refused)
    response = client.get("/readyz")
    assert response.status_code == 503
    database = response.json()["checks"]["database"]
    assert database == {"ok": False, "ms": database["ms"]}
    assert "db.internal" not in response.content.decode() and "gpupool" not in response.content.decode()
    assert "db.internal" in caplog.text  # the operator still learns why


def test_metrics_are_prometheus_text(client):
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    assert b"python_info" in response.content


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
def test_probes_answer_requests_by_ip_address(client, path):
    """Kubelets and Prometheus reach pods by IP; ALLOWED_HOSTS refuses that for everything else."""
    assert client.get(path, HTTP_HOST="10.1.2.3:8000").status_code == 200
    assert client.get("/login/", HTTP_HOST="10.1.2.3:8000").status_code == 400


def test_metrics_token_guards_metrics(client, settings):
    settings.METRICS_TOKEN = "scrape-secret"
    refused = client.get("/metrics")
    assert refused.status_code == 401 and refused["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    allowed = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret")
    assert allowed.status_code == 200 and b"python_info" in allowed.content


def test_tasks_are_routed_to_their_queues():
    from portal.celery import app

    def queue(task):
        return app.amqp.router.route({}, task)["queue"].name

    assert queue("scheduling.tasks.run_cycle") == "scheduling"
    assert queue("nodes.tasks.expire_commands") == "commands"
    assert queue("nodes.tasks.reconcile_node_health") == "commands"
    assert queue("metering.tasks.build_invoices") == "metering"
    assert queue("nodes.tasks.publish_fleet_snapshot") == "default"
    assert {q.name for q in app.conf.task_queues} == {"default", "scheduling", "commands", "metering"}


def test_metrics_without_a_token_are_refused_unless_made_public(client, settings):
    """Production settings (DEBUG off) with no METRICS_TOKEN: /metrics answers nobody; it used to
    answer everybody, revenue per plan included."""
    settings.METRICS_TOKEN = ""
    settings.METRICS_PUBLIC = False
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401
    settings.METRICS_PUBLIC = True  # make run: DEBUG on
    assert client.get("/metrics").status_code == 200


def test_hsts_preload_only_when_asked():
    code = (
        "import django; django.setup(); from django.conf import settings; print(settings.SECURE_HSTS_PRELOAD)"
    )
    env = {"DJANGO_SETTINGS_MODULE": "portal.settings", "DEBUG": "0", "SECRET_KEY": "x" * 50}
    assert python_run(code, **env, SECURE_HSTS_PRELOAD=None).stdout.strip() == "False"
    assert python_run(code, **env, SECURE_HSTS_PRELOAD="1").stdout.strip() == "True"
