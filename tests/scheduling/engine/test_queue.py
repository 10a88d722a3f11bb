from dataclasses import replace

from scheduling.engine import (
    CycleConfig,
    Pending,
    Place,
    QueueConfig,
    QueuePolicy,
    Reason,
    Request,
    Running,
    schedule,
)

from .factories import node, snapshot


def order(decisions):
    return [d.request_id for d in decisions if isinstance(d, Place)]


def test_priority_classes_go_first():
    snap = snapshot(node("n", gpus=1))
    out = schedule(
        snap,
        [
            Request("spot", "a", plan="spot", submit_time=0),
            Request("od", "b", plan="on_demand", submit_time=5),
        ],
    )
    assert order(out) == ["od"]


def test_fair_share_between_tenants_inside_a_class():
    # tenant a already uses 4 GPUs; b uses none: b's requests come first until shares even out
    running = [Running("ra", "a", "busy", (0, 1, 2, 3))]
    snap = snapshot(node("busy", gpus=4, free=dict.fromkeys(range(4), 0)), node("n", gpus=8), running=running)
    reqs = [Request(f"a{i}", "a", submit_time=i) for i in range(4)] + [
        Request(f"b{i}", "b", submit_time=10 + i) for i in range(4)
    ]
    out = schedule(snap, reqs)
    assert order(out)[:4] == ["b0", "b1", "b2", "b3"]


def test_tenant_weights_scale_the_share():
    snap = snapshot(node("n", gpus=3), weights={"a": 3.0, "b": 1.0})
    reqs = [Request(f"a{i}", "a", submit_time=i) for i in range(3)] + [
        Request(f"b{i}", "b", submit_time=i) for i in range(3)
    ]
    placed = order(schedule(snap, reqs))
    assert sum(p.startswith("a") for p in placed) == 2


def test_fcfs_inside_a_tenant_and_optional_sjf():
    snap = snapshot(node("n", gpus=1))
    reqs = [
        Request("late-short", "a", submit_time=5, est_runtime=10),
        Request("early-long", "a", submit_time=1, est_runtime=1000),
    ]
    assert order(schedule(snap, reqs)) == ["early-long"]
    sjf = CycleConfig(queue=QueueConfig(shortest_job_first=True))
    assert order(schedule(snap, reqs, sjf)) == ["late-short"]


def test_aging_promotes_a_long_waiting_request():
    snap = snapshot(node("n", gpus=1), now=10_000)
    reqs = [Request("old-spot", "a", plan="spot", submit_time=0), Request("new-od", "b", submit_time=9_999)]
    assert order(schedule(snap, reqs)) == ["old-spot"]
    no_aging = CycleConfig(queue=QueueConfig(promote_after_s=None))
    assert order(schedule(snap, reqs, no_aging)) == ["new-od"]


def _backfill_snapshot():
    # one 8-GPU node: 4 GPUs busy until t=100, 4 free. The head wants 8.
    running = [Running("r", "x", "n", tuple(range(4)), start_time=0, est_end=100)]
    return snapshot(node("n", gpus=8, free=dict.fromkeys(range(4), 0)), running=running, now=0)


def test_backfill_lets_short_work_run_without_delaying_the_head():
    reqs = [
        Request("head", "a", gpus=8, submit_time=0),
        Request("short", "b", gpus=2, submit_time=1, est_runtime=50),
        Request("long", "c", gpus=2, submit_time=2, est_runtime=500),
    ]
    out = {d.request_id: d for d in schedule(_backfill_snapshot(), reqs)}
    assert isinstance(out["head"], Pending) and out["head"].expected_start == 100
    assert isinstance(out["short"], Place) and out["short"].backfill
    assert isinstance(out["long"], Pending) and out["long"].reason == Reason.BLOCKED_BY_HEAD


def test_without_estimate_no_backfill_onto_held_capacity():
    reqs = [Request("head", "a", gpus=8, submit_time=0), Request("unknown", "b", gpus=2, submit_time=1)]
    out = {d.request_id: d for d in schedule(_backfill_snapshot(), reqs)}
    assert isinstance(out["unknown"], Pending)


def test_backfill_off_lets_anything_fit():
    reqs = [Request("head", "a", gpus=8, submit_time=0), Request("long", "c", gpus=2, submit_time=2)]
    out = {d.request_id: d for d in schedule(_backfill_snapshot(), reqs, CycleConfig(backfill=False))}
    assert isinstance(out["long"], Place)


def test_expected_start_for_capacity_pending():
    running = [Running("r", "x", "n", (0,), start_time=0, est_end=40)]
    snap = snapshot(node("n", gpus=1, free={0: 0}), running=running, now=0)
    [d] = schedule(snap, [Request("w", "a")], CycleConfig(backfill=False))
    assert d.reason == Reason.CAPACITY and d.expected_start == 40


def _queue_order(reqs, **config):
    snap = snapshot(node("n", gpus=1), now=7200)
    out = []
    pending = list(reqs)
    # One GPU: each schedule places the head of the queue; drop it and ask again.
    while pending:
        placed = order(schedule(snap, pending, CycleConfig(queue=QueueConfig(**config))))
        assert len(placed) == 1
        out += placed
        pending = [r for r in pending if r.id != placed[0]]
    return out


QUEUE = [
    Request("spot-old", "a", plan="spot", submit_time=0, est_runtime=5000),
    Request("spot-short", "a", plan="spot", submit_time=4000, est_runtime=60),
    Request("od-none", "a", plan="on_demand", submit_time=6000),
    Request("od-short", "a", plan="on_demand", submit_time=6500, est_runtime=120),
]


def test_each_queue_policy_orders_the_same_queue_its_own_way():
    # The default: class bands (spot-old promoted after an hour), then arrival.
    assert _queue_order(QUEUE) == ["spot-old", "od-none", "od-short", "spot-short"]
    assert _queue_order(QUEUE, policy=QueuePolicy.FCFS) == ["spot-old", "spot-short", "od-none", "od-short"]
    assert _queue_order(QUEUE, policy=QueuePolicy.SJF) == ["spot-short", "od-short", "spot-old", "od-none"]
    # Aged scores at t=7200: spot-old 1+2 = 3, spot-short 1+0.89, od-none 2+0.33, od-short 2+0.19.
    assert _queue_order(QUEUE, policy=QueuePolicy.PRIORITY_AGING) == [
        "spot-old",
        "od-none",
        "od-short",
        "spot-short",
    ]
    slow = _queue_order(QUEUE, policy=QueuePolicy.PRIORITY_AGING, priority_aging_per_hour=0.1)
    assert slow == ["od-none", "od-short", "spot-old", "spot-short"]


def test_a_requests_own_queue_policy_wins_over_the_config():
    reqs = [replace(r, queue_policy="sjf") for r in QUEUE]
    assert _queue_order(reqs, policy=QueuePolicy.FCFS) == ["spot-short", "od-short", "spot-old", "od-none"]
