"""Gang members' own addresses on a region's gang network, through the services: the cycle hands
each member a unique address of the region's range (the database refuses a second holder), the
rendezvous variables name those addresses, and an address goes back when its member is gone
(not before a forced stop is confirmed). Without a gang network, or with a node that cannot join
it, gangs keep the node-address rendezvous."""

from __future__ import annotations

import ipaddress

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from nodes.agent.workload_rules import WorkloadRuleError, check_start_payload
from nodes.models import CommandKind, NodeCommand
from nodes.services.commands import node_command_report
from scheduling.models import GangAddress
from scheduling.models import WorkloadState as S
from tests.scheduling.conftest import reload
from tests.scheduling.test_gangs import _exit, _report

pytestmark = pytest.mark.django_db

SUBNET, RANGE, GATEWAY = "10.77.0.0/16", "10.77.200.0/29", "10.77.0.1"


def _network(region, subnet=SUBNET, range_=RANGE, gateway=GATEWAY):
    region.gang_subnet, region.gang_range, region.gang_gateway = subnet, range_, gateway
    region.full_clean()
    region.save()


def _joins(*nodes, can=True):
    for node in nodes:
        node.status = {"gang_network": can}
        node.save(update_fields=["status"])


def _starts(w):
    return {
        c.node_id: c
        for c in NodeCommand.objects.filter(
            kind=CommandKind.START_WORKLOAD,
            payload__workload_id=str(w.pk),
            payload__attempt=reload(w).attempt,
        )
    }


def test_a_regions_gang_network_is_checked_naming_the_field(regions):
    region = regions["us"]
    for subnet, range_, gateway, field in (
        (SUBNET, "", None, "gang_range"),
        ("10.77.0.0/33", RANGE, None, "gang_subnet"),
        ("10.77.0.1/16", RANGE, None, "gang_subnet"),  # host bits set
        (SUBNET, "10.78.0.0/24", None, "gang_range"),  # outside the subnet
        (SUBNET, "10.77.200.0/31", None, "gang_range"),  # too small
        (SUBNET, RANGE, "10.78.0.1", "gang_gateway"),
        ("fd00::/64", "fd00::/80", None, "gang_subnet"),
        ("127.0.0.0/8", "127.0.0.0/24", None, "gang_subnet"),
    ):
        region.gang_subnet, region.gang_range, region.gang_gateway = subnet, range_, gateway
        with pytest.raises(ValidationError) as err:
            region.full_clean()
        assert field in err.value.message_dict, (subnet, range_, gateway, err.value)
    _network(region)  # a good one passes


def test_members_get_unique_addresses_of_the_range_and_meet_there(tenant, make_node, submit, cycle, regions):
    _network(regions["us"])
    a, b, c, d = (make_node() for _ in range(4))
    _joins(a, b, c, d)
    w1 = submit(tenant, gpu_count=16, gang=True)
    w2 = submit(tenant, gpu_count=16, gang=True)
    cycle()
    held = list(GangAddress.objects.values_list("address", flat=True))
    assert len(held) == 4 and len(set(held)) == 4
    hosts = {str(h) for h in ipaddress.ip_network(RANGE).hosts()}
    assert set(held) <= hosts
    for w in (w1, w2):
        starts = _starts(w)
        rows = {r.rank: r for r in GangAddress.objects.filter(workload=w)}
        assert {r.node_id for r in rows.values()} == set(starts)
        own = [rows[0].address, rows[1].address]
        for node_id, command in starts.items():
            env, net = command.payload["platform_env"], command.payload["gang_network"]
            rank = int(env["NODE_RANK"])
            assert rows[rank].node_id == node_id
            assert env["MASTER_ADDR"] == own[0] and env["GPUPOOL_PEERS"] == ",".join(own)
            assert net == {"subnet": SUBNET, "range": RANGE, "gateway": GATEWAY, "address": own[rank]}
            # The agent takes the payload as it is.
            assert check_start_payload(command.payload)["gang_network"] == net
    # The database refuses a second holder of an address in the region, whatever writes it.
    row = GangAddress.objects.first()
    with pytest.raises(IntegrityError), transaction.atomic():
        GangAddress.objects.create(
            region=row.region, address=row.address, workload=w2, node=row.node, rank=5, attempt=1
        )
    # The range (6 hosts, less the gateway: all of it outside here) has 2 left: a third gang of 2
    # gets them, a fourth goes through its rank 0's node as without a gang network.
    e, f, g, h = (make_node() for _ in range(4))
    _joins(e, f, g, h)
    w3 = submit(tenant, gpu_count=16, gang=True)
    cycle()
    w4 = submit(tenant, gpu_count=16, gang=True)
    cycle()
    assert GangAddress.objects.filter(workload=w3).count() == 2
    assert not GangAddress.objects.filter(workload=w4).exists()
    assert all("gang_network" not in c.payload for c in _starts(w4).values())
    assert len(set(GangAddress.objects.values_list("address", flat=True))) == 6


def test_without_a_network_or_a_node_that_can_join_it_the_rendezvous_is_the_nodes(
    tenant, make_node, submit, cycle, regions
):
    a, b = make_node(), make_node()
    _joins(a, b)
    w = submit(tenant, gpu_count=16, gang=True)
    cycle()  # the region has no gang network
    assert all("gang_network" not in c.payload for c in _starts(w).values())
    assert {c.payload["platform_env"]["MASTER_ADDR"] for c in _starts(w).values()} <= {a.hostname, b.hostname}
    _network(regions["us"])
    c, d = make_node(), make_node()
    _joins(c)
    _joins(d, can=False)  # d's agent has no gang_parent (or is not docker)
    w2 = submit(tenant, gpu_count=16, gang=True)
    cycle()
    assert all("gang_network" not in x.payload for x in _starts(w2).values())
    # A gang that publishes ports keeps the node-address rendezvous (its ports need a bridge).
    _joins(d)
    e, f = make_node(), make_node()
    _joins(e, f)
    w3 = submit(tenant, "instance", gpu_count=16, gang=True, ports=[8888])
    cycle()
    assert reload(w3).state == S.SCHEDULED
    assert all("gang_network" not in x.payload for x in _starts(w3).values())
    assert not GangAddress.objects.exists()


def test_addresses_go_back_when_the_gang_ends(
    tenant, make_node, submit, cycle, regions, django_capture_on_commit_callbacks
):
    _network(regions["us"])
    a, b = make_node(), make_node()
    _joins(a, b)
    w = submit(tenant, gpu_count=16, gang=True)
    cycle()
    _report(django_capture_on_commit_callbacks, w, a)
    _report(django_capture_on_commit_callbacks, w, b)
    assert reload(w).state == S.RUNNING and GangAddress.objects.filter(workload=w).count() == 2
    with django_capture_on_commit_callbacks(execute=True):
        _exit(a, w)
    assert GangAddress.objects.filter(workload=w).count() == 2  # the gang still runs
    with django_capture_on_commit_callbacks(execute=True):
        _exit(b, w)
    assert reload(w).state == S.SUCCEEDED
    assert not GangAddress.objects.filter(workload=w).exists()


def test_a_stopped_members_address_waits_for_its_nodes_word(
    tenant, make_node, submit, cycle, regions, django_capture_on_commit_callbacks
):
    _network(regions["us"])
    a, b = make_node(), make_node()
    _joins(a, b)
    w = submit(tenant, gpu_count=16, gang=True)
    cycle()
    first = dict(GangAddress.objects.filter(workload=w).values_list("node_id", "address"))
    _report(django_capture_on_commit_callbacks, w, a)
    _report(django_capture_on_commit_callbacks, w, b, status="failed", result={"reason": "image pull failed"})
    assert reload(w).state == S.QUEUED
    # A's member started and was told to stop: its address stays held until A says it is gone;
    # B's member never started, so its address went back at once.
    assert dict(GangAddress.objects.filter(workload=w).values_list("node_id", "address")) == {
        a.pk: first[a.pk]
    }
    stop = NodeCommand.objects.get(node=a, kind=CommandKind.STOP_WORKLOAD, payload__workload_id=str(w.pk))
    with django_capture_on_commit_callbacks(execute=True):
        node_command_report(node_id=a.pk, command_id=stop.pk, status="succeeded", result={})
    assert not GangAddress.objects.filter(workload=w).exists()
    c = make_node()  # B is avoided now
    _joins(c)
    cycle()  # placed again: new rows for the new attempt
    assert reload(w).state == S.SCHEDULED
    rows = GangAddress.objects.filter(workload=w)
    assert rows.count() == 2 and {r.attempt for r in rows} == {reload(w).attempt}
    given = {x.payload["gang_network"]["address"] for x in _starts(w).values()}
    assert given == set(rows.values_list("address", flat=True))


@pytest.mark.parametrize(
    "network",
    [
        {"subnet": SUBNET, "range": RANGE, "address": "10.77.0.9"},  # outside the range
        {"subnet": SUBNET, "range": "10.78.0.0/24", "address": "10.78.0.9"},  # range outside the subnet
        {"subnet": "10.77.0.0/33", "range": RANGE, "address": "10.77.200.2"},
        {"subnet": SUBNET, "range": RANGE, "address": "10.77.200.2; rm -rf /"},
        {"subnet": SUBNET, "range": RANGE, "address": "10.77.200.2", "gateway": "10.99.0.1"},
        {"subnet": SUBNET, "range": RANGE, "address": "10.77.200.2", "parent": "eth0"},
        {"subnet": ["10.77.0.0/16"], "range": RANGE, "address": "10.77.200.2"},
        "10.77.200.2",
    ],
)
def test_the_agent_refuses_a_bad_gang_network_naming_the_field(network):
    with pytest.raises(WorkloadRuleError) as err:
        check_start_payload({"workload_id": "1", "gang_network": network})
    assert err.value.field == "gang_network"
