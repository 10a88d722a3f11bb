"""Queue policy per region: the live cycle orders a region's queue by the policy staff chose, through
the engine's ``FairQueue`` (the simulator's code); staff set it on a page and through the staff API."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from nodes.models import Region
from portal.actors import Actor
from portal.models import AuditEvent, StaffScope, User
from portal.staff_tokens import staff_token_create
from scheduling.models import Workload
from scheduling.services.queue_policy import QUEUE_POLICY_AUDIT_ACTION

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff(db) -> User:
    return User.objects.create_user(email="ops@gpupool.test", password="pw-for-tests-1", is_staff=True)


def _aged(w: Workload, minutes: float) -> None:
    Workload.objects.filter(pk=w.pk).update(submitted_at=timezone.now() - timedelta(minutes=minutes))


@pytest.fixture
def three(tenant, regions, make_node, submit):
    """One free GPU in us-east-1 and three jobs for it: the oldest (spot, long), a short one (spot),
    and the newest (on-demand, no estimate). Each policy picks a different one."""
    make_node(gpus=1)
    jobs = {
        "oldest": submit(tenant, region="us-east-1", plan="spot", estimated_runtime_s=36000),
        "shortest": submit(tenant, region="us-east-1", plan="spot", estimated_runtime_s=60),
        "on_demand": submit(tenant, region="us-east-1", plan="on_demand"),
    }
    _aged(jobs["oldest"], 30)
    _aged(jobs["shortest"], 20)
    _aged(jobs["on_demand"], 10)
    return jobs


@pytest.mark.parametrize(
    "policy, first",
    [("", "on_demand"), ("fcfs", "oldest"), ("sjf", "shortest"), ("priority_aging", "on_demand")],
)
def test_the_same_queue_is_placed_in_the_policys_order(three, regions, cycle, policy, first):
    Region.objects.filter(pk=regions["us"].pk).update(queue_policy=policy)
    assert cycle().placed == [three[first].pk]


def test_sjf_puts_work_without_an_estimate_last(tenant, regions, make_node, submit, cycle):
    make_node(gpus=1)
    Region.objects.filter(pk=regions["us"].pk).update(queue_policy="sjf")
    none = submit(tenant, region="us-east-1")
    _aged(none, 60)
    long = submit(tenant, region="us-east-1", estimated_runtime_s=7200)
    assert cycle().placed == [long.pk]


@pytest.mark.parametrize("waited_min, first", [(30, "on_demand"), (90, "spot")])
def test_priority_aging_adds_one_class_per_hour_waited(
    tenant, regions, make_node, submit, cycle, waited_min, first
):
    make_node(gpus=1)
    Region.objects.filter(pk=regions["us"].pk).update(queue_policy="priority_aging")
    jobs = {"spot": submit(tenant, region="us-east-1", plan="spot")}
    jobs["on_demand"] = submit(tenant, region="us-east-1", plan="on_demand")
    _aged(jobs["spot"], waited_min)
    assert cycle().placed == [jobs[first].pk]


def test_a_region_orders_only_its_own_queue(three, regions, cycle):
    # The policy of another region changes nothing here.
    Region.objects.filter(pk=regions["eu"].pk).update(queue_policy="sjf")
    assert cycle().placed == [three["on_demand"].pk]


def test_staff_set_the_policy_on_the_page_audited(staff, tenant, regions, three, cycle):
    client = Client()
    client.force_login(staff)
    page = client.get("/staff/queue-policy/")
    assert page.status_code == 200 and b"us-east-1" in page.content
    r = client.post("/staff/queue-policy/", {"region": "us-east-1", "queue_policy": "sjf"})
    assert r.status_code == 302
    assert Region.objects.get(code="us-east-1").queue_policy == "sjf"
    event = AuditEvent.objects.get(action=QUEUE_POLICY_AUDIT_ACTION)
    assert event.data == {
        "before": {"queue_policy": "", "queue_policy_by_plan": {}},
        "after": {"queue_policy": "sjf", "queue_policy_by_plan": {}},
    }
    assert event.actor_user == staff
    assert b"sjf" in client.get("/staff/queue-policy/").content
    # The effect, where the user sees it: the short job runs first.
    assert cycle().placed == [three["shortest"].pk]
    # A bad value: 400 naming the field, nothing written.
    bad = client.post("/staff/queue-policy/", {"region": "us-east-1", "queue_policy": "lifo"})
    assert bad.status_code == 400 and b"Must be one of" in bad.content
    assert Region.objects.get(code="us-east-1").queue_policy == "sjf"
    assert AuditEvent.objects.filter(action=QUEUE_POLICY_AUDIT_ACTION).count() == 1


def test_tenants_get_403_on_the_page_and_the_api(tenant, owner, regions, make_token, api):
    client = Client()
    client.force_login(owner)
    assert client.get("/staff/queue-policy/").status_code == 403
    assert (
        client.post("/staff/queue-policy/", {"region": "us-east-1", "queue_policy": "sjf"}).status_code == 403
    )
    token = make_token(tenant)
    for method in ("get", "patch"):
        r = getattr(api(token), method)(
            "/api/staff/v1/regions/us-east-1/", data={"queue_policy": "sjf"}, content_type="application/json"
        )
        assert r.status_code == 403, r.content
    assert (
        client.patch(
            "/api/staff/v1/regions/us-east-1/", data={"queue_policy": "sjf"}, content_type="application/json"
        ).status_code
        == 403
    )
    assert Region.objects.get(code="us-east-1").queue_policy == ""
    assert not AuditEvent.objects.filter(action=QUEUE_POLICY_AUDIT_ACTION).exists()


def test_staff_set_the_policy_through_the_api(staff, regions, three, cycle, api):
    _, plaintext = staff_token_create(
        user=staff, name="ops", scopes=[StaffScope.SCHEDULING_WRITE], actor=Actor(user=staff)
    )
    listing = api(plaintext).get("/api/staff/v1/regions/")
    assert listing.status_code == 200
    assert {r["code"]: r["queue_policy"] for r in listing.json()["results"]}["us-east-1"] == ""
    r = api(plaintext).patch(
        "/api/staff/v1/regions/us-east-1/", data={"queue_policy": "fcfs"}, content_type="application/json"
    )
    assert r.status_code == 200 and r.json()["queue_policy"] == "fcfs"
    event = AuditEvent.objects.get(action=QUEUE_POLICY_AUDIT_ACTION)
    assert event.data == {"before": {"queue_policy": ""}, "after": {"queue_policy": "fcfs"}}
    assert cycle().placed == [three["oldest"].pk]
    # A staff token without the scope is refused.
    _, finance = staff_token_create(
        user=staff, name="fin", scopes=[StaffScope.FINANCE_READ], actor=Actor(user=staff)
    )
    r = api(finance).patch(
        "/api/staff/v1/regions/us-east-1/", data={"queue_policy": "sjf"}, content_type="application/json"
    )
    assert r.status_code == 403


@pytest.mark.parametrize(
    "body, field",
    [
        ({"queue_policy": "lifo"}, "queue_policy"),
        ({"queue_policy": 3}, "queue_policy"),
        ({"queue_policy": None}, "queue_policy"),
        ({}, "queue_policy"),
        ({"queue_policy": "sjf", "aging": 2}, "aging"),
        ({"queue_policy_by_plan": {"spot": "lifo"}}, "queue_policy_by_plan"),
        ({"queue_policy_by_plan": {"gold": "sjf"}}, "queue_policy_by_plan"),
        ({"queue_policy_by_plan": {"spot": ""}}, "queue_policy_by_plan"),
        ({"queue_policy_by_plan": ["sjf"]}, "queue_policy_by_plan"),
        ({"queue_policy": "sjf", "queue_policy_by_plan": "sjf"}, "queue_policy_by_plan"),
        (["sjf"], "queue_policy"),
    ],
)
def test_bad_values_answer_400_naming_the_field(staff, regions, body, field):
    client = Client()
    client.force_login(staff)
    r = client.patch("/api/staff/v1/regions/us-east-1/", data=body, content_type="application/json")
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"], r.json()
    assert Region.objects.get(code="us-east-1").queue_policy == ""
    assert not AuditEvent.objects.filter(action=QUEUE_POLICY_AUDIT_ACTION).exists()
    # Positive control: a good value from the same client is taken.
    ok = client.patch(
        "/api/staff/v1/regions/us-east-1/", data={"queue_policy": "sjf"}, content_type="application/json"
    )
    assert ok.status_code == 200


def test_unknown_region_is_404(staff, regions):
    client = Client()
    client.force_login(staff)
    assert client.get("/api/staff/v1/regions/us-east-1/").status_code == 200
    assert client.get("/api/staff/v1/regions/nowhere/").status_code == 404


def test_a_plan_can_have_its_own_policy_in_a_region(staff, tenant, regions, make_node, submit, cycle):
    make_node(gpus=1)
    old = submit(tenant, region="us-east-1", plan="spot", estimated_runtime_s=3600)
    _aged(old, 10)
    short = submit(tenant, region="us-east-1", plan="spot", estimated_runtime_s=60)
    client = Client()
    client.force_login(staff)
    r = client.post(
        "/staff/queue-policy/", {"region": "us-east-1", "queue_policy": "fcfs", "plan_spot": "sjf"}
    )
    assert r.status_code == 302
    region = Region.objects.get(code="us-east-1")
    assert (region.queue_policy, region.queue_policy_by_plan) == ("fcfs", {"spot": "sjf"})
    # The API reads what the page wrote; spot work here is ordered shortest first.
    api_view = client.get("/api/staff/v1/regions/us-east-1/").json()
    assert api_view["queue_policy_by_plan"] == {"spot": "sjf"}
    assert cycle().placed == [short.pk]


def test_without_the_plan_override_the_regions_policy_orders_it(tenant, regions, make_node, submit, cycle):
    make_node(gpus=1)
    old = submit(tenant, region="us-east-1", plan="spot", estimated_runtime_s=3600)
    _aged(old, 10)
    submit(tenant, region="us-east-1", plan="spot", estimated_runtime_s=60)
    # An override for another plan leaves spot work on the region's FCFS.
    Region.objects.filter(code="us-east-1").update(
        queue_policy="fcfs", queue_policy_by_plan={"on_demand": "sjf"}
    )
    assert cycle().placed == [old.pk]


def test_the_admin_shows_the_policy_but_leaves_changes_to_the_audited_paths(staff, regions):
    staff.is_superuser = True
    staff.save()
    client = Client()
    client.force_login(staff)
    page = client.get(f"/admin/nodes/region/{regions['us'].pk}/change/")
    assert page.status_code == 200
    assert b'name="name"' in page.content  # positive control: editable fields are inputs
    assert b'name="queue_policy"' not in page.content and b'name="queue_policy_by_plan"' not in page.content
