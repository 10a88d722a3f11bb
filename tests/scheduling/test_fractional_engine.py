"""Fractional GPUs in the engine: over-subscription per model and MIG instances kept apart from other
work: they go only to GPUs in MIG mode, and nothing else does (plain data, no database). The
hardware's placement rules are in ``engine/test_mig.py``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodes.mig_profiles import H100_80
from scheduling.engine import (
    MILLI,
    CycleConfig,
    Engine,
    Gpu,
    GpuModelInfo,
    GpuSpec,
    Node,
    Pending,
    Place,
    Plan,
    Request,
    Running,
    Snapshot,
    Vendor,
    schedule,
)

MIG = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


def catalog(f: float = 1.0) -> dict[str, GpuModelInfo]:
    return {
        "H100": GpuModelInfo("H100", Vendor.NVIDIA, 81920, 4.0, (9, 0), mig_profiles=MIG, oversubscription=f),
        "L4": GpuModelInfo("L4", Vendor.NVIDIA, 23034, 0.5, (8, 9)),
    }


def gpu_node(id: str = "n1", gpus: int = 1, model: str = "H100", **free: int) -> Node:
    return Node(
        id,
        model,
        [Gpu(index=g, free_milli=free.get(f"g{g}", MILLI)) for g in range(gpus)],
        64_000,
        262_144,
    )


def share(
    id: str, milli: int, *, mig: str | None = None, plan: Plan = Plan.ON_DEMAND, t: float = 0
) -> Request:
    return Request(id, "t1", GpuSpec(mig_profile=mig), gpus=1, milli=milli, plan=plan, submit_time=t)


def whole(id: str, gpus: int = 1, t: float = 0) -> Request:
    return Request(id, "t1", GpuSpec(), gpus=gpus, submit_time=t)


def places(decisions) -> dict[str, Place]:
    return {d.request_id: d for d in decisions if isinstance(d, Place)}


@pytest.mark.parametrize(("factor", "both_fit"), [(1.0, False), (1.19, False), (1.2, True), (2.0, True)])
def test_two_600_milli_shares_fit_one_gpu_only_from_factor_1_2(factor, both_fit):
    snap = Snapshot([gpu_node()], catalog(factor))
    decisions = schedule(snap, [share("a", 600, t=1), share("b", 600, t=2)])
    placed = places(decisions)
    assert "a" in placed
    assert ("b" in placed) is both_fit
    if both_fit:
        # Each holds ceil(600 / f) of the GPU's 1000 capacity units; together no more than 1000.
        units = -(-600 * MILLI // round(factor * MILLI))
        assert [placed[r].assignments[0].milli for r in ("a", "b")] == [units, units]
        assert 2 * units <= MILLI


def test_whole_gpu_never_lands_on_a_shared_gpu_even_over_subscribed():
    snap = Snapshot([gpu_node(gpus=2)], catalog(4.0))
    decisions = schedule(snap, [share("s", 100, t=1), whole("w2", gpus=2, t=2), whole("w1", t=3)])
    placed = places(decisions)
    assert "s" in placed and "w1" in placed
    assert "w2" not in placed  # one GPU is shared, so two whole GPUs are not free
    assert placed["w1"].assignments[0].gpu_indices != placed["s"].assignments[0].gpu_indices
    assert placed["w1"].assignments[0].milli == MILLI


def test_over_subscription_is_per_model():
    snap = Snapshot([gpu_node("l4", model="L4")], catalog(2.0))  # only the H100 is over-subscribed
    decisions = schedule(snap, [share("a", 600, t=1), share("b", 600, t=2)])
    assert set(places(decisions)) == {"a"}


def test_existing_shares_count_in_units():
    # 500 units already used on an f=2 GPU: 1000 milli of shares (500 units) still fit, 1002 not.
    snap = Snapshot([gpu_node(g0=500)], catalog(2.0))
    assert set(places(schedule(snap, [share("a", 500, t=1), share("b", 500, t=2)]))) == {"a", "b"}
    snap = Snapshot([gpu_node(g0=500)], catalog(2.0))
    assert set(places(schedule(snap, [share("a", 500, t=1), share("b", 502, t=2)]))) == {"a"}


def mig_node(id: str = "n1", gpus: int = 2, mig_gpus: tuple[int, ...] = (0,)) -> Node:
    node = gpu_node(id, gpus=gpus)
    for g in mig_gpus:
        node.gpus[g].mig = True
    return node


def test_mig_slices_share_a_gpu_but_never_with_other_shares():
    snap = Snapshot([mig_node()], catalog(2.0))
    decisions = schedule(
        snap,
        [
            share("m1", 142, mig="1g.10gb", t=1),
            share("s1", 300, t=2),
            share("m2", 285, mig="2g.20gb", t=3),
            share("s2", 300, t=4),
        ],
    )
    placed = places(decisions)
    assert set(placed) == {"m1", "m2", "s1", "s2"}
    gpu = {r: placed[r].assignments[0].gpu_indices[0] for r in placed}
    assert gpu["m1"] == gpu["m2"]
    assert gpu["s1"] == gpu["s2"] != gpu["m1"]
    # MIG slices are hardware: never over-subscribed; other shares are (f = 2).
    assert placed["m2"].assignments[0].milli == 285
    assert placed["s1"].assignments[0].milli == 150


def test_mig_waits_rather_than_joining_a_gpu_shared_otherwise():
    snap = Snapshot([gpu_node()], catalog())
    decisions = schedule(snap, [share("s", 100, t=1), share("m", 142, mig="1g.10gb", t=2)])
    assert set(places(decisions)) == {"s"}
    assert isinstance(next(d for d in decisions if d.request_id == "m"), Pending)


def test_a_share_waits_rather_than_joining_a_gpu_with_mig_slices():
    node = gpu_node(g0=858)
    node.gpus[0].mig = True
    decisions = schedule(
        Snapshot([node], catalog()), [share("s", 100, t=1), share("m", 142, mig="1g.10gb", t=2)]
    )
    assert set(places(decisions)) == {"m"}


def test_mig_only_on_models_offering_the_profile():
    snap = Snapshot([gpu_node("l4", model="L4")], catalog())
    decisions = schedule(snap, [share("m", 142, mig="1g.10gb")])
    assert not places(decisions)
    assert decisions[0].reason == "no_matching_model"


def test_a_gpu_in_mig_mode_takes_no_other_work_even_when_empty():
    engine = Engine([mig_node(gpus=1)], catalog(), CycleConfig())
    assert places(engine.cycle([whole("w", t=1), share("s", 100, t=2)])) == {}
    first = places(engine.cycle([share("m", 142, mig="1g.10gb", t=3)]))
    engine.release(first["m"].assignments)
    # Its instances all ended: still in MIG mode (only staff change that), still only MIG work.
    assert places(engine.cycle([whole("w", t=4)])) == {}
    assert set(places(engine.cycle([share("m2", 142, mig="1g.10gb", t=5)]))) == {"m2"}


def test_preemption_frees_mig_instances_for_an_instance_only():
    node = gpu_node()
    node.gpus[0] = Gpu(0, free_milli=1000 - 2 * 428, mig=True, mig_used=(("3g.40gb", 0), ("3g.40gb", 4)))
    running = [
        Running(
            "spot-a",
            "t2",
            "n1",
            (0,),
            milli=428,
            plan=Plan.SPOT,
            start_time=1,
            mig_profile="3g.40gb",
            mig_start=4,
        ),
        Running("ondemand-b", "t2", "n1", (0,), milli=428, start_time=2, mig_profile="3g.40gb", mig_start=0),
    ]
    snap = Snapshot([node], catalog(), running, now=10)
    # A non-MIG share never goes to a GPU in MIG mode: nothing is preempted for it.
    assert not places(schedule(snap, [share("s", 100, t=3)]))
    # Neither can a 1g.10gb fit beside the two 3g.40gb (every memory slice is held) ...
    snap = Snapshot([node], catalog(), running, now=10)
    placed = places(schedule(snap, [share("m", 142, mig="1g.10gb", t=3)]))
    # ... until the spot instance goes: then it goes where the spot instance was.
    assert placed["m"].preempt == ("spot-a",)
    assert placed["m"].assignments[0].mig_start in (4, 5, 6)


@settings(max_examples=60, deadline=None)
@given(
    factor=st.sampled_from([1.0, 1.25, 1.5, 2.0, 4.0]),
    reqs=st.lists(
        st.tuples(st.sampled_from([0, 100, 250, 333, 600, 999, 1000]), st.booleans()), min_size=1, max_size=24
    ),
)
def test_units_never_exceed_a_gpu_and_mig_never_mixes(factor, reqs):
    nodes = [mig_node("n1"), mig_node("n2")]
    requests = []
    for k, (milli, mig) in enumerate(reqs):
        if milli == 0:
            requests.append(whole(f"r{k}", t=k))
        elif mig and milli < MILLI:
            profile = MIG[milli % len(MIG)]
            requests.append(share(f"r{k}", H100_80.fraction_milli(profile), mig=profile, t=k))
        else:
            requests.append(share(f"r{k}", milli, t=k))
    by_id = {r.id: r for r in requests}
    placed = places(schedule(Snapshot(nodes, catalog(factor)), requests))
    units: dict[tuple[str, int], int] = {}
    kinds: dict[tuple[str, int], set[str]] = {}
    for rid, p in placed.items():
        r = by_id[rid]
        for a in p.assignments:
            for g in a.gpu_indices:
                units[(a.node_id, g)] = units.get((a.node_id, g), 0) + a.milli
                kind = "whole" if r.milli == MILLI else "mig" if r.mig else "share"
                kinds.setdefault((a.node_id, g), set()).add(kind)
                expected = (
                    r.milli if r.mig or r.milli == MILLI else -(-r.milli * MILLI // round(factor * MILLI))
                )
                assert a.milli == expected
    assert all(u <= MILLI for u in units.values())
    for ks in kinds.values():
        assert len(ks) == 1, ks  # whole, MIG and other shares never share a GPU


@pytest.mark.parametrize("mig_first", [True, False])
def test_the_right_gpu_is_taken_when_a_mig_and_a_shared_gpu_have_the_same_room(mig_first):
    node = gpu_node(gpus=2, g0=716, g1=716)
    node.gpus[0 if mig_first else 1].mig = True
    mig_gpu = 0 if mig_first else 1
    decisions = schedule(
        Snapshot([node], catalog()), [share("s", 100, t=1), share("m", 142, mig="1g.10gb", t=2)]
    )
    placed = places(decisions)
    assert placed["m"].assignments[0].gpu_indices == (mig_gpu,)
    assert placed["s"].assignments[0].gpu_indices == (1 - mig_gpu,)
