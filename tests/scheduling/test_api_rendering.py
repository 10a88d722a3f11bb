"""The workload serializers build their dicts directly (``WorkloadSerializer.to_representation``):
for every shape of workload they give exactly what DRF's own field-by-field loop gives over the
same serializer's fields, key for key, in the same order, and the same JSON bytes."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.test import RequestFactory
from django.utils import timezone
from rest_framework import serializers as drf

from nodes.models import Node
from portal.actors import Actor
from portal.api.renderers import JSONRenderer
from scheduling.api import WorkloadDetailSerializer, WorkloadSerializer
from scheduling.api_render import LIST_VALUES
from scheduling.models import Allocation, PublishedPort, Workload, WorkloadDependency, WorkloadShareLink
from scheduling.models import WorkloadState as S
from scheduling.selectors.shared import workload_gpu_model_names
from scheduling.services.access import share_link_create
from tests.scheduling.conftest import A100, H100, reload
from tests.scheduling.test_access import started

pytestmark = pytest.mark.django_db


def _drf(serializer: drf.ModelSerializer, w: Workload) -> dict:
    """DRF's rendering: ``Serializer.to_representation``'s loop over the serializer's fields."""
    return drf.ModelSerializer.to_representation(serializer, w)


def _same(ours: dict, theirs: dict) -> None:
    assert ours == theirs
    assert list(ours) == list(theirs)
    render = JSONRenderer().render
    assert render(ours) == render(theirs)  # types too: a bool is not 1, a Decimal is not its text


@pytest.fixture
def shapes(tenant, make_node, submit, cycle, regions):
    """Workloads of every shape the API shows: running with ports, SSH and a share link; waiting
    with an expected start; spot with a price; elastic; an array job and one of its tasks; with
    volumes and dependencies; without a region; finished with an exit code."""
    node = make_node(gpus=4)
    Node.objects.filter(pk=node.pk).update(
        simulated=False,
        address="10.0.0.7",
        ssh_port=2222,
        ssh_host_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI",
    )
    box = submit(tenant, kind="instance", name="nb", ports=[8888, {"port": 22, "protocol": "tcp"}])
    first = submit(tenant, name="first", gpu_count=2, env={"A": "1", "B": ""}, max_runtime_s=600)
    cycle()
    box = started(box, {"ports": {"8888": 49153, "22": 49154}, "runtime": "docker"})
    assert box.state == S.RUNNING and PublishedPort.objects.filter(workload=box).count() == 2
    share_link_create(workload=box, actor=Actor.system())
    waiting = submit(tenant, name="waits", gpu_count=4, estimated_runtime_s=60, checkpoint_resume=True)
    spot = submit(tenant, name="spot", gpu_count=4)
    elastic = submit(tenant, name="elastic", gpu_count=4)
    array = submit(tenant, name="array", gpu_count=1)
    task = submit(tenant, name="array[1]", gpu_count=1)
    done = submit(tenant, gpu_count=1)
    Workload.objects.filter(pk=waiting.pk).update(
        state=S.QUEUED,
        pending_reason="capacity",
        pending_message="No free GPU: \u2028 4 asked",
        expected_start_at=datetime(2031, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
        min_compute_weight=Decimal("1.5"),
    )
    Workload.objects.filter(pk=spot.pk).update(
        plan="spot", spot_max_price=Decimal("0.1234567891"), region=None, node_selector={"zone": "a"}
    )
    Workload.objects.filter(pk=elastic.pk).update(
        elastic_min_gpus=2, elastic_max_gpus=8, elastic_target_gpus=6, elastic_on_resize="restart"
    )
    Workload.objects.filter(pk=array.pk).update(array_count=3, array_parallelism=2)
    Workload.objects.filter(pk=task.pk).update(array_parent=array, array_index=1, state=S.RUNNING)
    Workload.objects.filter(pk=done.pk).update(
        state=S.FAILED, exit_code=-9, finished_at=timezone.now(), started_at=timezone.now(), ram_mib=2**40
    )
    WorkloadDependency.objects.create(tenant=tenant, workload=waiting, on=first, condition="afterok")
    WorkloadDependency.objects.create(tenant=tenant, workload=waiting, on=done, condition="afterany")
    ids = [w.pk for w in (box, first, waiting, spot, elastic, array, task, done)]
    rows = list(Workload.objects.filter(pk__in=ids).select_related("region").defer("log_tail"))
    assert len(rows) == len(ids)
    assert any(w.region is None for w in rows) and any(w.region is not None for w in rows)
    assert Allocation.objects.filter(workload=first, ended_at__isnull=True).exists()
    return {w.pk: w for w in rows}, box.pk


def test_the_list_serializer_renders_what_drf_renders(shapes):
    rows, _ = shapes
    names = workload_gpu_model_names(workload_ids=list(rows))
    for w in rows.values():
        w.gpu_model_names = names[w.pk]
    serializer = WorkloadSerializer()
    for w in rows.values():
        _same(serializer.to_representation(w), _drf(serializer, w))
    # A list page's values() rows render as their instances do through DRF.
    values = {r["id"]: r for r in Workload.objects.filter(pk__in=list(rows)).values(*LIST_VALUES)}
    for pk, w in rows.items():
        _same(serializer.to_representation({**values[pk], "gpu_model_names": names[pk]}), _drf(serializer, w))
    many = WorkloadSerializer(list(rows.values()), many=True).data
    assert [dict(d) for d in many] == [_drf(serializer, w) for w in rows.values()]
    # The shapes are there: a decimal, a price, nulls, a nested pending and elastic part.
    by_name = {d["name"]: d for d in many}
    assert by_name["waits"]["min_compute_weight"] == "1.50"
    assert by_name["waits"]["pending"]["expected_start_at"] == datetime(
        2031, 1, 2, 3, 4, 5, 678901, tzinfo=UTC
    )
    assert by_name["spot"]["spot_max_price"] == "0.1234567891" and by_name["spot"]["region"] is None
    assert by_name["elastic"]["elastic"] == {
        "min_gpus": 2,
        "max_gpus": 8,
        "target_gpus": 6,
        "on_resize": "restart",
    }
    assert by_name["array[1]"]["array_parent"] == by_name["array"]["id"]
    assert by_name[""]["exit_code"] == -9 and by_name[""]["finished_at"].endswith("Z")


def test_the_detail_serializer_renders_what_drf_renders(shapes, tenant):
    rows, box_id = shapes
    request = RequestFactory().get("/api/v1/instances/")
    for context in ({}, {"request": request}):
        serializer = WorkloadDetailSerializer(context=context)
        for w in rows.values():
            _same(serializer.to_representation(w), _drf(serializer, w))
    # The nested parts are all there in some shape.
    out = {w.name: WorkloadDetailSerializer(w, context={"request": request}).data for w in rows.values()}
    box = out["nb"]
    assert box["access"]["ssh"]["port"] == 2222 and box["access"]["share_link"]["created_at"].endswith("Z")
    assert [p["host_port"] for p in box["access"]["ports"]] == [49154, 49153]
    assert box["access"]["ports"][1]["url"] == f"http://testserver/proxy/{box_id}/8888/"
    assert "page_url" not in box["access"]["ports"][1]  # the selector's, not the API's
    assert box["placement"] and out["first"]["placement"][0]["fraction_milli"] == 1000
    assert out["waits"]["volumes"][0]["mount_path"] == "/ckpt"
    assert [d["condition"] for d in out["waits"]["depends_on"]] == ["afterok", "afterany"]
    assert (
        out["array"]["array"]["count"] == 3
        and out["array"]["array"]["made"] == 1
        and out["array"]["array"]["states"]["running"] == 1
    )
    assert WorkloadShareLink.objects.filter(workload_id=box_id).exists()


def test_the_detail_reads_a_running_workloads_placement_once(shapes, django_assert_num_queries):
    """Placement and access share one read of the allocations. An instance's detail: model names,
    allocations, published ports, share link, volumes (an instance has no dependencies); DRF's
    loop, with access reading the allocations again, makes one more."""
    rows, box_id = shapes
    box = Workload.objects.select_related("region").get(pk=reload(rows[box_id]).pk)
    serializer = WorkloadDetailSerializer()
    with django_assert_num_queries(6):
        _drf(serializer, box)
    with django_assert_num_queries(5):
        serializer.to_representation(box)


def test_the_list_pages_filter_and_walk_as_before(shapes, tenant, api, make_token, make_tenant):
    """Over HTTP: each entry of every page is DRF's rendering of that workload; filters and the
    cursor still apply to the rows (values()) the list reads."""
    rows, box_id = shapes
    client = api(make_token(tenant))
    serializer = WorkloadSerializer()
    names = workload_gpu_model_names(workload_ids=list(rows))
    seen, url = [], "/api/v1/jobs/?page_size=3"
    while url:
        body = client.get(url).json()
        assert len(body["results"]) <= 3
        seen += body["results"]
        url = body["next"]
    jobs = sorted((w for w in rows.values() if w.kind == "job"), key=lambda w: -w.pk)
    assert [d["id"] for d in seen] == [w.pk for w in jobs] and len(jobs) == 7
    for d, w in zip(seen, jobs, strict=True):
        w.gpu_model_names = names[w.pk]
        assert d == _json(_drf(serializer, w))
    queued = client.get("/api/v1/jobs/?state=queued").json()["results"]
    assert [d["name"] for d in queued] == ["waits"]
    assert [d["id"] for d in client.get("/api/v1/instances/").json()["results"]] == [box_id]
    assert client.get("/api/v1/jobs/?region=nowhere").json()["results"] == []
    # Another tenant's lists have none of them (the same routes gave them to their owner above).
    other = api(make_token(make_tenant("other")))
    for path in ("/api/v1/jobs/", "/api/v1/instances/", "/api/v1/jobs/?state=queued"):
        r = other.get(path)
        assert r.status_code == 200 and r.json()["results"] == []


def _json(data: dict) -> dict:
    import json

    return json.loads(JSONRenderer().render(data))


def test_a_list_without_pagination_renders_every_row(shapes, tenant, api, make_token, monkeypatch):
    """The list's own path when a view has no pagination class: every row, model names and all,
    as the paginated list gives them."""
    from scheduling.api import JobViewSet

    client = api(make_token(tenant))
    paged = client.get("/api/v1/jobs/?page_size=100").json()["results"]
    monkeypatch.setattr(JobViewSet, "pagination_class", None)
    whole = client.get("/api/v1/jobs/").json()
    assert isinstance(whole, list) and len(whole) == 7
    assert sorted(whole, key=lambda d: d["id"]) == sorted(paged, key=lambda d: d["id"])
    assert all(d["gpu_models"] for d in whole)


def _canonical(content: bytes, drop: str | None = None) -> str:
    """A JSON answer re-serialized key for key in its order (``true`` stays apart from ``1``),
    without its top-level key ``drop``."""
    import json

    pairs = json.loads(content, object_pairs_hook=lambda p: p)
    return json.dumps([p for p in pairs if p[0] != drop])


# Specs of every shape the answer has: JSON objects in and out of jsonb's key order (it stores
# shorter keys first, then by bytes), decimals, several models out of the catalog's order, an array,
# ports, volumes and dependencies (those two are read when attached), and no model named.
SPECS = [
    ("jobs", {"env": {"GPUPOOL_SIM_DURATION_S": "30"}}),
    ("jobs", {"env": {"BB": "1", "A": "2", "C": ""}, "node_selector": {"zone": "a", "rack": "r1"}}),
    ("jobs", {"env": {"A": "1", "B": "", "CC": "x"}, "min_compute_weight": "0.5", "max_runtime_s": 600}),
    ("jobs", {"gpu_models": [H100, A100], "name": "two models", "gpu_count": 2}),
    ("jobs", {"anti_affinity": {"topology_key": "node", "workloads": [-1]}, "array": {"count": 3}}),
    ("jobs", {"array": {"count": 3, "parallelism": 2}, "spread": {"topology_key": "rack", "max_skew": 1}}),
    ("instances", {"ports": [8888, {"port": 22, "protocol": "tcp"}], "ssh_public_key": ""}),
    ("instances", {"gpu_models": [A100], "name": "nb", "node_selector": {"rack": "r1", "az": "a"}}),
    ("jobs", {"volumes": "a new volume"}),
    ("jobs", {"depends_on": "the first job"}),
    ("jobs", {"gpu_models": [], "min_gpu_memory_gib": 40, "name": "any model with 40 GiB"}),
]


def test_a_submissions_answer_is_its_detail(tenant, make_node, regions, api, make_token, submit):
    """POST /api/v1/jobs/ and /instances/ answer with the new workload as GET of it then gives it,
    byte for byte (a job's answer adds its manifest warnings): the instance the service stored with
    its JSON and decimal columns read back, and its GPU model names, volumes and dependencies from
    what the service attached (read only when some were)."""
    from django.db import connection

    from scheduling.models import Volume

    make_node(model=H100, gpus=8)
    make_node(model=A100, gpus=8)
    client = api(make_token(tenant))
    first = submit(tenant, name="first")
    for n, (kind, extra) in enumerate(SPECS):
        spec = {"gpu_models": [H100], "gpu_count": 1, "image": "ghcr.io/acme/train:1", **extra}
        if kind == "jobs":
            spec.setdefault("command", ["python", "train.py"])
        if "anti_affinity" in spec:
            spec["anti_affinity"] = {**spec["anti_affinity"], "workloads": [first.pk]}
        if spec.get("volumes"):
            v = Volume.objects.create(tenant=tenant, name=f"v{n}", region=regions["us"], size_gib=1)
            spec["volumes"] = [{"volume": v.pk, "mount_path": "/data"}]
        if spec.get("depends_on"):
            spec["depends_on"] = [{"job": first.pk, "condition": "finished"}]
        statements = []

        def record(execute, sql, params, many, context, statements=statements):
            statements.append(sql)
            return execute(sql, params, many, context)

        with connection.execute_wrapper(record):
            r = client.post(f"/api/v1/{kind}/", spec, content_type="application/json")
        assert r.status_code == 201, (spec, r.content)
        wid = r.json()["id"]
        got = client.get(f"/api/v1/{kind}/{wid}/")
        assert got.status_code == 200
        assert _canonical(r.content, drop="warnings") == _canonical(got.content), spec
        if kind == "jobs":
            assert r.json()["warnings"] == []
        # The whole row is not read back (only its JSON and decimal columns, without the region).
        reread = [
            s for s in statements if s.startswith('SELECT "scheduling_workload"."id"') and "nodes_region" in s
        ]
        assert statements and not reread, spec
        narrow = [
            s
            for s in statements
            if s.startswith("SELECT")
            and '"scheduling_workload"."env"' in s
            and '"scheduling_workload"."image"' not in s
        ]
        assert len(narrow) == 1, spec
        reads = " ".join(statements)
        assert ("scheduling_workloadvolume" in reads) is ("volumes" in spec), spec
        assert ("scheduling_workloaddependency" in reads) is ("depends_on" in spec), spec
        assert 'scheduling_workload_gpu_models" t JOIN' not in reads
    by_name = {d["name"]: d for d in client.get("/api/v1/jobs/?page_size=50").json()["results"]}
    assert by_name["two models"]["gpu_models"] == [A100, H100]  # the catalog's order, as read
