from datetime import date
from decimal import Decimal

import pytest

from metering import tasks
from metering.models import Invoice, InvoiceStatus
from metering.services.invoices import invoice_build
from metering.services.usage import usage_build
from portal.models import User
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db


def test_staff_finalize_an_invoice_from_the_admin(client, tenant, card, run):
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 1))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    invoice = invoice_build(tenant=tenant, period_start=date(2024, 3, 1))
    staff = User.objects.create_superuser(email="finance@gpupool.test", password="pw-for-tests-1")
    client.force_login(staff)
    url = "/admin/metering/invoice/"
    assert client.get(url).status_code == 200
    assert client.get(f"{url}{invoice.pk}/change/").status_code == 200
    response = client.post(url, {"action": "finalize", "_selected_action": [invoice.pk]})
    assert response.status_code == 302
    invoice.refresh_from_db()
    assert invoice.status == InvoiceStatus.FINALIZED and invoice.total == Decimal("2.00")
    client.post(url, {"action": "finalize", "_selected_action": [invoice.pk]})  # refused with a message
    invoice.refresh_from_db()
    assert invoice.status == InvoiceStatus.FINALIZED


def test_the_beat_tasks_build_usage_and_invoices_and_are_safe_twice(tenant, card, run):
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 1))
    assert tasks.usage_build.run() == 1
    assert tasks.usage_build.run() == 0
    assert tasks.invoice_run.run("2024-03-01") == 1
    assert tasks.invoice_run.run("2024-03-01") == 1
    assert Invoice.objects.get().status == InvoiceStatus.FINALIZED  # its grace ended long ago
