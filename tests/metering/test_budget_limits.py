"""The budget's limit: estimated at the dearest model a request could land on, with a per-budget
action (alert only, refuse new work, or also stop running on-demand and spot work with notice)."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.core import mail
from django.test import override_settings

from metering.models import Budget, BudgetLimitAction
from metering.services.budgets import costs_to_date_update
from portal.actors import Actor
from scheduling.admission import AdmissionRefused
from scheduling.models import Plan, Workload, WorkloadEvent, WorkloadState
from scheduling.services.submission import workload_submit
from tests.metering.conftest import H100, utc

pytestmark = pytest.mark.django_db


def _submit(tenant, **spec):
    spec.setdefault("image", "ghcr.io/acme/train:1")
    spec.setdefault("command", ["python", "train.py"])
    return workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())


def test_a_request_by_constraints_is_estimated_at_the_dearest_model_it_could_land_on(tenant, card, node):
    Budget.objects.create(tenant=tenant, monthly_limit=Decimal("1"), limit_action=BudgetLimitAction.REFUSE)
    big = {"gpu_count": 8, "max_runtime_s": 30 * 86400}
    with pytest.raises(AdmissionRefused) as by_name:
        _submit(tenant, gpu_models=[H100], **big)
    assert by_name.value.code == "budget_exceeded"
    # The same request by constraints (80 GiB: H100 at 2.00/h or A100 at 1.00/h) is refused too,
    # estimated at the H100's price: 8 x 2.00 x 720 h = 11,520.00.
    with pytest.raises(AdmissionRefused) as by_constraints:
        _submit(tenant, min_gpu_memory_gib=80, **big)
    assert by_constraints.value.code == "budget_exceeded"
    assert "11520.00" in str(by_constraints.value)
    assert Workload.objects.count() == 0


def test_alert_only_budgets_refuse_nothing_and_refuse_budgets_count_work_not_yet_running(tenant, card, node):
    budget = Budget.objects.create(tenant=tenant, monthly_limit=Decimal("1.50"))
    assert budget.limit_action == BudgetLimitAction.ALERT
    _submit(tenant, gpu_models=[H100], max_runtime_s=3600 * 10)  # 20.00, but only alerts
    Workload.objects.all().delete()
    Budget.objects.filter(pk=budget.pk).update(limit_action=BudgetLimitAction.REFUSE)
    _submit(tenant, gpu_models=[H100], max_runtime_s=1800)  # 1.00: fits
    with pytest.raises(AdmissionRefused, match="not yet running"):
        _submit(tenant, gpu_models=[H100], max_runtime_s=1800)  # another 1.00 on top of the pending 1.00


@override_settings(METERING_BUDGET_STOP_NOTICE_S=600)
def test_a_stop_budget_stops_running_on_demand_and_spot_work_after_notice(
    tenant, card, run, reserve, django_capture_on_commit_callbacks
):
    Budget.objects.create(tenant=tenant, monthly_limit=Decimal("10"), limit_action=BudgetLimitAction.STOP)
    on_demand = run(tenant, utc(2024, 3, 1, 0), None)  # 2.00 per hour
    spot = run(tenant, utc(2024, 3, 1, 0), None, plan=Plan.SPOT)  # 0.80 per hour
    r = reserve(tenant, utc(2024, 2, 1), utc(2024, 5, 1))
    reserved = run(tenant, utc(2024, 3, 1, 0), None, plan=Plan.RESERVED, reservation=r)
    # Under the limit: nothing happens.
    costs_to_date_update(now=utc(2024, 3, 1, 0, 1))
    assert not mail.outbox
    # Past the limit after 6 h (12.00 on-demand, 4.80 spot, 8.40 of the fee): notice first.
    with django_capture_on_commit_callbacks(execute=True):
        costs_to_date_update(now=utc(2024, 3, 1, 6))
    notice = [m for m in mail.outbox if "stop" in m.subject.lower()]
    assert len(notice) == 1 and "600" in notice[0].body
    assert Workload.objects.get(pk=on_demand.workload_id).state == WorkloadState.RUNNING
    # Still over once the notice has passed: on-demand and spot work stops, reserved work runs on.
    costs_to_date_update(now=utc(2024, 3, 1, 6) + timedelta(seconds=601))
    for a in (on_demand, spot):
        w = Workload.objects.get(pk=a.workload_id)
        assert w.state == WorkloadState.STOPPING
        assert WorkloadEvent.objects.filter(workload=w, reason="budget_exceeded").exists()
    assert Workload.objects.get(pk=reserved.workload_id).state == WorkloadState.RUNNING
    # A second run changes nothing and sends no second notice.
    with django_capture_on_commit_callbacks(execute=True):
        costs_to_date_update(now=utc(2024, 3, 1, 6) + timedelta(seconds=700))
    assert len([m for m in mail.outbox if "stop" in m.subject.lower()]) == 1


def test_the_budget_api_takes_and_shows_the_limit_action(tenant, card, make_token, api):
    client = api(make_token(tenant))
    response = client.put(
        "/api/v1/budget/", {"monthly_limit": "100", "limit_action": "stop"}, content_type="application/json"
    )
    assert response.status_code == 200, response.content
    assert response.json()["limit_action"] == "stop" and response.json()["hard_limit"] is True
    assert Budget.objects.get(tenant=tenant).limit_action == "stop"
    bad = client.put(
        "/api/v1/budget/",
        {"monthly_limit": "100", "limit_action": "explode"},
        content_type="application/json",
    )
    assert bad.status_code == 400 and "limit_action" in bad.json()["error"]["fields"]
    # hard_limit alone still means refuse
    client.put(
        "/api/v1/budget/", {"monthly_limit": "100", "hard_limit": True}, content_type="application/json"
    )
    assert Budget.objects.get(tenant=tenant).limit_action == "refuse"
