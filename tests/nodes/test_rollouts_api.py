"""The staff rollout API (``/api/staff/v1/rollouts/``): start, list, read, pause, resume and abort for
staff (session or a staff token with ``fleet:write``); 400s naming the field; tenants and other staff
scopes refused; the answers as the schema says."""

from __future__ import annotations

import pytest
from django.test import Client

from nodes.models import RolloutCampaign, RolloutStep
from portal.actors import Actor
from portal.models import AuditEvent, StaffScope, User
from portal.staff_tokens import staff_token_create

pytestmark = pytest.mark.django_db
URL = "/api/staff/v1/rollouts/"
BODY = {
    "name": "driver 560",
    "upgrade": "driver-560",
    "region": "us-east-1",
    "batch_size": 1,
    "max_region_share": "25%",
    "drain_deadline_s": 600,
}


@pytest.fixture(autouse=True)
def _no_advance_tasks(settings):
    settings.ROLLOUT_ADVANCE_ON_COMMIT = False


@pytest.fixture
def staff_user(db) -> User:
    return User.objects.create_user(email="ops@gpupool.example", password="x", is_staff=True)


@pytest.fixture
def staff_client(staff_user) -> Client:
    client = Client()
    client.force_login(staff_user)
    return client


def post(client: Client, url: str, body) -> object:
    return client.post(url, data=body, content_type="application/json")


def test_staff_start_read_and_steer_a_campaign(staff_user, make_nodes, api):
    nodes = make_nodes(4)
    _, token = staff_token_create(
        user=staff_user, name="ops", scopes=[StaffScope.FLEET_WRITE], actor=Actor(user=staff_user)
    )
    client = api(token)
    created = post(client, URL, BODY)
    assert created.status_code == 201, created.content
    data = created.json()
    assert (
        data["state"] == "running"
        and data["max_region_share"] == "0.250"
        and data["created_by"] == staff_user.email
    )
    assert data["region"] == "us-east-1" and data["gpu_model"] is None and data["label"] is None
    assert [s["hostname"] for s in data["steps"]] == [n.hostname for n in nodes]
    assert data["progress"]["pending"] == 4 and data["step_timeout_s"] == 3600

    listing = client.get(URL)
    assert listing.status_code == 200
    (row,) = listing.json()["results"]
    assert row["id"] == data["id"] and row["progress"]["pending"] == 4 and "steps" not in row
    assert client.get(f"{URL}{data['id']}/").json()["steps"][0]["state"] == "pending"

    paused = post(client, f"{URL}{data['id']}/pause/", {"reason": "change freeze"})
    assert paused.status_code == 200 and paused.json()["state"] == "paused"
    assert paused.json()["state_reason"] == "change freeze"
    again = post(client, f"{URL}{data['id']}/pause/", {})
    assert again.status_code == 409 and "state" in again.json()["error"]["fields"]
    assert post(client, f"{URL}{data['id']}/resume/", {}).json()["state"] == "running"
    aborted = post(client, f"{URL}{data['id']}/abort/", {})
    assert aborted.status_code == 200 and aborted.json()["state"] == "aborted"
    assert aborted.json()["progress"]["cancelled"] == 4
    actions = AuditEvent.objects.filter(target_id=str(data["id"]), action__startswith="rollout.")
    assert sorted(actions.values_list("action", flat=True)) == [
        "rollout.abort", "rollout.pause", "rollout.resume", "rollout.start",
    ]  # fmt: skip
    assert set(actions.values_list("actor_user__email", flat=True)) == {staff_user.email}
    assert post(client, f"{URL}999999/abort/", {}).status_code == 404


@pytest.mark.parametrize(
    "body, field",
    [
        ({**BODY, "batch_size": 0}, "batch_size"),
        ({**BODY, "batch_size": True}, "batch_size"),
        ({**BODY, "max_region_share": "2"}, "max_region_share"),
        ({**BODY, "max_region_share": None}, "max_region_share"),
        ({**BODY, "upgrade": "rm -rf /"}, "upgrade"),
        ({**BODY, "upgrade": ["/usr/bin/apt", "upgrade"]}, "upgrade"),
        ({**BODY, "command": "/bin/sh -c reboot"}, "command"),
        ({**BODY, "region": "nowhere"}, "region"),
        ({**BODY, "label": "=x"}, "label"),
        ({**BODY, "drain_deadline_s": 10**9}, "drain_deadline_s"),
        ({**BODY, "name": "x" * 101}, "name"),
        ({k: v for k, v in BODY.items() if k != "drain_deadline_s"}, "drain_deadline_s"),
        (["not", "an", "object"], "body"),
    ],
)
def test_a_bad_field_is_a_400_naming_it_and_writes_nothing(staff_client, make_nodes, body, field):
    make_nodes(4)
    r = post(staff_client, URL, body)
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"], r.json()
    assert not RolloutCampaign.objects.exists() and not RolloutStep.objects.exists()
    assert not AuditEvent.objects.filter(action="rollout.start").exists()
    assert post(staff_client, URL, BODY).status_code == 201  # positive control


def test_an_action_takes_only_a_reason(staff_client, make_nodes):
    make_nodes(4)
    campaign_id = post(staff_client, URL, BODY).json()["id"]
    r = post(staff_client, f"{URL}{campaign_id}/abort/", {"force": True})
    assert r.status_code == 400 and "force" in r.json()["error"]["fields"]
    assert RolloutCampaign.objects.get(pk=campaign_id).state == "running"


def test_tenants_and_other_staff_scopes_are_refused(tenant, owner, make_token, api, staff_user, make_nodes):
    make_nodes(4)
    staff = Client()
    staff.force_login(staff_user)
    campaign_id = post(staff, URL, BODY).json()["id"]  # positive control: staff may
    member = Client()
    member.force_login(owner)
    tenant_token = api(make_token(tenant))
    _, finance = staff_token_create(
        user=staff_user, name="fin", scopes=[StaffScope.FINANCE_READ], actor=Actor(user=staff_user)
    )
    for client in (member, tenant_token, api(finance)):
        assert client.get(URL).status_code == 403
        assert client.get(f"{URL}{campaign_id}/").status_code == 403
        assert post(client, URL, BODY).status_code == 403
        assert post(client, f"{URL}{campaign_id}/abort/", {}).status_code == 403
    assert Client().get(URL).status_code in (401, 403)
    assert RolloutCampaign.objects.get().state == "running" and RolloutCampaign.objects.count() == 1


def test_the_schema_documents_the_rollout_api(staff_client):
    import yaml

    schema = yaml.safe_load(staff_client.get("/api/schema/").content)
    paths = schema["paths"]
    assert set(paths[URL]) == {"get", "post"}
    for name in ("pause", "resume", "abort"):
        assert "post" in paths[f"{URL}{{id}}/{name}/"]
    create = schema["components"]["schemas"]["RolloutCreateRequest"]["properties"]
    assert {"upgrade", "batch_size", "max_region_share", "drain_deadline_s", "label"} <= set(create)
    detail = schema["components"]["schemas"]["RolloutDetail"]["properties"]
    assert "steps" in detail and "progress" in detail
