"""The elastic job API: the spec's field, the job's state, and the owner's resize."""

from __future__ import annotations

import pytest

from nodes.models import CommandKind, NodeCommand
from portal.models import AuditEvent
from scheduling.models import Allocation, Workload
from scheduling.services.lifecycle import workload_on_running
from tests.scheduling.conftest import H100

pytestmark = pytest.mark.django_db

JOB = {"gpu_models": ["H100"], "image": "ghcr.io/acme/train:1", "command": ["python", "t.py"]}


@pytest.fixture
def client(tenant, make_token, api):
    return api(make_token(tenant))


def _running_elastic(client, make_node, cycle, **elastic):
    node = make_node(H100, gpus=8)
    r = client.post(
        "/api/v1/jobs/",
        {**JOB, "elastic": {"min_gpus": 2, "max_gpus": 8, **elastic}},
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    jid = r.json()["id"]
    cycle()
    workload_on_running(node_id=node.pk, workload_id=jid)
    return jid, node


def test_an_elastic_job_shows_its_bounds_and_is_resized_by_its_owner(client, make_node, cycle, tenant):
    jid, node = _running_elastic(client, make_node, cycle, on_resize="restart")
    body = client.get(f"/api/v1/jobs/{jid}/").json()
    assert body["gpu_count"] == 2
    assert body["elastic"] == {"min_gpus": 2, "max_gpus": 8, "target_gpus": 8, "on_resize": "restart"}
    cycle()
    assert client.get(f"/api/v1/jobs/{jid}/").json()["gpu_count"] == 8
    r = client.post(f"/api/v1/jobs/{jid}/resize/", {"gpu_count": 4}, content_type="application/json")
    assert r.status_code == 200, r.content
    assert r.json()["gpu_count"] == 4 and r.json()["elastic"]["target_gpus"] == 4
    assert len(r.json()["placement"]) == 4
    assert Allocation.objects.active().filter(workload_id=jid).count() == 4
    cmd = (
        NodeCommand.objects.filter(kind=CommandKind.RESIZE_WORKLOAD, node=node)
        .order_by("-created_at")
        .first()
    )
    assert cmd.payload["world_size"] == 4 and cmd.payload["on_resize"] == "restart"
    audit = AuditEvent.objects.get(action="job.resize")
    assert audit.tenant == tenant and audit.data["gpu_count"] == 4 and audit.data["held_before"] == 8


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"gpu_count": 1}, "gpu_count"),
        ({"gpu_count": 9}, "gpu_count"),
        ({"gpu_count": "x"}, "gpu_count"),
        ({}, "gpu_count"),
    ],
)
def test_a_bad_size_is_a_400_naming_gpu_count(client, make_node, cycle, body, field):
    jid, _ = _running_elastic(client, make_node, cycle)
    r = client.post(f"/api/v1/jobs/{jid}/resize/", body, content_type="application/json")
    assert r.status_code == 400, r.content
    assert field in str(r.json())
    assert Workload.objects.get(pk=jid).elastic_target_gpus == 8


def test_not_running_or_not_elastic_is_a_409(client, make_node, cycle):
    make_node(H100, gpus=8)
    r = client.post(
        "/api/v1/jobs/", {**JOB, "elastic": {"min_gpus": 2, "max_gpus": 4}}, content_type="application/json"
    )
    jid = r.json()["id"]
    r = client.post(f"/api/v1/jobs/{jid}/resize/", {"gpu_count": 3}, content_type="application/json")
    assert r.status_code == 409 and "running" in r.json()["error"]["message"]
    plain = client.post("/api/v1/jobs/", {**JOB, "gpu_count": 1}, content_type="application/json").json()[
        "id"
    ]
    r = client.post(f"/api/v1/jobs/{plain}/resize/", {"gpu_count": 2}, content_type="application/json")
    assert r.status_code == 409 and "elastic" in r.json()["error"]["message"]


def test_another_tenants_job_is_a_404(client, make_node, cycle, make_tenant, make_token, api):
    jid, _ = _running_elastic(client, make_node, cycle)
    # The owner reaches it by the same route first (positive control).
    assert (
        client.post(
            f"/api/v1/jobs/{jid}/resize/", {"gpu_count": 3}, content_type="application/json"
        ).status_code
        == 200
    )
    other = api(make_token(make_tenant("other")))
    r = other.post(f"/api/v1/jobs/{jid}/resize/", {"gpu_count": 2}, content_type="application/json")
    assert r.status_code == 404
    assert Workload.objects.get(pk=jid).elastic_target_gpus == 3
    reader = api(make_token(Workload.objects.get(pk=jid).tenant, scopes=("read",)))
    assert (
        reader.post(
            f"/api/v1/jobs/{jid}/resize/", {"gpu_count": 2}, content_type="application/json"
        ).status_code
        == 403
    )


def test_elastic_spec_errors_are_400s_naming_the_field(client, make_node):
    make_node(H100, gpus=8)
    for spec, field in [
        ({"elastic": {"min_gpus": 3, "max_gpus": 2}}, "elastic"),
        ({"elastic": "2:8"}, "elastic"),
        ({"elastic": {"min_gpus": 2, "max_gpus": 4}, "gpu_count": 5}, "gpu_count"),
    ]:
        r = client.post("/api/v1/jobs/", {**JOB, **spec}, content_type="application/json")
        assert r.status_code == 400 and field in str(r.json()), r.content
    r = client.post(
        "/api/v1/instances/",
        {"image": "img:1", "elastic": {"min_gpus": 1, "max_gpus": 2}},
        content_type="application/json",
    )
    assert r.status_code == 400 and "elastic" in str(r.json())
    assert not Workload.objects.exists()
