"""Partly reserved nodes, nodes to avoid after a failed start, and gangs that preempt."""

import pytest

from scheduling.engine import (
    POLICIES,
    CycleConfig,
    GpuSpec,
    Pending,
    Place,
    Reason,
    Request,
    Running,
    schedule,
)

from .factories import node, snapshot


def req(i, **kw):
    kw.setdefault("tenant", "t")
    return Request(id=str(i), **kw)


def partly(id, keep, owner="acme", **kw):
    n = node(id, reserved_for=owner, **kw)
    n.reserved_gpus = keep
    return n


def busy(id, gpus=8, **kw):
    return node(id, gpus=gpus, free=dict.fromkeys(range(gpus), 0), **kw)


# -- partly reserved nodes ------------------------------------------------------------------------


def test_on_demand_uses_only_what_the_owners_share_leaves():
    # 4 of 8 GPUs reserved: 4 for anyone, and not one more.
    out = schedule(snapshot(partly("n", 4)), [req(1, gpus=4, submit_time=1), req(2, gpus=1, submit_time=2)])
    assert isinstance(out[0], Place) and len(out[0].assignments[0].gpu_indices) == 4
    assert isinstance(out[1], Pending) and out[1].reason == Reason.CAPACITY
    # A whole-node reservation (no count) stays closed to on-demand work, as before.
    [d] = schedule(snapshot(node("n", reserved_for="acme")), [req(1, gpus=1)])
    assert isinstance(d, Pending)


def test_twelve_reserved_on_eight_gpu_nodes_leave_four_to_others():
    nodes = [node("a", reserved_for="acme"), partly("b", 4)]
    out = schedule(snapshot(*nodes), [req(1, gpus=4, submit_time=1), req(2, gpus=4, submit_time=2)])
    assert isinstance(out[0], Place) and out[0].assignments[0].node_id == "b"
    assert isinstance(out[1], Pending)


def test_fractions_and_cpu_only_work_keep_the_share_whole():
    # 2 of 2 kept: a fraction would break a kept GPU, a CPU-only request takes no GPU.
    out = schedule(snapshot(partly("n", 2, gpus=2)), [req(1, milli=300), req(2, gpus=0, submit_time=1)])
    assert isinstance(out[0], Pending) and isinstance(out[1], Place)
    # 1 of 2 kept: the fraction goes on the other GPU, and a second fraction joins it there.
    out = schedule(snapshot(partly("n", 1, gpus=2)), [req(1, milli=300), req(2, milli=300, submit_time=1)])
    assert all(isinstance(d, Place) for d in out)
    assert out[0].assignments[0].gpu_indices == out[1].assignments[0].gpu_indices


def test_the_owners_reserved_work_uses_its_share_first():
    # The owner's 2 reserved GPUs count against its 4: on-demand may then take 4 of the other 6.
    reqs = [req(1, tenant="acme", plan="reserved", gpus=2), req(2, gpus=4, submit_time=1)]
    out = schedule(snapshot(partly("n", 4)), reqs)
    assert all(isinstance(d, Place) for d in out)
    # Another tenant's reserved work has no claim on acme's node.
    [d] = schedule(snapshot(partly("n", 4)), [req(3, tenant="other", plan="reserved")])
    assert isinstance(d, Pending) and d.reason == Reason.RESERVATION


def test_spot_borrows_the_share_and_the_owner_takes_it_back():
    [d] = schedule(snapshot(partly("n", 4)), [req(1, plan="spot", gpus=8)])
    assert isinstance(d, Place)
    running = [Running("sp", "t", "n", tuple(range(8)), plan="spot")]
    snap = snapshot(partly("n", 4, free=dict.fromkeys(range(8), 0)), running=running)
    [d] = schedule(snap, [req(2, tenant="acme", plan="reserved", gpus=4)])
    assert isinstance(d, Place) and d.preempt == ("sp",)
    # On-demand work may preempt the borrower too, but only for what the share leaves.
    snap = snapshot(partly("n", 4, free=dict.fromkeys(range(8), 0)), running=running)
    [d] = schedule(snap, [req(3, gpus=4)])
    assert isinstance(d, Place) and d.preempt == ("sp",)
    snap = snapshot(partly("n", 4, free=dict.fromkeys(range(8), 0)), running=running)
    [d] = schedule(snap, [req(4, gpus=5)])
    assert isinstance(d, Pending)


def test_beyond_its_share_the_owner_takes_back_only_lent_capacity():
    # acme runs its 4 reserved GPUs (share used up); others run on-demand and spot on the rest.
    running = [
        Running("own", "acme", "n", (0, 1, 2, 3), plan="reserved"),
        Running("od", "t", "n", (4, 5), plan="on_demand", start_time=5),
        Running("sp", "t", "n", (6, 7), plan="spot", start_time=0),
    ]
    full = dict.fromkeys(range(8), 0)
    [d] = schedule(
        snapshot(partly("n", 0, free=full), running=running, now=10),
        [req(1, tenant="acme", plan="reserved", gpus=2)],
    )
    assert isinstance(d, Place) and d.preempt == ("sp",)
    [d] = schedule(
        snapshot(partly("n", 0, free=full), running=running, now=10),
        [req(1, tenant="acme", plan="reserved", gpus=4)],
    )
    assert isinstance(d, Pending)  # it would need the on-demand work's GPUs
    # Within its unused share (work placed before the reservation began) it preempts what it must.
    running = [Running("od", "t", "n", tuple(range(8)), plan="on_demand")]
    [d] = schedule(
        snapshot(partly("n", 4, free=full), running=running, now=10),
        [req(1, tenant="acme", plan="reserved", gpus=4)],
    )
    assert isinstance(d, Place) and d.preempt == ("od",)


def test_an_on_demand_gang_does_not_take_a_partly_reserved_node():
    nodes = [node("a"), partly("b", 4)]
    [d] = schedule(snapshot(*nodes), [req(1, gpus=16, gang=True)])
    assert isinstance(d, Pending)
    [d] = schedule(snapshot(*nodes, node("c")), [req(1, gpus=16, gang=True)])
    assert {a.node_id for a in d.assignments} == {"a", "c"}


# -- nodes to avoid -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_node_that_failed_to_start_the_request_is_avoided(policy):
    # "a" is the better fit (the request fills it), so without the avoid list it would go there.
    nodes = [node("a", gpus=2), node("b", gpus=8)]
    [d] = schedule(snapshot(*nodes), [req(1, gpus=2)], CycleConfig(policy=policy))
    if policy in ("bestfit", "packing", "gpupool"):
        assert d.assignments[0].node_id == "a"
    for _ in range(3):
        [d] = schedule(snapshot(*nodes), [req(1, gpus=2, avoid_nodes=("a",))], CycleConfig(policy=policy))
        assert isinstance(d, Place) and d.assignments[0].node_id == "b"


def test_an_avoided_node_is_used_again_only_when_no_other_could_ever_fit():
    # The only other node is busy now: the request waits for it rather than going back.
    nodes = [node("a", gpus=2), busy("b", gpus=2)]
    [d] = schedule(snapshot(*nodes), [req(1, gpus=2, avoid_nodes=("a",))])
    assert isinstance(d, Pending)
    # The other node can never take it (too small, another model): back to the avoided one.
    a100 = GpuSpec(models=("A100",))
    for other in (node("b", gpus=1), node("b", model="T4", gpus=2)):
        [d] = schedule(snapshot(node("a", gpus=2), other), [req(1, gpu=a100, gpus=2, avoid_nodes=("a",))])
        assert isinstance(d, Place) and d.assignments[0].node_id == "a"


def test_an_identical_request_without_an_avoid_list_still_gets_the_avoided_node():
    nodes = [node("a", gpus=2), busy("b", gpus=2)]
    out = schedule(snapshot(*nodes), [req(1, gpus=2, avoid_nodes=("a",)), req(2, gpus=2, submit_time=1)])
    assert isinstance(out[0], Pending)
    assert isinstance(out[1], Place) and out[1].assignments[0].node_id == "a"


def test_preemption_avoids_the_node_too():
    running = [Running("sp-a", "x", "a", (0, 1), plan="spot"), Running("sp-b", "x", "b", (0, 1), plan="spot")]
    snap = snapshot(busy("a", gpus=2), busy("b", gpus=2), running=running, now=10)
    [d] = schedule(snap, [req(1, gpus=2, avoid_nodes=("b",))])
    assert d.preempt == ("sp-a",)
    snap = snapshot(busy("a", gpus=2), busy("b", gpus=2), running=running, now=10)
    [d] = schedule(snap, [req(1, gpus=2, avoid_nodes=("a",))])
    assert d.preempt == ("sp-b",)


# -- gangs that preempt -----------------------------------------------------------------------------


def _spot(id, node_id, gpus=range(8), **kw):
    kw.setdefault("plan", "spot")
    return Running(id, "x", node_id, tuple(gpus), **kw)


def test_a_gang_preempts_on_enough_whole_nodes():
    running = [_spot("s-a", "a"), _spot("s-b", "b")]
    snap = snapshot(busy("a"), busy("b"), running=running, now=10)
    [d] = schedule(snap, [req(1, gpus=16, gang=True)])
    assert isinstance(d, Place) and set(d.preempt) == {"s-a", "s-b"}
    assert {a.node_id for a in d.assignments} == {"a", "b"}
    assert all(len(a.gpu_indices) == 8 for a in d.assignments)


def test_a_gang_uses_free_nodes_first_and_the_smallest_victim_set():
    running = [
        _spot("s1", "a", range(4)),
        _spot("s2", "a", range(4, 8)),
        _spot("s3", "b"),
        _spot("od", "c", plan="on_demand"),
    ]
    snap = snapshot(busy("a"), busy("b"), busy("c"), node("d"), running=running, now=10)
    [d] = schedule(snap, [req(1, gpus=16, gang=True)])
    assert d.preempt == ("s3",) and {a.node_id for a in d.assignments} == {"b", "d"}


def test_gang_preemption_is_all_or_nothing():
    # One node could be emptied, the other runs on-demand work: nothing is preempted.
    running = [_spot("s-a", "a"), _spot("od", "b", plan="on_demand")]
    snap = snapshot(busy("a"), busy("b"), running=running, now=10)
    [d] = schedule(snap, [req(1, gpus=16, gang=True)])
    assert isinstance(d, Pending) and d.reason == Reason.GANG
    # Nodes in different regions are not one gang.
    running = [_spot("s-a", "a"), _spot("s-b", "b")]
    snap = snapshot(busy("a"), busy("b", region="us"), running=running, now=10)
    [d] = schedule(snap, [req(1, gpus=16, gang=True)])
    assert isinstance(d, Pending)


def test_a_spot_gang_never_preempts_on_demand_and_gang_victims_go_together():
    running = [_spot("od-a", "a", plan="on_demand"), _spot("od-b", "b", plan="on_demand")]
    snap = snapshot(busy("a"), busy("b"), running=running, now=10)
    [d] = schedule(snap, [req(1, gpus=16, gang=True, plan="spot")])
    assert isinstance(d, Pending)
    # A spot gang on a and c, other spot work on b: emptying a and c costs one workload.
    running = [_spot("g", "a", gang_id="g"), _spot("g", "c", gang_id="g"), _spot("s-b", "b")]
    snap = snapshot(busy("a"), busy("b"), busy("c"), running=running, now=10)
    [d] = schedule(snap, [req(1, gpus=16, gang=True)])
    assert d.preempt == ("g",) and {a.node_id for a in d.assignments} == {"a", "c"}
    # With b free, the gang takes b and a; its victim's member on c goes too, and the next request
    # gets c without another victim.
    running = [_spot("g", "a", gang_id="g"), _spot("g", "c", gang_id="g")]
    snap = snapshot(busy("a"), node("b"), busy("c"), running=running, now=10)
    out = schedule(snap, [req(1, gpus=16, gang=True), req(2, gpus=8, submit_time=1)])
    assert out[0].preempt == ("g",) and len({a.node_id for a in out[0].assignments}) == 2
    assert isinstance(out[1], Place) and out[1].preempt == ()
