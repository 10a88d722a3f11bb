from __future__ import annotations

import pytest
from django.utils import timezone

from nodes.services.registration import bootstrap_token_create
from portal.actors import Actor
from tests.deploy.helpers import exported_series
from tests.nodes.conftest import agent_register, registration_body


@pytest.fixture
def metrics_text(db, client, monkeypatch, settings) -> str:
    """/metrics of a small fleet: two nodes in two regions, one with a heartbeat of telemetry; no
    per-GPU series (METRICS_PER_GPU is off in production: dashboards and rules must not need them)."""
    from nodes import agent_views
    from nodes.models import Region

    settings.METRICS_PER_GPU = False
    monkeypatch.setattr(agent_views, "DB_THREAD_SENSITIVE", True)
    agents = []
    for code, hostname, model in (
        ("us-east-1", "gpu-a", "NVIDIA H100 80GB HBM3"),
        ("eu-west-1", "gpu-b", "NVIDIA L4"),
    ):
        region = Region.objects.get_or_create(code=code, defaults={"name": code, "location": code})[0]
        token = bootstrap_token_create(region=region, actor=Actor.system())[1]
        agents.append(agent_register(registration_body(token, hostname, gpus=2, name=model)))
    first = agents[0]
    now = timezone.now()
    assert first.heartbeat(first.batch(samples=[first.sample(u, now) for u in first.uuids])).status_code < 300
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.content.decode()


@pytest.fixture
def exported(metrics_text) -> set[str]:
    names = exported_series(metrics_text)
    assert "gpupool_nodes" in names and "gpupool_gpu_util_percent_sum" in names  # the fleet really rendered
    assert "DCGM_FI_DEV_GPU_UTIL" not in names
    return names
