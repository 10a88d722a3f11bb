"""``GET /api/v1/{jobs|instances}/{id}/metrics/``: per GPU, per minute, only while the workload held
the GPU; a share's GPU gives only what is attributed to the workload."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import GpuMinuteRollup, GpuSample
from portal.actors import Actor
from portal.models import Scope
from scheduling.models import Allocation, WorkloadState
from scheduling.services.lifecycle import workload_stop
from scheduling.services.states import workload_transition
from tests.scheduling.conftest import reload

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(tenant, make_token, api):
    return api(make_token(tenant, scopes=[Scope.READ]))


def rollup(gpu, minute, util):
    return GpuMinuteRollup(
        gpu=gpu, minute=minute, sample_count=2, util_sum=2 * util, util_count=2, util_max=util,
        mem_used_sum=2048, mem_used_count=2, mem_used_max=1024, power_sum=601.0, power_count=2, temp_max=61,
    )  # fmt: skip


def test_whole_gpus_give_their_minutes_inside_the_allocation_only(client, tenant, make_node, submit, cycle):
    node = make_node(gpus=2)
    w = submit(tenant, kind="job", gpu_count=1)
    cycle()
    alloc = Allocation.objects.get(workload=w)
    start = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=10, seconds=-30)
    Allocation.objects.filter(pk=alloc.pk).update(started_at=start)
    mine = alloc.gpu
    neighbour = node.gpus.exclude(pk=mine.pk).get()
    first = start.replace(second=0) + timedelta(minutes=1)  # the first whole minute it held the GPU
    GpuMinuteRollup.objects.bulk_create(
        [rollup(g, first + timedelta(minutes=m), 10.0 + m) for m in range(-5, 10) for g in (mine, neighbour)]
    )
    r = client.get(f"/api/v1/jobs/{w.pk}/metrics/")
    assert r.status_code == 200, r.content
    body = r.json()
    assert [g["gpu"] for g in body["gpus"]] == [mine.uuid]
    gpu = body["gpus"][0]
    assert (gpu["node"], gpu["index"], gpu["shared"]) == (node.hostname, mine.index, False)
    assert gpu["held"][0]["end"] is None
    utils = [p["util_pct"] for p in gpu["minutes"]]
    assert utils == [10.0 + m for m in range(9)]  # not the 5 minutes before, not the minute in progress
    assert gpu["minutes"][0] == {
        "minute": first.isoformat().replace("+00:00", "Z"), "util_pct": 10.0, "mem_used_mib": 1024,
        "power_w": 300.5, "temp_c": 61,
    }  # fmt: skip
    # A window: since/until cut it.
    since = (first + timedelta(minutes=2)).isoformat()
    until = (first + timedelta(minutes=4)).isoformat()
    r = client.get(f"/api/v1/jobs/{w.pk}/metrics/", {"since": since, "until": until})
    assert [p["util_pct"] for p in r.json()["gpus"][0]["minutes"]] == [12.0, 13.0]
    # Ended: nothing after the allocation's end.
    workload_stop(workload=reload(w), actor=Actor.system())
    workload_transition(workload=reload(w), to=WorkloadState.STOPPED, reason="exited", actor=Actor.system())
    end = Allocation.objects.get(workload=w).ended_at
    GpuMinuteRollup.objects.filter(gpu=mine, minute__gte=end.replace(second=0)).delete()
    GpuMinuteRollup.objects.create(gpu=mine, minute=end.replace(second=0) + timedelta(minutes=1), sample_count=1,
                                   util_sum=99, util_count=1)  # fmt: skip
    body = client.get(f"/api/v1/jobs/{w.pk}/metrics/").json()
    assert body["gpus"][0]["held"][0]["end"] is not None
    assert 99.0 not in [p["util_pct"] for p in body["gpus"][0]["minutes"]]


def test_a_share_gives_its_own_memory_and_the_gpus_temperature(client, tenant, make_node, submit, cycle):
    make_node(gpus=1)
    w = submit(tenant, kind="instance", gpu_count=1, gpu_fraction_milli=500)
    other = submit(tenant, kind="instance", gpu_count=1, gpu_fraction_milli=500)
    cycle()
    alloc = Allocation.objects.get(workload=w)
    start = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=3)
    Allocation.objects.filter(pk=alloc.pk).update(started_at=start)
    gpu = alloc.gpu
    GpuMinuteRollup.objects.create(gpu=gpu, minute=start, sample_count=1, util_sum=90, util_count=1,
                                   power_sum=500, power_count=1, temp_max=70)  # fmt: skip
    procs = [
        {"pid": 1, "used_mib": 3000, "workload_id": str(w.pk)},
        {"pid": 2, "used_mib": 500, "workload_id": str(w.pk)},
        {"pid": 3, "used_mib": 9000, "workload_id": str(other.pk)},
    ]
    GpuSample.objects.bulk_create(
        [
            GpuSample(gpu=gpu, ts=start + timedelta(seconds=10), util_pct=90, power_w=500, temp_c=70, processes=procs),
            GpuSample(gpu=gpu, ts=start + timedelta(seconds=40), util_pct=90, power_w=500, temp_c=72,
                      processes=procs[:1]),
            GpuSample(gpu=gpu, ts=start + timedelta(minutes=1, seconds=5), temp_c=65, processes=None),
            GpuSample(gpu=gpu, ts=start - timedelta(seconds=5), temp_c=99, processes=procs),  # before it held it
        ]
    )  # fmt: skip
    r = client.get(f"/api/v1/instances/{w.pk}/metrics/")
    assert r.status_code == 200, r.content
    (series,) = r.json()["gpus"]
    assert series["shared"] is True
    first, second = series["minutes"][:2]
    # Its own processes only (3500 then 3000: 3250 on average), no utilisation or power (the GPU's).
    assert (first["mem_used_mib"], first["util_pct"], first["power_w"], first["temp_c"]) == (
        3250,
        None,
        None,
        72,
    )
    # A reading that listed no processes: memory unknown, not 0.
    assert (second["mem_used_mib"], second["temp_c"]) == (None, 65)


def test_bad_windows_and_other_tenants(client, tenant, make_tenant, make_node, submit, cycle):
    make_node(gpus=1)
    w = submit(tenant, kind="job", gpu_count=1)
    url = f"/api/v1/jobs/{w.pk}/metrics/"
    assert client.get(url).json()["gpus"] == []  # not placed yet
    now = timezone.now()
    for params, field in [
        ({"since": "yesterday"}, "since"),
        ({"since": "0001-01-01T00:00:00+23:59"}, "since"),
        ({"since": now.isoformat(), "until": (now - timedelta(hours=1)).isoformat()}, "since"),
        ({"since": (now - timedelta(days=2)).isoformat(), "until": now.isoformat()}, "until"),
    ]:
        r = client.get(url, params)
        assert r.status_code == 400, (params, r.content)
        assert field in r.json()["error"]["fields"], r.json()
    # Another tenant's workload: 404, as for its detail; an instance is not a job.
    theirs = submit(make_tenant("bravo"), kind="job", gpu_count=1)
    assert client.get(f"/api/v1/jobs/{theirs.pk}/metrics/").status_code == 404
    assert client.get(f"/api/v1/jobs/{theirs.pk}/metrics/", {"since": "bad"}).status_code == 404
    assert client.get(f"/api/v1/instances/{w.pk}/metrics/").status_code == 404
    # since alone: the window runs at most the maximum from it.
    since = now - timedelta(days=3)
    body = client.get(url, {"since": since.isoformat()}).json()
    assert body["until"] == (since + timedelta(days=1)).isoformat().replace("+00:00", "Z")
