from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import GpuModel
from portal.models import AuditEvent, User
from scheduling.models import Quota, Reservation, ReservationStatus, Workload
from tests.scheduling.conftest import H100

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client):
    staff = User.objects.create_superuser(email="ops@gpupool.test", password="pw-staff-1")
    client.force_login(staff)
    return client


def test_staff_pages_open(staff_client, tenant, make_node, submit):
    make_node()
    w = submit(tenant)
    for url in (
        "/admin/scheduling/workload/",
        f"/admin/scheduling/workload/{w.pk}/change/",
        "/admin/scheduling/quota/",
        "/admin/scheduling/quota/add/",
        "/admin/scheduling/reservation/",
        "/admin/scheduling/warmpool/",
        "/admin/scheduling/allocation/",
    ):
        assert staff_client.get(url).status_code == 200, url


def test_staff_confirm_a_reservation_and_stop_a_workload(staff_client, tenant, make_node, submit):
    node = make_node()
    now = timezone.now()
    r = Reservation.objects.create(
        tenant=tenant,
        gpu_model=GpuModel.objects.get(name=H100),
        region=node.region,
        count=8,
        starts_at=now,
        ends_at=now + timedelta(days=30),
    )
    resp = staff_client.post(
        "/admin/scheduling/reservation/", {"action": "activate", "_selected_action": [r.pk]}, follow=True
    )
    assert resp.status_code == 200
    r.refresh_from_db()
    assert r.status == ReservationStatus.ACTIVE
    assert AuditEvent.objects.filter(action="reservation.activate", target_id=str(r.pk)).exists()
    w = submit(tenant)
    staff_client.post(
        "/admin/scheduling/workload/", {"action": "stop", "_selected_action": [w.pk]}, follow=True
    )
    assert Workload.objects.get(pk=w.pk).state == "stopped"


def test_staff_set_a_quota_and_it_is_audited(staff_client, tenant):
    resp = staff_client.post(
        "/admin/scheduling/quota/add/",
        {
            "tenant": tenant.pk,
            "max_gpus_total": 16,
            "max_concurrent_workloads": "",
            "max_spot_gpus": "",
            "max_gpus_per_request": 8,
            "fair_share_weight": "2.00",
            "model_limits-TOTAL_FORMS": 0,
            "model_limits-INITIAL_FORMS": 0,
        },
    )
    assert resp.status_code == 302, resp.content[:2000]
    q = Quota.objects.get(tenant=tenant)
    assert (q.max_gpus_total, q.max_concurrent_workloads, q.max_gpus_per_request) == (16, None, 8)
    assert q.fair_share_weight == 2
    assert AuditEvent.objects.filter(action="quota.update", tenant=tenant).exists()


def test_staff_confirm_over_capacity_only_with_the_override(staff_client, tenant, make_node):
    node = make_node()  # 8 H100s
    now = timezone.now()
    r = Reservation.objects.create(
        tenant=tenant,
        gpu_model=GpuModel.objects.get(name=H100),
        region=node.region,
        count=9,
        starts_at=now,
        ends_at=now + timedelta(days=30),
    )
    page = staff_client.post(
        "/admin/scheduling/reservation/", {"action": "activate", "_selected_action": [r.pk]}, follow=True
    )
    assert "Not enough capacity" in page.content.decode()
    assert Reservation.objects.get(pk=r.pk).status == ReservationStatus.REQUESTED
    staff_client.post(
        "/admin/scheduling/reservation/",
        {"action": "activate_over_capacity", "_selected_action": [r.pk]},
        follow=True,
    )
    r.refresh_from_db()
    assert r.status == ReservationStatus.ACTIVE and r.activated_at is not None
    audit = AuditEvent.objects.get(action="reservation.activate", target_id=str(r.pk))
    assert audit.data["capacity_override"] is True and "overbooked by 1" in audit.data["risk"]
