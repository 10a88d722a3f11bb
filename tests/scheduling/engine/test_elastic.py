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


def test_borrowed_gpus_count_as_free_for_placement():
    # n1: an elastic job holds its 1 GPU plus 3 borrowed; n2 is idle. With the borrowed GPUs seen
    # as taken, the 1-GPU request went to n2 and the 4-GPU one then fitted nowhere; seen as free
    # (as with elastic moves off), the small one packs onto n1 and the big one gets n2.
    n1 = _busy(node("n1", gpus=4), range(4))
    e = _elastic(held=4, lo=1, hi=4)
    out = schedule(
        snapshot(n1, node("n2", gpus=4), running=[e]),
        [Request("small", "t2", gpus=1, submit_time=0.0), Request("big", "t2", gpus=4, submit_time=1.0)],
    )
    placed = {d.request_id: d.assignments[0].node_id for d in out if isinstance(d, Place)}
    assert placed == {"small": "n1", "big": "n2"}
    shrink = [d for d in out if isinstance(d, Resize)]
    assert [(r.for_request, len(r.removed)) for r in shrink] == [("small", 1)]
    assert out.index(shrink[0]) < [d.request_id for d in out].index("small")
    assert len(e.gpu_indices) == 3  # keeps the borrowed GPUs nobody took


def test_fair_share_counts_what_an_elastic_job_holds_firmly():
    # Tenant t1's elastic job borrows 7 of n1's GPUs; t1's next request is not ordered behind t3's
    # for them (its firm share, 1 GPU, is below t3's 2).
    n1 = _busy(node("n1", gpus=8), range(8))
    n2 = _busy(node("n2", gpus=4), range(2))
    busy = Running("b", "t3", "n2", (0, 1))
    e = _elastic(held=8, lo=1, hi=8)
    out = schedule(
        snapshot(n1, n2, running=[e, busy]),
        [Request("mine", "t1", gpus=2, submit_time=5.0), Request("theirs", "t3", gpus=2, submit_time=0.0)],
    )
    order = [d.request_id for d in out if isinstance(d, Place)]
    assert order[0] == "mine"


def test_a_placement_takes_idle_gpus_before_borrowed_ones_on_the_same_node():
    n = _busy(node("n1", gpus=8), range(6))
    e = _elastic(held=6, lo=2, hi=8)
    out = schedule(snapshot(n, running=[e]), [Request("r", "t2", gpus=2)])
    # The policy's first pick on n1 is GPUs 2 and 3, lent by the job: the idle 6 and 7 do as well.
    assert [type(d).__name__ for d in out] == ["Place"]
    assert out[0].assignments[0].gpu_indices == (6, 7)
    assert e.gpu_indices == tuple(range(6))


def test_borrowed_gpus_go_from_the_lowest_class_and_newest_job_first():
    n = _busy(node("n1", gpus=8), range(8))
    old = _elastic("old", held=4, lo=1, start=0.0)
    new = Running("new", "t1", "n1", (4, 5, 6, 7), start_time=50.0, elastic_min=1, elastic_max=8)
    spot = Running("sp", "t1", "n1", (), plan=Plan.SPOT)
    out = schedule(snapshot(n, running=[old, new, spot]), [Request("r", "t2", gpus=3)])
    shrunk = {d.request_id: d.removed for d in out if isinstance(d, Resize)}
    assert shrunk == {"new": (5, 6, 7)}
    assert old.gpu_indices == (0, 1, 2, 3) and new.gpu_indices == (4,)


def test_a_preempted_elastic_job_is_neither_given_back_its_gpus_nor_grown():
    n = _busy(node("n1", gpus=8), range(8))
    e = _elastic(held=6, lo=4, plan=Plan.SPOT)
    other = Running("o", "t3", "n1", (6, 7))
    out = schedule(snapshot(n, running=[e, other]), [Request("r", "t2", gpus=5, plan=Plan.ON_DEMAND)])
    # Two lent GPUs are not enough; preempting the job frees six, the request takes five, and the
    # sixth stays idle rather than going back to (or growing) the job that is being stopped.
    assert [type(d).__name__ for d in out] == ["Place"]
    assert out[0].preempt == ("e",)
    assert len(out[0].assignments[0].gpu_indices) == 5
