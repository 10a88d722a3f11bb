"""The workloads list and a workload's page: tenant scoping, filters and pagination, the detail's
pending reason, timeline, placement and telemetry (inside the allocation only), stop and restart,
the dashboard panel, and query counts and server time with 100 workloads per page."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import GpuMinuteRollup, GpuSample
from portal.actors import Actor
from portal.models import Role
from scheduling.models import Allocation, Workload, WorkloadState
from scheduling.services.lifecycle import workload_on_running
from scheduling.services.states import workload_transition
from tests.portal.conftest import HTMX, add_member, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import H100, reload
from tests.ssh_keys import public_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(signed_in, owner, tenant):  # noqa: F811
    return signed_in(owner, tenant)


@pytest.fixture
def other(make_tenant, submit, make_node):
    """Another tenant with a workload of its own."""
    make_node()
    b = make_tenant("bravo")
    return submit(b, kind="instance", name="bravo-secret-notebook")


def rows(html: str) -> int:
    return html.count('<tr id="workload-')


def fastest(client, url: str, data=None, tries: int = 3, **headers) -> float:
    """The best of a few runs, in seconds: the machine is shared, the page's own time is the least."""
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        assert client.get(url, data or {}, **headers).status_code == 200
        times.append(time.perf_counter() - start)
    return min(times)


def test_another_tenants_workload_does_not_exist(client, other):
    pk = other.pk
    for url in (f"/workloads/{pk}/", f"/workloads/{pk}/live/", f"/workloads/{pk}/telemetry/"):
        assert client.get(url).status_code == 404, url
        assert client.get(url, **HTMX).status_code == 404, url
    for url in (f"/workloads/{pk}/stop/", f"/workloads/{pk}/restart/"):
        assert client.post(url).status_code == 404, url
        assert client.post(url, **HTMX).status_code == 404, url
    assert reload(other).state == WorkloadState.PENDING and Workload.objects.count() == 1
    assert "bravo-secret-notebook" not in client.get("/workloads/").content.decode()
    assert "bravo-secret-notebook" not in client.get("/workloads/", {"q": str(pk)}).content.decode()
    assert "bravo-secret-notebook" not in client.get("/panels/workloads/", **HTMX).content.decode()


def test_the_list_filters_searches_and_paginates(client, tenant, make_node, submit, cycle):
    make_node(gpus=8)
    for i in range(3):
        submit(tenant, kind="instance", name=f"nb-{i}", gpu_count=1)
    jobs = [submit(tenant, name=f"train-{i}", gpu_count=8) for i in range(2)]
    cycle()  # the three instances fit on the node, then only one 8-GPU job could wait for it
    html = client.get("/workloads/").content.decode()
    assert rows(html) == 5 and "Page 1 of 1" not in html
    assert 'class="btn btn-primary" href="/launch/"' in html
    assert rows(client.get("/workloads/", {"kind": "job"}).content.decode()) == 2
    assert rows(client.get("/workloads/", {"state": "waiting"}).content.decode()) == 2
    assert rows(client.get("/workloads/", {"state": "holding"}).content.decode()) == 3
    assert rows(client.get("/workloads/", {"q": "train-1"}).content.decode()) == 1
    assert rows(client.get("/workloads/", {"q": f"#{jobs[0].pk}"}).content.decode()) == 1
    assert rows(client.get("/workloads/", {"region": "eu-west-1"}).content.decode()) == 0
    r = client.get("/workloads/", {"state": "bogus"})
    assert r.status_code == 400 and "State:" in r.content.decode()
    # the htmx filter form gets the rows alone
    part = client.get("/workloads/", {"kind": "instance"}, **HTMX).content.decode()
    assert part.startswith('<div id="workload-rows"') and rows(part) == 3
    # empty states say what to do next
    assert "Clear the filters" in client.get("/workloads/", {"q": "nothing-like-this"}).content.decode()


def test_pagination_with_many_workloads(client, tenant):
    now = timezone.now()
    Workload.objects.bulk_create(
        Workload(tenant=tenant, kind="job", name=f"w{i}", image="x:1", command=["true"], submitted_at=now)
        for i in range(230)
    )
    html = client.get("/workloads/").content.decode()
    assert rows(html) == 50 and "1\u201350 of 230" in html and "Page 1 of 5" in html
    html = client.get("/workloads/", {"per_page": "100", "page": "3"}).content.decode()
    assert rows(html) == 30 and "201\u2013230 of 230" in html and 'rel="prev"' in html


def test_the_list_with_100_workloads_per_page_is_fast(
    client, tenant, make_node, django_assert_max_num_queries
):
    make_node()
    now = timezone.now()
    Workload.objects.bulk_create(
        Workload(
            tenant=tenant,
            kind="instance",
            name=f"w{i}",
            image="x:1",
            submitted_at=now - timedelta(days=i % 30),
        )
        for i in range(3000)
    )
    client.get("/workloads/")  # warm up templates
    with django_assert_max_num_queries(12):
        r = client.get("/workloads/", {"per_page": "100", "state": "active"})
    assert r.status_code == 200 and rows(r.content.decode()) == 100
    assert fastest(client, "/workloads/", {"per_page": "100", "state": "active"}) < 0.3


def test_a_waiting_workload_says_why_and_when(client, tenant, make_node, submit, cycle):
    make_node(gpus=2)
    blocker = submit(tenant, kind="instance", gpu_count=2, name="blocker")
    w = submit(tenant, gpu_count=2, name="waits", estimated_runtime_s=600)
    cycle()
    w = reload(w)
    assert w.state in (WorkloadState.QUEUED, WorkloadState.PENDING) and w.pending_message
    html = client.get(f"/workloads/{w.pk}/").content.decode()
    assert "Why it waits:" in html and w.pending_message in html
    assert f'data-workload-state="{w.pk}"' in html and "Charts appear once it is placed" in html
    assert 'data-event="pending"' in html  # the timeline
    assert 'data-event="queued"' in html
    assert reload(blocker).state == WorkloadState.SCHEDULED
    html = client.get(f"/workloads/{blocker.pk}/").content.decode()
    assert "Connection" in html and 'data-stage="scheduled"' in html and 'aria-current="step"' in html


def test_charts_show_the_workloads_gpus_only_while_it_held_them(client, tenant, make_node, submit, cycle):
    node = make_node(gpus=2)
    w = submit(tenant, kind="instance", gpu_count=1)
    cycle()
    alloc = Allocation.objects.get(workload=w)
    start = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=10)
    Allocation.objects.filter(pk=alloc.pk).update(started_at=start)
    gpus = list(node.gpus.order_by("index"))
    mine, neighbour = alloc.gpu, next(g for g in gpus if g.pk != alloc.gpu_id)
    rollups = []
    for back in range(20, 0, -1):  # 20 minutes: 10 before the allocation and 10 while it held the GPU
        for g in (mine, neighbour):
            u = 10.0 * (g.index + 1) + back
            rollups.append(GpuMinuteRollup(gpu=g, minute=start + timedelta(minutes=10 - back), sample_count=1,
                util_sum=u, util_count=1, util_max=u, mem_used_sum=1024, mem_used_count=1,
                mem_used_max=1024, power_sum=300, power_count=1, temp_max=60))  # fmt: skip
    GpuMinuteRollup.objects.bulk_create(rollups)
    GpuSample.objects.create(
        gpu=mine, ts=timezone.now(), util_pct=77.0, mem_used_mib=2048, power_w=400, temp_c=70
    )
    data = client.get(f"/workloads/{w.pk}/telemetry/").json()
    assert [g["id"] for g in data["gpus"]] == [mine.pk] and data["holding"] is True
    assert data["gpus"][0]["label"] == f"{node.hostname} · GPU {mine.index}"
    minutes = [x for x in data["x"] if x % 60 == 0]
    assert min(data["x"]) >= int(start.timestamp()) and len(minutes) >= 9
    assert 77.0 in data["util"][0]
    html = client.get(f"/workloads/{w.pk}/").content.decode()
    assert 'id="workload-telemetry"' in html and 'data-chart="util"' in html
    # stopped: the window ends with the allocation, nothing after it
    client.post(f"/workloads/{w.pk}/stop/")
    assert reload(w).state == WorkloadState.STOPPING
    workload_transition(workload=reload(w), to=WorkloadState.STOPPED, reason="exited", actor=Actor.system())
    end = Allocation.objects.get(workload=w).ended_at
    later = end.replace(second=0, microsecond=0) + timedelta(minutes=2)
    GpuMinuteRollup.objects.create(
        gpu=mine, minute=later, sample_count=1, util_sum=99, util_count=1, util_max=99
    )
    GpuSample.objects.create(gpu=mine, ts=end + timedelta(seconds=1), util_pct=98.0)
    data = client.get(f"/workloads/{w.pk}/telemetry/").json()
    assert data["holding"] is False and data["x"] and max(data["x"]) <= int(end.timestamp())
    assert 99.0 not in data["util"][0] and 98.0 not in data["util"][0] and 77.0 in data["util"][0]


def test_stop_and_restart(client, tenant, make_node, submit, cycle):
    make_node(gpus=2)
    w = submit(tenant, kind="instance", name="nb", ssh_public_key=public_key(comment="me@x"), ports=[8888])
    r = client.post(f"/workloads/{w.pk}/stop/", **HTMX)
    html = r.content.decode()
    assert r.status_code == 200 and html.startswith('<div id="workload-live"') and "Stopped." in html
    assert reload(w).state == WorkloadState.STOPPED
    # again: a conflict, said in the card
    r = client.post(f"/workloads/{w.pk}/stop/", **HTMX)
    assert r.status_code == 409 and "already stopped" in r.content.decode()
    # restart: a copy through the submission service
    r = client.post(f"/workloads/{w.pk}/restart/", **HTMX)
    new = Workload.objects.exclude(pk=w.pk).get()
    assert r.status_code == 204 and r["HX-Redirect"] == f"/workloads/{new.pk}/"
    ports = [{"port": 8888, "protocol": "http"}]
    assert (new.kind, new.name, new.ports, new.ssh_public_key) == ("instance", "nb", ports, w.ssh_public_key)
    assert [m.name for m in new.gpu_models.all()] == [H100] and new.state == WorkloadState.PENDING
    # a running one: told to stop, placed ones stop when the agent reports
    cycle()
    workload_on_running(node_id=Allocation.objects.get(workload=new).node_id, workload_id=str(new.pk))
    assert reload(new).state == WorkloadState.RUNNING
    html = client.get(f"/workloads/{new.pk}/").content.decode()
    # the node's agent serves no SSH endpoint: the page says so rather than show a command
    assert "serves no SSH endpoint" in html and "data-connect" not in html and "8888" in html
    r = client.post(f"/workloads/{new.pk}/restart/")
    assert r.status_code == 302 and Workload.objects.count() == 2  # not finished: no copy
    r = client.post(f"/workloads/{new.pk}/stop/")
    assert r.status_code == 302 and reload(new).state == WorkloadState.STOPPING


def test_a_viewer_sees_workloads_but_cannot_stop_them(signed_in, add_member, tenant, make_node, submit):  # noqa: F811
    make_node()
    w = submit(tenant, kind="instance")
    viewer = signed_in(add_member(tenant, Role.VIEWER).user, tenant)
    html = viewer.get(f"/workloads/{w.pk}/").content.decode()
    assert "Status" in html and ">Stop</button>" not in html
    assert viewer.post(f"/workloads/{w.pk}/stop/").status_code == 403
    assert reload(w).state == WorkloadState.PENDING
    assert 'class="btn btn-primary" href="/launch/"' not in viewer.get("/workloads/").content.decode()


def test_a_job_shows_its_log_tail(client, tenant, make_node, submit):
    make_node()
    w = submit(tenant, name="train")
    Workload.objects.filter(pk=w.pk).update(log_tail="epoch 3/3 loss=0.12\n<done>", exit_code=0)
    html = client.get(f"/workloads/{w.pk}/").content.decode()
    assert "epoch 3/3 loss=0.12\n&lt;done&gt;" in html and f"/api/v1/jobs/{w.pk}/logs/" in html


def test_the_output_view_and_its_download(client, tenant, make_node, submit, cycle, make_tenant):
    from nodes.models import Node
    from scheduling.models import WorkloadLogLine

    make_node(gpus=1)
    w = submit(tenant, name="train")
    cycle()
    html = client.get(f"/workloads/{w.pk}/").content.decode()
    assert f'data-log-view data-log-url="/api/v1/jobs/{w.pk}/logs/"' in html
    assert "js/logs.js" in html and "kept 7 days" in html
    assert Node.objects.exists()
    now = timezone.now()
    WorkloadLogLine.objects.bulk_create(
        [
            WorkloadLogLine(workload=w, at=now, stream="stdout", text="epoch 1 <b>"),
            WorkloadLogLine(workload=w, at=now, stream="stderr", text="warn"),
        ]
    )
    response = client.get(f"/workloads/{w.pk}/logs.txt")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    assert response["Content-Disposition"] == f'attachment; filename="job-{w.pk}.log"'
    body = b"".join(response.streaming_content).decode()
    assert body.splitlines() == [f"{now.isoformat()} stdout epoch 1 <b>", f"{now.isoformat()} stderr warn"]
    # Another tenant's member: 404.
    other = make_tenant("other-logs")
    from portal.models import Membership

    outsider = Membership.objects.get(tenant=other).user
    client.force_login(outsider)
    assert client.get(f"/workloads/{w.pk}/logs.txt").status_code == 404


def test_the_dashboard_panel(client, tenant, make_node, submit, cycle):
    assert "Nothing running or waiting." in client.get("/panels/workloads/", **HTMX).content.decode()
    make_node(gpus=1)
    submit(tenant, kind="instance", name="one")
    submit(tenant, kind="instance", name="two")
    cycle()
    html = client.get("/panels/workloads/", **HTMX).content.decode()
    assert html.count("data-workload-state=") == 2 and "one" in html and "two" in html


def test_detail_and_live_pages_take_a_fixed_number_of_queries(
    client, tenant, make_node, submit, cycle, django_assert_max_num_queries
):
    make_node(gpus=8)
    w = submit(tenant, kind="instance", gpu_count=4)
    cycle()
    for _ in range(30):
        Workload.objects.filter(pk=w.pk).update(state_reason="x")
    workload_transition(workload=reload(w), to=WorkloadState.RUNNING, reason="started", actor=Actor.system())
    with django_assert_max_num_queries(15):  # 14, and one for its volumes' card
        assert client.get(f"/workloads/{w.pk}/").status_code == 200
    with django_assert_max_num_queries(8):
        assert client.get(f"/workloads/{w.pk}/live/", **HTMX).status_code == 200
    with django_assert_max_num_queries(10):
        assert client.get(f"/workloads/{w.pk}/telemetry/").status_code == 200
    assert fastest(client, f"/workloads/{w.pk}/") < 0.3


def test_times_show_in_the_persons_time_zone(signed_in, owner, tenant, make_node, submit):  # noqa: F811
    from datetime import UTC, datetime

    make_node()
    w = submit(tenant, name="tz")
    Workload.objects.filter(pk=w.pk).update(submitted_at=datetime(2026, 1, 15, 23, 30, tzinfo=UTC))
    owner.time_zone = "Asia/Tokyo"
    owner.save()
    html = signed_in(owner, tenant).get(f"/workloads/{w.pk}/").content.decode()
    assert "Jan 16, 2026 08:30 JST" in html  # stored in UTC, shown in Tokyo time
    rows_html = signed_in(owner, tenant).get("/workloads/").content.decode()
    assert 'datetime="2026-01-16T08:30:00+09:00">Jan 16, 08:30</time>' in rows_html


def test_a_share_of_a_gpu_shows_no_gpu_charts(client, tenant, make_node, submit, cycle):
    """A share's GPU also runs other work (other tenants' too): its charts would show their use."""
    make_node(gpus=1)
    w = submit(tenant, kind="instance", gpu_count=1, gpu_fraction_milli=500)
    cycle()
    assert Allocation.objects.filter(workload=w).exists()
    assert client.get(f"/workloads/{w.pk}/telemetry/").json() == {"x": [], "gpus": []}
    html = client.get(f"/workloads/{w.pk}/").content.decode()
    assert 'id="workload-telemetry"' not in html
    assert "It shares its GPU with other work" in html
