from __future__ import annotations

import pytest

from portal import health


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
    assert body["checks"]["broker"]["ok"] is False and body["checks"]["broker"]["error"]
    assert body["checks"]["database"]["ok"] is True


@pytest.mark.django_db
def test_readyz_is_503_when_the_database_fails(client, monkeypatch):
    monkeypatch.setattr(health, "_check_database", lambda: "OperationalError: connection refused")
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["database"] == {
        "ok": False,
        "ms": response.json()["checks"]["database"]["ms"],
        "error": "OperationalError: connection refused",
    }


def test_metrics_are_prometheus_text(client):
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    assert b"python_info" in response.content
