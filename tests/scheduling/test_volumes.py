"""Volumes through the API and the services: create, attach at submission (region, share rules,
hostile mount paths), delete (refused while in use), and the agents' measurements."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import CommandKind, NodeCommand
from nodes.services.heartbeat_parse import VolumeReport
from portal.models import AuditEvent
from scheduling.models import Volume, VolumeState, Workload, WorkloadVolume
from scheduling.models import WorkloadState as S
from scheduling.services.lifecycle import workload_on_exited
from scheduling.services.volumes import volumes_on_measured
from tests.scheduling.conftest import reload

pytestmark = pytest.mark.django_db

JOB = {"gpu_models": ["H100"], "image": "ghcr.io/acme/train:1", "command": ["python", "t.py"]}


@pytest.fixture
def acme(tenant, make_token, api):
    return api(make_token(tenant))


def post(acme, url, body):
    return acme.post(url, body, content_type="application/json")


def make_volume(acme, name="data", region="us-east-1", size_gib=10) -> dict:
    r = post(acme, "/api/v1/volumes/", {"name": name, "region": region, "size_gib": size_gib})
    assert r.status_code == 201, r.content
    return r.json()


def job(acme, volumes, **extra):
    return post(acme, "/api/v1/jobs/", {**JOB, "volumes": volumes, **extra})


def test_create_list_retrieve_and_refusals_name_the_field(acme, regions, settings):
    v = make_volume(acme)
    assert (v["name"], v["region"], v["size_gib"], v["state"], v["used_bytes"]) == (
        "data",
        "us-east-1",
        10,
        "available",
        None,
    )
    assert [x["id"] for x in acme.get("/api/v1/volumes/").json()["results"]] == [v["id"]]
    assert acme.get(f"/api/v1/volumes/{v['id']}/").json()["in_use_by"] == []
    assert AuditEvent.objects.filter(action="volume.create").count() == 1
    settings.VOLUME_STORAGE_ROOTS = {"us-east-1": "/srv/vol"}  # eu-west-1 has none
    for body, field in (
        ({"name": "Bad Name", "region": "us-east-1", "size_gib": 1}, "name"),
        ({"name": "../x", "region": "us-east-1", "size_gib": 1}, "name"),
        ({"name": "ok", "region": "mars-1", "size_gib": 1}, "region"),
        ({"name": "ok", "region": "eu-west-1", "size_gib": 1}, "region"),
        ({"name": "ok", "region": "us-east-1", "size_gib": 0}, "size_gib"),
        ({"name": "ok", "region": "us-east-1", "size_gib": 10**9}, "size_gib"),
        ({"name": "ok", "region": "us-east-1", "size_gib": "ten"}, "size_gib"),
    ):
        r = post(acme, "/api/v1/volumes/", body)
        assert r.status_code == 400, (body, r.content)
        assert set(r.json()["error"]["fields"]) == {field}, (body, r.json())
    r = post(acme, "/api/v1/volumes/", {"name": "data", "region": "us-east-1", "size_gib": 5})
    assert r.status_code == 409 and set(r.json()["error"]["fields"]) == {"name"}
    assert Volume.objects.count() == 1


def test_another_tenants_volume_does_not_exist(acme, make_tenant, make_token, api, regions, make_node):
    make_node()
    v = make_volume(acme)
    assert acme.get(f"/api/v1/volumes/{v['id']}/").status_code == 200  # the owner sees it
    other = api(make_token(make_tenant("other")))
    assert other.get(f"/api/v1/volumes/{v['id']}/").status_code == 404
    assert other.delete(f"/api/v1/volumes/{v['id']}/").status_code == 404
    assert other.get("/api/v1/volumes/").json()["results"] == []
    r = job(other, [{"volume": v["id"], "mount_path": "/workspace"}])
    assert r.status_code == 400 and set(r.json()["error"]["fields"]) == {"volumes"}
    assert reload_volume(v).state == VolumeState.AVAILABLE


def reload_volume(v: dict) -> Volume:
    return Volume.objects.get(pk=v["id"])


def test_a_read_token_cannot_create_or_delete(tenant, make_token, api, regions):
    writer = api(make_token(tenant))
    v = make_volume(writer)
    reader = api(make_token(tenant, scopes=("read",)))
    assert reader.get(f"/api/v1/volumes/{v['id']}/").status_code == 200
    assert (
        post(reader, "/api/v1/volumes/", {"name": "x", "region": "us-east-1", "size_gib": 1}).status_code
        == 403
    )
    assert reader.delete(f"/api/v1/volumes/{v['id']}/").status_code == 403


def test_a_workload_goes_where_its_volume_is(acme, regions, make_node, cycle):
    make_node(region="us"), make_node(region="eu")
    v = make_volume(acme, region="eu-west-1")
    r = job(acme, [{"volume": v["id"], "mount_path": "/workspace"}])
    assert r.status_code == 201, r.content
    assert r.json()["volumes"] == [
        {"volume": v["id"], "name": "data", "mount_path": "/workspace", "shared": False}
    ]
    w = Workload.objects.get(pk=r.json()["id"])
    assert w.region.code == "eu-west-1" and w.other_regions_ok is False
    cycle()
    start = NodeCommand.objects.get(kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk))
    assert start.node.region.code == "eu-west-1"
    assert start.payload["volumes"] == [
        {"volume_id": str(v["id"]), "mount_path": "/workspace", "size_gib": 10}
    ]
    assert "checkpoint" not in start.payload
    # Naming another region is refused, naming the field; nothing is stored.
    count = Workload.objects.count()
    r = job(acme, [{"volume": v["id"], "mount_path": "/workspace", "shared": True}], region="us-east-1")
    assert r.status_code == 400 and set(r.json()["error"]["fields"]) == {"region"}
    assert Workload.objects.count() == count


@pytest.mark.parametrize(
    "path",
    [
        "workspace",
        "/",
        "/etc",
        "/etc/cron.d",
        "/proc/self",
        "/sys/x",
        "/dev/shm",
        "/usr/local/x",
        "/run/gpupool",
        "/lib64",
        "/bin",
        "/a/../etc",
        "/a/./b",
        "/a//b",
        "/a/",
        "//etc",
        "/a b",
        "/a\nb",
        "/x" * 200,
        "",
        None,
        5,
    ],
)
def test_hostile_mount_paths_are_refused_naming_volumes(acme, regions, make_node, path):
    make_node()
    v = make_volume(acme)
    r = job(acme, [{"volume": v["id"], "mount_path": path}])
    assert r.status_code == 400, r.content
    assert set(r.json()["error"]["fields"]) == {"volumes"}
    assert not Workload.objects.exists() and not WorkloadVolume.objects.exists()


def test_one_volume_per_path_and_malformed_items(acme, regions, make_node):
    make_node()
    a, b = make_volume(acme, "a"), make_volume(acme, "b")
    eu = make_volume(acme, "c", region="eu-west-1")
    for volumes in (
        [{"volume": a["id"], "mount_path": "/data"}, {"volume": b["id"], "mount_path": "/data"}],
        [{"volume": a["id"], "mount_path": "/data"}, {"volume": b["id"], "mount_path": "/data/in"}],
        [{"volume": a["id"], "mount_path": "/data"}, {"volume": a["id"], "mount_path": "/other"}],
        [{"volume": a["id"], "mount_path": "/data"}, {"volume": eu["id"], "mount_path": "/eu"}],
        [{"volume": a["id"], "mount_path": "/data", "host_path": "/etc"}],
        [{"volume": "1", "mount_path": "/data"}],
        [{"volume": a["id"], "mount_path": "/data", "shared": "yes"}],
        ["/data"],
        [{"volume": 999999, "mount_path": "/data"}],
    ):
        r = job(acme, volumes)
        assert r.status_code == 400, (volumes, r.content)
        assert set(r.json()["error"]["fields"]) == {"volumes"}, r.json()
    r = job(acme, [{"volume": a["id"], "mount_path": "/data"}, {"volume": b["id"], "mount_path": "/data2"}])
    assert r.status_code == 201, r.content
    assert not Workload.objects.exclude(pk=r.json()["id"]).exists()


def test_checkpoints_need_a_volume(acme, regions, make_node):
    make_node()
    r = post(acme, "/api/v1/jobs/", {**JOB, "checkpoint_resume": True})
    assert r.status_code == 400 and set(r.json()["error"]["fields"]) == {"checkpoint_resume"}
    v = make_volume(acme)
    r = job(acme, [{"volume": v["id"], "mount_path": "/ckpt"}], checkpoint_resume=True)
    assert r.status_code == 201, r.content


def test_share_rules(acme, regions, make_node, cycle):
    make_node()
    v = make_volume(acme)
    mine = [{"volume": v["id"], "mount_path": "/w"}]
    shared = [{"volume": v["id"], "mount_path": "/w", "shared": True}]
    first = job(acme, mine)
    assert first.status_code == 201
    for volumes in (mine, shared):  # exclusive in use: nobody else, shared or not
        r = job(acme, volumes)
        assert r.status_code == 409 and set(r.json()["error"]["fields"]) == {"volumes"}, r.content
    # When the first ends the volume is free again: the next one may use it (and keep it).
    w = Workload.objects.get(pk=first.json()["id"])
    cycle()
    w = reload(w)
    node_id = w.allocations.get().node_id
    workload_on_exited(node_id=node_id, workload_id=w.pk, state="exited", exit_code=0)
    assert reload(w).state == S.SUCCEEDED
    a = job(acme, shared)
    assert a.status_code == 201, a.content
    b = job(acme, shared)
    assert b.status_code == 201, b.content  # both asked to share
    r = job(acme, mine)
    assert r.status_code == 409, r.content  # this one did not
    assert sorted(acme.get(f"/api/v1/volumes/{v['id']}/").json()["in_use_by"]) == sorted(
        [a.json()["id"], b.json()["id"]]
    )


def test_delete_is_refused_while_in_use_then_removes_the_data(acme, regions, make_node, cycle):
    node = make_node()
    v = make_volume(acme)
    r = job(acme, [{"volume": v["id"], "mount_path": "/w"}])
    w = Workload.objects.get(pk=r.json()["id"])
    r = acme.delete(f"/api/v1/volumes/{v['id']}/")
    assert r.status_code == 409 and r.json()["error"]["code"] == "volume_in_use", r.content
    assert reload_volume(v).state == VolumeState.AVAILABLE
    assert not NodeCommand.objects.filter(kind=CommandKind.DELETE_VOLUME).exists()
    acme.post(f"/api/v1/jobs/{w.pk}/stop/")  # still waiting: stops at once
    assert reload(w).is_terminal
    r = acme.delete(f"/api/v1/volumes/{v['id']}/")
    assert r.status_code == 204, r.content
    gone = reload_volume(v)
    assert gone.state == VolumeState.DELETED and gone.deleted_at is not None
    cmd = NodeCommand.objects.get(kind=CommandKind.DELETE_VOLUME)
    assert cmd.node_id == node.pk and cmd.payload == {"volume_id": str(v["id"])}
    assert acme.get(f"/api/v1/volumes/{v['id']}/").status_code == 404
    assert acme.get("/api/v1/volumes/").json()["results"] == []
    r = job(acme, [{"volume": v["id"], "mount_path": "/w"}])
    assert r.status_code == 400 and set(r.json()["error"]["fields"]) == {"volumes"}
    # The name is free again.
    assert make_volume(acme)["id"] != v["id"]


def test_measurements_are_kept_per_region_and_never_go_back_in_time(acme, regions, make_node):
    us_node, eu_node = make_node(region="us"), make_node(region="eu")
    v = make_volume(acme)
    now = timezone.now()
    report = VolumeReport(volume_id=v["id"], used_bytes=1234, measured_at=now)
    assert volumes_on_measured(node_id=eu_node.pk, reports=[report]) == 0  # not its region
    assert volumes_on_measured(node_id=us_node.pk, reports=[report]) == 1
    older = VolumeReport(volume_id=v["id"], used_bytes=1, measured_at=now - timedelta(minutes=1))
    assert volumes_on_measured(node_id=us_node.pk, reports=[older]) == 0
    body = acme.get(f"/api/v1/volumes/{v['id']}/").json()
    assert body["used_bytes"] == 1234 and body["used_measured_at"] is not None


def test_data_removal_is_asked_again_until_a_node_does_it(acme, regions, make_node):
    from nodes.models import CommandState, NodeState
    from scheduling.services.volumes import DATA_REMOVAL_TRIES, volumes_data_removal

    node = make_node(state=NodeState.MAINTENANCE)
    v = make_volume(acme)
    assert acme.delete(f"/api/v1/volumes/{v['id']}/").status_code == 204
    assert not NodeCommand.objects.filter(kind=CommandKind.DELETE_VOLUME).exists()  # no ready node
    assert volumes_data_removal() == []
    type(node).objects.filter(pk=node.pk).update(state=NodeState.READY)
    assert volumes_data_removal() == [v["id"]]
    assert volumes_data_removal() == []  # in flight: not asked twice
    cmd = NodeCommand.objects.get(kind=CommandKind.DELETE_VOLUME)
    assert cmd.node_id == node.pk and cmd.payload == {"volume_id": str(v["id"])}
    NodeCommand.objects.filter(pk=cmd.pk).update(state=CommandState.EXPIRED)
    assert volumes_data_removal() == [v["id"]]  # expired: asked again
    NodeCommand.objects.filter(kind=CommandKind.DELETE_VOLUME).update(state=CommandState.SUCCEEDED)
    assert volumes_data_removal() == []  # done
    NodeCommand.objects.filter(kind=CommandKind.DELETE_VOLUME).update(state=CommandState.FAILED)
    for _ in range(DATA_REMOVAL_TRIES - 2):
        assert volumes_data_removal() == [v["id"]]
        NodeCommand.objects.filter(kind=CommandKind.DELETE_VOLUME).update(state=CommandState.FAILED)
    assert volumes_data_removal() == []  # given up after DATA_REMOVAL_TRIES: logged for staff
    assert NodeCommand.objects.filter(kind=CommandKind.DELETE_VOLUME).count() == DATA_REMOVAL_TRIES
