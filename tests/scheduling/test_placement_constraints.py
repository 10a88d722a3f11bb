"""Placement constraints through the API and a real scheduling cycle on the database."""

from __future__ import annotations

import pytest

from scheduling.models import Allocation, Workload
from tests.scheduling.conftest import A100, H100, reload

pytestmark = pytest.mark.django_db

JOB = {"gpu_models": ["H100"], "gpu_count": 8, "image": "ghcr.io/acme/train:1", "command": ["python", "t.py"]}


@pytest.fixture
def client(tenant, make_token, api):
    return api(make_token(tenant))


def _post(client, **extra):
    return client.post("/api/v1/jobs/", {**JOB, **extra}, content_type="application/json")


def _labelled(make_node, rack, **kw):
    node = make_node(**kw)
    node.labels = {"rack": rack, "simulated": "true"}
    node.save(update_fields=["labels"])
    return node


def _nodes(w):
    return set(Allocation.objects.filter(workload=w, ended_at__isnull=True).values_list("node_id", flat=True))


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"node_selector": {"bad key!": "x"}}, "node_selector"),
        ({"node_selector": {"rack": "r 1"}}, "node_selector.rack"),
        ({"node_selector": {f"k{i}": "v" for i in range(5000)}}, "node_selector"),
        ({"node_selector": ["rack"]}, "node_selector"),
        ({"affinity": {"workloads": []}}, "affinity.workloads"),
        ({"affinity": {"workloads": [1], "evil": 1}}, "affinity"),
        ({"affinity": {"workloads": list(range(1, 1000))}}, "affinity.workloads"),
        ({"anti_affinity": {"workloads": ["1"]}}, "anti_affinity.workloads"),
        ({"anti_affinity": {"workloads": [10**30]}}, "anti_affinity.workloads"),
        ({"spread": {"topology_key": "rack"}}, "spread"),  # not an array nor a gang
        (
            {"gang": True, "gpu_count": 16, "spread": {"topology_key": "rack", "max_skew": 0}},
            "spread.max_skew",
        ),
        ({"gang": True, "gpu_count": 16, "spread": {"topology_key": "../x"}}, "spread.topology_key"),
        ({"preference": "fastest"}, "preference"),  # only one model allowed
        ({"preference": "best", "gpu_models": ["H100", "A100"]}, "preference"),
    ],
)
def test_hostile_placement_fields_are_400s_naming_the_field(client, make_node, extra, field):
    make_node()
    before = Workload.objects.count()
    r = _post(client, **extra)
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"], r.json()
    assert Workload.objects.count() == before


def test_another_tenants_workload_cannot_be_named(client, make_tenant, make_node, submit):
    make_node()
    other = submit(make_tenant("rival"), gpu_count=1)
    own = _post(client, gpu_count=1)
    assert own.status_code == 201
    # Positive control: its own id is accepted.
    r = _post(client, gpu_count=1, anti_affinity={"workloads": [own.json()["id"]], "topology_key": "node"})
    assert r.status_code == 201, r.content
    assert r.json()["anti_affinity"] == {"workloads": [own.json()["id"]], "topology_key": "node"}
    taken = _post(client, gpu_count=1, affinity={"workloads": [other.pk]})
    absent = _post(client, gpu_count=1, affinity={"workloads": [other.pk + 10_000]})
    assert taken.status_code == absent.status_code == 400
    msg = taken.json()["error"]["fields"]["affinity.workloads"][0]
    assert msg.replace(str(other.pk), "N") == absent.json()["error"]["fields"]["affinity.workloads"][
        0
    ].replace(str(other.pk + 10_000), "N")


def test_cycle_honours_selector_anti_affinity_and_pending_reason(tenant, make_node, submit, cycle):
    r1 = _labelled(make_node, "r1")
    r2 = _labelled(make_node, "r2")
    r2b = _labelled(make_node, "r2")
    a = submit(tenant, gpu_count=8, node_selector={"rack": "r2"})
    cycle()
    assert _nodes(reload(a)) <= {r2.pk, r2b.pk} and _nodes(reload(a))
    b = submit(tenant, gpu_count=4, anti_affinity={"workloads": [a.pk], "topology_key": "rack"})
    cycle()
    assert _nodes(reload(b)) == {r1.pk}
    c = submit(tenant, gpu_count=8, node_selector={"rack": "r9"})
    cycle()
    c = reload(c)
    assert c.state in ("queued", "pending") and c.pending_reason == "node_selector"
    assert "rack=r9" in c.pending_message


def test_cycle_spreads_array_tasks_over_racks(tenant, make_node, submit, cycle):
    racks = {}
    for rack in ("r1", "r1", "r2", "r2"):
        racks[_labelled(make_node, rack).pk] = rack
    job = submit(tenant, gpu_count=1, array={"count": 4}, spread={"topology_key": "rack", "max_skew": 1})
    cycle()
    cycle()
    tasks = list(Workload.objects.filter(array_parent=job))
    placed = [racks[n] for t in tasks for n in _nodes(t)]
    assert sorted(placed) == ["r1", "r1", "r2", "r2"], placed


def test_cycle_prefers_the_fastest_model(tenant, make_node, submit, cycle):
    h = make_node(model=H100)
    a = make_node(model=A100)
    first = submit(tenant, gpu_count=1, gpu_models=[A100])
    cycle()
    assert _nodes(reload(first)) == {a.pk}
    # Without a preference packing puts it beside the first, on the A100s; "fastest" on the H100s.
    plain = submit(tenant, gpu_count=1, gpu_models=[H100, A100])
    cycle()
    fast = submit(tenant, gpu_count=1, gpu_models=[H100, A100], preference="fastest")
    cycle()
    assert _nodes(reload(plain)) == {a.pk}
    assert _nodes(reload(fast)) == {h.pk}


def test_cost_estimate_says_which_model_it_chose_and_why(client, make_node):
    from datetime import UTC, datetime

    from metering.models import RateCard
    from metering.services.rates import rate_card_version_create
    from nodes.models import GpuModel

    h100, a100 = GpuModel.objects.get(name=H100), GpuModel.objects.get(name=A100)
    rc = RateCard.objects.create(name="Standard", currency="USD", is_default=True)
    rate_card_version_create(
        rate_card=rc,
        effective_from=datetime(2020, 1, 1, tzinfo=UTC),
        gpu_prices={(h100.pk, "on_demand"): "2.00", (a100.pk, "on_demand"): "1.00"},
        allow_past=True,
    )
    make_node(model=H100)
    make_node(model=A100, region="eu")
    one = client.post("/api/v1/cost-estimate/", {"gpu_model": "H100"}, content_type="application/json")
    assert one.status_code == 200, one.content
    assert one.json()["placement"]["gpu_model"] == H100 and one.json()["placement"]["region"] == "us-east-1"
    both = [H100, A100]
    fast = client.post(
        "/api/v1/cost-estimate/",
        {"gpu_models": both, "preference": "fastest"},
        content_type="application/json",
    ).json()
    cheap = client.post(
        "/api/v1/cost-estimate/",
        {"gpu_models": both, "preference": "cheapest"},
        content_type="application/json",
    ).json()
    assert fast["placement"]["gpu_model"] == H100 and fast["placement"]["reason"] == "highest compute weight"
    cands = {c["gpu_model"]: c for c in cheap["placement"]["candidates"]}
    best = max(cands.values(), key=lambda c: float(c["compute_weight"]) / float(c["price_per_gpu_hour"]))
    assert cheap["placement"]["gpu_model"] == best["gpu_model"]
    assert cheap["placement"]["candidates"][0]["gpu_model"] == best["gpu_model"] == A100
    assert cheap["placement"]["region"] == ("us-east-1" if best["gpu_model"] == H100 else "eu-west-1")
    # per_hour prices the chosen model.
    alone = client.post(
        "/api/v1/cost-estimate/", {"gpu_model": best["gpu_model"]}, content_type="application/json"
    ).json()
    assert cheap["per_hour"]["on_demand"] == alone["per_hour"]["on_demand"]
    bad = client.post(
        "/api/v1/cost-estimate/",
        {"gpu_model": "H100", "preference": "fastest"},
        content_type="application/json",
    )
    assert bad.status_code == 400 and "preference" in bad.json()["error"]["fields"]
    neither = client.post("/api/v1/cost-estimate/", {}, content_type="application/json")
    assert neither.status_code == 400 and "gpu_model" in neither.json()["error"]["fields"]
