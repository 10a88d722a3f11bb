"""Dunning: an invoice past its due date puts the tenant into GRACE (warned, e-mailed, still
working), past the grace days into SUSPENDED (new workloads refused; running ones kept or stopped by
``METERING_SUSPEND_RUNNING``); paying brings it back."""

from __future__ import annotations

import subprocess
from datetime import date
from decimal import Decimal

import pytest
from django.core.exceptions import ImproperlyConfigured

from metering.models import BillingAccount, Invoice, InvoiceStatus
from metering.services.invoices import invoice_mark_paid, invoice_run
from metering.services.payments import dunning_run
from nodes.models import CommandKind, NodeCommand
from portal.actors import Actor
from portal.errors import ValidationFailed
from portal.models import AuditEvent, Membership, Role, Tenant, User
from portal.services.tenants import tenant_set_status
from scheduling.admission import AdmissionRefused
from scheduling.models import Workload, WorkloadEvent, WorkloadState
from scheduling.services.submission import workload_submit
from tests.conftest import python_run
from tests.metering.conftest import H100, utc

MARCH, APRIL = date(2024, 3, 1), date(2024, 4, 1)


@pytest.fixture(autouse=True)
def _no_cycle_tasks(settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False  # submissions would ask Celery for a cycle on commit


@pytest.fixture
def march(tenant, card, run):
    """Finalized 5 April, due 19 April (2.64 USD); the grace of 7 days ends on 26 April."""
    BillingAccount.objects.create(tenant=tenant, tax_rate_percent=Decimal("10"))
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 1))
    run(tenant, utc(2024, 3, 2), utc(2024, 3, 2, 0, 30), plan="spot")
    invoice_run(period_start=MARCH, now=utc(2024, 4, 5))
    Workload.objects.filter(tenant=tenant).update(state=WorkloadState.STOPPED)  # they ended in March
    invoice = Invoice.objects.get(tenant=tenant, period_start=MARCH)
    assert invoice.status == InvoiceStatus.FINALIZED and invoice.total == Decimal("2.64")
    return invoice


@pytest.fixture
def billing_member(tenant):
    user = User.objects.create_user(email="books@acme.test", password="pw-for-tests-1")
    Membership.objects.create(tenant=tenant, user=user, role=Role.BILLING)
    viewer = User.objects.create_user(email="viewer@acme.test", password="pw-for-tests-1")
    Membership.objects.create(tenant=tenant, user=viewer, role=Role.VIEWER)
    return user


@pytest.fixture
def dun(django_capture_on_commit_callbacks):
    """``dun(now)``: one dunning run, its e-mails sent (they go out on commit)."""

    def do(now):
        with django_capture_on_commit_callbacks(execute=True):
            return dunning_run(now=now)

    return do


def submit(tenant) -> Workload:
    spec = {"image": "ghcr.io/acme/train:1", "command": ["python", "train.py"], "gpu_models": [H100]}
    return workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())


def grace_text(invoice: Invoice, due: str, on: str) -> str:
    return (
        f"Invoice #{invoice.pk} for {invoice.period_start:%Y-%m} (2.64 USD) was due {due}; "
        f"the team will be suspended on {on} unless it is paid"
    )


def test_past_due_the_tenant_is_in_grace_warned_once_and_still_works(
    march, tenant, owner, billing_member, dun, mailoutbox, client, make_token, api
):
    assert dun(utc(2024, 4, 18, 23)) == []
    assert [t.pk for t in dun(utc(2024, 4, 20))] == [tenant.pk]
    tenant.refresh_from_db()
    reason = grace_text(march, "2024-04-19", "2024-04-26")
    assert tenant.status == Tenant.Status.GRACE and tenant.is_active
    assert tenant.suspended_reason == reason
    assert AuditEvent.objects.get(action="tenant.grace").data == {
        "from": "active",
        "to": "grace",
        "reason": reason,
    }
    grace = AuditEvent.objects.get(action="invoice.dunning_grace")
    assert grace.target_id == str(march.pk) and grace.data["suspend_on"].startswith("2024-04-26")
    assert len(mailoutbox) == 1
    mail = mailoutbox[0]
    assert sorted(mail.to) == ["books@acme.test", "owner@acme.test"]
    assert "payment overdue" in mail.subject and reason in mail.body

    assert dun(utc(2024, 4, 21)) == [] and dun(utc(2024, 4, 25, 23)) == []  # reruns: no change, no mail
    assert len(mailoutbox) == 1 and AuditEvent.objects.filter(action="tenant.grace").count() == 1

    # Shown: the banner on every page (with the invoices link for those who may see invoices) ...
    client.force_login(owner)
    page = client.get("/").content.decode()
    assert "Payment overdue." in page and f"{reason}." in page and 'href="/billing/invoices/"' in page
    client.force_login(User.objects.get(email="viewer@acme.test"))
    page = client.get("/").content.decode()
    assert f"{reason}." in page and 'href="/billing/invoices/"' not in page
    # ... and in the API, which keeps working.
    me = api(make_token(tenant)).get("/api/v1/me/")
    assert me.status_code == 200
    assert me.json()["tenant"]["status"] == "grace" and me.json()["tenant"]["suspended_reason"] == reason
    # New workloads are admitted.
    assert submit(tenant).state in (WorkloadState.PENDING, WorkloadState.QUEUED)


def test_past_the_grace_days_new_workloads_are_refused_and_running_ones_kept(
    march, tenant, run, dun, mailoutbox, settings
):
    assert settings.METERING_SUSPEND_RUNNING == "keep"
    running = run(tenant, utc(2024, 4, 20), None).workload
    dun(utc(2024, 4, 20))
    assert [t.status for t in dun(utc(2024, 4, 26))] == [Tenant.Status.SUSPENDED]
    tenant.refresh_from_db()
    reason = f"Unpaid invoice #{march.pk} for 2024-03 (2.64 USD), due 2024-04-19"
    assert tenant.status == Tenant.Status.SUSPENDED and tenant.suspended_reason == reason
    assert AuditEvent.objects.filter(action="tenant.suspend").count() == 1
    assert AuditEvent.objects.get(action="invoice.dunning_suspend").data.get("workloads_stopped") is None
    assert len(mailoutbox) == 2 and "suspended" in mailoutbox[1].subject
    assert "continue and are billed" in mailoutbox[1].body
    with pytest.raises(AdmissionRefused) as refused:
        submit(tenant)
    assert reason in str(refused.value) and refused.value.code == "tenant_suspended"
    assert Workload.objects.get(pk=running.pk).state == WorkloadState.RUNNING
    assert not NodeCommand.objects.filter(kind=CommandKind.STOP_WORKLOAD).exists()
    assert dun(utc(2024, 4, 27)) == [] and len(mailoutbox) == 2  # safe to run twice


def test_stop_setting_stops_running_and_queued_workloads_naming_the_suspension(
    march, tenant, run, dun, settings
):
    settings.METERING_SUSPEND_RUNNING = "stop"
    running = run(tenant, utc(2024, 4, 20), None).workload
    dun(utc(2024, 4, 20))
    queued = submit(tenant)  # admitted during the grace
    assert Workload.objects.get(pk=running.pk).state == WorkloadState.RUNNING  # grace stops nothing
    dun(utc(2024, 4, 26))
    reason = f"Unpaid invoice #{march.pk} for 2024-03 (2.64 USD), due 2024-04-19"
    running.refresh_from_db()
    queued.refresh_from_db()
    assert running.state == WorkloadState.STOPPING and queued.state == WorkloadState.STOPPED
    for w in (running, queued):
        event = WorkloadEvent.objects.filter(workload=w).latest("at", "id")
        assert event.reason == "tenant_suspended" and reason in event.message and "suspended" in event.message
    command = NodeCommand.objects.get(kind=CommandKind.STOP_WORKLOAD)
    assert command.payload["workload_id"] == str(running.pk)
    assert AuditEvent.objects.get(action="invoice.dunning_suspend").data["workloads_stopped"] == 2
    assert AuditEvent.objects.filter(action="job.stop", data__reason="tenant_suspended").count() == 2


def test_paying_in_grace_reactivates(march, tenant, owner, dun, client):
    dun(utc(2024, 4, 20))
    invoice_mark_paid(invoice=march, actor=Actor.system(), now=utc(2024, 4, 22))
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.ACTIVE and tenant.suspended_reason == ""
    assert AuditEvent.objects.filter(action="tenant.reactivate").count() == 1
    client.force_login(owner)
    assert "Payment overdue." not in client.get("/").content.decode()
    assert dun(utc(2024, 5, 1)) == []


def test_two_overdue_invoices_paid_one_by_one(
    march, tenant, run, dun, mailoutbox, django_capture_on_commit_callbacks
):
    run(tenant, utc(2024, 4, 1), utc(2024, 4, 1, 1))
    invoice_run(period_start=APRIL, now=utc(2024, 5, 5))
    Workload.objects.filter(tenant=tenant).update(state=WorkloadState.STOPPED)
    april = Invoice.objects.get(tenant=tenant, period_start=APRIL)  # due 19 May, suspends 26 May
    assert [t.status for t in dun(utc(2024, 5, 20))] == [Tenant.Status.SUSPENDED]  # march is the oldest
    tenant.refresh_from_db()
    assert tenant.suspended_reason.startswith(f"Unpaid invoice #{march.pk} ")

    with django_capture_on_commit_callbacks(execute=True):
        invoice_mark_paid(invoice=march, actor=Actor.system(), now=utc(2024, 5, 21))
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.GRACE  # april is past due, not yet past the grace
    assert tenant.suspended_reason == grace_text(april, "2024-05-19", "2024-05-26").replace("2.64", "2.20")
    assert "payment overdue" in mailoutbox[-1].subject and f"#{april.pk}" in mailoutbox[-1].subject
    assert dun(utc(2024, 5, 22)) == []  # already in grace for april

    invoice_mark_paid(invoice=april, actor=Actor.system(), now=utc(2024, 5, 23))
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.ACTIVE and tenant.suspended_reason == ""
    assert list(
        AuditEvent.objects.filter(action__startswith="tenant.")
        .exclude(action="tenant.create")
        .order_by("pk")
        .values_list("action", flat=True)
    ) == ["tenant.suspend", "tenant.grace", "tenant.reactivate"]


def test_a_grace_status_needs_a_reason(tenant):
    with pytest.raises(ValidationFailed) as exc:
        tenant_set_status(tenant=tenant, status=Tenant.Status.GRACE, reason=" ", actor=Actor.system())
    assert "reason" in exc.value.fields
    assert Tenant.objects.get(pk=tenant.pk).status == Tenant.Status.ACTIVE


def test_an_unknown_suspend_running_value_is_refused(march, settings):
    settings.METERING_SUSPEND_RUNNING = "pause"
    with pytest.raises(ImproperlyConfigured, match="METERING_SUSPEND_RUNNING"):
        dunning_run(now=utc(2024, 4, 26))
    assert Tenant.objects.get(pk=march.tenant_id).status == Tenant.Status.ACTIVE

    def start(value: str) -> subprocess.CompletedProcess:
        code = "import django; django.setup(); from django.conf import settings; print(settings.METERING_SUSPEND_RUNNING)"
        return python_run(
            code, DJANGO_SETTINGS_MODULE="portal.settings", DEBUG="1", METERING_SUSPEND_RUNNING=value
        )

    refused = start("pause")
    assert refused.returncode != 0 and "METERING_SUSPEND_RUNNING must be keep or stop" in refused.stderr
    accepted = start("Stop")
    assert accepted.returncode == 0 and accepted.stdout.strip() == "stop"


def test_the_admin_form_asks_for_a_reason_for_grace_as_for_suspension(tenant):
    from portal.admin import TenantAdminForm

    fields = {
        "name": tenant.name,
        "slug": tenant.slug,
        "billing_email": tenant.billing_email,
        "currency": "USD",
    }
    for status in (Tenant.Status.GRACE, Tenant.Status.SUSPENDED):
        form = TenantAdminForm(data={**fields, "status": status, "suspended_reason": ""}, instance=tenant)
        assert not form.is_valid() and "suspended_reason" in form.errors
    form = TenantAdminForm(data={**fields, "status": "grace", "suspended_reason": "late"}, instance=tenant)
    assert form.is_valid(), form.errors


@pytest.mark.parametrize("setting", ["keep", "stop"])
def test_staff_suspending_a_tenant_treats_its_workloads_as_dunning_does(tenant, run, settings, setting):
    """A suspension by staff (the admin's status change goes through tenant_set_status) applies
    METERING_SUSPEND_RUNNING like dunning's: portal's tenant_suspended, metering's receiver."""
    settings.METERING_SUSPEND_RUNNING = setting
    staff = User.objects.create_superuser(email="ops@gpupool.test", password="pw-for-tests-1")
    running = run(tenant, utc(2024, 4, 20), None).workload
    queued = submit(tenant)
    tenant_set_status(
        tenant=tenant, status=Tenant.Status.SUSPENDED, reason="Abuse report 17", actor=Actor(user=staff)
    )
    running.refresh_from_db()
    queued.refresh_from_db()
    if setting == "keep":
        assert running.state == WorkloadState.RUNNING and queued.state in (
            WorkloadState.PENDING,
            WorkloadState.QUEUED,
        )
        assert not NodeCommand.objects.filter(kind=CommandKind.STOP_WORKLOAD).exists()
        return
    assert running.state == WorkloadState.STOPPING and queued.state == WorkloadState.STOPPED
    for w in (running, queued):
        event = WorkloadEvent.objects.filter(workload=w).latest("at", "id")
        assert event.reason == "tenant_suspended" and "Abuse report 17" in event.message
    assert NodeCommand.objects.get(kind=CommandKind.STOP_WORKLOAD).payload["workload_id"] == str(running.pk)
    # Already suspended: a new reason sends nothing again.
    with pytest.raises(AdmissionRefused):
        submit(tenant)
    tenant_set_status(
        tenant=tenant, status=Tenant.Status.SUSPENDED, reason="Abuse report 18", actor=Actor(user=staff)
    )
    assert NodeCommand.objects.filter(kind=CommandKind.STOP_WORKLOAD).count() == 1
