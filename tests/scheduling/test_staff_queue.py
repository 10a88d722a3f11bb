"""The staff queue view: pending demand by GPU model and region, the reasons it waits, and the
fair-share standing per tenant (the engine's own FairShare), staff only, refreshed by htmx."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.actors import Actor
from portal.models import User
from scheduling.models import WAITING_STATES, Workload
from scheduling.selectors.staff_queue import queue_overview
from scheduling.services.quotas import quota_update
from tests.portal.conftest import HTMX, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import A100, H100

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(db) -> Client:
    c = Client()
    c.force_login(
        User.objects.create_user(email="ops@gpupool.test", password="pw-for-tests-1", is_staff=True)
    )
    return c


@pytest.fixture
def queue(tenant, make_tenant, make_node, submit, cycle):
    """Two H100 nodes (16 GPUs, no CPU or RAM asked): acme holds 12, bravo 4 (weight 2). Waiting:
    acme 2x 8 H100 (us), bravo 1x 4 H100 in eu and one A100-or-H100 job; charlie nothing."""
    make_node(H100, gpus=8, cpu_cores=96, ram_mib=1024 * 1024)
    make_node(H100, gpus=8, cpu_cores=96, ram_mib=1024 * 1024)
    bravo = make_tenant("bravo")
    make_tenant("charlie")
    quota_update(tenant=bravo, changes={"fair_share_weight": "2"}, actor=Actor.system())
    submit(tenant, gpu_count=8)
    submit(tenant, gpu_count=4)
    submit(bravo, gpu_count=4)
    cycle()
    make_node(H100, gpus=8, region="eu", state="cordoned")
    make_node(A100, gpus=8, state="cordoned")
    submit(tenant, gpu_count=8, region="us-east-1", other_regions_ok=False)
    submit(tenant, gpu_count=8, region="us-east-1", other_regions_ok=False)
    submit(bravo, gpu_count=4, region="eu-west-1", other_regions_ok=False)
    submit(bravo, gpu_count=1, gpu_models=[A100, H100])
    cycle()
    Workload.objects.filter(state__in=WAITING_STATES, tenant=bravo, gpu_count=1).update(
        submitted_at=timezone.now() - timedelta(hours=3)
    )
    return {"acme": tenant, "bravo": bravo}


def test_only_staff_see_the_queue(client, signed_in, owner, tenant, staff_client):  # noqa: F811
    r = client.get("/staff/queue/")
    assert r.status_code == 302 and r["Location"].startswith("/login/")
    assert signed_in(owner, tenant).get("/staff/queue/").status_code == 403
    page = staff_client.get("/staff/queue/").content.decode()
    assert re.search(r'<a href="/staff/queue/" class="nav-link active"', page)
    assert "Nothing is waiting" in page


def test_demand_reasons_and_fair_share_equal_the_data(staff_client, queue):
    acme, bravo = queue["acme"], queue["bravo"]
    waiting = list(Workload.objects.filter(state__in=WAITING_STATES))
    assert len(waiting) == 4
    html = staff_client.get("/staff/queue/").content.decode()
    assert re.search(r'data-count="waiting">4<', html) and re.search(r'data-count="waiting-gpus">21<', html)

    def demand(models, region):
        m = re.search(
            rf'data-demand="{re.escape(models)}\|{region}">.*?data-n>(\d+)</td><td class="num" data-gpus>([\d.]+)<',
            html,
            re.S,
        )
        assert m, (models, region)
        return int(m.group(1)), m.group(2)

    assert demand(H100, "us-east-1") == (2, "16")
    assert demand(H100, "eu-west-1") == (1, "4")
    assert demand(f"{A100} / {H100}", "any") == (1, "1")
    # reasons: counted from the rows the API reads
    expected: dict[str, int] = {}
    for w in waiting:
        expected[w.pending_reason or "queued"] = expected.get(w.pending_reason or "queued", 0) + 1
    for reason, n in expected.items():
        assert re.search(rf'data-reason="{re.escape(reason)}">.*?data-n>{n}<', html, re.S), reason
    # fair share: GPU share 12/16 for acme; bravo 4/16 divided by its weight 2
    ov = queue_overview()
    by = {s.slug: s for s in ov.standings}
    assert by["acme"].share == pytest.approx(0.75) and by["acme"].gpus_held == 12
    assert by["bravo"].share == pytest.approx(0.125) and by["bravo"].dominant == pytest.approx(0.25)
    assert (by["bravo"].rank, by["acme"].rank) == (1, 2)
    assert (by["acme"].pending, by["bravo"].pending) == (2, 2)
    assert "charlie" not in by
    row = re.search(r'data-tenant="bravo">(.*?)</tr>', html, re.S).group(1)
    assert "data-share>0.1250<" in row and "data-weight>2.00<" in row and "data-pending>2<" in row
    assert acme.pk != bravo.pk


def test_the_standing_is_the_engines_own(queue):
    """The same numbers as the scheduling cycle's FairShare over its own snapshot."""
    from django.db import transaction
    from django.utils import timezone as tz

    from scheduling.engine.queueing import FairShare
    from scheduling.services.snapshot import cycle_snapshot_load

    with transaction.atomic():
        snapshot, _, _ = cycle_snapshot_load(tz.now())
    fair = FairShare(snapshot.nodes, snapshot.models, snapshot.running, snapshot.tenant_weights)
    for s in queue_overview().standings:
        assert s.share == pytest.approx(fair.share(str(s.tenant_id)))


def test_htmx_refresh_gets_the_body_every_10_s_and_queries_are_bounded(
    staff_client, queue, make_tenant, submit
):
    r = staff_client.get("/staff/queue/", **HTMX)
    body = r.content.decode()
    assert r.status_code == 200 and "<html" not in body
    assert 'id="queue-body"' in body and 'hx-trigger="every 10s"' in body

    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert staff_client.get("/staff/queue/").status_code == 200
        return len(ctx.captured_queries)

    few = count()
    for i in range(5):
        t = make_tenant(f"more{i}")
        submit(t, gpu_count=2)
        submit(t, gpu_count=1, gpu_models=[A100])
    assert count() == few
