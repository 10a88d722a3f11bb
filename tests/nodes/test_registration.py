from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.core.management import call_command

from nodes.models import Gpu, Node, NodeBootstrapToken, UnknownGpuReport
from portal.models import AuditEvent
from tests.nodes.conftest import Agent, registration_body


def post_register(client, body):
    return client.post("/agent/v1/register", data=json.dumps(body), content_type="application/json")


def test_register_creates_node_gpus_and_credential(client, make_bootstrap_token):
    token = make_bootstrap_token()
    response = post_register(client, registration_body(token, "gpu-a-001", gpus=8))
    assert response.status_code == 201
    data = response.json()
    assert data["credential"].startswith(f"gpn_{data['node_id']}_")
    assert data["heartbeat_interval_s"] > 0 and data["commands_wait_s"] > 0
    node = Node.objects.get(pk=data["node_id"])
    assert node.hostname == "gpu-a-001" and node.region.code == "us-east-1" and node.state == "ready"
    assert node.interconnect == "nvswitch" and node.cpu_cores == 96
    gpus = list(node.gpus.order_by("index"))
    assert len(gpus) == 8 and gpus[0].model.name == "NVIDIA H100 SXM 80GB"
    assert data["credential"] not in node.credential.key_hash  # stored hashed
    assert AuditEvent.objects.filter(action="node.register", target_id=str(node.pk)).exists()


def test_bootstrap_token_is_one_use(client, make_bootstrap_token):
    token = make_bootstrap_token()
    assert post_register(client, registration_body(token, "gpu-1")).status_code == 201
    again = post_register(client, registration_body(token, "gpu-2"))
    assert again.status_code == 401
    assert again.json()["error"]["code"] == "not_authenticated"
    assert not Node.objects.filter(hostname="gpu-2").exists()


def test_a_retried_registration_by_the_same_machine_gets_the_same_node(client, make_bootstrap_token):
    """The agent timed out after the portal accepted: the same request again answers the same node
    with a fresh credential (the first one, never read, stops working)."""
    token = make_bootstrap_token()
    body = registration_body(token, "gpu-r1", gpus=4)
    first = post_register(client, body)
    assert first.status_code == 201
    epoch = Node.objects.get().seq_epoch
    again = post_register(client, body)
    assert again.status_code == 201, again.content
    node_id = again.json()["node_id"]
    assert node_id == first.json()["node_id"] and again.json()["credential"] != first.json()["credential"]
    assert Node.objects.count() == 1 and Gpu.objects.filter(node_id=node_id, removed_at=None).count() == 4
    assert Node.objects.get().seq_epoch == epoch  # not re-keyed as a reinstall
    beat = f"/agent/v1/nodes/{node_id}/commands"
    assert (
        client.get(beat, {"wait": 0}, HTTP_AUTHORIZATION=f"Node {again.json()['credential']}").status_code
        == 200
    )
    assert (
        client.get(beat, {"wait": 0}, HTTP_AUTHORIZATION=f"Node {first.json()['credential']}").status_code
        == 401
    )
    assert AuditEvent.objects.filter(action="node.register.retry", target_id=str(node_id)).count() == 1


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda body: body.update(hostname="gpu-other"), id="another hostname"),
        pytest.param(lambda body: body["gpus"][0].update(uuid="GPU-someone-else"), id="other GPUs"),
        pytest.param(lambda body: body["gpus"].pop(), id="fewer GPUs"),
    ],
)
def test_a_spent_token_from_another_machine_is_still_refused(client, make_bootstrap_token, change):
    token = make_bootstrap_token()
    body = registration_body(token, "gpu-r2", gpus=2)
    assert post_register(client, body).status_code == 201
    other = json.loads(json.dumps(body))
    change(other)
    response = post_register(client, other)
    assert response.status_code == 401 and "already been used" in response.json()["error"]["message"]
    assert list(Node.objects.values_list("hostname", flat=True)) == ["gpu-r2"]
    assert set(Gpu.objects.filter(removed_at=None).values_list("uuid", flat=True)) == {
        "GPU-gpu-r2-0",
        "GPU-gpu-r2-1",
    }


def test_a_spent_token_is_refused_after_the_window_or_once_the_node_is_live(client, make_bootstrap_token):
    from django.utils import timezone

    from nodes.agent_views import _parse_registration
    from nodes.services.registration import REGISTER_RETRY_WINDOW, NotAuthenticated, node_register

    token = make_bootstrap_token()
    body = registration_body(token, "gpu-r3", gpus=2)
    first = post_register(client, body)
    assert first.status_code == 201
    plaintext, info = _parse_registration(body)
    with pytest.raises(NotAuthenticated, match="already been used"):
        node_register(
            bootstrap_token=plaintext,
            info=info,
            now=timezone.now() + REGISTER_RETRY_WINDOW + timedelta(seconds=5),
        )
    # Within the window, but the node has sent a heartbeat with its credential: no longer a retry.
    agent = Agent(first.json()["node_id"], first.json()["credential"], ["GPU-gpu-r3-0", "GPU-gpu-r3-1"])
    assert agent.heartbeat(agent.batch()).status_code == 200
    again = post_register(client, body)
    assert again.status_code == 401 and "already been used" in again.json()["error"]["message"]
    assert agent.poll(wait=0).status_code == 200  # the live node's credential still works


@pytest.mark.parametrize("token", ["gpb_nope_secret", "garbage", ""])
def test_wrong_bootstrap_token_is_401(client, region, token):
    response = post_register(client, registration_body(token, "gpu-x"))
    assert response.status_code in (400, 401)
    if token:
        assert response.status_code == 401
    else:
        assert response.json()["error"]["fields"] == {"bootstrap_token": ["This field may not be blank."]}
    assert not Node.objects.exists()


def test_right_key_id_wrong_secret_is_401(client, make_bootstrap_token):
    token = make_bootstrap_token()
    forged = token.rsplit("_", 1)[0] + "_" + "x" * 43
    assert post_register(client, registration_body(forged, "gpu-x")).status_code == 401
    assert NodeBootstrapToken.objects.get().used_at is None


def test_expired_bootstrap_token_is_401(client, make_bootstrap_token):
    token = make_bootstrap_token(expires_in=timedelta(seconds=-1))
    assert post_register(client, registration_body(token, "gpu-x")).status_code == 401


def test_region_must_match_token(client, make_bootstrap_token):
    token = make_bootstrap_token()
    response = post_register(client, registration_body(token, "gpu-x", region="eu-west-1"))
    assert response.status_code == 400
    assert "region" in response.json()["error"]["fields"]
    assert NodeBootstrapToken.objects.get().used_at is None  # nothing spent


def test_tenant_bearer_token_opens_nothing(agent, tenant, make_token):
    from django.test import Client

    bearer = Client(HTTP_AUTHORIZATION=f"Bearer {make_token(tenant)}")
    for response in (
        bearer.post(agent.url("heartbeat"), data=json.dumps(agent.batch()), content_type="application/json"),
        bearer.get(agent.url("commands"), {"wait": 0}),
        bearer.post(
            agent.url("commands/00000000-0000-0000-0000-000000000000/report"),
            data="{}",
            content_type="application/json",
        ),
    ):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "not_authenticated"
        assert response["WWW-Authenticate"].startswith("Node")
    assert not agent.node.heartbeats.exists()


def test_wrong_credential_is_401_and_other_nodes_url_is_404(register_node):
    a, b = register_node(), register_node()
    a.credential = a.credential[:-4] + "AAAA"
    from django.test import Client

    wrong = Client(HTTP_AUTHORIZATION=f"Node {a.credential}")
    assert (
        wrong.post(
            a.url("heartbeat"), data=json.dumps(a.batch()), content_type="application/json"
        ).status_code
        == 401
    )
    # b's good credential on a's URLs: 404, and nothing is written for either node.
    response = b.heartbeat(b.batch(), node_id=a.node_id)
    assert response.status_code == 404
    assert b.poll(node_id=a.node_id).status_code == 404
    assert not Node.objects.get(pk=a.node_id).heartbeats.exists()
    assert not Node.objects.get(pk=b.node_id).heartbeats.exists()


def test_reregistering_a_hostname_rekeys_the_node(register_node, client, make_bootstrap_token):
    first = register_node("gpu-reinstalled")
    assert first.heartbeat(first.batch()).json()["status"] == "accepted"
    response = post_register(client, registration_body(make_bootstrap_token(), "gpu-reinstalled"))
    assert response.status_code == 201
    assert response.json()["node_id"] == first.node_id
    assert first.heartbeat(first.batch()).status_code == 401  # the old credential stopped working
    from tests.nodes.conftest import Agent

    second = Agent(first.node_id, response.json()["credential"], first.uuids)
    # The reinstalled server numbers its batches from 1 again: not a duplicate.
    assert second.heartbeat(second.batch(1)).json()["status"] == "accepted"
    assert Gpu.objects.filter(node_id=first.node_id, removed_at__isnull=True).count() == 2


def test_unknown_gpu_model_is_flagged_not_crashed(register_node):
    agent = register_node(name="NVIDIA Quantum Z9000")
    gpus = list(Gpu.objects.filter(node_id=agent.node_id))
    assert all(g.model is None and g.reported_name == "NVIDIA Quantum Z9000" for g in gpus)
    report = UnknownGpuReport.objects.get(reported_name="NVIDIA Quantum Z9000")
    assert report.gpu_count == 2 and report.example_node_id == agent.node_id
    assert agent.heartbeat(agent.batch()).json()["status"] == "accepted"


def test_staff_alias_then_rematch_links_unknown_gpus(register_node):
    from nodes.models import GpuModel
    from nodes.services.registration import gpu_models_rematch
    from portal.actors import Actor

    agent = register_node(name="NVIDIA H100 NVL")
    h100p = GpuModel.objects.get(name="NVIDIA H100 PCIe 80GB")
    h100p.aliases = [*h100p.aliases, "NVIDIA H100 NVL"]
    h100p.save()
    assert gpu_models_rematch(actor=Actor.system()) == 2
    assert set(Gpu.objects.filter(node_id=agent.node_id).values_list("model__name", flat=True)) == {
        h100p.name
    }
    assert UnknownGpuReport.objects.get(reported_name="NVIDIA H100 NVL").resolved_model == h100p


def test_malformed_registration_names_the_field(client, make_bootstrap_token):
    token = make_bootstrap_token()
    body = registration_body(token, "gpu-x")
    body["gpus"][1]["index"] = "one"
    response = post_register(client, body)
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {"gpus[1].index": ["Expected an integer."]}
    assert not Node.objects.exists()


def test_createnodetoken_prints_a_working_token_once(client, region, capsys):
    call_command("createnodetoken", "--region", "us-east-1", "--expires-in-hours", "2")
    out, err = capsys.readouterr()
    token = out.strip()
    assert token.startswith("gpb_") and "shown only this once" in err
    row = NodeBootstrapToken.objects.get()
    assert row.region == region and row.expires_at is not None and token not in row.token_hash
    assert post_register(client, registration_body(token, "gpu-cli")).status_code == 201


def test_createnodetoken_unknown_region(db):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="Unknown region"):
        call_command("createnodetoken", "--region", "mars-1")
