"""Staff finance reports on real usage, invoices and fleet: revenue by month, tenant, model, plan
and region; billed versus used GPU-hours against capacity; receivables by age. Through the
selectors, the staff pages (HTML, CSV, chart) and the staff API, and only for staff."""

from __future__ import annotations

import csv
import io
import uuid
from datetime import date
from decimal import Decimal

import pytest

from metering import reports
from metering.models import BillingAccount, UsageRecord
from metering.services.invoices import credit_note_issue, invoice_build, invoice_finalize, invoice_mark_paid
from metering.services.usage import usage_build
from nodes.models import Gpu, Node, Region
from portal.actors import Actor
from portal.models import Membership, Role, User
from scheduling.models import Allocation, Plan, Workload, WorkloadEvent
from tests.metering.conftest import utc
from tests.portal.conftest import signed_in  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db

D = Decimal
MARCH, APRIL = date(2024, 3, 1), date(2024, 4, 1)
SYSTEM = Actor.system()


@pytest.fixture(autouse=True)
def _no_cycle_tasks(settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False


@pytest.fixture
def books(tenant, make_tenant, card, node, run, reserve, a100):
    """Two tenants, two regions, two models, three plans, over March and April 2024.

    Fleet: 8 H100 in us-east-1 from 2024-01-01; 4 A100 in eu-west-1 from 2024-03-16, one of them
    removed on 2024-03-24.
    acme (tax 10 %): March 10 h on-demand H100 (20.00) + 30 s (billed the 60 s minimum: 0.0333),
      telemetry 50 % on the 10 h; April 2 h on-demand H100 (4.00).
    beta: March 5 h spot H100 (4.00), 4 h on-demand A100 in eu-west-1 (4.00), a 1-month reservation
      of 1 H100 (1.50/h x 730 h = 1,095.00); April 1 h on-demand A100 (1.00).
    """
    beta = make_tenant("beta")
    BillingAccount.objects.create(tenant=tenant, tax_rate_percent=D("10"))
    Node.objects.filter(pk=node.pk).update(registered_at=utc(2024, 1, 1))
    eu = Region.objects.create(code="eu-west-1", name="EU West")
    eu_node = Node.objects.create(hostname="eu-0001", region=eu, registered_at=utc(2024, 3, 16))
    eu_gpus = [
        Gpu.objects.create(
            node=eu_node, index=i, uuid=f"GPU-{uuid.uuid4()}", model=a100, reported_name="A100"
        )
        for i in range(4)
    ]
    Gpu.objects.filter(pk=eu_gpus[3].pk).update(removed_at=utc(2024, 3, 24))

    def run_a100(t, start, end):
        w = Workload.objects.create(tenant=t, kind="job", state="running", image="img", started_at=start)
        Allocation.objects.create(
            tenant=t,
            workload=w,
            node=eu_node,
            gpu=eu_gpus[0],
            gpu_model=a100,
            plan=Plan.ON_DEMAND,
            started_at=start,
            ended_at=end,
            end_reason="stopped",
        )
        WorkloadEvent.objects.create(
            tenant=t, workload=w, at=start, from_state="starting", to_state="running", reason="started"
        )

    ten_hours = run(tenant, utc(2024, 3, 2), utc(2024, 3, 2, 10), gpu_index=0)
    run(tenant, utc(2024, 3, 3), utc(2024, 3, 3, 0, 0, 30), gpu_index=0)
    run(tenant, utc(2024, 4, 2), utc(2024, 4, 2, 2), gpu_index=0)
    run(beta, utc(2024, 3, 5), utc(2024, 3, 5, 5), plan=Plan.SPOT, gpu_index=1)
    run_a100(beta, utc(2024, 3, 20), utc(2024, 3, 20, 4))
    run_a100(beta, utc(2024, 4, 20), utc(2024, 4, 20, 1))
    reserve(beta, utc(2024, 3, 1), utc(2024, 4, 1))
    usage_build(since=utc(2024, 3, 1), now=utc(2024, 5, 1))
    UsageRecord.objects.filter(allocation=ten_hours).update(avg_util_pct=50.0)

    march = {
        t.slug: invoice_finalize(
            invoice=invoice_build(tenant=t, period_start=MARCH), actor=SYSTEM, now=utc(2024, 4, 4)
        )
        for t in (tenant, beta)
    }
    invoice_mark_paid(invoice=march["acme"], actor=SYSTEM, now=utc(2024, 4, 10))
    credit_note_issue(invoice=march["beta"], amount="3.00", reason="Goodwill", actor=SYSTEM)
    april_acme = invoice_finalize(
        invoice=invoice_build(tenant=tenant, period_start=APRIL), actor=SYSTEM, now=utc(2024, 5, 4)
    )
    april_beta = invoice_build(tenant=beta, period_start=APRIL)  # stays a draft
    return {"acme": tenant, "beta": beta, "march": march, "april_acme": april_acme, "april_beta": april_beta}


def _rows(report, month=MARCH):
    return {r.label: r.amount for r in report.rows if r.month == month}


def test_revenue_by_tenant_model_plan_and_region_adds_up_to_the_invoices(books):
    march = books["march"]
    assert march["acme"].subtotal == D("20.030") and march["acme"].total == D("22.030")
    assert march["beta"].subtotal == D("1103.000")
    by_tenant = reports.revenue_report(first=MARCH, last=APRIL, group_by="tenant")
    assert _rows(by_tenant) == {"Acme": D("20.030"), "Beta": D("1103.000")}
    assert _rows(by_tenant, APRIL) == {"Acme": D("4.000")}  # beta's April is a draft
    with_drafts = reports.revenue_report(
        first=MARCH, last=APRIL, group_by="tenant", statuses=(*reports.REVENUE_STATUSES, "draft")
    )
    assert _rows(with_drafts, APRIL) == {"Acme": D("4.000"), "Beta": D("1.000")}

    by_model = reports.revenue_report(first=MARCH, last=MARCH, group_by="model")
    assert _rows(by_model) == {"NVIDIA H100 SXM 80GB": D("1119.030"), "NVIDIA A100 SXM 80GB": D("4.000")}
    h100 = next(r for r in by_model.rows if r.label == "NVIDIA H100 SXM 80GB")
    assert h100.gpu_hours.quantize(D("0.001")) == D("15.017")  # 10 h + 60 s + 5 h spot; fees are not hours

    by_plan = reports.revenue_report(first=MARCH, last=MARCH, group_by="plan")
    assert _rows(by_plan) == {"On demand": D("24.030"), "Spot": D("4.000"), "Reserved": D("1095.000")}

    by_region = reports.revenue_report(first=MARCH, last=MARCH, group_by="region")
    assert _rows(by_region) == {
        "us-east-1": D("24.03"),
        "eu-west-1": D("4.00"),
        reports.UNATTRIBUTED_LABEL: D("1095.000"),
    }

    (total,) = by_region.totals
    assert (total.month, total.currency, total.invoices) == (MARCH, "USD", 2)
    assert total.charges == D("1123.030") == sum(_rows(by_region).values())
    assert (total.tax, total.total, total.credit_notes) == (D("2.000"), D("1125.030"), D("3.000"))
    assert total.net == D("1120.030")


def test_void_invoices_are_not_revenue(books):
    from metering.services.invoices import invoice_void

    invoice_void(invoice=books["march"]["beta"], actor=SYSTEM, reason="Billed in error")
    report = reports.revenue_report(first=MARCH, last=MARCH, group_by="tenant")
    assert _rows(report) == {"Acme": D("20.030")}


def test_gpu_hours_capacity_used_billed_and_busy(books):
    now = utc(2024, 5, 1)
    fleet = reports.gpu_hours_report(first=MARCH, last=APRIL, group_by="fleet", now=now)
    march, april = fleet
    # us-east: 8 GPUs x 31 days x 24 h; eu-west: 3 GPUs x 16 days + 1 GPU x 8 days, x 24 h.
    assert march.capacity_h == D(8 * 744 + 3 * 384 + 192) == D(7296)
    assert april.capacity_h == D(8 * 720 + 3 * 720)
    micro = D("0.000001")
    assert march.used_h.quantize(micro) == (D(19) + D(30) / 3600).quantize(micro)
    assert march.billed_h.quantize(micro) == (D(19) + D(60) / 3600).quantize(micro)
    assert march.busy_h == D(5) and march.metered_h == D(10) and march.busy_pct == D(50)
    assert march.idle_h == march.capacity_h - march.used_h
    assert round(march.utilisation_pct, 4) == round(march.used_h * 100 / D(7296), 4)
    assert april.used_h == D(3) and april.busy_h is None and april.busy_pct is None

    by_region = {
        (r.month, r.key): r
        for r in reports.gpu_hours_report(first=MARCH, last=MARCH, group_by="region", now=now)
    }
    assert by_region[(MARCH, "eu-west-1")].capacity_h == D(1344)
    assert by_region[(MARCH, "eu-west-1")].used_h == D(4)
    assert by_region[(MARCH, "us-east-1")].used_h.quantize(micro) == (D(15) + D(30) / 3600).quantize(micro)
    by_model = reports.gpu_hours_report(first=MARCH, last=MARCH, group_by="model", now=now)
    assert {r.label: r.capacity_h for r in by_model} == {
        "NVIDIA H100 SXM 80GB": D(5952),
        "NVIDIA A100 SXM 80GB": D(1344),
    }
    # Capacity never counts the future: on 2024-03-11 12:00, 10.5 days of March have passed.
    partial = reports.gpu_hours_report(first=MARCH, last=MARCH, group_by="model", now=utc(2024, 3, 11, 12))
    assert {r.label: r.capacity_h for r in partial}["NVIDIA H100 SXM 80GB"] == D(8 * 252)


def test_receivables_by_tenant_and_age(books):
    # beta's March (1,103.00 less a 3.00 credit note) was due 2024-04-18; acme's April is due 05-18.
    early = reports.receivables_report(now=utc(2024, 5, 10))
    rows = {r.tenant: r for r in early.rows}
    assert set(rows) == {"Acme", "Beta"}  # acme's March is paid
    assert rows["Beta"].buckets["1-30"] == D("1100.000") and rows["Beta"].overdue == D("1100.000")
    assert rows["Acme"].buckets["current"] == D("4.400") and rows["Acme"].overdue == 0
    assert early.totals()["USD"]["outstanding"] == D("1104.400")
    assert [inv.pk for inv in early.oldest] == [books["march"]["beta"].pk]

    later = reports.receivables_report(now=utc(2024, 8, 1))
    rows = {r.tenant: r for r in later.rows}
    assert rows["Beta"].buckets["90+"] == D("1100.000")
    assert rows["Acme"].buckets["61-90"] == D("4.400")


@pytest.fixture
def staff_client(signed_in):  # noqa: F811
    user = User.objects.create_user(email="finance@gpupool.test", password="pw-for-tests-1", is_staff=True)
    return signed_in(user)


@pytest.fixture
def tenant_client(signed_in, tenant):  # noqa: F811
    return signed_in(Membership.objects.get(tenant=tenant, role=Role.OWNER).user, tenant)


def test_pages_render_with_tables_charts_and_csv(books, staff_client):
    page = staff_client.get("/staff/finance/?start=2024-03&end=2024-04&group=tenant")
    assert page.status_code == 200
    html = page.content.decode()
    assert "<svg" in html and "Revenue by month (USD)" in html
    assert "1,103.00 USD" in html and "20.03 USD" in html and "1,120.03 USD" in html  # net March
    assert 'href="/staff/finance/receivables/"' in html
    default = staff_client.get("/staff/finance/")  # the last 12 months, by month
    assert default.status_code == 200 and 'class="nav-link active"' in default.content.decode()

    export = staff_client.get("/staff/finance/?start=2024-03&end=2024-03&group=region&export=csv")
    assert export.status_code == 200 and export["Content-Type"].startswith("text/csv")
    assert "revenue-2024-03-2024-03-region.csv" in export["Content-Disposition"]
    rows = list(csv.reader(io.StringIO(export.content.decode())))
    assert rows[0][:2] == ["month", "currency"]
    body = rows[1 : rows.index([])]
    assert {r[3]: r[4] for r in body} == {
        "us-east-1": "24.03",
        "eu-west-1": "4.00",
        reports.UNATTRIBUTED_LABEL: "1095.00",
    }
    totals = rows[rows.index([]) + 2]
    assert totals[:4] == ["2024-03", "USD", "2", "1123.03"]

    gh = staff_client.get("/staff/finance/gpu-hours/?start=2024-03&end=2024-03&group=region")
    assert gh.status_code == 200 and "<svg" in gh.content.decode() and "1344.0" in gh.content.decode()
    gh_csv = staff_client.get("/staff/finance/gpu-hours/?start=2024-03&end=2024-03&group=region&export=csv")
    gh_rows = {r[1]: r for r in csv.reader(io.StringIO(gh_csv.content.decode()))}
    assert gh_rows["eu-west-1"][3:5] == ["1344.000", "4.000"]

    rec = staff_client.get("/staff/finance/receivables/")
    assert rec.status_code == 200
    assert "1,100.00 USD" in rec.content.decode() and "<svg" in rec.content.decode()
    rec_csv = staff_client.get("/staff/finance/receivables/?export=csv")
    rec_rows = list(csv.reader(io.StringIO(rec_csv.content.decode())))
    beta = next(r for r in rec_rows if r[1] == "Beta")
    assert beta[-2:] == ["1100.00", "1100.00"]


def test_bad_filters_answer_400_naming_the_field(staff_client):
    for query, field in (
        ("start=2024-13", "start"),
        ("start=March", "start"),
        ("start=2024-05&end=2024-03", "start"),
        ("start=2020-01&end=2024-01", "end"),
        ("group=galaxy", "group"),
    ):
        page = staff_client.get(f"/staff/finance/?{query}")
        assert page.status_code == 400, query
        api = staff_client.get(f"/api/staff/v1/finance/revenue/?{query}")
        assert api.status_code == 400, query
        assert field in api.json()["error"]["fields"], query


def test_only_staff_see_finance(books, tenant_client, client, make_token, api, tenant):
    assert 'href="/staff/finance/"' not in tenant_client.get("/").content.decode()  # no nav entry
    for url in ("/staff/finance/", "/staff/finance/gpu-hours/", "/staff/finance/receivables/"):
        assert tenant_client.get(url).status_code == 403
        assert tenant_client.get(url + "?export=csv").status_code == 403
        anonymous = client.get(url)
        assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]
    token = api(make_token(tenant))  # an owner's token with every tenant scope
    for name in ("revenue", "gpu-hours", "receivables"):
        response = token.get(f"/api/staff/v1/finance/{name}/")
        assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"
        assert client.get(f"/api/staff/v1/finance/{name}/").status_code == 401


def test_the_staff_api_gives_the_same_numbers(books, staff_client, make_tenant, make_token, api):
    body = staff_client.get("/api/staff/v1/finance/revenue/?start=2024-03&end=2024-03&group=plan").json()
    assert {r["key"]: r["amount"] for r in body["rows"]} == {
        "on_demand": "24.03",
        "spot": "4.00",
        "reserved": "1095.00",
    }
    assert body["totals"][0]["charges"] == "1123.03" and body["totals"][0]["net"] == "1120.03"

    # A staff token gives the same numbers (a tenant's token never does: test_staff_api_access).
    staff = User.objects.get(email="finance@gpupool.test")
    from portal.staff_tokens import staff_token_create

    _, plaintext = staff_token_create(
        user=staff, name="finance", scopes=["finance:read"], actor=Actor(user=staff)
    )
    gh = api(plaintext).get("/api/staff/v1/finance/gpu-hours/?start=2024-03&end=2024-03")
    assert gh.status_code == 200
    (row,) = gh.json()["rows"]
    assert row["capacity_gpu_hours"] == "7296.000" and row["busy_pct"] == "50.00"
    rec = api(plaintext).get("/api/staff/v1/finance/receivables/").json()
    assert rec["totals"]["USD"]["outstanding"] == "1104.40"


def test_currencies_are_never_added_together_and_labels_are_escaped(books, make_tenant, staff_client):
    from metering.models import Invoice, InvoiceLine, LineKind

    euro = make_tenant("euro", name="<b>Euro & Co</b>")
    inv = Invoice.objects.create(
        tenant=euro, period_start=MARCH, period_end=APRIL, currency="EUR", subtotal=D("50"), total=D("50")
    )
    InvoiceLine.objects.create(
        tenant=euro,
        invoice=inv,
        position=1,
        kind=LineKind.ON_DEMAND,
        plan="on_demand",
        description="x",
        amount=D("50"),
    )
    Invoice.objects.filter(pk=inv.pk).update(status="finalized", due_at=utc(2024, 4, 18))

    report = reports.revenue_report(first=MARCH, last=MARCH, group_by="tenant")
    assert {(t.currency, t.charges) for t in report.totals} == {("USD", D("1123.030")), ("EUR", D("50"))}
    assert {(r.currency, r.label, r.amount) for r in report.rows if r.currency == "EUR"} == {
        ("EUR", "<b>Euro & Co</b>", D("50"))
    }
    html = staff_client.get("/staff/finance/?start=2024-03&end=2024-03&group=tenant").content.decode()
    assert "Revenue by month (EUR)" in html and "50.00 EUR" in html and "1,123.03 USD" in html
    assert "<b>Euro" not in html and "&lt;b&gt;Euro &amp; Co&lt;/b&gt;" in html
    totals = reports.receivables_report(now=utc(2024, 5, 10)).totals()
    assert totals["EUR"]["1-30"] == D("50") and totals["USD"]["outstanding"] == D("1104.400")
