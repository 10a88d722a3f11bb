"""Quota management for staff: /staff/quotas/ (limits beside use, filters, bulk change, audit trail),
one tenant's quota form, the quota service (validation, audit before/after, warnings) and the Django
admin's QuotaAdmin saving through the same service."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.test import Client

from nodes.models import GpuModel
from portal.actors import Actor
from portal.errors import ValidationFailed
from portal.models import AuditEvent, Tenant, User
from scheduling.models import Quota, QuotaModelLimit
from scheduling.selectors.shared import quota_usage
from scheduling.selectors.staff_quotas import quota_usage_by_tenant
from scheduling.services.quotas import quota_bulk_update, quota_update
from tests.portal.conftest import HTMX, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import A100, H100

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff(db) -> User:
    return User.objects.create_user(email="ops@gpupool.test", password="pw-for-tests-1", is_staff=True)


@pytest.fixture
def staff_client(staff) -> Client:
    c = Client()
    c.force_login(staff)
    return c


@pytest.fixture
def owner_client(signed_in, owner, tenant):  # noqa: F811
    return signed_in(owner, tenant)


@pytest.fixture
def busy(tenant, make_tenant, make_node, submit, cycle):
    """acme: 2 H100 jobs placed (8 + 4 GPUs), a spot job of 2 waiting behind them... and a 1-GPU
    A100-only job waiting; bravo: one 8-GPU job placed; charlie: nothing."""
    make_node(H100, gpus=8)
    make_node(H100, gpus=8)
    bravo, charlie = make_tenant("bravo"), make_tenant("charlie")
    submit(tenant, gpu_count=8)
    submit(tenant, gpu_count=4)
    submit(bravo, gpu_count=4)
    cycle()
    submit(tenant, gpu_count=2, plan="spot")
    make_node(A100, gpus=1, state="cordoned")
    submit(tenant, gpu_models=[A100], gpu_count=1)
    return {"acme": tenant, "bravo": bravo, "charlie": charlie}


def row_of(html: str, tenant: Tenant) -> str:
    m = re.search(rf'<tr id="quota-{tenant.pk}">(.*?)</tr>', html, re.S)
    assert m, f"no row for {tenant.slug}"
    return m.group(1)


def cell(row: str, name: str) -> tuple[str, str]:
    m = re.search(
        rf'data-quota="{re.escape(name)}"><span data-use>([^<]*)</span> / <strong data-limit>([^<]*)</strong>',
        row,
    )
    assert m, name
    return m.group(1), m.group(2)


# --- access --------------------------------------------------------------------------------------------


def test_only_staff_reach_the_quota_pages(client, owner_client, tenant, staff_client):
    urls = ["/staff/quotas/", f"/staff/quotas/{tenant.pk}/"]
    for url in urls:
        r = client.get(url)
        assert r.status_code == 302 and r["Location"].startswith("/login/")
        assert owner_client.get(url).status_code == 403
    assert owner_client.post(f"/staff/quotas/{tenant.pk}/", {"max_gpus_total": "1"}).status_code == 403
    assert (
        owner_client.post(
            "/staff/quotas/bulk/", {"tenants": [tenant.pk], "field": "max_gpus_total", "value": "1"}
        ).status_code
        == 403
    )
    assert not Quota.objects.filter(tenant=tenant, max_gpus_total=1).exists()
    assert not AuditEvent.objects.filter(action="quota.update").exists()
    assert 'href="/staff/quotas/"' not in owner_client.get("/").content.decode()
    page = staff_client.get("/staff/quotas/").content.decode()
    assert re.search(r'<a href="/staff/quotas/" class="nav-link active"', page)
    assert 'href="/staff/queue/"' in page


# --- numbers -------------------------------------------------------------------------------------------


def test_usage_is_counted_per_tenant_as_submissions_count_it(busy):
    acme, bravo, charlie = busy["acme"], busy["bravo"], busy["charlie"]
    h100, a100 = (GpuModel.objects.get(name=n).pk for n in (H100, A100))
    grouped = quota_usage_by_tenant()
    assert charlie.pk not in grouped
    a = grouped[acme.pk]
    # 8 + 4 placed on H100, a spot 2 waiting (H100 only), a 1-GPU A100-only job waiting
    assert (a.workloads, a.gpus, a.spot_gpus, a.largest_request_gpus) == (4, 15, 2, 8)
    assert a.model_milli == {h100: 14_000, a100: 1_000}
    b = grouped[bravo.pk]
    assert (b.workloads, b.gpus, b.spot_gpus, b.model_milli) == (1, 4, 0, {h100: 4_000})
    assert quota_usage(tenant=acme) == a and quota_usage(tenant=charlie).workloads == 0
    assert quota_usage_by_tenant(tenant_ids=[]) == {}
    assert quota_usage_by_tenant(tenant_ids=[bravo.pk, charlie.pk]) == {bravo.pk: b}


def test_a_waiting_request_for_several_models_counts_in_the_totals_only(busy, submit):
    """Per model, a waiting request counts only when that model is the only one it accepts."""
    charlie = busy["charlie"]
    h100, a100 = (GpuModel.objects.get(name=n).pk for n in (H100, A100))
    submit(charlie, gpu_models=[H100, A100], gpu_count=2)
    submit(charlie, gpu_models=[A100], gpu_count=1, plan="spot")
    usage = quota_usage(tenant=charlie)
    assert (usage.workloads, usage.gpus, usage.spot_gpus, usage.largest_request_gpus) == (2, 3, 1, 2)
    assert usage.model_milli == {a100: 1_000}
    assert quota_usage_by_tenant()[busy["acme"].pk].model_milli == {h100: 14_000, a100: 1_000}


def test_each_limit_beside_its_use(staff_client, busy):
    acme, bravo, charlie = busy["acme"], busy["bravo"], busy["charlie"]
    quota_update(tenant=acme, changes={"max_gpus_total": 14, "max_spot_gpus": 4}, actor=Actor.system())
    a100 = GpuModel.objects.get(name=A100)
    quota_update(tenant=acme, changes={"model_limits": {a100: 1}}, actor=Actor.system())
    html = staff_client.get("/staff/quotas/").content.decode()
    acme_row = row_of(html, acme)
    # 8 + 4 placed, 2 spot and 1 A100 waiting: 15 GPUs in 4 workloads; largest request 8.
    assert cell(acme_row, "max_gpus_total") == ("15", "14")
    assert 'badge-danger">over' in acme_row
    assert cell(acme_row, "max_concurrent_workloads") == ("4", "100")
    assert cell(acme_row, "max_spot_gpus") == ("2", "4")
    assert cell(acme_row, "max_gpus_per_request") == ("8", "∞")
    assert f"{A100}: 1 / <strong>1</strong>" in acme_row
    assert cell(row_of(html, bravo), "max_gpus_total") == ("4", "64")
    charlie_row = row_of(html, charlie)
    assert cell(charlie_row, "max_gpus_total") == ("0", "64") and "defaults" in charlie_row
    # the filters: search, and at-or-over a limit
    html = staff_client.get("/staff/quotas/", {"q": "brav"}).content.decode()
    assert f'id="quota-{bravo.pk}"' in html and f'id="quota-{acme.pk}"' not in html
    r = staff_client.get("/staff/quotas/", {"status": "over"}, **HTMX)
    html = r.content.decode()
    assert r.status_code == 200 and "<html" not in html
    assert f'id="quota-{acme.pk}"' in html and f'id="quota-{bravo.pk}"' not in html
    assert staff_client.get("/staff/quotas/", {"status": "nonsense"}).status_code == 400


def test_the_list_takes_a_fixed_number_of_queries(
    staff_client, busy, make_tenant, django_assert_max_num_queries
):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert staff_client.get("/staff/quotas/").status_code == 200
        return len(ctx.captured_queries)

    few = count()
    for i in range(25):
        t = make_tenant(f"extra{i:02d}")
        quota_update(tenant=t, changes={"max_gpus_total": i}, actor=Actor.system())
    assert count() == few
    with django_assert_max_num_queries(20):
        staff_client.get("/staff/quotas/", {"status": "limited"})


# --- one tenant's form ---------------------------------------------------------------------------------


def test_editing_a_quota_writes_the_audit_event_with_before_and_after(staff_client, staff, busy):
    acme = busy["acme"]
    h100 = GpuModel.objects.get(name=H100)
    page = staff_client.get(f"/staff/quotas/{acme.pk}/").content.decode()
    assert 'name="max_gpus_total"' in page and f'name="model_{h100.pk}"' in page
    assert re.search(r'data-use="max_gpus_total">In use now: <strong>15</strong>', page)
    r = staff_client.post(
        f"/staff/quotas/{acme.pk}/",
        {
            "max_gpus_total": "10",  # below the 15 in use: allowed, warned
            "max_concurrent_workloads": "100",
            "max_spot_gpus": "",
            "max_gpus_per_request": "8",
            "fair_share_weight": "2.5",
            f"model_{h100.pk}": "12",
        },
        follow=True,
    )
    assert r.status_code == 200
    html = r.content.decode()
    assert "below the 15 in use now" in html
    q = Quota.objects.get(tenant=acme)
    assert (q.max_gpus_total, q.max_concurrent_workloads, q.max_spot_gpus, q.max_gpus_per_request) == (
        10,
        100,
        None,
        8,
    )
    assert q.fair_share_weight == Decimal("2.5")
    assert QuotaModelLimit.objects.get(quota=q).max_gpus == 12
    event = AuditEvent.objects.get(action="quota.update", tenant=acme)
    assert event.actor_user == staff
    assert event.data["before"] == {
        "max_gpus_total": 64,
        "max_gpus_per_request": None,
        "fair_share_weight": "1.00",
        f"max_gpus[{H100}]": None,
    }
    assert event.data["after"] == {
        "max_gpus_total": 10,
        "max_gpus_per_request": 8,
        "fair_share_weight": "2.50",
        f"max_gpus[{H100}]": 12,
    }
    assert event.data["bulk"] is False and event.data["warnings"]
    # the trail on both pages
    for url in ("/staff/quotas/", f"/staff/quotas/{acme.pk}/"):
        trail = staff_client.get(url).content.decode().split('id="quota-audit"')[1]
        assert "ops@gpupool.test" in trail and "<code>max_gpus_total</code> 64 → <strong>10</strong>" in trail


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_gpus_total", "-1", "Must not be negative."),
        ("max_spot_gpus", "1.5", "Must be a whole number"),
        ("max_concurrent_workloads", "ten", "Must be a whole number"),
        ("fair_share_weight", "0", "Must be between 0.01 and 9999.99."),
        ("model", "-3", "Must not be negative."),
    ],
)
def test_bad_input_is_refused_naming_the_field(staff_client, tenant, field, value, message):
    h100 = GpuModel.objects.get(name=H100)
    data = {"max_gpus_total": "5", "fair_share_weight": "1"}
    name = f"model_{h100.pk}" if field == "model" else field
    data[name] = value
    r = staff_client.post(f"/staff/quotas/{tenant.pk}/", data)
    assert r.status_code == 400
    html = r.content.decode()
    assert re.search(
        rf'<label for="id_{name}">[^<]*(<span[^>]*>[^<]*</span>)?</label>\s*<input[^>]*name="{name}"', html
    )
    assert message in html.split(f'name="{name}"')[1].split("</div>")[0]
    assert not Quota.objects.filter(tenant=tenant).exists()
    assert not AuditEvent.objects.filter(action="quota.update").exists()


# --- bulk ----------------------------------------------------------------------------------------------


def test_bulk_change_sets_one_field_for_the_selected_tenants(staff_client, busy):
    acme, bravo, charlie = busy["acme"], busy["bravo"], busy["charlie"]
    r = staff_client.post(
        "/staff/quotas/bulk/",
        {"tenants": [acme.pk, bravo.pk], "field": "max_gpus_total", "value": "12"},
        follow=True,
    )
    assert r.status_code == 200
    html = r.content.decode()
    assert "GPUs in total set for 2 tenant(s); 2 changed." in html
    assert "Acme: GPUs in total: the new limit 12 is below the 15 in use now" in html
    assert dict(Quota.objects.values_list("tenant__slug", "max_gpus_total")) == {
        "acme": 12,
        "bravo": 12,
    }
    events = AuditEvent.objects.filter(action="quota.update").order_by("tenant_id")
    assert [(e.tenant_id, e.data["before"], e.data["after"], e.data["bulk"]) for e in events] == [
        (acme.pk, {"max_gpus_total": 64}, {"max_gpus_total": 12}, True),
        (bravo.pk, {"max_gpus_total": 64}, {"max_gpus_total": 12}, True),
    ]
    assert not Quota.objects.filter(tenant=charlie).exists()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"field": "max_gpus_total", "value": "-2"}, "max_gpus_total: Must not be negative."),
        ({"field": "max_spot_gpus", "value": "x"}, "max_spot_gpus: Must be a whole number"),
        ({"field": "tenant", "value": "1"}, "One of max_gpus_total"),
        ({"field": "max_gpus_total", "value": "1", "tenants": []}, "Choose at least one tenant."),
    ],
)
def test_bulk_bad_input_changes_nobody(staff_client, busy, data, message):
    data.setdefault("tenants", [busy["acme"].pk, busy["bravo"].pk])
    before = list(Quota.objects.order_by("pk").values())
    r = staff_client.post("/staff/quotas/bulk/", data)
    assert r.status_code == 400
    assert message in r.content.decode()
    assert list(Quota.objects.order_by("pk").values()) == before
    assert not AuditEvent.objects.filter(action="quota.update").exists()


def test_bulk_is_one_transaction(busy, monkeypatch):
    """A failure on the second tenant leaves the first unchanged too."""
    from scheduling.services import quotas

    real = quotas.audit_record
    calls = []

    def failing(**kwargs):
        calls.append(kwargs)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        return real(**kwargs)

    monkeypatch.setattr(quotas, "audit_record", failing)
    with pytest.raises(RuntimeError):
        quota_bulk_update(
            tenants=[busy["acme"], busy["bravo"]], name="max_spot_gpus", value=3, actor=Actor.system()
        )
    assert not Quota.objects.filter(max_spot_gpus=3).exists()
    assert not AuditEvent.objects.filter(action="quota.update").exists()


# --- the service ---------------------------------------------------------------------------------------


def test_the_service_validates_and_audits_only_real_changes(tenant):
    actor = Actor.system()
    for changes, field in [
        ({"max_gpus_total": True}, "max_gpus_total"),
        ({"max_gpus_total": 2.0}, "max_gpus_total"),
        ({"max_gpus_total": 2**31}, "max_gpus_total"),
        ({"fair_share_weight": 1.5}, "fair_share_weight"),
        ({"fair_share_weight": "1.005"}, "fair_share_weight"),
        ({"tenant": 3}, "tenant"),
        ({"model_limits": {999_999: 1}}, "model_limits"),
    ]:
        with pytest.raises(ValidationFailed) as e:
            quota_update(tenant=tenant, changes=changes, actor=actor)
        assert field in e.value.fields, changes
    assert not Quota.objects.exists()
    result = quota_update(tenant=tenant, changes={"max_gpus_total": "7", "max_spot_gpus": None}, actor=actor)
    assert result.after == {"max_gpus_total": 7} and not result.warnings
    again = quota_update(tenant=tenant, changes={"max_gpus_total": 7}, actor=actor)
    assert not again.changed
    assert AuditEvent.objects.filter(action="quota.update").count() == 1
    h100 = GpuModel.objects.get(name=H100)
    quota_update(tenant=tenant, changes={"model_limits": {h100.pk: 4}}, actor=actor)
    assert QuotaModelLimit.objects.get(quota__tenant=tenant, gpu_model=h100).max_gpus == 4
    r = quota_update(tenant=tenant, changes={"model_limits": {h100: None}}, actor=actor)
    assert r.before == {f"max_gpus[{H100}]": 4} and r.after == {f"max_gpus[{H100}]": None}
    assert not QuotaModelLimit.objects.exists()


def test_a_lowered_quota_applies_to_the_next_submission(staff_client, tenant, make_node, submit):
    from scheduling.services.submission import QuotaExceeded

    make_node()
    submit(tenant, gpu_count=2)
    staff_client.post(f"/staff/quotas/{tenant.pk}/", {"max_gpus_total": "2", "fair_share_weight": "1"})
    with pytest.raises(QuotaExceeded):
        submit(tenant, gpu_count=1)


# --- the Django admin ----------------------------------------------------------------------------------


def test_admin_edits_go_through_the_service_and_are_audited(tenant, make_node, submit):
    superuser = User.objects.create_superuser(email="root@gpupool.test", password="pw-staff-1")
    c = Client()
    c.force_login(superuser)
    make_node()
    submit(tenant, gpu_count=4)
    quota_update(tenant=tenant, changes={"max_gpus_total": 16}, actor=Actor.system())
    q = Quota.objects.get(tenant=tenant)
    h100 = GpuModel.objects.get(name=H100)
    r = c.post(
        f"/admin/scheduling/quota/{q.pk}/change/",
        {
            "max_gpus_total": 3,
            "max_concurrent_workloads": 100,
            "max_spot_gpus": "",
            "max_gpus_per_request": "",
            "fair_share_weight": "1.00",
            "model_limits-TOTAL_FORMS": 1,
            "model_limits-INITIAL_FORMS": 0,
            "model_limits-0-gpu_model": h100.pk,
            "model_limits-0-max_gpus": 6,
        },
        follow=True,
    )
    assert r.status_code == 200, r.content[:2000]
    assert "below the 4 in use now" in r.content.decode()
    q.refresh_from_db()
    assert q.max_gpus_total == 3 and QuotaModelLimit.objects.get(quota=q).max_gpus == 6
    event = AuditEvent.objects.filter(action="quota.update", actor_user=superuser).get()
    assert event.data["before"] == {"max_gpus_total": 16, f"max_gpus[{H100}]": None}
    assert event.data["after"] == {"max_gpus_total": 3, f"max_gpus[{H100}]": 6}
    # the tenant of a quota is not changed in the admin
    assert "readonly" in c.get(f"/admin/scheduling/quota/{q.pk}/change/").content.decode()
