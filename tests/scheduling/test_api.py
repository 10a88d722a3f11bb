from __future__ import annotations

import contextlib

import pytest
from django.utils import timezone

from nodes.models import Gpu, GpuModel
from scheduling.models import Allocation, Quota, Workload, WorkloadState
from scheduling.pricing import register_price_provider, unregister_price_provider
from tests.scheduling.conftest import H100, reload
from tests.ssh_keys import public_key

pytestmark = pytest.mark.django_db

JOB = {"gpu_models": ["H100"], "gpu_count": 2, "image": "ghcr.io/acme/train:1", "command": ["python", "t.py"]}


@pytest.fixture
def client(tenant, make_token, api):
    return api(make_token(tenant))


def test_create_list_detail_and_stop_a_job(client, make_node, cycle):
    make_node()
    r = client.post("/api/v1/jobs/", JOB, content_type="application/json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["state"] == "pending" and body["gpu_models"] == [H100] and body["kind"] == "job"
    assert body["pending"]["reason"] == "submitted"
    jid = body["id"]
    assert client.get("/api/v1/instances/").json()["results"] == []
    assert [j["id"] for j in client.get("/api/v1/jobs/?state=pending").json()["results"]] == [jid]
    assert client.get("/api/v1/jobs/?state=running").json()["results"] == []
    cycle()
    detail = client.get(f"/api/v1/jobs/{jid}/").json()
    assert detail["state"] == "scheduled" and detail["pending"] is None
    assert len(detail["placement"]) == 2 and detail["placement"][0]["gpu_model"] == H100
    events = client.get(f"/api/v1/jobs/{jid}/events/").json()
    assert [e["to_state"] for e in events] == ["pending", "queued", "scheduled"]
    r = client.post(f"/api/v1/jobs/{jid}/stop/")
    assert r.status_code == 200 and r.json()["state"] == "stopping"
    r = client.post(f"/api/v1/jobs/{jid}/stop/")
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    logs = client.get(f"/api/v1/jobs/{jid}/logs/").json()
    assert logs == {"lines": [], "next": "0"}  # no agent has sent output for it


def test_each_workload_names_its_gpu_models_in_catalog_order(client, make_node, django_assert_num_queries):
    """By vendor, then name; a page's names come in one statement, and no workloads need none."""
    from scheduling.selectors.shared import workload_gpu_model_names

    make_node()
    spec = {**JOB, "gpu_models": ["NVIDIA L4", "MI300X", "H100"]}
    r = client.post("/api/v1/jobs/", spec, content_type="application/json")
    assert r.status_code == 201, r.content
    many = r.json()["id"]
    one = client.post("/api/v1/jobs/", JOB, content_type="application/json").json()["id"]
    expected = {many: ["AMD Instinct MI300X", H100, "NVIDIA L4"], one: [H100]}
    listed = client.get("/api/v1/jobs/").json()["results"]
    assert {j["id"]: j["gpu_models"] for j in listed} == expected
    assert client.get(f"/api/v1/jobs/{many}/").json()["gpu_models"] == expected[many]
    with django_assert_num_queries(1):
        assert workload_gpu_model_names(workload_ids=[many, one, 10**9]) == expected
    with django_assert_num_queries(0):
        assert workload_gpu_model_names(workload_ids=[]) == {}


def test_lists_and_details_do_not_read_the_log_tail(client, make_node):
    """The agent's last message is read by none of them (``logs`` gives the stored lines)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    make_node()
    jid = client.post("/api/v1/jobs/", JOB, content_type="application/json").json()["id"]
    Workload.objects.filter(pk=jid).update(log_tail="epoch 3/3 loss=0.12")
    for url in ("/api/v1/jobs/", f"/api/v1/jobs/{jid}/", f"/api/v1/jobs/{jid}/logs/"):
        with CaptureQueriesContext(connection) as q:
            assert client.get(url).status_code == 200
        reads = [x["sql"] for x in q.captured_queries if "scheduling_workload" in x["sql"]]
        assert reads and not any("log_tail" in sql for sql in reads), reads
    assert client.get(f"/api/v1/jobs/{jid}/logs/").json() == {"lines": [], "next": "0"}


def test_bad_input_is_a_400_naming_the_field(client, make_node):
    make_node()
    for spec, field in [
        ({**JOB, "gpu_models": ["nope"]}, "gpu_models"),
        ({**JOB, "gpu_count": 0}, "gpu_count"),
        ({**JOB, "gpu_count": "many"}, "gpu_count"),
        ({**JOB, "region": "mars"}, "region"),
        ({**JOB, "gpu_count": 2, "gpu_fraction_milli": 100}, "gpu_fraction_milli"),
    ]:
        r = client.post("/api/v1/jobs/", spec, content_type="application/json")
        assert r.status_code == 400, r.content
        assert field in r.json()["error"]["fields"], r.json()
    r = client.post("/api/v1/instances/", {"gpu_models": ["H100"]}, content_type="application/json")
    assert r.status_code == 400 and "image" in r.json()["error"]["fields"]
    assert not Workload.objects.exists()


def test_a_quota_error_and_the_quota_endpoint(client, tenant, make_node):
    make_node()
    Quota.objects.create(tenant=tenant, max_gpus_total=3)
    assert client.post("/api/v1/jobs/", JOB, content_type="application/json").status_code == 201
    r = client.post("/api/v1/jobs/", JOB, content_type="application/json")
    assert r.status_code == 403
    err = r.json()["error"]
    assert err["code"] == "quota_exceeded" and err["fields"]["quota"] == "max_gpus_total"
    assert err["fields"]["limit"] == 3 and "in use 2" in err["message"]
    q = client.get("/api/v1/quotas/").json()
    assert q["limits"]["max_gpus_total"] == 3 and q["usage"]["gpus"] == "2" and q["usage"]["workloads"] == 1
    assert q["usage"]["gpus_per_model"] == {H100: "2"}


def test_gpu_types_show_live_availability_and_prices_when_provided(client, tenant, make_node, cycle, submit):
    make_node(gpus=8)
    make_node(gpus=8, region="eu")
    submit(tenant, gpu_count=3)
    cycle()
    types = {t["name"]: t for t in client.get("/api/v1/gpu-types/").json()}
    avail = {a["region"]: a for a in types[H100]["availability"]}
    assert avail["us-east-1"]["free_gpus"] + avail["eu-west-1"]["free_gpus"] == 13
    assert avail["us-east-1"]["total_gpus"] == 8
    assert avail["us-east-1"]["price_per_gpu_hour"] == {"on_demand": None, "spot": None, "reserved": None}
    assert types["NVIDIA T4"]["availability"] == []

    from decimal import Decimal

    class Flat:
        def prices(self, *, gpu_model, region):
            return {"on_demand": Decimal("2.50")}

        def spot_floor(self, *, gpu_model, region):
            return Decimal("0.80")

    provider = register_price_provider(Flat())
    try:
        types = {t["name"]: t for t in client.get("/api/v1/gpu-types/").json()}
        assert types[H100]["availability"][0]["price_per_gpu_hour"]["on_demand"] == "2.50"
        r = client.post(
            "/api/v1/jobs/", {**JOB, "plan": "spot", "spot_max_price": "0.5"}, content_type="application/json"
        )
        assert r.status_code == 400 and "spot_max_price" in r.json()["error"]["fields"]
    finally:
        unregister_price_provider(provider)


def test_reservations_are_requested_listed_and_cancelled(client, make_node):
    make_node()
    r = client.post(
        "/api/v1/reservations/",
        {
            "gpu_model": "H100",
            "region": "us-east-1",
            "count": 8,
            "starts_at": "2030-01-01T00:00:00Z",
            "ends_at": "2030-02-01T00:00:00Z",
        },
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    rid = r.json()["id"]
    assert r.json()["status"] == "requested" and r.json()["gpu_model"] == H100
    assert [x["id"] for x in client.get("/api/v1/reservations/").json()["results"]] == [rid]
    assert client.post(f"/api/v1/reservations/{rid}/cancel/").json()["status"] == "cancelled"
    r = client.post(
        "/api/v1/reservations/",
        {
            "gpu_model": "H100",
            "region": "us-east-1",
            "count": 8,
            "starts_at": "2030-02-01T00:00:00Z",
            "ends_at": "2030-01-01T00:00:00Z",
        },
        content_type="application/json",
    )
    assert r.status_code == 400 and "ends_at" in r.json()["error"]["fields"]


def test_a_waiting_instance_says_why(client, tenant, make_node, submit, cycle):
    make_node(gpus=1)
    submit(tenant, kind="instance")
    w = submit(tenant, kind="instance")
    cycle()
    body = client.get(f"/api/v1/instances/{w.pk}/").json()
    assert body["state"] == "queued"
    assert body["pending"]["reason"] == "capacity" and body["pending"]["message"]
    assert reload(w).pending_reason == "capacity"


def test_gpu_availability_counts_schedulable_free_and_shared_capacity(tenant, make_node, submit, cycle):
    from nodes.models import GpuHealth, NodeState
    from scheduling.selectors.shared import gpu_availability

    node = make_node(gpus=4)
    make_node(gpus=2, state=NodeState.DOWN)
    submit(tenant, gpu_count=1)
    submit(tenant, gpu_fraction_milli=500)
    cycle()
    make_node(gpus=2, region="eu")
    gpus = list(node.gpus.order_by("index"))
    busy = {a.gpu_id for a in Allocation.objects.filter(ended_at__isnull=True)}
    idle = [g for g in gpus if g.pk not in busy]
    assert len(busy) == 2 and len(idle) == 2
    Gpu.objects.filter(pk=idle[0].pk).update(health=GpuHealth.UNHEALTHY)
    h100 = GpuModel.objects.get(name=H100).pk
    us, eu = gpu_availability()[h100]["us-east-1"], gpu_availability()[h100]["eu-west-1"]
    # us: 6 GPUs; the DOWN node's 2 and the unhealthy one are not schedulable; of the other three,
    # one is wholly free, one holds a whole-GPU job and one a half share.
    assert (us.total_gpus, us.schedulable_gpus, us.free_gpus, us.free_milli) == (6, 3, 1, 1500)
    assert (eu.total_gpus, eu.schedulable_gpus, eu.free_gpus, eu.free_milli) == (2, 2, 2, 2000)


def test_the_unfiltered_gpu_catalog_is_served_from_the_cache_for_a_moment(
    client, tenant, make_node, settings, monkeypatch
):
    from django.core.cache import cache
    from kombu.exceptions import OperationalError

    from scheduling.api import GpuTypeViewSet

    settings.SCHEDULING_GPU_TYPES_CACHE_S = 60
    make_node(gpus=8)

    def free_h100(**params):
        types = {t["name"]: t for t in client.get("/api/v1/gpu-types/", params).json()}
        return sum(a["free_gpus"] for a in types.get(H100, {"availability": []})["availability"])

    assert free_h100() == 8
    make_node(gpus=8)
    assert free_h100() == 8  # the cached answer, at most SCHEDULING_GPU_TYPES_CACHE_S old
    assert free_h100(vendor="nvidia") == 16  # a filtered list is computed for each request

    # Older than the setting: served as it is while the refresh another request asked for is on its
    # way (the lock is taken); the first request to find the lock free asks a worker for the next
    # answer and is served the old one too. The worker's task fills the cache and frees the lock.
    from scheduling.tasks import refresh_gpu_types

    def make_old():
        computed_at, data = cache.get(GpuTypeViewSet.CACHE_KEY)
        cache.set(GpuTypeViewSet.CACHE_KEY, (computed_at - 61, data), 600)

    make_old()
    assert cache.add(GpuTypeViewSet.REFRESH_KEY, 1, 60)
    assert free_h100() == 8
    cache.delete(GpuTypeViewSet.REFRESH_KEY)
    sent = []
    monkeypatch.setattr(refresh_gpu_types, "apply_async", lambda **kw: sent.append(kw))
    assert free_h100() == 8
    assert sent == [{"expires": 600, "retry": False}]  # not run once older than an answer is kept
    assert cache.get(GpuTypeViewSet.REFRESH_KEY) == 1  # no second refresh while this one is on its way
    assert free_h100() == 8 and len(sent) == 1
    refresh_gpu_types()
    assert cache.get(GpuTypeViewSet.REFRESH_KEY) is None
    assert free_h100() == 16 and len(sent) == 1  # fresh again

    # The task cannot be sent (the broker is away): the request computes the answer itself.
    def broker_away(**kw):
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(refresh_gpu_types, "apply_async", broker_away)
    make_node(gpus=8)
    make_old()
    assert free_h100() == 24
    assert cache.get(GpuTypeViewSet.REFRESH_KEY) is None

    # A refresh that fails leaves the lock until it expires: one try per period, not per request.
    def fill_fails():
        raise RuntimeError("the database went away")

    assert cache.add(GpuTypeViewSet.REFRESH_KEY, 1, 60)
    with monkeypatch.context() as patched, pytest.raises(RuntimeError):
        patched.setattr("scheduling.api.gpu_types_cache_fill", fill_fails)
        refresh_gpu_types()
    assert cache.get(GpuTypeViewSet.REFRESH_KEY) == 1
    cache.delete(GpuTypeViewSet.REFRESH_KEY)
    # No answer in the cache (a cold start, a lost cache): computed by the request.
    make_node(gpus=8)
    cache.delete(GpuTypeViewSet.CACHE_KEY)
    assert free_h100() == 32
    settings.SCHEDULING_GPU_TYPES_CACHE_S = 0
    make_node(gpus=8)
    assert free_h100() == 40


@pytest.mark.django_db(transaction=True)
def test_a_real_worker_refreshes_the_gpu_catalog_a_request_found_old(client, tenant, make_node, settings):
    """The refresh goes through the broker to a worker (on the default queue, not the one whose
    worker runs the cycles) and the next request gets its answer."""
    import time

    from celery.contrib.testing.worker import start_worker
    from django.core.cache import cache

    from portal.celery import app
    from scheduling.api import GpuTypeViewSet
    from tests.conftest import postgres_only

    postgres_only("the worker runs in its own connection")
    assert app.amqp.router.route({}, "scheduling.tasks.refresh_gpu_types")["queue"].name == "default"
    settings.SCHEDULING_GPU_TYPES_CACHE_S = 1

    def free_h100():
        types = {t["name"]: t for t in client.get("/api/v1/gpu-types/").json()}
        return sum(a["free_gpus"] for a in types.get(H100, {"availability": []})["availability"])

    make_node(gpus=8)
    assert free_h100() == 8
    make_node(gpus=8)
    time.sleep(1.1)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        assert free_h100() == 8  # old, served while the worker computes the next
        deadline = time.monotonic() + 30
        while cache.get(GpuTypeViewSet.REFRESH_KEY) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
    assert cache.get(GpuTypeViewSet.REFRESH_KEY) is None
    assert free_h100() == 16


def test_workloads_render_every_field_in_order_and_times_in_the_active_zone(
    client, tenant, make_node, cycle, submit
):
    """For workloads in every shape the API shows, each serializer renders its fields in the
    declared order; times render in the active zone (a person's, UserTimezoneMiddleware), UTC with
    a Z otherwise."""
    from scheduling.api import WorkloadDetailSerializer, WorkloadSerializer

    make_node(gpus=8)
    spot = submit(tenant, gpu_count=2, plan="spot", spot_max_price="1.2500000000", name="spot one")
    r = client.post(
        "/api/v1/instances/",
        # An instance has no command field: sending one is refused (a field it does not know).
        {
            **{k: v for k, v in JOB.items() if k != "command"},
            "ports": [22, 8888],
            "ssh_public_key": public_key(),
        },
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    cycle()
    waiting = submit(tenant, gpu_count=8, env={"A": "b"}, max_runtime_s=600)  # cannot fit: pending
    finished = submit(tenant, gpu_count=1)
    Workload.objects.filter(pk=finished.pk).update(state="failed", exit_code=3, retries=1)
    workloads = Workload.objects.filter(tenant=tenant).select_related("region").prefetch_related("gpu_models")
    assert {w.pk for w in workloads} >= {spot.pk, waiting.pk, finished.pk} and len(workloads) == 4
    shapes = set()
    for zone in (None, "Asia/Kolkata"):
        with timezone.override(zone) if zone else contextlib.nullcontext():
            for cls in (WorkloadSerializer, WorkloadDetailSerializer):
                for w in workloads:
                    data = cls(w).data
                    assert list(data) == cls.Meta.fields, w.pk
                    shapes.add((w.state, w.plan, w.region_id is None, bool(data.get("placement"))))
                    assert data["submitted_at"].endswith("+05:30" if zone else "Z")
    assert len(shapes) >= 4  # pending, scheduled, failed; spot and on-demand; with and without placement
    listed = client.get("/api/v1/jobs/").json()["results"]
    assert {j["id"]: j["name"] for j in listed}[spot.pk] == "spot one"
    assert {j["id"]: j["spot_max_price"] for j in listed}[spot.pk] == "1.2500000000"


def test_placement_is_read_only_for_a_workload_that_holds_gpus(
    client, make_node, cycle, django_assert_num_queries
):
    """Allocations are released when a workload leaves the holding states: the placement of a waiting
    workload is empty without a query, that of a scheduled one is read."""
    from scheduling.selectors.shared import workload_placement

    make_node()
    jid = client.post("/api/v1/jobs/", JOB, content_type="application/json").json()["id"]
    waiting = Workload.objects.get(pk=jid)
    with django_assert_num_queries(0):
        assert workload_placement(workload=waiting) == []
    cycle()
    scheduled = Workload.objects.get(pk=jid)
    with django_assert_num_queries(1):
        assert len(workload_placement(workload=scheduled)) == 2


def test_a_page_reads_its_gpu_models_in_one_query_whatever_its_size(client, tenant, make_node, submit):
    """A list page's GPU model names come in one query for the page, in the catalog's order, as the
    workload's detail shows them."""
    from tests.scheduling.conftest import A100

    make_node()
    make_node(model=A100)
    both = submit(tenant, gpu_models=[H100, A100], gpu_count=1)
    by_memory = submit(tenant, gpu_count=1, min_gpu_memory_gib=40)  # the models it resolves to

    def page() -> dict[int, list[str]]:
        r = client.get("/api/v1/jobs/")
        assert r.status_code == 200
        return {j["id"]: j["gpu_models"] for j in r.json()["results"]}

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    page()  # warm: the throttle's and the token's first reads
    with CaptureQueriesContext(connection) as few:
        listed = page()
    assert listed[both.pk] == sorted([H100, A100])
    for w in (both, by_memory):
        assert client.get(f"/api/v1/jobs/{w.pk}/").json()["gpu_models"] == listed[w.pk]
        assert listed[w.pk] == [m.name for m in w.gpu_models.order_by("vendor", "name")]
    for _ in range(5):
        submit(tenant, gpu_count=1)
    with CaptureQueriesContext(connection) as more:
        assert len(page()) == 7
    assert len(more.captured_queries) == len(few.captured_queries)  # not one per workload
    assert sum("scheduling_workload_gpu_models" in q["sql"] for q in more.captured_queries) == 1


def _schema(client) -> dict:
    return client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()


def test_a_created_workload_is_answered_and_documented_as_its_detail(client, make_node):
    """Found by the schemathesis run: the 201 was documented as the create spec, and a workload
    with no vendor, priority class or region ("", "", null) broke the documented enums and types."""
    make_node()
    body = client.post("/api/v1/jobs/", JOB, content_type="application/json").json()
    assert body["placement"] == [] and body["region"] is None
    assert body["gpu_vendor"] == "" and body["priority_class"] == ""
    doc = _schema(client)
    created = doc["paths"]["/api/v1/instances/"]["post"]["responses"]["201"]["content"]["application/json"]
    assert created["schema"]["$ref"] == "#/components/schemas/WorkloadDetail"
    # A job's: its detail and the warnings of a Kubernetes manifest (scheduling.k8s_manifest).
    job = doc["paths"]["/api/v1/jobs/"]["post"]["responses"]["201"]["content"]["application/json"]
    assert job["schema"]["$ref"] == "#/components/schemas/JobCreated"
    job_props = doc["components"]["schemas"]["JobCreated"]["properties"]
    props = doc["components"]["schemas"]["WorkloadDetail"]["properties"]
    assert set(job_props) == {*props, "warnings"} and job_props["region"] == props["region"]
    assert props["region"]["nullable"] is True
    blank = {"$ref": "#/components/schemas/BlankEnum"}
    assert blank in props["gpu_vendor"]["oneOf"] and blank in props["priority_class"]["oneOf"]


def test_events_and_logs_are_documented_as_answered(client, make_node):
    """``events`` is every event, unpaginated and unfiltered: a list filter in its query string made
    the job 404 (the filter applied to the lookup), and the schema promised a paginated page."""
    make_node()
    jid = client.post("/api/v1/jobs/", JOB, content_type="application/json").json()["id"]
    r = client.get(f"/api/v1/jobs/{jid}/events/?state=running&page_size=1")
    assert r.status_code == 200 and [e["to_state"] for e in r.json()] == ["pending"]
    doc = _schema(client)
    events = doc["paths"]["/api/v1/jobs/{id}/events/"]["get"]
    assert [p["name"] for p in events["parameters"]] == ["id"]
    assert events["responses"]["200"]["content"]["application/json"]["schema"]["type"] == "array"
    logs = doc["paths"]["/api/v1/jobs/{id}/logs/"]["get"]["responses"]["200"]["content"]
    assert logs["application/json"]["schema"]["$ref"] == "#/components/schemas/WorkloadLogs"
    assert set(client.get(f"/api/v1/jobs/{jid}/logs/").json()) == set(
        doc["components"]["schemas"]["WorkloadLogs"]["properties"]
    )


def test_quotas_are_one_object_as_documented(client, tenant):
    """``/api/v1/quotas/`` answers one object; its schema said a list of them."""
    Quota.objects.create(tenant=tenant, max_gpus_total=3)
    body = client.get("/api/v1/quotas/").json()
    assert body["limits"]["max_gpus_total"] == 3 and body["usage"]["gpus"] == "0"
    doc = _schema(client)
    answer = doc["paths"]["/api/v1/quotas/"]["get"]["responses"]["200"]["content"]["application/json"]
    assert answer["schema"] == {"$ref": "#/components/schemas/Quota"}
    limits = doc["components"]["schemas"]["QuotaLimits"]["properties"]
    assert limits["max_spot_gpus"]["nullable"] is True


def test_workload_rendering_reads_columns_directly_and_answers_what_drf_answers(
    tenant, make_node, submit, cycle
):
    """The workload serializers build their dicts directly (more shapes in test_api_rendering): for
    placed, waiting and instance workloads (nulls, blanks, a region or none), the list and the
    detail serializers give exactly what DRF's own field-by-field loop gives; a serializer of
    ``FieldsOnceModelSerializer`` renders a dict of values the DRF way."""
    from rest_framework import serializers as drf

    from portal.api.serializers import FieldsOnceModelSerializer
    from scheduling.api import WorkloadDetailSerializer, WorkloadSerializer

    make_node(gpus=2)
    placed = submit(tenant, name="placed", gpu_count=2, env={"A": "1"}, max_runtime_s=600)
    waiting = submit(tenant, gpu_count=2, estimated_runtime_s=60)
    instance = submit(tenant, kind="instance", name="nb")
    cycle()
    rows = list(Workload.objects.filter(pk__in=[placed.pk, waiting.pk, instance.pk]).select_related("region"))
    assert {w.state for w in rows} == {WorkloadState.SCHEDULED, WorkloadState.QUEUED}  # two wait
    for cls in (WorkloadSerializer, WorkloadDetailSerializer):
        serializer = cls()
        for w in rows:
            ours = serializer.to_representation(w)
            theirs = drf.ModelSerializer.to_representation(serializer, w)
            assert ours == theirs and list(ours) == list(theirs)
            assert ours["region"] == (w.region.code if w.region else None)
    # Something not a model instance (a dict of values) renders the DRF way.
    as_dict = {name: getattr(rows[0], name) for name in ("id", "name", "state", "kind")}

    class Narrow(FieldsOnceModelSerializer):
        class Meta:
            model = Workload
            fields = list(as_dict)

    assert Narrow(as_dict).data == as_dict
