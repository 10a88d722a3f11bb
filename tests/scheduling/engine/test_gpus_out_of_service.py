"""A GPU that takes no work (unhealthy, isolated, or draining for a staff MIG change: the snapshot
marks it not healthy) while work still runs on it: nothing the engine does with that work (lend an
elastic job's GPUs, preempt it, count its end for the head of the queue's reservation) makes the
GPU take new work."""

from __future__ import annotations

from scheduling.engine import Place, Plan, Request, Resize, Running, schedule

from .factories import node, snapshot


def _busy(n, held):
    for g in n.gpus:
        if g.index in held:
            g.free_milli = 0
    return n


def _placed_on(decisions) -> set[tuple[str, int]]:
    return {
        (a.node_id, g)
        for d in decisions
        if isinstance(d, Place)
        for a in d.assignments
        for g in a.gpu_indices
    }


def test_an_elastic_job_does_not_lend_a_draining_gpu():
    # The job holds GPUs 0 and 1 (minimum 1); GPU 1 drains. Lent, it would go to the request: the job
    # keeps it as its minimum and lends GPU 0 instead.
    n = _busy(node("n1", gpus=2, unhealthy=(1,)), (0, 1))
    e = Running("e", "t1", "n1", (0, 1), elastic_min=1, elastic_max=2)
    out = schedule(snapshot(n, running=[e]), [Request("r", "t2")])
    assert _placed_on(out) == {("n1", 0)}
    [resize] = [d for d in out if isinstance(d, Resize)]
    assert resize.gpu_indices == (1,) and resize.removed == (0,)


def test_an_elastic_job_lends_its_healthy_gpus_but_keeps_the_draining_one():
    # Held 0, 1, 2 (minimum 1) with GPU 2 draining: GPU 2 counts toward the minimum, so 0 and 1
    # are lent and a two-GPU request takes them, never GPU 2.
    n = _busy(node("n1", gpus=3, unhealthy=(2,)), (0, 1, 2))
    e = Running("e", "t1", "n1", (0, 1, 2), elastic_min=1, elastic_max=3)
    out = schedule(snapshot(n, running=[e]), [Request("r", "t2", gpus=2)])
    assert _placed_on(out) == {("n1", 0), ("n1", 1)}
    [resize] = [d for d in out if isinstance(d, Resize)]
    assert resize.gpu_indices == (2,)


def test_preempting_work_on_a_draining_gpu_places_nothing_there():
    n = _busy(node("n1", gpus=1, unhealthy=(0,)), (0,))
    spot = Running("sp", "t1", "n1", (0,), plan=Plan.SPOT)
    out = schedule(snapshot(n, running=[spot]), [Request("r", "t2")])
    assert not [d for d in out if isinstance(d, Place)]  # no preemption for a GPU that takes no work


def test_the_end_of_work_on_a_draining_gpu_reserves_nothing_for_the_head_of_the_queue():
    # GPU 0 drains (its job ends soon), GPU 1 is free. Were GPU 0's end counted, the two-GPU head of
    # the queue would hold the node from t=10 and a long one-GPU job could not backfill on GPU 1.
    n = _busy(node("n1", gpus=2, unhealthy=(0,)), (0,))
    draining = Running("a", "t1", "n1", (0,), start_time=0, est_end=10)
    head = Request("head", "t2", gpus=2, submit_time=0)
    small = Request("small", "t3", gpus=1, submit_time=1, est_runtime=1000)
    out = schedule(snapshot(n, running=[draining], now=5), [head, small])
    assert _placed_on(out) == {("n1", 1)}
