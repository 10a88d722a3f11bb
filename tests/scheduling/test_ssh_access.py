# ruff: noqa: F811  (fixtures imported from other conftests)
"""Saved SSH keys (``/api/v1/ssh-keys/`` and the account page), the per-workload key's validation,
``access.ssh`` of a workload's detail, and the agent's two SSH endpoints: who may log in, asked at
login time. The real logins (a real ssh client through a real agent) are in
``tests/nodes/test_ssh_e2e.py``."""

from __future__ import annotations

import json
import subprocess

import pytest
from django.test import Client

from nodes.models import Node
from portal.actors import Actor
from portal.models import AuditEvent, Membership, Role
from portal.services.members import membership_remove
from portal.services.tenants import tenant_create
from portal.services.tokens import api_token_create
from scheduling.models import SshKey, Workload, WorkloadState
from scheduling.services.lifecycle import workload_on_running
from scheduling.services.ssh_keys import ssh_key_delete
from tests.nodes.conftest import make_bootstrap_token, region, register_node  # noqa: F401  (fixtures)
from tests.portal.conftest import add_member, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import reload
from tests.ssh_keys import key_pair, public_key

pytestmark = pytest.mark.django_db

KEYS = "/api/v1/ssh-keys/"


def bearer(token: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def post_key(client: Client, public: str, name: str = "laptop"):
    return client.post(
        KEYS, json.dumps({"name": name, "public_key": public}), content_type="application/json"
    )


def fingerprint_by_ssh_keygen(public: str, tmp_path) -> str:
    path = tmp_path / "key.pub"
    path.write_text(public + "\n")
    return subprocess.run(
        ["ssh-keygen", "-lf", str(path)], capture_output=True, text=True, check=True
    ).stdout.split()[1]


# --- saved keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ed25519", "ecdsa", "rsa"])
def test_a_saved_key_is_normalised_with_ssh_keygens_fingerprint(kind, tenant, make_token, tmp_path):
    client = bearer(make_token(tenant))
    public = public_key(kind, comment="me@laptop")
    messy = "  " + public.replace(" ", "   ", 1) + "\n"  # pasted with extra spaces and a newline
    r = post_key(client, messy)
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["public_key"] == public and body["name"] == "laptop"
    assert body["fingerprint"] == fingerprint_by_ssh_keygen(public, tmp_path)
    listed = client.get(KEYS).json()["results"]
    assert [k["fingerprint"] for k in listed] == [body["fingerprint"]]
    again = post_key(client, public, name="again")
    assert again.status_code == 400 and "already saved" in again.json()["error"]["fields"]["public_key"][0]


# A real DSA key (ssh-keygen -t dsa): a type OpenSSH itself has dropped.
DSA_KEY = (
    "ssh-dss AAAAB3NzaC1kc3MAAACBANxYFji68xrbw+hT4+++t37LyTxnp03E"
    "H8FXGVllLy6gZHyKAG/yzFRGSImINhbzfaQhTHtzVmU4BJituxScH72957IsPZLansBSHCrh3hDETOtJVlxQtptqye5DNctWwxB0acaUqslLEa5xK2Fxv88YRVLXdByJ209/o8lfCsGTAAAAFQC98kpSXxsmNbx1VzFGvjuhA5Kf9wAAAIEA22W0PGEpGIQPdMv1r9I/6DOyPHuUrrbswSOrV7oOqRnA5jbnpT4j4I790DZ130uHRqSTVlyKLeOhCU8Zruk8Iedg07GhWeaBbiN9gy2TPKOW6OsAktrEVvEwve26FskWSMSBZO0G+4/3emtoPYgtZzXpQxUU8coKxuod0CFWuikAAACAAgiNtLtP/hrO2HbgR2MUfBKNT5lLo90Tfug4cQ9XkL4WcQ7dxjfum31NoL9ZwBQ4M7L75XdzhVklMKrwNYhwb2PQppyJjsWNgzcP98R36pmYlPKE384exzbvlHUA/t2X7A2RJ/SffDHMZxwQHKcnAwX65/TlfG9pE34uvDofohA="
)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (lambda: public_key("rsa", bits=1024), "at least 2048 bits"),
        (lambda: DSA_KEY, "key type must be one of"),
        (lambda: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHh0ZXN0a2V5", "Not a valid OpenSSH public key"),
        (lambda: 'command="rm -rf /" ' + public_key(), "key type must be one of"),
        (lambda: public_key() + "\n" + public_key(), "control characters"),
        (lambda: "ssh-ed25519 not-base64!", "Not a valid OpenSSH public key"),
        (lambda: "", "This field may not be blank"),
    ],
    ids=["rsa-1024", "dsa", "truncated", "options", "two-keys", "not-base64", "blank"],
)
def test_a_bad_key_is_a_400_naming_public_key(value, message, tenant, make_token):
    client = bearer(make_token(tenant))
    r = post_key(client, value())
    assert r.status_code == 400, r.content
    assert message in " ".join(r.json()["error"]["fields"]["public_key"])
    assert not SshKey.objects.exists()


def test_keys_are_the_persons_and_changes_are_audited_in_each_of_their_teams(
    tenant, owner, make_tenant, make_token, add_member, signed_in
):
    other = make_tenant("other")
    Membership.objects.create(tenant=other, user=owner, role=Role.VIEWER)  # the owner is in two teams
    mine = bearer(make_token(tenant))
    r = post_key(mine, public_key())
    assert r.status_code == 201
    key_id = r.json()["id"]
    assert mine.get(f"{KEYS}{key_id}/").status_code == 200  # positive control
    # Another person of the same team, and another team's owner, see nothing of it.
    colleague = signed_in(add_member(tenant, Role.ADMIN).user, tenant)
    stranger = bearer(make_token(make_tenant("stranger")))
    for client in (colleague, stranger):
        assert client.get(f"{KEYS}{key_id}/").status_code == 404
        assert client.delete(f"{KEYS}{key_id}/").status_code == 404
        assert client.get(KEYS).json()["results"] == []
    # A token acts for its creator: the owner's token of the other team lists the same key.
    _, elsewhere = api_token_create(tenant=other, name="t", scopes=["read"], actor=Actor(user=owner))
    assert [k["id"] for k in bearer(elsewhere).get(KEYS).json()["results"]] == [key_id]
    # A read-only token may not change keys.
    assert post_key(bearer(make_token(tenant, scopes=["read"])), public_key()).status_code == 403
    assert mine.delete(f"{KEYS}{key_id}/").status_code == 204
    assert not SshKey.objects.exists()
    for action in ("ssh_key.create", "ssh_key.delete"):
        events = AuditEvent.objects.filter(action=action)
        assert {e.tenant_id for e in events} == {tenant.pk, other.pk}
        assert all(
            e.actor_user_id == owner.pk and e.data["fingerprint"].startswith("SHA256:") for e in events
        )


def test_a_token_without_a_person_has_no_keys(tenant):
    _, token = api_token_create(tenant=tenant, name="ops", scopes=["read", "write"], actor=Actor.system())
    client = bearer(token)
    assert client.get(KEYS).json()["results"] == []
    r = post_key(client, public_key())
    assert r.status_code == 400 and "no person" in r.json()["error"]["fields"]["public_key"][0]


def test_the_account_page_adds_lists_and_deletes(tenant, owner, signed_in, add_member, tmp_path):
    client = signed_in(owner, tenant)
    page = client.get("/account/ssh-keys/")
    assert page.status_code == 200 and "No saved keys yet" in page.content.decode()
    bad = client.post("/account/ssh-keys/", {"name": "old", "public_key": public_key("rsa", bits=1024)})
    assert bad.status_code == 400 and "at least 2048 bits" in bad.content.decode()
    public = public_key()
    r = client.post("/account/ssh-keys/", {"name": "laptop", "public_key": public})
    assert r.status_code == 302
    html = client.get("/account/ssh-keys/").content.decode()
    fingerprint = fingerprint_by_ssh_keygen(public, tmp_path)
    assert fingerprint in html and "laptop" in html and "ssh-ed25519" in html
    key = SshKey.objects.get()
    other = signed_in(add_member(tenant, Role.MEMBER).user, tenant)
    assert other.post(f"/account/ssh-keys/{key.pk}/delete/").status_code == 404  # not theirs
    assert client.post(f"/account/ssh-keys/{key.pk}/delete/").status_code == 302
    assert not SshKey.objects.exists()


# --- the per-workload key -----------------------------------------------------------------------------


def test_an_instances_key_is_checked_at_the_api_and_stored_normalised(tenant, make_token, make_node):
    make_node(gpus=2)
    client = bearer(make_token(tenant))
    spec = {"gpu_models": ["NVIDIA H100 SXM 80GB"], "image": "ghcr.io/acme/notebook:1"}
    for bad, message in (
        (public_key("rsa", bits=1024), "at least 2048 bits"),
        ("ssh-dss AAAAB3NzaC1kc3MAAACBAP", "key type must be one of"),
        ("ssh-ed25519 AAAA", "Not a valid OpenSSH public key"),
    ):
        r = client.post(
            "/api/v1/instances/", json.dumps({**spec, "ssh_public_key": bad}), content_type="application/json"
        )
        assert r.status_code == 400 and message in r.json()["error"]["fields"]["ssh_public_key"][0], r.content
    assert not Workload.objects.exists()
    public = public_key()
    r = client.post(
        "/api/v1/instances/",
        json.dumps({**spec, "ssh_public_key": f" {public}\n"}),
        content_type="application/json",
    )
    assert r.status_code == 201 and Workload.objects.get().ssh_public_key == public


# --- access.ssh and the agent's endpoints --------------------------------------------------------------


@pytest.fixture
def ssh_node(register_node):
    """A registered node (with its credential) whose agent has announced its SSH endpoint."""
    agent = register_node("ssh-node-1")
    client = Client(HTTP_AUTHORIZATION=f"Node {agent.credential}")
    host_key = public_key(comment="")
    r = client.put(
        f"/agent/v1/nodes/{agent.node_id}/ssh-endpoint",
        json.dumps({"port": 2222, "host_key": host_key}),
        content_type="application/json",
    )
    assert r.status_code == 200, r.content
    Node.objects.filter(pk=agent.node_id).update(address="gpu1.example.net")
    return agent, client, host_key


def running_instance(tenant, node_id: int, submit, cycle, **spec) -> Workload:
    w = submit(tenant, kind="instance", gpu_models=["NVIDIA H100 SXM 80GB"], **spec)
    cycle()
    workload_on_running(node_id=node_id, workload_id=str(w.pk))
    assert reload(w).state == WorkloadState.RUNNING
    return w


def test_access_ssh_gives_the_command_and_known_hosts_while_it_runs(
    ssh_node, tenant, owner, make_token, submit, cycle, signed_in
):
    agent, _, host_key = ssh_node
    client = bearer(make_token(tenant))
    job = submit(tenant, kind="job", gpu_models=["NVIDIA H100 SXM 80GB"])
    w = submit(tenant, kind="instance", gpu_models=["NVIDIA H100 SXM 80GB"])
    access = client.get(f"/api/v1/instances/{w.pk}/").json()["access"]
    assert access["ssh"] is None and "pending" in access["ssh_unavailable_reason"]
    cycle()
    workload_on_running(node_id=agent.node_id, workload_id=str(w.pk))
    access = client.get(f"/api/v1/instances/{w.pk}/").json()["access"]
    assert access["ssh"] == {
        "host": "gpu1.example.net",
        "port": 2222,
        "user": str(w.pk),
        "command": f"ssh -p 2222 {w.pk}@gpu1.example.net",
        "known_hosts": f"[gpu1.example.net]:2222 {host_key}",
    }
    assert access["ssh_unavailable_reason"] == ""
    html = signed_in(owner, tenant).get(f"/workloads/{w.pk}/").content.decode()
    assert f"<code data-connect>ssh -p 2222 {w.pk}@gpu1.example.net</code>" in html
    # A job opens the same way while it runs.
    assert (
        "SSH opens while it runs"
        in client.get(f"/api/v1/jobs/{job.pk}/").json()["access"]["ssh_unavailable_reason"]
    )
    workload_on_running(node_id=agent.node_id, workload_id=str(job.pk))
    assert client.get(f"/api/v1/jobs/{job.pk}/").json()["access"]["ssh"]["user"] == str(job.pk)
    # The simulated fleet has no shells: the API and the page say so instead of a command.
    Node.objects.filter(pk=agent.node_id).update(simulated=True)
    access = client.get(f"/api/v1/instances/{w.pk}/").json()["access"]
    assert (
        access["ssh"] is None and "not available on the simulated fleet" in access["ssh_unavailable_reason"]
    )
    html = signed_in(owner, tenant).get(f"/workloads/{w.pk}/").content.decode()
    assert "data-connect" not in html and "not available on the simulated fleet" in html


def test_the_agent_is_told_the_keys_of_operating_members_now(
    ssh_node, register_node, tenant, owner, add_member, make_tenant, submit, cycle
):
    agent, node_client, _ = ssh_node
    workload_key = public_key(comment="launch")
    w = running_instance(tenant, agent.node_id, submit, cycle, ssh_public_key=workload_key)
    keys_url = f"/agent/v1/nodes/{agent.node_id}/workloads/{w.pk}/ssh-keys"

    def save(user) -> SshKey:
        return SshKey.objects.create(
            user=user, name="k", public_key=(line := public_key()), fingerprint=f"fp-{line[-12:]}"
        )

    owner_key = save(owner)
    member = add_member(tenant, Role.MEMBER)
    member_key = save(member.user)
    viewer_key = save(add_member(tenant, Role.VIEWER).user)
    billing_key = save(add_member(tenant, Role.BILLING).user)
    inactive = add_member(tenant, Role.ADMIN)
    inactive_key = save(inactive.user)
    inactive.user.is_active = False
    inactive.user.save()
    stranger_key = save(Membership.objects.get(tenant=make_tenant("stranger"), role=Role.OWNER).user)

    def told() -> set[str]:
        r = node_client.get(keys_url)
        assert r.status_code == 200, r.content
        return {k["key"] for k in r.json()["keys"]}

    assert told() == {workload_key, owner_key.public_key, member_key.public_key}
    assert not told() & {viewer_key.public_key, billing_key.public_key, inactive_key.public_key}
    assert stranger_key.public_key not in told()
    # A removed member's keys and a deleted key stop at once.
    membership_remove(membership=member, actor=Actor.system())
    ssh_key_delete(key=owner_key, actor=Actor(user=owner))
    assert told() == {workload_key}

    # Only the node that holds it, only while it runs, only with a node credential.
    other = register_node("ssh-node-2")
    other_client = Client(HTTP_AUTHORIZATION=f"Node {other.credential}")
    assert other_client.get(f"/agent/v1/nodes/{other.node_id}/workloads/{w.pk}/ssh-keys").status_code == 404
    assert other_client.get(keys_url).status_code == 404  # another node's URL
    assert Client().get(keys_url).status_code == 401
    tenant_token = api_token_create(tenant=tenant, name="t", scopes=["read"], actor=Actor(user=owner))[1]
    assert Client(HTTP_AUTHORIZATION=f"Bearer {tenant_token}").get(keys_url).status_code == 401
    for bogus in ("../1", "abc", "9" * 30):
        assert (
            node_client.get(f"/agent/v1/nodes/{agent.node_id}/workloads/{bogus}/ssh-keys").status_code == 404
        )
    Workload.objects.filter(pk=w.pk).update(state=WorkloadState.STOPPING)
    assert node_client.get(keys_url).status_code == 404


def test_the_ssh_endpoint_announcement_is_validated(ssh_node):
    agent, client, _ = ssh_node
    url = f"/agent/v1/nodes/{agent.node_id}/ssh-endpoint"
    for body, field in (
        ({"port": 0, "host_key": public_key()}, "port"),
        ({"port": "22; rm", "host_key": public_key()}, "port"),
        ({"port": 2222, "host_key": public_key("rsa", bits=1024)}, "host_key"),
        ({"port": 2222, "host_key": "ssh-ed25519 AAAA\nssh-rsa B"}, "host_key"),
    ):
        r = client.put(url, json.dumps(body), content_type="application/json")
        assert r.status_code == 400 and field in r.json()["error"]["fields"], (body, r.content)
    assert Node.objects.get(pk=agent.node_id).ssh_port == 2222  # unchanged
    r = client.put(url, json.dumps({"port": None}), content_type="application/json")
    assert r.status_code == 200
    node = Node.objects.get(pk=agent.node_id)
    assert node.ssh_port is None and node.ssh_host_key == ""
    assert Client().put(url, "{}", content_type="application/json").status_code == 401


def test_a_tenant_created_elsewhere_does_not_leak_keys(ssh_node, tenant, submit, cycle):
    """Positive control for the walker's person-scoping: a person in two teams is told for both."""
    agent, node_client, _ = ssh_node
    second = tenant_create(slug="second", name="Second", owner_email="o@second.test", actor=Actor.system())
    w = running_instance(second, agent.node_id, submit, cycle)
    person = Membership.objects.get(tenant=second, role=Role.OWNER).user
    Membership.objects.create(tenant=tenant, user=person, role=Role.VIEWER)
    line = key_pair()[1]
    SshKey.objects.create(user=person, name="k", public_key=line, fingerprint="fp-x")
    keys = node_client.get(f"/agent/v1/nodes/{agent.node_id}/workloads/{w.pk}/ssh-keys").json()["keys"]
    assert [k["key"] for k in keys] == [line]
    assert keys[0]["source"] == "o@second.test: k"
