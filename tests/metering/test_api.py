import csv
import io
from datetime import date
from decimal import Decimal

import pytest
from django.utils import timezone

from metering.models import BillingAccount, Budget
from metering.services.invoices import invoice_build
from metering.services.usage import usage_build
from portal.actors import Actor
from scheduling.admission import AdmissionRefused
from scheduling.models import Workload
from scheduling.pricing import gpu_prices, spot_price_floor
from scheduling.services.submission import workload_submit
from tests.metering.conftest import H100, utc
from tests.portal.conftest import signed_in  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_cycle_tasks(settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False


def test_usage_and_invoices_need_the_billing_scope_and_show_the_tenants_own(
    tenant, make_tenant, card, run, make_token, api
):
    other = make_tenant("other")
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 2))
    run(other, utc(2024, 3, 1), utc(2024, 3, 1, 5))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    invoice = invoice_build(tenant=tenant, period_start=date(2024, 3, 1))
    invoice_build(tenant=other, period_start=date(2024, 3, 1))

    reader = api(make_token(tenant, scopes=["read"]))
    assert reader.get("/api/v1/usage/").status_code == 403
    assert reader.get("/api/v1/invoices/").json()["error"]["code"] == "permission_denied"

    billing = api(make_token(tenant, scopes=["read", "billing"]))
    usage = billing.get("/api/v1/usage/?period=2024-03-01").json()["results"]
    assert len(usage) == 1 and usage[0]["amount"] == "4.0000000000" and usage[0]["gpu_model"] == H100
    assert billing.get("/api/v1/usage/?period=2024-04-01").json()["results"] == []
    invoices = billing.get("/api/v1/invoices/").json()["results"]
    assert [i["id"] for i in invoices] == [invoice.pk]
    detail = billing.get(f"/api/v1/invoices/{invoice.pk}/").json()
    assert detail["total"] == "4.000" and detail["lines"][0]["kind"] == "on_demand"

    response = billing.get(f"/api/v1/invoices/{invoice.pk}/csv/")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[2][1] == "on_demand" and rows[2][7] == "4.000" and rows[-1][1:2] == ["total"]


def test_cost_estimate_prices_a_spec_per_plan_with_the_discount(tenant, card, make_token, api):
    BillingAccount.objects.create(tenant=tenant, discount_percent=Decimal("10"))
    client = api(make_token(tenant, scopes=["read"]))  # pricing writes nothing: read is enough
    body = client.post(
        "/api/v1/cost-estimate/", {"gpu_model": H100, "gpu_count": 4}, content_type="application/json"
    ).json()
    assert body["currency"] == "USD"
    assert body["per_hour"] == {"on_demand": "7.20", "spot": "2.88", "reserved": "5.40"}
    # No READY server of the model: no region to price the placement candidate in.
    assert body["placement"]["gpu_model"] == H100 and body["placement"]["region"] is None
    assert body["placement"]["candidates"][0]["price_per_gpu_hour"] is None
    bad = client.post("/api/v1/cost-estimate/", {"gpu_model": "nope"}, content_type="application/json")
    assert bad.status_code == 400 and "gpu_model" in bad.json()["error"]["fields"]


def test_scheduling_sees_rate_card_prices_and_the_spot_floor(card, h100, region):
    assert gpu_prices(gpu_model=h100, region=region) == {
        "on_demand": Decimal("2"),
        "spot": Decimal("0.8"),
        "reserved": Decimal("1.5"),
    }
    assert spot_price_floor(gpu_model=h100, region=region) == Decimal("0.8")


def _submit(tenant, **spec):
    spec.setdefault("image", "ghcr.io/acme/train:1")
    spec.setdefault("command", ["python", "train.py"])
    spec.setdefault("gpu_models", [H100])
    return workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())


def test_the_budget_hard_limit_refuses_a_workload_naming_the_budget(tenant, card, run, make_token, api):
    now = timezone.now()
    run(
        tenant, now.replace(day=1, hour=0, minute=0, second=0, microsecond=0), None
    )  # about 2.00 per hour so far
    Budget.objects.create(tenant=tenant, monthly_limit=Decimal("1000000"), limit_action="refuse")
    _submit(tenant, gpu_count=1, max_runtime_s=3600)
    Budget.objects.filter(tenant=tenant).update(monthly_limit=Decimal("0.50"))
    with pytest.raises(AdmissionRefused) as exc:
        _submit(tenant, gpu_count=1, max_runtime_s=3600)
    assert exc.value.code == "budget_exceeded" and "budget" in exc.value.fields
    count = Workload.objects.count()
    response = api(make_token(tenant)).post(
        "/api/v1/jobs/",
        {"image": "ghcr.io/acme/train:1", "command": ["x"], "gpu_models": [H100]},
        content_type="application/json",
    )
    assert response.status_code == 403, response.content
    assert "budget" in response.json()["error"]["message"].lower()
    assert Workload.objects.count() == count


def test_a_suspended_tenant_cannot_submit(tenant, card, node):
    tenant.status = tenant.Status.SUSPENDED
    tenant.suspended_reason = "unpaid invoice"
    tenant.save()
    with pytest.raises(AdmissionRefused, match="suspended: unpaid invoice"):
        _submit(tenant)


def test_the_launch_form_shows_the_cost_estimate_apis_figure(
    tenant,
    card,
    node,
    h100,
    owner,
    signed_in,  # noqa: F811
    make_token,
    api,
):
    """Same spec, same figure: the tenant's discount and the region's spot market price in both."""
    from metering.models import SpotPrice
    from tests.portal.conftest import HTMX

    BillingAccount.objects.create(tenant=tenant, discount_percent=Decimal("10"))
    SpotPrice.objects.create(
        gpu_model=h100,
        region=node.region,
        at=timezone.now(),
        price=Decimal("1.10"),
        floor=Decimal("0.80"),
        on_demand=Decimal("2.00"),
        utilisation=Decimal("0.5"),
    )
    client = api(make_token(tenant, scopes=["read"]))  # pricing writes nothing: read is enough
    body = client.post(
        "/api/v1/cost-estimate/", {"gpu_model": H100, "gpu_count": 2}, content_type="application/json"
    ).json()
    # on demand 2 x 2.00 less 10 %; spot at the market's 1.10 less 10 %
    assert body["per_hour"]["on_demand"] == "3.60" and body["per_hour"]["spot"] == "1.98"
    web = signed_in(owner, tenant)
    for plan in ("on_demand", "spot"):
        html = web.get(
            "/launch/summary/",
            {
                "gpu_model": H100,
                "gpu_count": "2",
                "fraction": "1000",
                "plan": plan,
                "region": node.region.code,
            },
            **HTMX,
        ).content.decode()
        assert f'data-estimate="hour">{body["per_hour"][plan]} USD' in html, plan
