"""Placement constraints in the engine: node selector, affinity, anti-affinity, spread, preference."""

from __future__ import annotations

from scheduling.engine import GpuSpec, Pending, Place, Reason, Request, Running, schedule
from scheduling.engine.constraints import Constraints, Term, rank_models

from .factories import CATALOG, node, snapshot


def labelled(id, rack, model="A100", gpus=8, **kw):
    n = node(id, model, gpus, **kw)
    n.labels = {"rack": rack}
    return n


def nodes_of(decisions):
    return {d.request_id: [a.node_id for a in d.assignments] for d in decisions if isinstance(d, Place)}


def test_node_selector_places_only_on_matching_labels():
    snap = snapshot(labelled("a", "r1"), labelled("b", "r2"), labelled("c", "r1"))
    reqs = [
        Request(f"w{i}", "t1", gpus=8, constraints=Constraints(node_selector=(("rack", "r2"),)))
        for i in range(2)
    ]
    out = schedule(snap, reqs)
    assert nodes_of(out) == {"w0": ["b"]}
    pending = [d for d in out if isinstance(d, Pending)]
    assert pending[0].request_id == "w1"
    assert pending[0].reason == Reason.NODE_SELECTOR  # r2 exists but is full


def test_node_selector_nothing_matches_names_the_selector():
    out = schedule(
        snapshot(labelled("a", "r1")),
        [Request("w", "t1", constraints=Constraints(node_selector=(("rack", "r9"),)))],
    )
    assert out[0].reason == Reason.NODE_SELECTOR
    assert "rack=r9" in out[0].message


def test_anti_affinity_keeps_a_tenants_workloads_apart_by_rack():
    snap = snapshot(labelled("a", "r1"), labelled("b", "r1"), labelled("c", "r2"))
    snap.running = [Running("old", "t1", "a", (0,))]
    snap.nodes[0].gpus[0].free_milli = 0
    term = Term(frozenset({"old"}), "rack")
    out = schedule(snap, [Request("w", "t1", constraints=Constraints(anti_affinity=term))])
    assert nodes_of(out) == {"w": ["c"]}


def test_other_tenants_workloads_never_count():
    snap = snapshot(labelled("a", "r1"), labelled("c", "r2"))
    snap.running = [Running("old", "t2", "a", (0,))]
    snap.nodes[0].gpus[0].free_milli = 0
    term = Term(frozenset({"old"}), "node")
    # Affinity to another tenant's workload: no domain holds one of its own, so it waits.
    out = schedule(snap, [Request("w", "t1", constraints=Constraints(affinity=term))])
    assert out[0].reason == Reason.AFFINITY
    # Anti-affinity to it rules nothing out.
    out = schedule(snap, [Request("w", "t1", gpus=7, constraints=Constraints(anti_affinity=term))])
    assert nodes_of(out) == {"w": ["a"]}


def test_affinity_follows_a_workload_placed_in_the_same_cycle():
    snap = snapshot(labelled("a", "r1"), labelled("b", "r2"), labelled("c", "r2"))
    first = Request("w1", "t1", gpus=8, constraints=Constraints(node_selector=(("rack", "r2"),)))
    second = Request(
        "w2", "t1", gpus=8, submit_time=1, constraints=Constraints(affinity=Term(frozenset({"w1"}), "rack"))
    )
    placed = nodes_of(schedule(snap, [first, second]))
    assert placed["w1"][0] in ("b", "c") and placed["w2"][0] in ("b", "c")
    assert placed["w1"] != placed["w2"]


def test_array_tasks_spread_over_racks():
    snap = snapshot(*(labelled(f"n{i}", f"r{i % 3}") for i in range(6)))
    c = Constraints(spread_key="rack", max_skew=1, group="arr")
    reqs = [Request(f"t{i}", "t1", gpus=1, submit_time=i, constraints=c) for i in range(6)]
    placed = nodes_of(schedule(snap, reqs))
    racks = [int(placed[f"t{i}"][0][1:]) % 3 for i in range(6)]
    assert sorted(racks) == [0, 0, 1, 1, 2, 2]
    # Without the spread the packing policy puts them all on one node.
    plain = nodes_of(schedule(snap, [Request(f"t{i}", "t1", gpus=1, submit_time=i) for i in range(6)]))
    assert len({v[0] for v in plain.values()}) == 1


def test_spread_counts_running_members():
    snap = snapshot(labelled("a", "r1"), labelled("b", "r2"))
    snap.running = [Running("t0", "t1", "a", (0,), group="arr")]
    snap.nodes[0].gpus[0].free_milli = 0
    c = Constraints(spread_key="rack", group="arr")
    assert nodes_of(schedule(snap, [Request("t1x", "t1", constraints=c)])) == {"t1x": ["b"]}


def test_gang_spread_takes_one_node_per_rack():
    snap = snapshot(*(labelled(f"n{i}", "r1" if i < 3 else "r2") for i in range(6)))
    c = Constraints(spread_key="rack", max_skew=1)
    placed = nodes_of(schedule(snap, [Request("g", "t1", gpus=16, gang=True, constraints=c)]))
    assert sorted(placed["g"]) == ["n0", "n3"]
    plain = nodes_of(schedule(snap, [Request("g", "t1", gpus=16, gang=True)]))
    assert sorted(plain["g"]) == ["n0", "n1"]


def test_gang_spread_unmet_is_named():
    snap = snapshot(*(labelled(f"n{i}", "r1") for i in range(4)), labelled("x", "r2"))
    c = Constraints(spread_key="rack", max_skew=1)
    out = schedule(snap, [Request("g", "t1", gpus=32, gang=True, constraints=c)])
    assert out[0].reason == Reason.SPREAD


def test_preference_ranks_models():
    ranked = rank_models(["T4", "H100", "A100"], CATALOG, "fastest")
    assert [r.model for r in ranked] == ["H100", "A100", "T4"]
    from decimal import Decimal

    prices = {"H100": Decimal("8"), "A100": Decimal("2"), "T4": Decimal("0.5")}
    ranked = rank_models(["T4", "H100", "A100"], CATALOG, "cheapest", prices)
    assert [r.model for r in ranked] == ["A100", "T4", "H100"]  # 1.25, 1.0, 0.5 per unit price


def test_preference_chooses_the_model():
    snap = snapshot(node("t", "T4"), node("h", "H100"), node("a", "A100"))
    spec = GpuSpec(models=("T4", "H100", "A100"))
    for prefer, want in ((("H100", "A100", "T4"), "h"), (("T4", "A100", "H100"), "t")):
        out = schedule(snap, [Request("w", "t1", gpu=spec, constraints=Constraints(prefer=prefer))])
        assert nodes_of(out) == {"w": [want]}
    # Region still comes first: the preferred model elsewhere loses to the home region.
    snap = snapshot(node("t", "T4", region="eu"), node("h", "H100", region="us"))
    out = schedule(
        snap, [Request("w", "t1", gpu=spec, region="eu", constraints=Constraints(prefer=("H100", "T4")))]
    )
    assert nodes_of(out) == {"w": ["t"]}


def test_naming_an_array_job_names_its_running_tasks():
    snap = snapshot(labelled("a", "r1"), labelled("b", "r2"))
    snap.running = [Running("task7", "t1", "a", (0,), group="arr")]
    snap.nodes[0].gpus[0].free_milli = 0
    near = Constraints(affinity=Term(frozenset({"arr"}), "rack"))
    away = Constraints(anti_affinity=Term(frozenset({"arr"}), "rack"))
    assert nodes_of(schedule(snap, [Request("w", "t1", constraints=near)])) == {"w": ["a"]}
    assert nodes_of(schedule(snap, [Request("w", "t1", constraints=away)])) == {"w": ["b"]}
