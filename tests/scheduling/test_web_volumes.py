"""The volumes page (list with usage, create, delete refused while in use) and the launch form's
volume field, through the real views."""

from __future__ import annotations

import pytest
from django.utils import timezone

from portal.models import Role
from scheduling.models import Volume, VolumeState, Workload
from tests.portal.conftest import add_member, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import H100

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(signed_in, owner, tenant):  # noqa: F811
    return signed_in(owner, tenant)


def test_the_page_lists_volumes_with_their_use_and_creates_one(client, tenant, regions, make_tenant):
    used = Volume.objects.create(
        tenant=tenant,
        name="data",
        region=regions["eu"],
        size_gib=10,
        used_bytes=5 * 1024**3,
        used_measured_at=timezone.now(),
    )
    Volume.objects.create(tenant=make_tenant("other"), name="theirs", region=regions["us"], size_gib=1)
    html = client.get("/volumes/").content.decode()
    assert f'id="volume-{used.pk}"' in html and "5.00 GiB (50%)" in html and "eu-west-1" in html
    assert "theirs" not in html
    r = client.post("/volumes/", {"name": "scratch", "region": "us-east-1", "size_gib": "20"})
    assert r.status_code == 302
    made = Volume.objects.get(name="scratch")
    assert (made.tenant, made.region.code, made.size_gib) == (tenant, "us-east-1", 20)
    r = client.post("/volumes/", {"name": "scratch", "region": "us-east-1", "size_gib": "20"})
    assert r.status_code == 409 and "Already used in this region" in r.content.decode()
    r = client.post("/volumes/", {"name": "Bad Name", "region": "us-east-1", "size_gib": "20"})
    assert r.status_code == 400 and Volume.objects.filter(tenant=tenant).count() == 2


def test_delete_is_refused_while_in_use(client, tenant, regions, make_node):
    make_node()
    v = Volume.objects.create(tenant=tenant, name="data", region=regions["us"], size_gib=10)
    r = client.post(
        "/launch/",
        {
            "kind": "job",
            "gpu_model": H100,
            "gpu_count": "1",
            "fraction": "1000",
            "plan": "on_demand",
            "image": "ghcr.io/acme/train:1",
            "command": "python train.py",
            "volume": str(v.pk),
            "mount_path": "/data",
            "checkpoint_resume": "on",
        },
    )
    assert r.status_code == 302, r.content.decode()[:2000]
    w = Workload.objects.get()
    assert w.checkpoint_resume and w.region == regions["us"] and not w.other_regions_ok
    assert list(w.volume_mounts.values_list("volume_id", "mount_path", "shared")) == [(v.pk, "/data", False)]
    html = client.get("/volumes/").content.decode()
    assert f'href="/workloads/{w.pk}/"' in html
    r = client.post(f"/volumes/{v.pk}/delete/", follow=True)
    assert "in use by workload(s)" in r.content.decode()
    assert Volume.objects.get(pk=v.pk).state == VolumeState.AVAILABLE


def test_the_launch_form_names_the_volume_field_in_errors(client, tenant, regions, make_node):
    make_node()
    v = Volume.objects.create(tenant=tenant, name="data", region=regions["us"], size_gib=10)
    data = {
        "kind": "job",
        "gpu_model": H100,
        "gpu_count": "1",
        "fraction": "1000",
        "plan": "on_demand",
        "image": "ghcr.io/acme/train:1",
        "command": "python train.py",
        "volume": str(v.pk),
        "mount_path": "/etc",
    }
    r = client.post("/launch/", data)
    assert r.status_code == 400
    assert 'id="id_volume_error"' in r.content.decode()
    assert not Workload.objects.exists()


def test_a_viewer_sees_the_page_and_cannot_change_anything(signed_in, tenant, regions, add_member):  # noqa: F811
    v = Volume.objects.create(tenant=tenant, name="data", region=regions["us"], size_gib=10)
    viewer = signed_in(add_member(tenant, Role.VIEWER).user, tenant)
    html = viewer.get("/volumes/").content.decode()
    assert "data" in html and "New volume" not in html
    assert viewer.post("/volumes/", {"name": "x", "region": "us-east-1", "size_gib": "1"}).status_code == 403
    assert viewer.post(f"/volumes/{v.pk}/delete/").status_code == 403
    assert Volume.objects.get(pk=v.pk).state == VolumeState.AVAILABLE


def launch_with_a_volume(client, tenant, regions, make_node) -> Volume:
    """A checkpointing job launched from the form with volume "data" at /data; returns the volume."""
    make_node()
    v = Volume.objects.create(tenant=tenant, name="data", region=regions["us"], size_gib=10)
    data = {
        "kind": "job",
        "gpu_model": H100,
        "gpu_count": "1",
        "fraction": "1000",
        "plan": "on_demand",
        "image": "ghcr.io/acme/train:1",
        "command": "python train.py",
        "volume": str(v.pk),
        "mount_path": "/data",
        "checkpoint_resume": "on",
    }
    assert client.post("/launch/", data).status_code == 302
    return v


def test_a_restart_keeps_the_volumes(client, tenant, regions, make_node):
    v = launch_with_a_volume(client, tenant, regions, make_node)
    first = Workload.objects.get()
    client.post(f"/workloads/{first.pk}/stop/")
    r = client.post(f"/workloads/{first.pk}/restart/")
    assert r.status_code == 302, r.content.decode()[:1000]
    again = Workload.objects.exclude(pk=first.pk).get()
    assert list(again.volume_mounts.values_list("volume_id", "mount_path")) == [(v.pk, "/data")]


def test_the_workload_page_names_its_volumes(client, tenant, regions, make_node):
    v = launch_with_a_volume(client, tenant, regions, make_node)
    html = client.get(f"/workloads/{Workload.objects.get().pk}/").content.decode()
    assert f'href="/volumes/#volume-{v.pk}">data</a> at <code>/data</code>' in html
    assert "checkpoints on data" in html
