"""A heartbeat's ``volumes``: measurements reach the volumes of the node's region; a malformed entry
is a 400 naming the field, and the batch writes nothing."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from nodes.models import HeartbeatBatch
from scheduling.models import Volume
from tests.nodes.conftest import iso

pytestmark = pytest.mark.django_db


def test_measurements_reach_the_volume_and_bad_ones_are_refused(
    agent, tenant, django_capture_on_commit_callbacks
):
    node = agent.node
    volume = Volume.objects.create(tenant=tenant, name="data", region=node.region, size_gib=1)
    at = datetime.now(UTC)
    body = agent.batch()
    body["volumes"] = [{"volume_id": str(volume.pk), "used_bytes": 4096, "measured_at": iso(at)}]
    with django_capture_on_commit_callbacks(execute=True):
        r = agent.heartbeat(body)
    assert r.status_code == 200, r.content
    volume.refresh_from_db()
    assert volume.used_bytes == 4096 and volume.used_measured_at is not None
    batches = HeartbeatBatch.objects.filter(node=node).count()
    for bad, field in (
        ({"volume_id": "../1", "used_bytes": 1, "measured_at": iso(at)}, "volumes[0].volume_id"),
        ({"volume_id": str(volume.pk), "used_bytes": -1, "measured_at": iso(at)}, "volumes[0].used_bytes"),
        ({"volume_id": str(volume.pk), "used_bytes": True, "measured_at": iso(at)}, "volumes[0].used_bytes"),
        ({"volume_id": str(volume.pk), "used_bytes": 1}, "volumes[0].measured_at"),
        ("x", "volumes[0]"),
    ):
        body = agent.batch()
        body["volumes"] = [bad]
        r = agent.heartbeat(body)
        assert r.status_code == 400, (bad, r.content)
        assert field in r.json()["error"]["fields"], r.json()
    assert HeartbeatBatch.objects.filter(node=node).count() == batches
    volume.refresh_from_db()
    assert volume.used_bytes == 4096
