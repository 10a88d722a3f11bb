from scheduling.engine import CycleConfig, Place, Reason, Request, schedule

from .factories import node, snapshot


def req(i, **kw):
    kw.setdefault("tenant", "t")
    return Request(id=str(i), **kw)


def test_whole_gpus_on_one_node_are_distinct_and_free():
    snap = snapshot(node("n", gpus=8, free={0: 500}))
    [d] = schedule(snap, [req(1, gpus=4)])
    a = d.assignments[0]
    assert len(set(a.gpu_indices)) == 4 and 0 not in a.gpu_indices and a.milli == 1000


def test_multi_gpu_prefers_one_nvlink_island():
    # islands {0..3} and {4..7}; island 0 has only 3 whole GPUs left, island 1 has 4
    snap = snapshot(node("n", gpus=8, islands=2, free={0: 0}))
    [d] = schedule(snap, [req(1, gpus=4)])
    assert sorted(d.assignments[0].gpu_indices) == [4, 5, 6, 7]


def test_multi_gpu_spans_islands_only_when_it_must():
    snap = snapshot(node("n", gpus=8, islands=2, free={0: 0, 4: 0}))
    [d] = schedule(snap, [req(1, gpus=6)])
    assert len(d.assignments[0].gpu_indices) == 6


def test_topology_beats_packing_across_nodes():
    # node a would be packed tighter but must split the pair across islands; b keeps it in one
    a = node("a", gpus=4, islands=2, free={0: 0, 2: 0})
    b = node("b", gpus=4, islands=2)
    [d] = schedule(snapshot(a, b), [req(1, gpus=2)], CycleConfig(policy="bestfit"))
    assert d.assignments[0].node_id == "b"


def test_fractions_share_one_gpu_up_to_1000():
    snap = snapshot(node("n", gpus=1))
    out = schedule(snap, [req(i, milli=300, submit_time=i) for i in range(4)])
    placed = [d for d in out if isinstance(d, Place)]
    assert len(placed) == 3 and sum(d.assignments[0].milli for d in placed) == 900
    assert not isinstance(out[3], Place) or out[3].request_id != "3"


def test_fraction_goes_to_the_fitting_partly_used_gpu():
    snap = snapshot(node("n", gpus=2, free={0: 400}))
    [d] = schedule(snap, [req(1, milli=400)], CycleConfig(policy="bestfit"))
    assert d.assignments[0].gpu_indices == (0,)


def test_gang_is_all_or_nothing_on_whole_nodes():
    nodes = [node(f"n{i}", gpus=8) for i in range(3)]
    nodes[2] = node("n2", gpus=8, free={0: 0})
    [d] = schedule(snapshot(*nodes), [req(1, gpus=16, gang=True)])
    assert isinstance(d, Place) and {a.node_id for a in d.assignments} == {"n0", "n1"}
    assert all(len(a.gpu_indices) == 8 for a in d.assignments)
    [d] = schedule(snapshot(*nodes), [req(1, gpus=24, gang=True)])
    assert not isinstance(d, Place) and d.reason == Reason.GANG


def test_gang_needs_a_multiple_of_the_node_size():
    [d] = schedule(snapshot(node("a", gpus=8), node("b", gpus=8)), [req(1, gpus=12, gang=True)])
    assert d.reason == Reason.NO_MATCHING_MODEL


def test_invalid_requests_are_rejected_with_a_reason():
    out = schedule(snapshot(node("n")), [req(1, gpus=2, milli=500), req(2, gpus=9)])
    assert [d.reason for d in out] == [Reason.INVALID, Reason.INVALID]


def test_all_policies_place_the_same_simple_request():
    for policy in ("gpupool", "fgd", "bestfit", "random", "packing", "spread"):
        [d] = schedule(snapshot(node("n")), [req(1, gpus=2)], CycleConfig(policy=policy))
        assert isinstance(d, Place), policy


def test_identical_nodes_share_one_bucket():
    from scheduling.engine import ClusterState

    st = ClusterState([node(f"n{i}") for i in range(100)] + [node("x", free={0: 0})])
    assert len(st.buckets) == 2
