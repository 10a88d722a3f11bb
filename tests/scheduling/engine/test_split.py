"""GPUs pooled across nodes (``gpus_per_node``): one node when it can, then one domain, then one
region, across regions only when the request allows it."""

from dataclasses import replace

from scheduling.engine import Place, Reason, Request, schedule
from scheduling.engine.fragmentation import Distribution
from scheduling.engine.spec import demand_for

from .factories import CATALOG, node, snapshot

BUSY6 = dict.fromkeys(range(6), 0)  # an 8-GPU node with 2 whole GPUs free


def req(i, **kw):
    kw.setdefault("tenant", "t")
    return Request(id=str(i), **kw)


def _nodes(d):
    return sorted((a.node_id, len(a.gpu_indices)) for a in d.assignments)


def test_four_gpus_come_as_two_plus_two_only_when_allowed():
    snap = snapshot(node("a", free=BUSY6), node("b", free=BUSY6))
    [d] = schedule(snap, [req(1, gpus=4)])
    assert not isinstance(d, Place) and d.reason == Reason.CAPACITY
    [d] = schedule(
        snapshot(node("a", free=BUSY6), node("b", free=BUSY6)), [req(1, gpus=4, gpus_per_node=(2, 4, 8))]
    )
    assert isinstance(d, Place) and _nodes(d) == [("a", 2), ("b", 2)]


def test_one_node_first_when_one_can_take_it_all():
    snap = snapshot(node("a", free=BUSY6), node("b", free=BUSY6), node("c", free={0: 0, 1: 0, 2: 0, 3: 0}))
    [d] = schedule(snap, [req(1, gpus=4, gpus_per_node=(2, 4))])
    assert _nodes(d) == [("c", 4)]


def test_one_domain_before_one_region_and_never_across_regions_unless_allowed():
    a = replace(node("a", free=BUSY6), domain="rack-1")
    b = replace(node("b", free=BUSY6), domain="rack-2")
    c = replace(node("c", free=BUSY6), domain="rack-1")
    [d] = schedule(snapshot(a, b, c), [req(1, gpus=4, gpus_per_node=(2,))])
    assert _nodes(d) == [("a", 2), ("c", 2)]
    # Different domains: one region still does.
    [d] = schedule(snapshot(a, b), [req(1, gpus=4, gpus_per_node=(2,))])
    assert _nodes(d) == [("a", 2), ("b", 2)]
    # Two regions: only when the request allows splitting across them.
    us = replace(node("u", free=BUSY6, region="us"), domain="rack-1")
    [d] = schedule(snapshot(a, us), [req(1, gpus=4, gpus_per_node=(2,))])
    assert not isinstance(d, Place)
    [d] = schedule(snapshot(a, us), [req(1, gpus=4, gpus_per_node=(2,), split_regions_ok=True)])
    assert _nodes(d) == [("a", 2), ("u", 2)]


def test_pieces_are_of_one_model_and_the_largest_size_first():
    snap = snapshot(
        node("a", free=dict.fromkeys(range(4), 0)),
        node("b", free=dict.fromkeys(range(4), 0)),
        node("h", "H100", free=BUSY6),
    )
    [d] = schedule(snap, [req(1, gpus=8, gpus_per_node=(2, 4))])
    assert _nodes(d) == [("a", 4), ("b", 4)]
    # 16 GPUs without a gang, as 8 + 8.
    [d] = schedule(snapshot(node("a"), node("b")), [req(1, gpus=16, gpus_per_node=(8,))])
    assert _nodes(d) == [("a", 8), ("b", 8)]


def test_refused_shapes():
    for bad in (
        req(1, gpus=4, gpus_per_node=(2,), gang=True),
        req(1, gpus=4, gpus_per_node=(0,)),
        req(1, gpus=12, gpus_per_node=(8,)),
    ):
        [d] = schedule(snapshot(node("a"), node("b")), [bad])
        assert d.reason == Reason.INVALID


def test_the_fragmentation_measure_counts_a_split_request_by_its_pieces():
    d = demand_for(req(1, gpus=16, gpus_per_node=(4, 8)), CATALOG)
    dist = Distribution.from_demands([d])
    assert [t[2] for t in dist.types] == [4]
