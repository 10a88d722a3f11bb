"""The staff fleet pages over HTTP: access, counts, heat map, filters and pagination, node detail,
actions through the nodes services (audited, nothing half-written), query counts, and the live
snapshot on the staff websocket group."""

from __future__ import annotations

import json
import re
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client
from django.utils import timezone

from nodes import tasks
from nodes.live import fleet_snapshot
from nodes.models import (
    FleetAlert,
    Gpu,
    GpuHealth,
    GpuMinuteRollup,
    GpuModel,
    GpuSample,
    Node,
    NodeCommand,
    NodeState,
    Region,
    UnknownGpuReport,
)
from nodes.services.commands import node_command_enqueue, node_command_report, node_commands_deliver_due
from nodes.services.health import node_cordon
from portal.actors import Actor
from portal.middleware import SESSION_TENANT_KEY
from portal.models import AuditEvent, Membership, User
from tests.portal.conftest import HTMX

_hosts = iter(range(1, 1_000_000))


class Fleet:
    """Makes nodes and GPUs straight in the database (bulk inserts), with chosen telemetry."""

    def __init__(self):
        self.regions: dict[str, Region] = {}

    def region(self, code: str) -> Region:
        if code not in self.regions:
            self.regions[code] = Region.objects.get_or_create(
                code=code, defaults={"name": code.upper(), "location": f"{code} DC"}
            )[0]
        return self.regions[code]

    def nodes(
        self,
        count: int,
        *,
        region: str = "us-east-1",
        model: str = "NVIDIA H100 SXM 80GB",
        gpus: int = 8,
        state: str = NodeState.READY,
        util: float | None = 50.0,
        simulated: bool = False,
        prefix: str = "gpu",
    ) -> list[Node]:
        now = timezone.now()
        gpu_model = GpuModel.objects.get(name=model)
        made = Node.objects.bulk_create(
            [
                Node(
                    hostname=f"{prefix}-{next(_hosts):05d}",
                    region=self.region(region),
                    state=state,
                    cpu_cores=96,
                    ram_mib=1024 * 1024,
                    driver_version="560.35.03",
                    cuda_version="12.6",
                    agent_version="0.1.0",
                    interconnect="nvswitch",
                    labels={"rack": "r1"},
                    last_heartbeat_at=now,
                    simulated=simulated,
                )
                for _ in range(count)
            ]
        )
        Gpu.objects.bulk_create(
            [
                Gpu(
                    node=node,
                    index=i,
                    uuid=f"GPU-{node.hostname}-{i}",
                    model=gpu_model,
                    reported_name=gpu_model.name,
                    memory_mib=gpu_model.memory_gib * 1024,
                    last_sample_at=now if util is not None else None,
                    last_util_pct=util,
                    last_mem_used_mib=40 * 1024 if util is not None else None,
                    last_power_w=400.0 if util is not None else None,
                    last_temp_c=65 if util is not None else None,
                )
                for node in made
                for i in range(gpus)
            ]
        )
        return made


@pytest.fixture
def fleet(db) -> Fleet:
    return Fleet()


@pytest.fixture
def staff(db) -> User:
    return User.objects.create_user(email="ops@gpupool.test", password="pw-for-tests-1", is_staff=True)


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


@pytest.fixture
def owner_client(owner, tenant) -> Client:
    """A tenant's owner, signed in with the tenant active: not staff."""
    client = Client()
    client.force_login(owner)
    session = client.session
    session[SESSION_TENANT_KEY] = tenant.pk
    session.save()
    return client


def html(response) -> str:
    return response.content.decode()


def staff_actions():
    """The audit of what staff did here (their sign-in is audited too)."""
    return AuditEvent.objects.exclude(action__startswith="account.")


# --- access -------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_anonymous_people_are_sent_to_sign_in(client, fleet):
    node = fleet.nodes(1)[0]
    for url in ("/fleet/", f"/fleet/nodes/{node.pk}/"):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/login/?next=")
    response = client.post(f"/fleet/nodes/{node.pk}/actions/cordon/", {"reason": "x"})
    assert response.status_code == 302
    node.refresh_from_db()
    assert node.state == NodeState.READY


@pytest.mark.django_db
def test_tenant_members_get_403_and_change_nothing(owner_client, fleet):
    node = fleet.nodes(1)[0]
    gpu = node.gpus.first()
    Gpu.objects.filter(pk=gpu.pk).update(health=GpuHealth.UNHEALTHY, isolated=True)
    assert owner_client.get("/fleet/").status_code == 403
    assert owner_client.get(f"/fleet/nodes/{node.pk}/").status_code == 403
    assert owner_client.post(f"/fleet/nodes/{node.pk}/actions/cordon/", {"reason": "x"}).status_code == 403
    assert owner_client.post(f"/fleet/gpus/{gpu.pk}/return/", {"reason": "x"}).status_code == 403
    node.refresh_from_db()
    gpu.refresh_from_db()
    assert node.state == NodeState.READY and gpu.health == GpuHealth.UNHEALTHY
    assert not AuditEvent.objects.filter(action__startswith="node.").exists()
    # and the sidebar does not offer the page
    assert 'href="/fleet/"' not in html(owner_client.get("/"))


@pytest.mark.django_db
def test_staff_see_the_fleet_entry_in_the_sidebar(staff_client, fleet):
    fleet.nodes(1)
    page = html(staff_client.get("/fleet/"))
    assert re.search(r'<a href="/fleet/" class="nav-link active" aria-current="page">', page)


# --- overview -----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_overview_counts_nodes_by_state_and_region_and_gpus_by_model_and_health(staff_client, fleet):
    fleet.nodes(3, region="us-east-1")
    fleet.nodes(1, region="us-east-1", state=NodeState.CORDONED)
    fleet.nodes(2, region="eu-west-1", model="NVIDIA T4", gpus=4, util=20.0, simulated=True)
    fleet.nodes(1, region="eu-west-1", model="NVIDIA T4", gpus=4, state=NodeState.DOWN, util=None)
    fleet.nodes(1, region="eu-west-1", model="NVIDIA T4", gpus=4, state=NodeState.MAINTENANCE)
    t4 = Gpu.objects.filter(model__name="NVIDIA T4").order_by("pk")
    Gpu.objects.filter(pk=t4[0].pk).update(health=GpuHealth.UNHEALTHY, isolated=True)
    Gpu.objects.filter(pk=t4[1].pk).update(isolated=True)
    Gpu.objects.filter(pk=t4[2].pk).update(removed_at=timezone.now())  # gone: counted nowhere

    response = staff_client.get("/fleet/")
    assert response.status_code == 200
    counts = response.context["counts"]
    assert counts["total"] == 8 and counts["simulated"] == 2
    assert counts["by_state"] == {
        "ready": 5, "cordoned": 1, "draining": 0, "suspect": 0, "down": 1, "maintenance": 1, "slurm": 0,
    }  # fmt: skip
    by_region = {r["code"]: r["states"] for r in counts["regions"]}
    assert by_region["us-east-1"]["ready"] == 3 and by_region["us-east-1"]["cordoned"] == 1
    assert by_region["eu-west-1"] == {
        "ready": 2, "cordoned": 0, "draining": 0, "suspect": 0, "down": 1, "maintenance": 1, "slurm": 0,
    }  # fmt: skip

    gpus = response.context["gpu_counts"]
    assert (gpus["total"], gpus["unhealthy"], gpus["isolated"], gpus["healthy"]) == (47, 1, 2, 45)
    models = {m["name"]: m for m in gpus["models"]}
    assert (
        models["NVIDIA H100 SXM 80GB"]["total"] == 32 and models["NVIDIA H100 SXM 80GB"]["util_avg"] == 50.0
    )
    assert (models["NVIDIA T4"]["total"], models["NVIDIA T4"]["unhealthy"], models["NVIDIA T4"]["isolated"]) == (
        15, 1, 2,
    )  # fmt: skip

    page = html(response)
    assert 'data-count="region:eu-west-1:down">1</td>' in page
    assert 'data-count="state:cordoned">1</td>' in page
    assert "2 simulated" in page and 'class="hm-sim"' in page


@pytest.mark.django_db
def test_silent_gpus_do_not_count_in_utilisation(staff_client, fleet):
    live = fleet.nodes(1, gpus=2, util=80.0)[0]
    quiet = fleet.nodes(1, gpus=2, util=10.0)[0]
    Gpu.objects.filter(node=quiet).update(last_sample_at=timezone.now() - timedelta(minutes=10))
    response = staff_client.get("/fleet/")
    assert response.context["gpu_counts"]["util_avg"] == 80.0
    assert response.context["gpu_counts"]["models"][0]["util_avg"] == 80.0
    rows = {n.pk: n.util_avg for n in response.context["nodes"]}
    assert rows == {live.pk: 80.0, quiet.pk: None}


@pytest.mark.django_db
def test_heat_map_has_one_cell_per_present_gpu_coloured_by_utilisation(staff_client, fleet):
    busy = fleet.nodes(2, util=87.0)
    idle = fleet.nodes(1, region="eu-west-1", util=3.0, gpus=2)
    silent = fleet.nodes(1, region="eu-west-1", util=None, gpus=2)
    stale = fleet.nodes(1, gpus=1)[0]
    Gpu.objects.filter(node=stale).update(last_sample_at=timezone.now() - timedelta(hours=1))
    bad = Gpu.objects.filter(node=busy[0], index=3).get()
    Gpu.objects.filter(pk=bad.pk).update(health=GpuHealth.UNHEALTHY, isolated=True)
    removed = Gpu.objects.filter(node=busy[1], index=7).get()
    Gpu.objects.filter(pk=removed.pk).update(removed_at=timezone.now())

    page = html(staff_client.get("/fleet/"))
    cells = {int(g): cls for cls, g in re.findall(r'<i class="hc ([a-z0-9 ]+)" data-g="(\d+)"', page)}
    present = set(Gpu.objects.filter(removed_at__isnull=True).values_list("pk", flat=True))
    assert set(cells) == present and len(present) == 2 * 8 - 1 + 2 + 2 + 1
    assert cells[bad.pk] == "u8 bad"
    assert {cells[g.pk] for g in busy[0].gpus.exclude(pk=bad.pk)} == {"u8"}
    assert {cells[g.pk] for g in idle[0].gpus.all()} == {"u0"}
    assert {cells[g.pk] for g in silent[0].gpus.all()} == {"ux"}
    assert {cells[g.pk] for g in stale.gpus.all()} == {"ux"}  # an hour-old sample is not "current"
    # grouped by region, then node: every node tile sits inside its region's block
    eu = page.index('data-region="eu-west-1"')
    us = page.index('data-region="us-east-1"')
    assert eu < page.index(f'data-node="{idle[0].pk}"') < us < page.index(f'data-node="{busy[0].pk}"')
    # the tooltip's numbers travel in the page's initial snapshot
    initial = json.loads(
        re.search(r'<script id="fleet-initial" type="application/json">(.*?)</script>', page).group(1)
    )
    rows = {r[0]: r for r in initial["g"]}
    assert rows[busy[0].gpus.first().pk] == [busy[0].gpus.first().pk, 87.0, 40.0, 400, 65]
    assert rows[silent[0].gpus.first().pk][1:] == [None, None, None, None]
    assert ["H100", 80] in initial["models"]


@pytest.mark.django_db
def test_alerts_and_unknown_gpus_are_listed(staff_client, fleet):
    node = fleet.nodes(1)[0]
    now = timezone.now()
    FleetAlert.objects.create(
        kind=FleetAlert.Kind.MASS_SILENCE,
        message="12 of 20 nodes are silent",
        opened_at=now,
        last_seen_at=now,
    )
    FleetAlert.objects.create(
        kind=FleetAlert.Kind.MASS_SILENCE,
        message="old news",
        opened_at=now,
        last_seen_at=now,
        resolved_at=now,
    )
    UnknownGpuReport.objects.create(reported_name="NVIDIA B200", gpu_count=8, example_node=node)
    page = html(staff_client.get("/fleet/"))
    assert "12 of 20 nodes are silent" in page and "old news" not in page
    assert "NVIDIA B200" in page and f'href="/fleet/nodes/{node.pk}/"' in page


@pytest.mark.django_db
def test_filters_narrow_the_node_table(staff_client, fleet):
    a = fleet.nodes(2, region="us-east-1", prefix="alpha")
    b = fleet.nodes(1, region="eu-west-1", model="NVIDIA T4", gpus=1, prefix="beta")
    c = fleet.nodes(1, region="eu-west-1", state=NodeState.DRAINING, prefix="gamma")
    t4 = GpuModel.objects.get(name="NVIDIA T4")

    def hosts(query: dict) -> set[str]:
        response = staff_client.get("/fleet/", query, **HTMX)
        assert response.status_code == 200
        body = html(response)
        assert "<html" not in body and body.startswith('<div id="node-rows"')  # the table alone
        return set(re.findall(r'<tr id="node-\d+">\s*<td><a href="/fleet/nodes/\d+/"><strong>([^<]+)<', body))

    assert hosts({"region": "eu-west-1"}) == {b[0].hostname, c[0].hostname}
    assert hosts({"state": "draining"}) == {c[0].hostname}
    assert hosts({"model": t4.pk}) == {b[0].hostname}
    assert hosts({"q": "ALPHA"}) == {n.hostname for n in a}
    assert hosts({"region": "eu-west-1", "model": t4.pk, "q": "beta"}) == {b[0].hostname}
    assert hosts({"q": "nothing-like-this"}) == set()

    bad = staff_client.get("/fleet/", {"state": "exploded"})
    assert bad.status_code == 400 and "State:" in html(bad)


@pytest.mark.django_db
def test_node_table_is_paginated(staff_client, fleet):
    fleet.nodes(120, gpus=1)
    first = staff_client.get("/fleet/")
    assert first.status_code == 200
    assert len(first.context["nodes"]) == 50 and first.context["paginator"].num_pages == 3
    assert "1\u201350 of 120" in html(first) and 'rel="next" href="?page=2"' in html(first)
    last = staff_client.get("/fleet/", {"page": 3}, **HTMX)
    body = html(last)
    assert len(re.findall(r'<tr id="node-\d+">', body)) == 20 and "101\u2013120 of 120" in body
    hosts_1 = {n.hostname for n in first.context["nodes"]}
    hosts_3 = {n.hostname for n in last.context["nodes"]}
    assert not hosts_1 & hosts_3
    # the pager keeps the filters
    filtered = html(staff_client.get("/fleet/", {"q": "gpu", "page": 2}))
    assert "?q=gpu&amp;page=3" in filtered and "?q=gpu&amp;page=1" in filtered


@pytest.mark.django_db
def test_overview_query_count_does_not_grow_with_the_fleet(
    staff_client, fleet, django_assert_max_num_queries
):
    fleet.nodes(150, region="us-east-1")
    fleet.nodes(50, region="eu-west-1", model="NVIDIA L4", gpus=4, state=NodeState.CORDONED)
    with django_assert_max_num_queries(17):
        response = staff_client.get("/fleet/")
    assert response.status_code == 200
    assert html(response).count('" data-g="') == 150 * 8 + 50 * 4
    with django_assert_max_num_queries(10):
        assert staff_client.get("/fleet/", {"page": 4, "region": "eu-west-1"}, **HTMX).status_code == 200


# --- node detail --------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_node_detail_shows_facts_gpus_telemetry_and_command_history(staff_client, fleet):
    node = fleet.nodes(1, gpus=2)[0]
    g0, g1 = node.gpus.order_by("index")
    Gpu.objects.filter(pk=g1.pk).update(health=GpuHealth.UNHEALTHY, isolated=True, health_reason="XID 79")
    if timezone.now().second >= 57:  # the page reads "this minute" a moment later: stay inside it
        time.sleep(4)
    minute = timezone.now().replace(second=0, microsecond=0)
    for back in (3, 2, 1):
        # A minute after which utilisation went unreported (MIG mode): its average is a gap, not 0.
        util_n = 0 if back == 1 else 4
        GpuMinuteRollup.objects.create(
            gpu=g0, minute=minute - timedelta(minutes=back), sample_count=4, util_sum=util_n * 60.0,
            util_count=util_n, util_max=70 if util_n else None, mem_used_sum=4 * 2048, mem_used_count=4,
            mem_used_max=2048, power_sum=4 * 300.0, power_count=4, temp_max=70 + back,
        )  # fmt: skip
    GpuMinuteRollup.objects.create(
        gpu=g0, minute=minute - timedelta(hours=3), sample_count=1, util_sum=1, mem_used_sum=1, power_sum=1
    )  # outside the default hour
    GpuSample.objects.create(gpu=g0, ts=minute, util_pct=99.0, mem_used_mib=4096, power_w=650.0, temp_c=80)
    command = node_command_enqueue(node=node, kind="prewarm", payload={"image": "pytorch:2.4"})
    node_commands_deliver_due(node_id=node.pk)
    node_command_report(node_id=node.pk, command_id=command.pk, status="succeeded")

    response = staff_client.get(f"/fleet/nodes/{node.pk}/")
    assert response.status_code == 200
    page = html(response)
    for text in (
        node.hostname,
        "us-east-1",
        "560.35.03",
        "12.6",
        "96 cores",
        "1024 GiB",
        "rack=r1",
        "NVSwitch",
    ):
        assert text in page, text
    assert f'id="gpu-{g0.pk}"' in page and f'id="gpu-{g1.pk}"' in page and "XID 79" in page
    assert (
        f'hx-post="/fleet/gpus/{g1.pk}/return/"' in page
        and f'hx-post="/fleet/gpus/{g0.pk}/return/"' not in page
    )
    assert "Prewarm" in page and "Succeeded" in page and "delivered" in page  # command + its events
    assert 'data-chart="util"' in page and "uPlot.iife.min.js" in page

    telemetry = json.loads(
        re.search(r'<script id="node-telemetry" type="application/json">(.*?)</script>', page).group(1)
    )
    assert [g["label"] for g in telemetry["gpus"]] == ["GPU 0", "GPU 1"]
    assert len(telemetry["x"]) == 4  # three finished minutes + the raw sample of this minute
    assert telemetry["util"][0] == [60.0, 60.0, None, 99.0] and telemetry["util"][1] == [None] * 4
    assert telemetry["mem"][0] == [2.0, 2.0, 2.0, 4.0]
    assert telemetry["temp"][0] == [73, 72, 71, 80]
    assert telemetry["window_s"] == 3600
    wide = staff_client.get(f"/fleet/nodes/{node.pk}/", {"range": "6h"})
    assert wide.context["telemetry"]["x"][0] == int((minute - timedelta(hours=3)).timestamp())


@pytest.mark.django_db
def test_node_detail_query_count_is_bounded(staff_client, fleet, django_assert_max_num_queries):
    node = fleet.nodes(1, gpus=8)[0]
    for i in range(15):
        node_command_enqueue(node=node, kind="prewarm", payload={"image": f"img:{i}"})
    with django_assert_max_num_queries(12):
        assert staff_client.get(f"/fleet/nodes/{node.pk}/").status_code == 200


@pytest.mark.django_db
def test_missing_node_is_404(staff_client):
    assert staff_client.get("/fleet/nodes/999999/").status_code == 404


# --- actions ------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_cordon_through_htmx_changes_state_writes_audit_and_returns_the_state_card(
    staff_client, staff, fleet
):
    node = fleet.nodes(1)[0]
    response = staff_client.post(f"/fleet/nodes/{node.pk}/actions/cordon/", {"reason": "fan noise"}, **HTMX)
    assert response.status_code == 200
    body = html(response)
    assert body.startswith('<section class="card" id="node-state"')
    assert f'data-node-state="{node.pk}">Cordoned</span>' in body and "was cordoned" in body
    assert "/actions/uncordon/" in body and "/actions/cordon/" not in body
    node.refresh_from_db()
    assert node.state == NodeState.CORDONED and node.state_reason == "fan noise"
    audit = AuditEvent.objects.get(action="node.cordon")
    assert audit.actor_user == staff and audit.target_id == str(node.pk)
    assert audit.data == {"from": "ready", "to": "cordoned", "reason": "fan noise"}


@pytest.mark.django_db
def test_drain_enqueues_a_drain_command_and_uncordon_returns_the_node(staff_client, fleet):
    node = fleet.nodes(1)[0]
    response = staff_client.post(f"/fleet/nodes/{node.pk}/actions/drain/", {"reason": ""})
    assert response.status_code == 302 and response["Location"] == f"/fleet/nodes/{node.pk}/"
    node.refresh_from_db()
    assert node.state == NodeState.DRAINING
    assert NodeCommand.objects.filter(node=node, kind="drain").count() == 1
    assert staff_client.post(f"/fleet/nodes/{node.pk}/actions/uncordon/", **HTMX).status_code == 200
    node.refresh_from_db()
    assert node.state == NodeState.READY
    assert list(staff_actions().order_by("id").values_list("action", flat=True)) == [
        "node.drain",
        "node.uncordon",
    ]


@pytest.mark.django_db
def test_maintenance_needs_a_reason_and_a_refusal_writes_nothing(staff_client, fleet):
    node = fleet.nodes(1)[0]
    response = staff_client.post(f"/fleet/nodes/{node.pk}/actions/maintenance/", {"reason": "  "}, **HTMX)
    assert response.status_code == 400
    body = html(response)
    assert 'aria-invalid="true"' in body and "Say why the node goes into maintenance." in body
    node.refresh_from_db()
    assert node.state == NodeState.READY
    assert not staff_actions().exists()

    too_long = staff_client.post(
        f"/fleet/nodes/{node.pk}/actions/maintenance/", {"reason": "x" * 300}, **HTMX
    )
    assert too_long.status_code == 400 and "at most 255 characters" in html(too_long)
    # without htmx the whole page comes back with the error in the actions card
    page = staff_client.post(f"/fleet/nodes/{node.pk}/actions/maintenance/", {"reason": ""})
    assert page.status_code == 400 and "<html" in html(page) and "Say why the node goes" in html(page)

    ok = staff_client.post(f"/fleet/nodes/{node.pk}/actions/maintenance/", {"reason": "PSU swap"}, **HTMX)
    assert ok.status_code == 200
    node.refresh_from_db()
    assert node.state == NodeState.MAINTENANCE and node.state_reason == "PSU swap"
    assert staff_actions().get().action == "node.maintenance"


@pytest.mark.django_db
def test_an_action_the_state_does_not_allow_is_409_and_changes_nothing(staff_client, fleet):
    node = fleet.nodes(1, state=NodeState.DOWN)[0]
    response = staff_client.post(f"/fleet/nodes/{node.pk}/actions/drain/", {"reason": "x"}, **HTMX)
    assert response.status_code == 409
    assert 'role="alert"' in html(response) and "A down node cannot be drained." in html(response)
    node.refresh_from_db()
    assert node.state == NodeState.DOWN
    assert not staff_actions().exists() and not NodeCommand.objects.exists()
    assert staff_client.post(f"/fleet/nodes/{node.pk}/actions/explode/", **HTMX).status_code == 404
    assert staff_client.get(f"/fleet/nodes/{node.pk}/actions/cordon/").status_code == 405


@pytest.mark.django_db
def test_return_gpu_to_service(staff_client, staff, fleet):
    node = fleet.nodes(1, gpus=2)[0]
    g0, g1 = node.gpus.order_by("index")
    Gpu.objects.filter(pk=g0.pk).update(health=GpuHealth.UNHEALTHY, isolated=True, health_reason="XID 79")

    response = staff_client.post(f"/fleet/gpus/{g0.pk}/return/", {"reason": "reseated"}, **HTMX)
    assert response.status_code == 200
    body = html(response)
    assert body.startswith(f'<tr id="gpu-{g0.pk}"') and "back in service" in body and "Healthy" in body
    g0.refresh_from_db()
    assert (g0.health, g0.isolated, g0.health_reason) == (GpuHealth.HEALTHY, False, "")
    audit = AuditEvent.objects.get(action="gpu.return_to_service")
    assert audit.actor_user == staff and audit.data["reason"] == "reseated"

    healthy = staff_client.post(f"/fleet/gpus/{g1.pk}/return/", {"reason": "why not"}, **HTMX)
    assert healthy.status_code == 409 and "already in service" in html(healthy)
    assert staff_actions().count() == 1
    assert staff_client.post("/fleet/gpus/999999/return/", **HTMX).status_code == 404


# --- live ---------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_snapshot_event_content(fleet):
    ready = fleet.nodes(2, gpus=2, util=87.4)
    down = fleet.nodes(1, region="eu-west-1", gpus=1, state=NodeState.DOWN, util=None)[0]
    cordoned = fleet.nodes(1, region="eu-west-1", gpus=1, state=NodeState.CORDONED, util=12.0)[0]
    bad = ready[0].gpus.get(index=1)
    Gpu.objects.filter(pk=bad.pk).update(health=GpuHealth.UNHEALTHY, isolated=True)
    now = timezone.now()
    FleetAlert.objects.create(
        kind=FleetAlert.Kind.MASS_SILENCE, message="silent", opened_at=now, last_seen_at=now
    )

    event = fleet_snapshot()
    assert event["type"] == "fleet.snapshot" and event["v"] == 1 and abs(event["ts"] - now.timestamp()) < 5
    assert event["nodes"]["total"] == 4
    assert event["nodes"]["by_state"]["ready"] == 2 and event["nodes"]["by_state"]["down"] == 1
    assert event["nodes"]["by_region"] == {"us-east-1": {"ready": 2}, "eu-west-1": {"down": 1, "cordoned": 1}}
    assert event["not_ready"] == {"down": [down.pk], "cordoned": [cordoned.pk]}
    assert event["gpus"] == {
        "total": 6, "healthy": 5, "unhealthy": 1, "isolated": 1, "util_avg": round((87.4 * 4 + 12) / 5, 1),
    }  # fmt: skip
    rows = {r[0]: r for r in event["g"]}
    assert len(rows) == 6
    assert rows[ready[0].gpus.get(index=0).pk] == [ready[0].gpus.get(index=0).pk, 87, 40.0, 400, 65]
    assert rows[down.gpus.get().pk][1:] == [None, None, None, None]
    assert event["alerts"] == [
        {"id": FleetAlert.objects.get().pk, "kind": "mass_silence", "message": "silent"}
    ]
    assert event["unknown_gpus"] == 0
    # compact: about 25 bytes a GPU
    fleet.nodes(200, region="ap-northeast-1", gpus=8, util=55.5)
    size = len(json.dumps(fleet_snapshot(), separators=(",", ":")))
    assert size < 1700 * 30, size


def _session_cookie(user) -> bytes:
    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()


def _socket(cookie: bytes) -> WebsocketCommunicator:
    from portal.asgi import application

    headers = [(b"origin", b"http://testserver"), (b"host", b"testserver"), (b"cookie", cookie)]
    return WebsocketCommunicator(application, "/ws/events/", headers=headers)


@pytest.mark.django_db(transaction=True)
def test_snapshot_task_and_state_changes_reach_staff_sockets_only(make_tenant, fleet):
    tenant = make_tenant("alpha")
    member = Membership.objects.get(tenant=tenant).user
    staff = User.objects.create_user(email="ops@gpupool.test", password="x", is_staff=True)
    node = fleet.nodes(2, gpus=2, util=70.0)[0]
    staff_cookie, member_cookie = _session_cookie(staff), _session_cookie(member)
    run_task = database_sync_to_async(tasks.publish_fleet_snapshot)
    cordon = database_sync_to_async(lambda: node_cordon(node=node, actor=Actor(user=staff), reason="noisy"))

    async def scenario():
        sock_staff, sock_member = _socket(staff_cookie), _socket(member_cookie)
        assert (await sock_staff.connect())[0] and (await sock_member.connect())[0]
        assert await run_task() == 4
        event = await sock_staff.receive_json_from(timeout=5)
        assert event["type"] == "fleet.snapshot" and len(event["g"]) == 4
        assert event["nodes"]["by_state"]["ready"] == 2
        await cordon()
        event = await sock_staff.receive_json_from(timeout=5)
        assert event == {
            "type": "node.state", "node": node.pk, "hostname": node.hostname, "state": "cordoned",
            "label": "Cordoned", "reason": "noisy",
        }  # fmt: skip
        assert await sock_member.receive_nothing(timeout=0.5)
        await sock_staff.disconnect()
        await sock_member.disconnect()

    async_to_sync(scenario)()


def test_the_snapshot_is_on_the_beat_schedule():
    entry = settings.CELERY_BEAT_SCHEDULE["nodes-publish-fleet-snapshot"]
    assert entry["task"] == "nodes.tasks.publish_fleet_snapshot"
    assert entry["schedule"].total_seconds() == settings.FLEET_SNAPSHOT_INTERVAL_S <= 10
    assert tasks.publish_fleet_snapshot.name == entry["task"]
