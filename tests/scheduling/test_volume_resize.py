"""Resizing a volume: ``PATCH /api/v1/volumes/{id}/ {"size_gib": N}`` grows it at any time and
shrinks it only above what it holds; the start command a node receives carries the size as it is
at delivery, and the agent (the real subprocess runtime) checks the volume's use against it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.runtimes.process import SubprocessRuntime
from nodes.agent.types import WorkloadSpec
from nodes.agent.volumes import GIB, Volumes
from nodes.models import CommandKind
from nodes.services.commands import command_as_wire, node_commands_deliver_due
from portal.models import AuditEvent
from scheduling.models import Volume, VolumeResize
from tests.agent.conftest import process_options, wait_for  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db

JOB = {"gpu_models": ["H100"], "image": "ghcr.io/acme/train:1", "command": ["/bin/true"]}


@pytest.fixture
def acme(tenant, make_token, api):
    return api(make_token(tenant))


def make_volume(acme, size_gib=10) -> dict:
    r = acme.post(
        "/api/v1/volumes/",
        {"name": "data", "region": "us-east-1", "size_gib": size_gib},
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    return r.json()


def patch(client, vid, body):
    return client.patch(f"/api/v1/volumes/{vid}/", body, content_type="application/json")


def test_grow_and_shrink_above_what_it_holds(acme, regions):
    v = make_volume(acme, 10)
    r = patch(acme, v["id"], {"size_gib": 20})
    assert r.status_code == 200, r.content
    assert r.json()["size_gib"] == 20 and Volume.objects.get(pk=v["id"]).size_gib == 20
    assert list(VolumeResize.objects.filter(volume_id=v["id"]).values_list("from_gib", "to_gib")) == [
        (10, 20)
    ]
    audit = AuditEvent.objects.get(action="volume.resize")
    assert audit.data["from_gib"] == 10 and audit.data["to_gib"] == 20
    # It holds 5.5 GiB (the agent's last measurement): 5 is refused, naming size_gib; 6 is fine.
    Volume.objects.filter(pk=v["id"]).update(used_bytes=int(5.5 * GIB))
    r = patch(acme, v["id"], {"size_gib": 5})
    assert r.status_code == 409, r.content
    assert "size_gib" in r.json()["error"]["fields"] and "5.50 GiB" in r.json()["error"]["message"]
    assert Volume.objects.get(pk=v["id"]).size_gib == 20 and VolumeResize.objects.count() == 1
    r = patch(acme, v["id"], {"size_gib": 6})
    assert r.status_code == 200 and r.json()["size_gib"] == 6
    # The same size again changes nothing.
    assert patch(acme, v["id"], {"size_gib": 6}).status_code == 200
    assert list(VolumeResize.objects.values_list("from_gib", "to_gib").order_by("id")) == [(10, 20), (20, 6)]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"size_gib": 0}, "size_gib"),
        ({"size_gib": 16385}, "size_gib"),
        ({"size_gib": "big"}, "size_gib"),
        ({"size_gib": 2.5}, "size_gib"),
        ({}, "size_gib"),
        ({"size_gib": 20, "name": "renamed"}, "name"),
        ({"size_gib": 20, "region": "eu-west-1"}, "region"),
    ],
)
def test_bad_resizes_are_refused_naming_the_field(acme, regions, body, field):
    v = make_volume(acme, 10)
    r = patch(acme, v["id"], body)
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"], r.json()
    assert Volume.objects.get(pk=v["id"]).size_gib == 10 and not VolumeResize.objects.exists()


def test_who_may_resize(acme, tenant, make_tenant, make_token, api, regions):
    v = make_volume(acme, 10)
    assert patch(acme, v["id"], {"size_gib": 11}).status_code == 200  # the owner: positive control
    other = api(make_token(make_tenant("other")))
    assert patch(other, v["id"], {"size_gib": 12}).status_code == 404
    reader = api(make_token(tenant, scopes=("read",)))
    assert patch(reader, v["id"], {"size_gib": 12}).status_code == 403
    assert (
        acme.put(f"/api/v1/volumes/{v['id']}/", {"size_gib": 12}, content_type="application/json").status_code
        == 405
    )
    assert acme.delete(f"/api/v1/volumes/{v['id']}/").status_code == 204
    assert patch(acme, v["id"], {"size_gib": 12}).status_code == 404  # deleted
    assert Volume.objects.get(pk=v["id"]).size_gib == 11


@pytest.fixture
def volumes_root():
    root = Path(tempfile.mkdtemp(prefix="gpupool-resize-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_the_agent_checks_a_start_against_the_size_at_delivery(
    acme,
    regions,
    make_node,
    cycle,
    volumes_root,
    tmp_path,
    process_options,  # noqa: F811
):
    node = make_node()
    v = make_volume(acme, 1)
    # The volume holds 1.5 GiB (a sparse file: its apparent size counts).
    (volumes_root / f"vol-{v['id']}").mkdir()
    with open(volumes_root / f"vol-{v['id']}" / "big", "wb") as handle:
        handle.truncate(GIB + GIB // 2)
    runtime = SubprocessRuntime(tmp_path / "state", **process_options)
    runtime.volumes = Volumes(volumes_root)

    def start_after(resize_to: int | None) -> WorkloadSpec:
        r = acme.post(
            "/api/v1/jobs/", {**JOB, "volumes": [{"volume": v["id"], "mount_path": "/data", "shared": True}]},
            content_type="application/json",
        )  # fmt: skip
        assert r.status_code == 201, r.content
        cycle()  # the start command is stored with the size at placement
        if resize_to is not None:
            assert patch(acme, v["id"], {"size_gib": resize_to}).status_code == 200
        commands, _ = node_commands_deliver_due(node_id=node.pk)
        [wire] = [command_as_wire(c) for c in commands if c.kind == CommandKind.START_WORKLOAD]
        return WorkloadSpec.from_payload(wire["payload"])

    spec = start_after(None)
    assert spec.volumes[0]["size_gib"] == 1
    with pytest.raises(RuntimeFailure, match=r"holds 1\.50 GiB, over its size of 1 GiB"):
        runtime.start(spec)
    Volume.objects.filter(pk=v["id"]).update(used_bytes=int(1.5 * GIB))  # as the agent reported
    # Grown to 2 GiB after placement, before delivery: the node is told 2 and starts it.
    spec = start_after(2)
    assert spec.volumes[0]["size_gib"] == 2
    runtime.start(spec)
    status = wait_for(lambda: (s := runtime.get_status(spec.workload_id)) is not None and s.terminal and s)
    assert (status.state, status.exit_code) == ("exited", 0)


def test_a_volume_in_use_shrinks_only_on_a_recent_measurement(acme, regions, make_node):
    from datetime import timedelta

    from django.utils import timezone

    make_node()
    v = make_volume(acme, 10)
    r = acme.post(
        "/api/v1/jobs/", {**JOB, "volumes": [{"volume": v["id"], "mount_path": "/data"}]},
        content_type="application/json",
    )  # fmt: skip
    assert r.status_code == 201, r.content
    stale = timezone.now() - timedelta(seconds=120)
    Volume.objects.filter(pk=v["id"]).update(used_bytes=GIB, used_measured_at=stale)
    r = patch(acme, v["id"], {"size_gib": 5})
    assert r.status_code == 409 and r.json()["error"]["code"] == "volume_measurement_stale", r.content
    assert patch(acme, v["id"], {"size_gib": 20}).status_code == 200  # growing needs no measurement
    Volume.objects.filter(pk=v["id"]).update(used_measured_at=timezone.now())
    assert patch(acme, v["id"], {"size_gib": 5}).status_code == 200
    assert Volume.objects.get(pk=v["id"]).size_gib == 5
