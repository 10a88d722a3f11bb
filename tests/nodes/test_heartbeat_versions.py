"""Heartbeats carry the driver stack's versions and each GPU's firmware: the portal keeps them
current after an upgrade, writing them only when they change, and refuses a malformed block."""

from __future__ import annotations

import pytest

from nodes.models import Gpu, Node

pytestmark = pytest.mark.django_db


def versions(agent, *, driver="550.54.15", cuda="12.4", firmware="96.00.89.00.01"):
    return {
        "driver_version": driver,
        "cuda_version": cuda,
        "rocm_version": "",
        "level_zero_version": "",
        "gpus": [{"uuid": uuid, "firmware_version": firmware} for uuid in agent.uuids],
    }


def test_a_heartbeat_updates_versions_only_when_they_change(agent) -> None:
    body = agent.batch() | {"versions": versions(agent)}
    assert agent.heartbeat(body).status_code == 200
    node = agent.node
    assert (node.driver_version, node.cuda_version, node.versions_digest != "") == ("550.54.15", "12.4", True)
    assert set(Gpu.objects.filter(node=node).values_list("firmware_version", flat=True)) == {"96.00.89.00.01"}

    # The same versions again write nothing: a value changed behind the portal's back stays.
    Node.objects.filter(pk=node.pk).update(cuda_version="edited")
    Gpu.objects.filter(node=node).update(firmware_version="edited")
    assert agent.heartbeat(agent.batch() | {"versions": versions(agent)}).status_code == 200
    assert agent.node.cuda_version == "edited"
    assert set(Gpu.objects.filter(node=node).values_list("firmware_version", flat=True)) == {"edited"}

    # An upgrade: the next heartbeat carries the new versions, and they are written.
    upgraded = versions(agent, driver="570.86.10", cuda="12.8", firmware="96.00.A5.00.01")
    assert agent.heartbeat(agent.batch() | {"versions": upgraded}).status_code == 200
    node = agent.node
    assert (node.driver_version, node.cuda_version) == ("570.86.10", "12.8")
    assert set(Gpu.objects.filter(node=node).values_list("firmware_version", flat=True)) == {"96.00.A5.00.01"}
    # A late batch (a buffer replay) does not turn them back.
    late = agent.batch(seq=1) | {"versions": versions(agent)}
    assert agent.heartbeat(late).json()["status"] == "duplicate"
    assert agent.node.cuda_version == "12.8"


@pytest.mark.parametrize(
    ("versions_block", "field"),
    [
        ("12.4", "versions"),
        ({"cuda_version": 12}, "versions.cuda_version"),
        ({"driver_version": "x" * 65}, "versions.driver_version"),
        ({"gpus": "all"}, "versions.gpus"),
        ({"gpus": [{"firmware_version": "1"}]}, "versions.gpus[0].uuid"),
    ],
)
def test_a_malformed_versions_block_is_a_400_naming_it(agent, versions_block, field) -> None:
    before = agent.node.driver_version
    response = agent.heartbeat(agent.batch() | {"versions": versions_block})
    assert response.status_code == 400 and field in response.json()["error"]["fields"]
    assert agent.node.driver_version == before
