from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.core.management import call_command

from nodes.models import Gpu, Node, NodeBootstrapToken, UnknownGpuReport
from portal.models import AuditEvent
from tests.nodes.conftest import Agent, agent_request, registration_body


@pytest.fixture
def staff_actor(db):
    from portal.actors import Actor
    from portal.models import User

    return Actor(user=User.objects.create_user(email="ops@gpupool.test", password="pw-1", is_staff=True))


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
    assert Agent(node_id, again.json()["credential"], []).poll(wait=0).status_code == 200
    assert Agent(node_id, first.json()["credential"], []).poll(wait=0).status_code == 401
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
    bearer = {"Authorization": f"Bearer {make_token(tenant)}", "Content-Type": "application/json"}
    for response in (
        agent_request("POST", agent.url("heartbeat"), content=json.dumps(agent.batch()), headers=bearer),
        agent_request("GET", agent.url("commands"), params={"wait": 0}, headers=bearer),
        agent_request(
            "POST",
            agent.url("commands/00000000-0000-0000-0000-000000000000/report"),
            content="{}",
            headers=bearer,
        ),
    ):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "not_authenticated"
        assert response.headers["WWW-Authenticate"].startswith("Node")
    assert not agent.node.heartbeats.exists()


def test_wrong_credential_is_401_and_other_nodes_url_is_404(register_node):
    a, b = register_node(), register_node()
    a.credential = a.credential[:-4] + "AAAA"
    assert a.heartbeat(a.batch()).status_code == 401
    # b's good credential on a's URLs: 404, and nothing is written for either node.
    response = b.heartbeat(b.batch(), node_id=a.node_id)
    assert response.status_code == 404
    assert b.poll(node_id=a.node_id).status_code == 404
    assert not Node.objects.get(pk=a.node_id).heartbeats.exists()
    assert not Node.objects.get(pk=b.node_id).heartbeats.exists()


@pytest.mark.parametrize("state", ["ready", "down", "maintenance"])
def test_a_fresh_token_cannot_take_over_a_registered_hostname(
    register_node, client, make_bootstrap_token, state
):
    """The attack: any unused bootstrap token, sent with a registered node's hostname, re-keyed that
    node (its agent locked out, its GPUs removed, its commands delivered to the sender). Every node
    that exists is live, whatever its state: the answer is 409 and nothing changes."""
    victim = register_node("gpu-victim")
    assert victim.heartbeat(victim.batch()).json()["status"] == "accepted"
    Node.objects.filter(pk=victim.node_id).update(state=state)
    epoch = victim.node.seq_epoch
    token = make_bootstrap_token()
    for gpus in (registration_body(token, "gpu-victim")["gpus"], []):  # its GPUs, or none
        response = post_register(client, registration_body(token, "gpu-victim") | {"gpus": gpus})
        assert response.status_code == 409, response.content
        error = response.json()["error"]
        assert error["code"] == "node_exists" and "hostname" in error["fields"]
        assert "re-key" in error["message"] and "credential" not in response.json()
    assert victim.poll(wait=0).status_code == 200  # the node's own credential keeps working
    assert victim.heartbeat(victim.batch()).json()["status"] == "accepted"
    assert victim.node.seq_epoch == epoch
    assert Gpu.objects.filter(node_id=victim.node_id, removed_at__isnull=True).count() == 2
    assert NodeBootstrapToken.objects.get(used_at__isnull=True).used_by_node is None  # not spent
    assert not AuditEvent.objects.filter(action="node.rekey").exists()


def test_a_staff_rekey_token_rekeys_that_node_and_no_other(register_node, client, staff_actor):
    """A reinstalled server: staff make a token bound to its node; only that token re-keys, and only
    that node. The old credential stops working and batches count from 1 again."""
    from nodes.services.registration import node_rekey_token_create

    first, other = register_node("gpu-reinstalled"), register_node("gpu-bystander")
    assert first.heartbeat(first.batch()).json()["status"] == "accepted"
    token, plaintext = node_rekey_token_create(node=first.node, actor=staff_actor)
    assert token.rekey_node_id == first.node_id and token.expires_at is not None
    assert AuditEvent.objects.filter(action="node.rekey_token.create", target_id=str(first.node_id)).exists()
    wrong = post_register(client, registration_body(plaintext, "gpu-bystander"))
    assert wrong.status_code == 409 and "hostname" in wrong.json()["error"]["fields"]
    fresh = post_register(client, registration_body(plaintext, "gpu-brand-new"))
    assert fresh.status_code == 409 and not Node.objects.filter(hostname="gpu-brand-new").exists()
    assert (
        other.poll(wait=0).status_code == 200 and NodeBootstrapToken.objects.get(pk=token.pk).used_at is None
    )
    response = post_register(client, registration_body(plaintext, "gpu-reinstalled"))
    assert response.status_code == 201, response.content
    assert response.json()["node_id"] == first.node_id
    assert first.heartbeat(first.batch()).status_code == 401  # the old credential stopped working
    second = Agent(first.node_id, response.json()["credential"], first.uuids)
    # The reinstalled server numbers its batches from 1 again: not a duplicate.
    assert second.heartbeat(second.batch(1)).json()["status"] == "accepted"
    assert Gpu.objects.filter(node_id=first.node_id, removed_at__isnull=True).count() == 2
    assert AuditEvent.objects.filter(action="node.rekey", target_id=str(first.node_id)).count() == 1
    again = post_register(client, registration_body(plaintext, "gpu-reinstalled"))
    assert again.status_code == 401  # one use; the retry window closed with the first heartbeat


def test_a_lost_answer_to_a_rekey_is_retried(register_node, client, staff_actor):
    from nodes.services.registration import node_rekey_token_create

    node = register_node("gpu-rk-retry")
    _, plaintext = node_rekey_token_create(node=node.node, actor=staff_actor)
    body = registration_body(plaintext, "gpu-rk-retry")
    first, again = post_register(client, body), post_register(client, body)
    assert first.status_code == again.status_code == 201, again.content
    assert again.json()["node_id"] == node.node_id
    assert AuditEvent.objects.filter(action="node.register.retry", target_id=str(node.node_id)).count() == 1


def test_a_gpu_uuid_of_another_node_is_refused_and_alerts_staff(
    register_node, client, make_bootstrap_token, staff_actor
):
    """The attack: a registration listing another node's GPU UUIDs moved those GPU rows (and their
    history) to the new node. Now: 409 naming ``gpus``, nothing moves, and staff see an alert."""
    from nodes.models import FleetAlert

    owner = register_node("gpu-owner")
    body = registration_body(make_bootstrap_token(), "gpu-thief", gpus=1)
    body["gpus"][0]["uuid"] = owner.uuids[1]
    response = post_register(client, body)
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "gpu_conflict" and list(error["fields"]) == ["gpus"]
    assert owner.uuids[1] in error["fields"]["gpus"][0]
    assert not Node.objects.filter(hostname="gpu-thief").exists()
    assert set(
        Gpu.objects.filter(node_id=owner.node_id, removed_at=None).values_list("uuid", flat=True)
    ) == set(owner.uuids)
    alert = FleetAlert.objects.get(kind=FleetAlert.Kind.GPU_UUID_CONFLICT, resolved_at=None)
    assert "gpu-thief" in alert.message and "gpu-owner" in alert.message and owner.uuids[1] in alert.message
    assert alert.data["gpus"] == [{"uuid": owner.uuids[1], "node": "gpu-owner"}]
    # A re-key of another node that lists the owner's GPU is refused the same way.
    from nodes.services.registration import node_rekey_token_create

    other = register_node("gpu-other")
    _, plaintext = node_rekey_token_create(node=other.node, actor=staff_actor)
    body = registration_body(plaintext, "gpu-other")
    body["gpus"][0]["uuid"] = owner.uuids[0]
    assert post_register(client, body).status_code == 409
    assert Gpu.objects.get(uuid=owner.uuids[0]).node_id == owner.node_id
    assert other.poll(wait=0).status_code == 200
    assert FleetAlert.objects.filter(kind=FleetAlert.Kind.GPU_UUID_CONFLICT, resolved_at=None).count() == 2


@pytest.mark.django_db(transaction=True)
def test_two_registrations_racing_for_one_gpu_uuid_get_one_node_and_one_409(
    make_bootstrap_token, monkeypatch
):
    """Both registrations are held by a barrier just before they look at the listed GPUs (in the
    catalog lookup that precedes it), so both find them free. The second then took the GPU from the
    first silently (its read came after the first's commit) or met the unique index (a 500). Now
    the second is the same 409 as a GPU taken long before, and the first keeps its GPU."""
    import threading

    from django.db import connections

    from nodes.services import registration
    from tests.conftest import postgres_only

    postgres_only("two transactions write at once")
    tokens = [make_bootstrap_token(), make_bootstrap_token()]
    uuid = "GPU-0000race-0000-0000-0000-000000000000"
    both_there = threading.Barrier(2, timeout=10)
    real_index = registration.gpu_model_index

    def index_then_wait():
        index = real_index()
        both_there.wait()
        return index

    monkeypatch.setattr(registration, "gpu_model_index", index_then_wait)
    results: dict[str, object] = {}

    def register(i: int) -> None:
        info = registration.NodeInfo(
            hostname=f"race-{i}",
            gpus=(registration.GpuInfo(index=0, uuid=uuid, name="NVIDIA H100 80GB HBM3"),),
        )
        try:
            results[info.hostname] = registration.node_register(bootstrap_token=tokens[i], info=info)[0]
        except Exception as exc:  # asserted below
            results[info.hostname] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=register, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outcomes = sorted(type(result).__name__ for result in results.values())
    assert outcomes == ["GpuConflict", "Node"], results
    refused = next(result for result in results.values() if isinstance(result, registration.GpuConflict))
    assert refused.status_code == 409 and uuid in str(refused)
    winner = next(result for result in results.values() if isinstance(result, Node))
    assert list(Gpu.objects.filter(uuid=uuid).values_list("node_id", "removed_at")) == [(winner.pk, None)]
    assert list(Node.objects.values_list("hostname", flat=True)) == [winner.hostname]  # nothing half-written


def test_bootstrap_tokens_expire_in_72_hours_unless_never_is_asked(region, settings):
    from django.utils import timezone

    from nodes.services.registration import bootstrap_token_create
    from portal.actors import Actor

    now = timezone.now()
    token, _ = bootstrap_token_create(region=region, actor=Actor.system(), now=now)
    assert settings.NODE_BOOTSTRAP_TOKEN_TTL_H == 72
    assert token.expires_at == now + timedelta(hours=72)
    forever, _ = bootstrap_token_create(region=region, actor=Actor.system(), never_expires=True, now=now)
    assert forever.expires_at is None
    assert (
        AuditEvent.objects.get(action="node.bootstrap_token.create", target_id=str(forever.pk)).data[
            "expires_at"
        ]
        == "never"
    )


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


@pytest.mark.parametrize(
    "address",
    ["gpu-a-001.dc1.example", "10.0.3.7", "2001:db8::7", "Gpu-7"],
)
def test_the_advertised_address_is_kept(client, make_bootstrap_token, address):
    body = {**registration_body(make_bootstrap_token(), "gpu-addr"), "address": address}
    response = post_register(client, body)
    assert response.status_code == 201, response.content
    node = Node.objects.get(pk=response.json()["node_id"])
    assert node.address == node.reach_address == address


def test_without_an_address_the_node_is_reached_by_its_hostname(client, make_bootstrap_token):
    response = post_register(client, registration_body(make_bootstrap_token(), "gpu-noaddr"))
    node = Node.objects.get(pk=response.json()["node_id"])
    assert (node.address, node.reach_address) == ("", "gpu-noaddr")


@pytest.mark.parametrize(
    "address",
    ["10.0.0.1:22", "ssh://gpu-1", "gpu 1", "-oProxyCommand=x", "gpu-1;rm", "a" * 254, "", 7],
)
def test_an_address_that_is_not_a_name_or_ip_is_refused(client, make_bootstrap_token, address):
    body = {**registration_body(make_bootstrap_token(), "gpu-badaddr"), "address": address}
    response = post_register(client, body)
    if address == "":
        assert response.status_code == 201  # empty: not given
        return
    assert response.status_code == 400, (address, response.content)
    assert list(response.json()["error"]["fields"]) == ["address"]
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


def test_createnodetoken_expires_in_72_hours_by_default_and_never_only_when_asked(region, capsys):
    from django.utils import timezone

    call_command("createnodetoken", "--region", "us-east-1")
    capsys.readouterr()
    row = NodeBootstrapToken.objects.get()
    assert abs(row.expires_at - (timezone.now() + timedelta(hours=72))) < timedelta(minutes=1)
    call_command("createnodetoken", "--region", "us-east-1", "--expires", "never")
    _, err = capsys.readouterr()
    assert "WARNING" in err and "never expires" in err
    assert NodeBootstrapToken.objects.filter(expires_at=None).count() == 1


def test_createnodetoken_rekey_makes_a_token_for_that_node_only(register_node, client, capsys):
    node = register_node("gpu-cli-rekey")
    call_command("createnodetoken", "--rekey", "gpu-cli-rekey")
    out, err = capsys.readouterr()
    token = out.strip()
    assert "re-keys node gpu-cli-rekey" in err
    assert NodeBootstrapToken.objects.get(rekey_node_id=node.node_id).region_id == node.node.region_id
    assert post_register(client, registration_body(token, "gpu-cli-rekey")).status_code == 201
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="No node"):
        call_command("createnodetoken", "--rekey", "gpu-nowhere")


def test_staff_make_a_rekey_token_on_the_node_page_and_see_conflict_alerts(
    register_node, client, make_bootstrap_token, staff_actor
):
    from django.test import Client

    from nodes.models import FleetAlert

    node = register_node("gpu-page-rekey")
    staff = Client()
    staff.force_login(staff_actor.user)
    page = staff.get(f"/fleet/nodes/{node.node_id}/")
    assert page.status_code == 200 and "Make a re-key token" in page.content.decode()
    tenant_user = Client()
    from portal.models import User

    tenant_user.force_login(User.objects.create_user(email="t@gpupool.test", password="pw-2"))
    assert tenant_user.post(f"/fleet/nodes/{node.node_id}/rekey/").status_code == 403
    assert not NodeBootstrapToken.objects.filter(rekey_node_id=node.node_id).exists()
    made = staff.post(f"/fleet/nodes/{node.node_id}/rekey/", HTTP_HX_REQUEST="true")
    assert made.status_code == 201 and "no-cache" in made["Cache-Control"]
    plaintext = re.search(r"data-rekey-token>(gpb_[^<]+)<", made.content.decode())[1]
    assert NodeBootstrapToken.objects.get(rekey_node_id=node.node_id).created_by == staff_actor.user
    assert AuditEvent.objects.filter(action="node.rekey_token.create", actor_user=staff_actor.user).exists()
    assert post_register(client, registration_body(plaintext, "gpu-page-rekey")).status_code == 201
    # A GPU UUID conflict shows on the fleet page until staff resolve it.
    body = registration_body(make_bootstrap_token(), "gpu-clone", gpus=1)
    body["gpus"][0]["uuid"] = node.uuids[0]
    assert post_register(client, body).status_code == 409
    fleet = staff.get("/fleet/").content.decode()
    assert "A registration claimed another node&#x27;s GPUs" in fleet and "gpu-clone" in fleet
    from nodes.services.registration import gpu_conflict_alert_resolve

    gpu_conflict_alert_resolve(alert=FleetAlert.objects.get(subject="gpu-clone"), actor=staff_actor)
    assert "gpu-clone" not in staff.get("/fleet/").content.decode()


def test_the_admin_makes_expiring_tokens_never_only_when_ticked_and_rekey_tokens(
    client, region, register_node
):
    from django.utils import timezone

    from portal.models import User

    node = register_node("gpu-admin-rekey")
    admin = type(client)()
    admin.force_login(User.objects.create_superuser(email="root@gpupool.test", password="pw-root-1"))
    add = "/admin/nodes/nodebootstraptoken/add/"
    assert admin.post(add, {"region": region.pk, "note": "a", "expires_in_hours": ""}).status_code == 302
    assert abs(NodeBootstrapToken.objects.get(note="a").expires_at - timezone.now() - timedelta(hours=72)) < (
        timedelta(minutes=1)
    )
    both = admin.post(add, {"region": region.pk, "note": "b", "expires_in_hours": "5", "never_expires": "on"})
    assert both.status_code == 200 and not NodeBootstrapToken.objects.filter(note="b").exists()
    never = admin.post(add, {"region": region.pk, "note": "c", "never_expires": "on"}, follow=True)
    assert NodeBootstrapToken.objects.get(note="c").expires_at is None
    assert "never expires" in never.content.decode()
    made = admin.post(
        "/admin/nodes/node/",
        {"action": "make_rekey_token", "_selected_action": [node.node_id]},
        follow=True,
    )
    token = re.search(
        r"(gpb_[A-Za-z0-9_-]+)", made.content.decode().split("Re-key token for gpu-admin-rekey")[1]
    )[1]
    assert NodeBootstrapToken.objects.get(rekey_node_id=node.node_id).created_by.email == "root@gpupool.test"
    assert post_register(client, registration_body(token, "gpu-admin-rekey")).status_code == 201


def test_the_gpus_a_registration_locks_are_locked_in_id_order(register_node):
    """Two registrations listing the same GPUs took their row locks in whatever order PostgreSQL
    returned the rows, so each could hold one the other waited for (a deadlock, a 500 for one)."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from nodes.locks import lock_gpus_by_uuid

    node = register_node("gpu-order")
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        locked = lock_gpus_by_uuid(uuids=list(reversed(node.uuids)))
    assert set(locked) == set(node.uuids)
    (sql,) = [q["sql"] for q in queries.captured_queries if "FOR UPDATE" in q["sql"]]
    assert re.search(r'ORDER BY "nodes_gpu"\."id" ASC', sql), sql


@pytest.mark.parametrize(
    ("labels", "field"),
    [
        ({"bad key": "x"}, "labels"),
        ({"rack": "r 12"}, "labels.rack"),
        ({"rack": {"nested": 1}}, "labels.rack"),
        ({f"k{i}": "v" for i in range(65)}, "labels"),
        (["rack"], "labels"),
    ],
)
def test_labels_follow_the_label_rules_node_selectors_use(client, make_bootstrap_token, labels, field):
    token = make_bootstrap_token()
    body = registration_body(token, "gpu-l")
    body["labels"] = labels
    response = post_register(client, body)
    assert response.status_code == 400, response.content
    assert field in response.json()["error"]["fields"]
    assert not Node.objects.exists()
    body["labels"] = {"rack": "r12", "simulated": True, "row": 7}
    assert post_register(client, body).status_code == 201
    assert Node.objects.get().labels == {"rack": "r12", "simulated": "true", "row": "7"}
