"""Ports in the API and on the workload page (issue 28): a port spec is checked at the API, the
node's report becomes ``access.ports``, the page shows a URL only where the proxy reaches a running
port, and a share link is made and revoked by those who may write. The proxy itself, with a real
portal, agent and upstream: ``test_proxy_e2e``."""

from __future__ import annotations

import pytest

from nodes.models import CommandKind, CommandState, Node
from portal.actors import Actor
from portal.models import AuditEvent, Role
from scheduling.models import Allocation, PublishedPort, Workload, WorkloadShareLink
from scheduling.models import WorkloadState as S
from scheduling.services.access import NOT_PUBLISHED, NOT_PUBLISHED_SIMULATED
from scheduling.services.lifecycle import workload_on_command_finished, workload_stop
from tests.portal.conftest import HTMX, add_member, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import H100, reload

pytestmark = pytest.mark.django_db

INSTANCE = {"gpu_models": [H100], "image": "ghcr.io/acme/notebook:1"}


def started(w: Workload, result: dict) -> Workload:
    """The node's report that its start command succeeded, through the lifecycle service."""
    w = reload(w)
    node_id = Allocation.objects.get(workload=w).node_id
    workload_on_command_finished(
        kind=CommandKind.START_WORKLOAD,
        payload={"workload_id": str(w.pk), "attempt": w.attempt},
        node_id=node_id,
        state=CommandState.SUCCEEDED,
        result={"workload_id": str(w.pk), "ref": "c1", **result},
    )
    return reload(w)


@pytest.mark.parametrize(
    ("ports", "reason"),
    [
        ([0], "not a port number"),
        ([65536], "not a port number"),
        (["8080"], "not a port number"),
        ([True], "not a port number"),
        ([{"port": 80, "protocol": "udp"}], "protocol must be one of http, tcp"),
        ([{"port": 80, "host_port": 80}], "Unknown key 'host_port'"),
        ([80, {"port": 80, "protocol": "tcp"}], "twice with different protocols"),
        ([{"protocol": "http"}], "None is not a port number"),
    ],
)
def test_bad_port_specs_are_a_400_naming_ports(api, tenant, make_token, make_node, ports, reason):
    make_node()
    r = api(make_token(tenant)).post(
        "/api/v1/instances/", {**INSTANCE, "ports": ports}, content_type="application/json"
    )
    assert r.status_code == 400, r.content
    assert reason in str(r.json()["error"]["fields"]["ports"])
    assert not Workload.objects.exists()


def test_ports_are_stored_with_their_protocol_and_shown_by_what_the_node_published(
    api, tenant, make_token, make_node, cycle
):
    make_node()
    client = api(make_token(tenant))
    r = client.post(
        "/api/v1/instances/",
        {**INSTANCE, "ports": [8888, {"port": 22, "protocol": "tcp"}, {"port": 6006}]},
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    w = Workload.objects.get(pk=r.json()["id"])
    assert w.ports == [
        {"port": 22, "protocol": "tcp"},
        {"port": 6006, "protocol": "http"},
        {"port": 8888, "protocol": "http"},
    ]
    assert [p["note"] for p in r.json()["access"]["ports"]] == ["Reachable while it runs."] * 3
    cycle()
    # The node published two of them (6006 missing from its report).
    w = started(w, {"ports": {"8888": 49153, "22": 49154}, "runtime": "docker"})
    assert w.state == S.RUNNING
    ports = client.get(f"/api/v1/instances/{w.pk}/").json()["access"]["ports"]
    node = Node.objects.get(pk=Allocation.objects.get(workload=w).node_id)
    assert ports == [
        {"port": 22, "protocol": "tcp", "host_port": 49154, "host": node.reach_address, "url": None,
         "note": ports[0]["note"]},
        {"port": 6006, "protocol": "http", "host_port": None, "host": None, "url": None, "note": NOT_PUBLISHED},
        {"port": 8888, "protocol": "http", "host_port": 49153, "host": None,
         "url": f"http://testserver/proxy/{w.pk}/8888/", "note": ""},
    ]  # fmt: skip
    assert "does not check who connects" in ports[0]["note"]
    # Stopped: the published ports go with the placement.
    workload_stop(workload=w, actor=Actor.system())
    assert all(p["url"] is None for p in client.get(f"/api/v1/instances/{w.pk}/").json()["access"]["ports"])
    workload_on_command_finished(
        kind=CommandKind.STOP_WORKLOAD,
        payload={"workload_id": str(w.pk)},
        node_id=node.pk,
        state=CommandState.SUCCEEDED,
        result={"workload_id": str(w.pk), "state": "stopped"},
    )
    assert reload(w).state == S.STOPPED and not PublishedPort.objects.filter(workload=w).exists()
    assert all(p["url"] is None for p in client.get(f"/api/v1/instances/{w.pk}/").json()["access"]["ports"])


def test_the_page_shows_a_url_only_where_the_proxy_reaches_it(
    signed_in,  # noqa: F811
    owner,
    tenant,
    make_node,
    submit,
    cycle,
):
    make_node()
    client = signed_in(owner, tenant)
    w = submit(tenant, kind="instance", ports=[8888])
    cycle()
    page = client.get(f"/workloads/{w.pk}/live/").content.decode()
    assert "data-port-url" not in page and "/proxy/" not in page
    # A simulated node publishes nothing: the page says so, with no address.
    w = started(w, {"ports": {}, "runtime": "simulated"})
    page = client.get(f"/workloads/{w.pk}/live/").content.decode()
    assert NOT_PUBLISHED_SIMULATED in page and "data-port-url" not in page
    assert "Ports open on" not in page  # the old text that promised a host port
    # A node that published it: the link.
    started(w, {"ports": {"8888": 40001}, "runtime": "docker"})
    page = client.get(f"/workloads/{w.pk}/live/").content.decode()
    assert f'href="http://testserver/proxy/{w.pk}/8888/"' in page


def test_share_links_need_write_and_are_audited(
    api, signed_in, owner, add_member, tenant, make_tenant, make_token, make_node, submit, cycle  # noqa: F811
):  # fmt: skip
    make_node()
    w = submit(tenant, kind="instance", ports=[8888, {"port": 22, "protocol": "tcp"}])
    tcp_only = submit(tenant, kind="instance", ports=[{"port": 22, "protocol": "tcp"}])
    cycle()
    started(w, {"ports": {"8888": 40001, "22": 40002}, "runtime": "docker"})
    writer = api(make_token(tenant))
    # A read-only token and another tenant cannot.
    assert (
        api(make_token(tenant, scopes=("read",))).post(f"/api/v1/instances/{w.pk}/share-link/").status_code
        == 403
    )
    assert (
        api(make_token(make_tenant("other"))).post(f"/api/v1/instances/{w.pk}/share-link/").status_code == 404
    )
    assert not WorkloadShareLink.objects.exists()
    # Nothing to share on a workload without an HTTP port.
    r = writer.post(f"/api/v1/instances/{tcp_only.pk}/share-link/")
    assert r.status_code == 400 and "ports" in r.json()["error"]["fields"]

    r = writer.post(f"/api/v1/instances/{w.pk}/share-link/")
    assert r.status_code == 200
    secret = r.json()["secret"]
    assert r.json()["urls"] == [f"http://testserver/proxy/{w.pk}/8888/?gpupool_share={secret}"]
    link = WorkloadShareLink.objects.get(workload=w)
    assert link.token_hash != secret and secret not in str(writer.get(f"/api/v1/instances/{w.pk}/").json())
    # A second link replaces the first.
    again = writer.post(f"/api/v1/instances/{w.pk}/share-link/").json()["secret"]
    assert again != secret and WorkloadShareLink.objects.get(workload=w).pk != link.pk

    # The page: a viewer sees no buttons; the owner makes one (shown once) and revokes it.
    viewer = signed_in(add_member(tenant, Role.VIEWER).user, tenant)
    page = viewer.get(f"/workloads/{w.pk}/live/").content.decode()
    assert "data-share-create" not in page and "data-share-revoke" not in page
    assert viewer.post(f"/workloads/{w.pk}/share-link/", {"action": "revoke"}, **HTMX).status_code == 403
    assert WorkloadShareLink.objects.filter(workload=w).exists()
    client = signed_in(owner, tenant)
    page = client.get(f"/workloads/{w.pk}/live/").content.decode()
    assert "data-share-active" in page and "data-share-revoke" in page
    made = client.post(f"/workloads/{w.pk}/share-link/", {"action": "create"}, **HTMX).content.decode()
    assert f"/proxy/{w.pk}/8888/?gpupool_share=gpl_" in made and "data-share-url" in made
    assert "gpupool_share=" not in client.get(f"/workloads/{w.pk}/live/").content.decode()  # once
    done = client.post(f"/workloads/{w.pk}/share-link/", {"action": "revoke"}, **HTMX).content.decode()
    assert "Share link revoked." in done and not WorkloadShareLink.objects.filter(workload=w).exists()
    assert writer.delete(f"/api/v1/instances/{w.pk}/share-link/").status_code == 204  # idempotent
    actions = list(
        AuditEvent.objects.filter(action__startswith="workload.share_link")
        .order_by("id")
        .values_list("action", flat=True)
    )
    assert actions == ["workload.share_link.create"] * 3 + ["workload.share_link.revoke"]
