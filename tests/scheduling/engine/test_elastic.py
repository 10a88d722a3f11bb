"""Elastic jobs in the engine: grow into idle GPUs, shrink toward the minimum before preempting."""

from __future__ import annotations

from scheduling.engine import CycleConfig, Place, Plan, Request, Resize, Running, schedule

from .factories import node, snapshot


def _elastic(id="e", *, held=4, lo=2, hi=8, plan=Plan.ON_DEMAND, start=0.0, tenant="t1", node_id="n1"):
    return Running(
        id=id,
        tenant=tenant,
        node_id=node_id,
        gpu_indices=tuple(range(held)),
        plan=plan,
        start_time=start,
        elastic_min=lo,
        elastic_max=hi,
    )


def _busy(n, held):
    for g in n.gpus:
        if g.index in held:
            g.free_milli = 0
    return n


def test_grows_into_idle_gpus_of_its_node_up_to_max():
    n = _busy(node("n1", gpus=8), range(4))
    e = _elastic(held=4, hi=6)
    out = schedule(snapshot(n, running=[e]), [])
    assert out == [Resize("e", "n1", (0, 1, 2, 3, 4, 5), added=(4, 5))]
    assert e.gpu_indices == (0, 1, 2, 3, 4, 5)


def test_grows_after_the_queue_is_served():
    n = _busy(node("n1", gpus=8), range(4))
    out = schedule(snapshot(n, running=[_elastic(held=4, hi=8)]), [Request("r", "t2", gpus=2)])
    place = [d for d in out if isinstance(d, Place)]
    grow = [d for d in out if isinstance(d, Resize)]
    assert len(place[0].assignments[0].gpu_indices) == 2
    assert len(grow) == 1 and len(grow[0].added) == 2
    assert not set(grow[0].added) & set(place[0].assignments[0].gpu_indices)


def test_shrinks_toward_min_instead_of_preempting():
    n = _busy(node("n1", gpus=8), range(8))
    spot = Running("s", "t3", "n1", (), plan=Plan.SPOT)  # nothing to take from it here
    e = _elastic(held=8, lo=2, hi=8)
    out = schedule(snapshot(n, running=[e, spot]), [Request("r", "t2", gpus=3)])
    assert isinstance(out[0], Resize) and out[0].for_request == "r"
    assert len(out[0].removed) == 3 and len(out[0].gpu_indices) == 5
    assert isinstance(out[1], Place) and out[1].preempt == ()
    assert set(out[1].assignments[0].gpu_indices) == set(out[0].removed)


def test_never_below_min_then_preemption_decides():
    n = _busy(node("n1", gpus=8), range(8))
    e = _elastic(held=8, lo=6, hi=8)
    out = schedule(snapshot(n, running=[e]), [Request("r", "t2", gpus=3, plan=Plan.SPOT)])
    # Two GPUs above the minimum are not enough, and an on-demand job does not preempt its peer.
    assert [type(d).__name__ for d in out] == ["Pending"]
    assert e.gpu_indices == tuple(range(8))


def test_gpus_above_min_are_borrowed_and_yield_even_to_a_lower_class():
    n = _busy(node("n1", gpus=8), range(8))
    out = schedule(
        snapshot(n, running=[_elastic(held=8, lo=6, plan=Plan.ON_DEMAND)]),
        [Request("r", "t2", gpus=2, plan=Plan.SPOT), Request("q", "t3", gpus=1, plan=Plan.SPOT)],
    )
    # The spot request takes the two borrowed GPUs; the next finds the job at its minimum.
    assert [type(d).__name__ for d in out] == ["Resize", "Place", "Pending"]
    assert len(out[0].gpu_indices) == 6


def test_disabled_by_config():
    n = _busy(node("n1", gpus=8), range(4))
    out = schedule(snapshot(n, running=[_elastic(held=4)]), [], CycleConfig(elastic=False))
    assert out == []
