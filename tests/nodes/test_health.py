from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from nodes.models import FleetAlert, Gpu, GpuHealth, GpuSample, Node, NodeCommand
from nodes.selectors import gpus_schedulable
from nodes.services.health import (
    gpu_return_to_service,
    node_cordon,
    node_drain,
    node_health_reconcile,
    node_set_maintenance,
    node_uncordon,
)
from nodes.signals import gpu_unhealthy, node_down
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.models import AuditEvent


@pytest.fixture
def fleet(register_node):
    """Ten nodes that all sent a heartbeat just now."""
    agents = [register_node(f"node-{i:02d}", gpus=1) for i in range(10)]
    for a in agents:
        assert a.heartbeat(a.batch()).json()["status"] == "accepted"
    return agents


def silence(agents, since):
    Node.objects.filter(pk__in=[a.node_id for a in agents]).update(last_heartbeat_at=since)


def states(agents) -> list[str]:
    return [a.node.state for a in agents]


def test_silent_nodes_become_suspect_then_down(
    fleet, settings, capture_signal, django_capture_on_commit_callbacks
):
    now = timezone.now()
    silence(fleet[:2], now)  # the other 8 keep talking (their heartbeats are "now + x" below)
    later = now + timedelta(seconds=settings.NODE_SUSPECT_AFTER_S + 1)
    Node.objects.filter(pk__in=[a.node_id for a in fleet[2:]]).update(last_heartbeat_at=later)
    result = node_health_reconcile(now=later)
    assert sorted(result.suspect) == sorted(a.node_id for a in fleet[:2]) and result.down == []
    assert states(fleet[:3]) == ["suspect", "suspect", "ready"]

    much_later = now + timedelta(seconds=settings.NODE_DOWN_AFTER_S + 1)
    Node.objects.filter(pk__in=[a.node_id for a in fleet[2:]]).update(last_heartbeat_at=much_later)
    with capture_signal(node_down) as calls, django_capture_on_commit_callbacks(execute=True):
        result = node_health_reconcile(now=much_later)
    assert sorted(result.down) == sorted(a.node_id for a in fleet[:2])
    assert states(fleet[:3]) == ["down", "down", "ready"]
    assert sorted(c["node"].pk for c in calls) == sorted(result.down)
    assert all(c["last_heartbeat_at"] == now for c in calls)
    assert not result.mass_silence and not FleetAlert.objects.exists()
    # DOWN nodes are not reported DOWN twice.
    with capture_signal(node_down) as calls, django_capture_on_commit_callbacks(execute=True):
        node_health_reconcile(now=much_later + timedelta(minutes=5))
    assert [c for c in calls if c["node"].pk in result.down] == []


def test_a_down_node_that_talks_again_is_ready(fleet, settings):
    now = timezone.now()
    silence(fleet[:1], now - timedelta(seconds=settings.NODE_DOWN_AFTER_S + 1))
    node_health_reconcile(now=now)
    assert fleet[0].node.state == "down"
    fleet[0].heartbeat(fleet[0].batch())
    assert fleet[0].node.state == "ready"


def test_mass_silence_marks_nobody_down_and_raises_one_alert(
    fleet, settings, capture_signal, django_capture_on_commit_callbacks, caplog
):
    now = timezone.now()
    silence(fleet[:4], now - timedelta(seconds=settings.NODE_DOWN_AFTER_S + 60))  # 40% > 30%
    with capture_signal(node_down) as calls, django_capture_on_commit_callbacks(execute=True):
        result = node_health_reconcile(now=now)
        node_health_reconcile(now=now + timedelta(seconds=10))
    assert result.mass_silence and result.silent_fraction == pytest.approx(0.4)
    assert result.down == [] and calls == []
    assert states(fleet[:4]) == ["suspect"] * 4
    alert = FleetAlert.objects.get()
    assert alert.kind == "mass_silence" and alert.resolved_at is None and alert.data["silent"] == 4
    assert "Mass silence" in caplog.text
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("gpupool_fleet_mass_silence") == 1.0
    # The nodes come back: the alert is resolved, and nothing was evicted.
    silence(fleet[:4], now + timedelta(seconds=20))
    node_health_reconcile(now=now + timedelta(seconds=20))
    alert.refresh_from_db()
    assert alert.resolved_at is not None
    assert REGISTRY.get_sample_value("gpupool_fleet_mass_silence") == 0.0


def test_down_transitions_are_rate_limited(fleet, settings):
    settings.NODE_MAX_DOWN_PER_RUN = 2
    settings.NODE_MASS_SILENCE_FRACTION = 0.5
    now = timezone.now()
    for i, a in enumerate(fleet[:4]):  # 40%: under the guard; node-00 silent longest
        silence([a], now - timedelta(seconds=settings.NODE_DOWN_AFTER_S + 100 - i))
    result = node_health_reconcile(now=now)
    assert result.down == [fleet[0].node_id, fleet[1].node_id]
    assert result.deferred_down == [fleet[2].node_id, fleet[3].node_id]
    assert states(fleet[:4]) == ["down", "down", "ready", "ready"]
    result = node_health_reconcile(now=now + timedelta(seconds=10))
    assert sorted(result.down) == sorted([fleet[2].node_id, fleet[3].node_id])


def test_maintenance_nodes_are_not_watched(fleet, settings):
    node_set_maintenance(node=fleet[0].node, actor=Actor.system(), reason="PSU swap")
    silence(fleet[:1], timezone.now() - timedelta(days=1))
    node_health_reconcile()
    assert fleet[0].node.state == "maintenance"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"xid_errors": [79]}, "XID 79"),
        ({"xid_errors": [48]}, "XID 48"),
        ({"ecc_dbe": 1}, "double-bit ECC"),
        ({"row_remap_failure": True}, "row remapping failure"),
        ({"retired_pages_pending": True}, "retired pages"),
        ({"fell_off_bus": True}, "fallen off the bus"),
    ],
)
def test_failing_gpu_is_isolated_and_announced(
    agent, overrides, reason, capture_signal, django_capture_on_commit_callbacks
):
    now = timezone.now()
    bad, good = agent.uuids
    samples = [agent.sample(bad, now, **overrides), agent.sample(good, now)]
    with capture_signal(gpu_unhealthy) as calls, django_capture_on_commit_callbacks(execute=True):
        assert agent.heartbeat(agent.batch(samples=samples)).json()["status"] == "accepted"
        agent.heartbeat(agent.batch(samples=[agent.sample(bad, now + timedelta(seconds=1), **overrides)]))
    gpu = Gpu.objects.get(uuid=bad)
    assert gpu.health == "unhealthy" and gpu.isolated and reason in gpu.health_reason
    assert Gpu.objects.get(uuid=good).health == "healthy"
    assert len(calls) == 1  # once, not on every batch that shows it
    assert (
        calls[0]["gpu"].pk == gpu.pk and calls[0]["node"].pk == agent.node_id and reason in calls[0]["reason"]
    )
    assert list(gpus_schedulable().values_list("uuid", flat=True)) == [good]


def test_non_hardware_xid_does_not_isolate(agent):
    now = timezone.now()
    agent.heartbeat(agent.batch(samples=[agent.sample(agent.uuids[0], now, xid_errors=[13])]))  # app error
    gpu = Gpu.objects.get(uuid=agent.uuids[0])
    assert gpu.health == "healthy" and gpu.last_xid == 13 and gpu.xid_count == 1


def test_staff_return_gpu_to_service_is_audited_and_new_errors_only_isolate_again(agent, owner):
    now = timezone.now()
    uuid = agent.uuids[0]
    agent.heartbeat(agent.batch(samples=[agent.sample(uuid, now, ecc_dbe=2)]))
    gpu = Gpu.objects.get(uuid=uuid)
    assert gpu.health == "unhealthy"
    gpu_return_to_service(gpu=gpu, actor=Actor(user=owner), reason="reset, burn-in passed")
    gpu.refresh_from_db()
    assert gpu.health == "healthy" and not gpu.isolated
    event = AuditEvent.objects.get(action="gpu.return_to_service")
    assert (
        event.tenant is None and event.actor_user == owner and event.data["before"]["health"] == "unhealthy"
    )
    # The same (volatile) count again is not a new error; a higher one is.
    agent.heartbeat(agent.batch(samples=[agent.sample(uuid, now + timedelta(seconds=1), ecc_dbe=2)]))
    assert Gpu.objects.get(uuid=uuid).health == "healthy"
    agent.heartbeat(agent.batch(samples=[agent.sample(uuid, now + timedelta(seconds=2), ecc_dbe=3)]))
    assert Gpu.objects.get(uuid=uuid).health == "unhealthy"


def test_cordon_drain_uncordon_are_audited(agent, owner):
    actor = Actor(user=owner)
    node = node_cordon(node=agent.node, actor=actor, reason="flaky NIC")
    assert node.state == "cordoned"
    node = node_drain(node=node, actor=actor)
    assert node.state == "draining"
    assert NodeCommand.objects.filter(node=node, kind="drain").count() == 1
    assert [c["kind"] for c in agent.poll().json()["commands"]] == ["drain"]
    node = node_uncordon(node=node, actor=actor)
    assert node.state == "ready"
    actions = list(
        AuditEvent.objects.filter(target_type="nodes.node", target_id=str(node.pk))
        .order_by("id")
        .values_list("action", "data")
    )
    assert [a for a, _ in actions if a != "node.register"] == [
        "node.cordon",
        "node.drain",
        "node.uncordon",
    ]
    assert actions[1][1]["reason"] == "flaky NIC" and actions[1][1]["from"] == "ready"
    assert all(
        e.actor_user == owner for e in AuditEvent.objects.filter(action__in=["node.cordon", "node.drain"])
    )


def test_staff_state_rules(agent):
    actor = Actor.system()
    with pytest.raises(ValidationFailed):
        node_set_maintenance(node=agent.node, actor=actor, reason="  ")
    Node.objects.filter(pk=agent.node_id).update(state="down")
    with pytest.raises(Conflict):
        node_cordon(node=agent.node, actor=actor)
    assert node_uncordon(node=agent.node, actor=actor).state == "ready"


def test_a_gpu_that_fell_off_the_bus_with_no_gauges_is_isolated(
    agent, capture_signal, django_capture_on_commit_callbacks
):
    """What the agent sends for a lost GPU: every gauge null, ``fell_off_bus`` true."""
    lost = agent.sample(
        agent.uuids[1],
        datetime.now(UTC),
        util_pct=None,
        mem_used_mib=None,
        power_w=None,
        temp_c=None,
        sm_clock_mhz=None,
        ecc_sbe=None,
        ecc_dbe=None,
        fell_off_bus=True,
        xid_errors=[79],
        processes=[],
    )
    with capture_signal(gpu_unhealthy) as calls, django_capture_on_commit_callbacks(execute=True):
        response = agent.heartbeat(agent.batch(samples=[lost]))
    assert response.status_code == 200, response.content
    gpu = Gpu.objects.get(uuid=agent.uuids[1])
    assert gpu.health == GpuHealth.UNHEALTHY and gpu.isolated and "XID 79" in gpu.health_reason
    assert [c["gpu"].pk for c in calls] == [gpu.pk]
    assert gpu.last_util_pct is None and gpu.last_temp_c is None
    assert GpuSample.objects.get(gpu=gpu).util_pct is None
