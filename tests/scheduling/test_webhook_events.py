"""Scheduling's events reach webhook endpoints: state changes, preemption notices, gang completion
and full volumes become recorded events with a delivery per endpoint that wants them, in the
transaction of the change (delivery itself: tests/webhooks/test_delivery_worker.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from nodes.services.heartbeat_parse import VolumeReport
from portal.actors import Actor
from scheduling.models import Volume
from scheduling.models import WorkloadState as S
from scheduling.services.lifecycle import workload_preempt, workload_stop
from scheduling.services.volumes import volumes_on_measured
from tests.scheduling.test_preemption import _start_all
from webhooks.models import WebhookDelivery, WebhookEvent
from webhooks.services.endpoints import endpoint_create

GIB = 1024**3


@pytest.fixture
def hook(tenant, settings):
    settings.WEBHOOK_ALLOW_LOOPBACK = True

    def make(types=("*",), t=None):
        endpoint, _ = endpoint_create(
            tenant=t or tenant, url="http://127.0.0.1:9/hook", event_types=list(types), actor=Actor.system()
        )
        return endpoint

    return make


def _events(type_: str) -> list[dict]:
    return [e.payload for e in WebhookEvent.objects.filter(type=type_).order_by("id")]


def test_state_changes_are_recorded_for_the_endpoints_that_want_them(
    tenant, make_tenant, hook, submit, make_node, cycle, django_capture_on_commit_callbacks
):
    wants, other_types = hook(["workload.state"]), hook(["invoice.paid"])
    disabled = hook(["*"])
    disabled.enabled = False
    disabled.save()
    stranger = make_tenant("globex")
    hook(["*"], t=stranger)
    make_node(gpus=8)
    with django_capture_on_commit_callbacks() as queued:
        job = submit(tenant, gpu_count=2)
    assert len(queued) >= 1
    cycle()
    states = _events("workload.state")
    assert [(e["workload_id"], e["from"], e["to"]) for e in states] == [
        (job.pk, "", S.PENDING),
        (job.pk, S.PENDING, S.QUEUED),
        (job.pk, S.QUEUED, S.SCHEDULED),
    ]
    assert set(WebhookDelivery.objects.values_list("endpoint_id", flat=True)) == {wants.pk}
    assert not WebhookDelivery.objects.filter(endpoint=other_types).exists()
    assert not WebhookEvent.objects.filter(tenant=stranger).exists()
    assert WebhookDelivery.objects.filter(state="pending", next_attempt_at__isnull=False).count() == 3


def test_a_change_that_rolls_back_records_nothing(tenant, hook, submit, make_node):
    hook()
    make_node(gpus=8)
    with pytest.raises(RuntimeError), transaction.atomic():
        submit(tenant, gpu_count=1)
        raise RuntimeError("the request failed after the submission")
    assert not WebhookEvent.objects.exists() and not WebhookDelivery.objects.exists()


def test_without_endpoints_nothing_is_written(tenant, submit, make_node):
    make_node(gpus=8)
    submit(tenant, gpu_count=1)
    assert not WebhookEvent.objects.exists()


def test_a_preemption_notice_says_when_the_workload_stops(tenant, hook, submit, make_node, cycle):
    hook(["workload.preemption_notice"])
    make_node(gpus=2)
    job = submit(tenant, gpu_count=2, plan="spot")
    cycle()
    _start_all()
    before = timezone.now()
    workload_preempt(workload=job, reason="spot_price", notice_s=45)
    [notice] = _events("workload.preemption_notice")
    assert notice["workload_id"] == job.pk and notice["notice_s"] == 45 and notice["reason"] == "spot_price"
    stop_at = timezone.datetime.fromisoformat(notice["stop_at"])
    assert before + timedelta(seconds=44) <= stop_at <= timezone.now() + timedelta(seconds=46)
    assert notice["requeues"] is True
    assert WebhookEvent.objects.filter(type="workload.preemption_notice").count() == 1


def test_a_gang_that_ends_is_announced_and_a_single_job_is_not(tenant, hook, submit, make_node):
    hook(["gang.completed"])
    make_node(gpus=8)
    make_node(gpus=8)
    gang = submit(tenant, gpu_count=16, gang=True)
    single = submit(tenant, gpu_count=1)
    workload_stop(workload=single, actor=Actor.system())
    assert _events("gang.completed") == []
    workload_stop(workload=gang, actor=Actor.system())
    [done] = _events("gang.completed")
    assert done["workload_id"] == gang.pk and done["state"] == S.STOPPED and done["gpu_count"] == 16


def test_an_array_that_ends_is_announced_once_and_its_tasks_are_not(tenant, hook, submit, make_node, cycle):
    hook(["array.completed", "gang.completed"])
    make_node(gpus=8)
    parent = submit(tenant, array={"count": 3, "parallelism": 2})
    cycle()
    assert _events("array.completed") == []
    workload_stop(workload=parent, actor=Actor.system())
    [done] = _events("array.completed")
    assert done["workload_id"] == parent.pk and done["state"] == S.STOPPED and done["array_count"] == 3
    assert _events("gang.completed") == []


def test_a_volume_is_announced_full_once_per_crossing(tenant, hook, regions, make_node):
    hook(["volume.full"])
    node = make_node(region="us")
    v = Volume.objects.create(tenant=tenant, name="data", region=regions["us"], size_gib=2)
    now = timezone.now()

    def measure(used, seconds):
        report = VolumeReport(volume_id=v.pk, used_bytes=used, measured_at=now + timedelta(seconds=seconds))
        return volumes_on_measured(node_id=node.pk, reports=[report])

    assert measure(GIB, 1) == 1 and _events("volume.full") == []
    assert measure(2 * GIB - 1, 2) == 1 and _events("volume.full") == []
    assert measure(2 * GIB, 3) == 1
    assert measure(3 * GIB, 4) == 1  # still full: no second event
    [full] = _events("volume.full")
    assert full["volume_id"] == v.pk and full["name"] == "data" and full["size_gib"] == 2
    assert full["used_bytes"] == 2 * GIB and full["region"] == regions["us"].code
    assert measure(GIB, 5) == 1 and measure(5 * GIB, 6) == 1  # emptied, then full again
    assert len(_events("volume.full")) == 2
    assert measure(9 * GIB, 5) == 0  # an older measurement changes nothing
    assert Volume.objects.get(pk=v.pk).used_bytes == 5 * GIB
