"""MIG instances placed as the hardware makes them: the profile tables (memory slices, compute
slices, start positions, counts) of ``nodes.mig_profiles``, through the engine (plain data)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodes.mig_profiles import (
    A30_24,
    A100_40,
    H100_80,
    H200_141,
    check_placements,
    fit_starts,
    layout_placements,
    table_for,
)
from scheduling.engine import (
    MILLI,
    CycleConfig,
    Engine,
    Gpu,
    GpuModelInfo,
    GpuSpec,
    Node,
    Place,
    Request,
    Snapshot,
    Vendor,
    schedule,
)

H100 = "NVIDIA H100 SXM 80GB"
A30 = "NVIDIA A30"


def catalog() -> dict[str, GpuModelInfo]:
    return {
        H100: GpuModelInfo(H100, Vendor.NVIDIA, 81920, 1.0, (9, 0), mig_profiles=H100_80.names),
        A30: GpuModelInfo(A30, Vendor.NVIDIA, 24576, 0.47, (8, 0), mig_profiles=A30_24.names),
    }


def node(id: str = "n1", model: str = H100, gpus: int = 1, layout=(), used=()) -> Node:
    return Node(
        id,
        model,
        [Gpu(g, mig=True, mig_layout=tuple(layout), mig_used=tuple(used)) for g in range(gpus)],
        64_000,
        262_144,
    )


def mig(id: str, profile: str, t: float = 0, model: str = H100) -> Request:
    table = table_for(model)
    return Request(id, "t1", GpuSpec(mig_profile=profile), milli=table.fraction_milli(profile), submit_time=t)


def placed(decisions) -> dict[str, Place]:
    return {d.request_id: d for d in decisions if isinstance(d, Place)}


def test_the_tables_say_what_nvidia_documents():
    assert H100_80.names == ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
    assert [(p.compute, p.memory, p.starts) for p in H100_80.profiles] == [
        (1, 1, (0, 1, 2, 3, 4, 5, 6)),
        (1, 2, (0, 2, 4, 6)),
        (2, 2, (0, 2, 4)),
        (3, 4, (0, 4)),
        (4, 4, (0,)),
        (7, 8, (0,)),
    ]
    assert [p.max_count for p in H100_80.profiles] == [7, 4, 3, 2, 1, 1]
    assert A100_40.names[0] == "1g.5gb" and H200_141.names[-1] == "7g.141gb"
    assert (A30_24.compute_slices, A30_24.memory_slices, A30_24.fraction_milli("2g.12gb")) == (4, 4, 500)
    for name, key in (
        ("NVIDIA H100 80GB HBM3", "H100-80"),
        ("NVIDIA A100-SXM4-40GB", "A100-40"),
        ("NVIDIA A100-SXM4-80GB", "A100-80"),
        ("NVIDIA A100 80GB PCIe", "A100-80"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A30", "A30"),
    ):
        assert table_for(name).key == key, name
    assert table_for("NVIDIA L4") is None and table_for("NVIDIA H100 NVL") is None


def test_seven_1g_20gb_on_one_h100_places_four():
    # The issue: all seven went to one H100; the hardware fits 4 (2 memory slices each, of 8).
    decisions = schedule(Snapshot([node()], catalog()), [mig(f"m{k}", "1g.20gb", t=k) for k in range(7)])
    got = placed(decisions)
    assert len(got) == 4
    assert sorted(p.assignments[0].mig_start for p in got.values()) == [0, 2, 4, 6]
    # With a second GPU in MIG mode the other three go there.
    decisions = schedule(
        Snapshot([node(gpus=2)], catalog()), [mig(f"m{k}", "1g.20gb", t=k) for k in range(7)]
    )
    by_gpu = [p.assignments[0].gpu_indices[0] for p in placed(decisions).values()]
    assert sorted(by_gpu) == [0, 0, 0, 0, 1, 1, 1]


def test_two_3g_40gb_leave_no_memory_for_a_1g_10gb():
    # The issue: 3g.40gb + 3g.40gb + 1g.10gb was accepted though it needs 9 of 8 memory slices.
    reqs = [mig("a", "3g.40gb", 1), mig("b", "3g.40gb", 2), mig("c", "1g.10gb", 3)]
    got = placed(schedule(Snapshot([node()], catalog()), reqs))
    assert set(got) == {"a", "b"}
    assert {got["a"].assignments[0].mig_start, got["b"].assignments[0].mig_start} == {0, 4}
    with pytest.raises(ValueError, match="does not fit one GPU"):
        layout_placements(H100_80, ["3g.40gb", "3g.40gb", "1g.10gb"])


def test_valid_mixes_fill_the_gpu():
    # 4g + 2g + 1g: seven compute slices; and 3g + 2g + 1g + 1g at starts the hardware takes.
    reqs = [mig("a", "4g.40gb", 1), mig("b", "2g.20gb", 2), mig("c", "1g.10gb", 3), mig("d", "1g.10gb", 4)]
    got = placed(schedule(Snapshot([node()], catalog()), reqs))
    assert set(got) == {"a", "b", "c"}  # the 4th would be an 8th compute slice
    starts = [(r, got[r].assignments[0].mig_start) for r in "abc"]
    check_placements(H100_80, [({"a": "4g.40gb", "b": "2g.20gb", "c": "1g.10gb"}[r], s) for r, s in starts])
    assert layout_placements(H100_80, ["1g.10gb", "3g.40gb", "2g.20gb", "1g.10gb"]) == [
        ("2g.20gb", 0),
        ("1g.10gb", 2),
        ("1g.10gb", 3),
        ("3g.40gb", 4),
    ]


def test_a_3g_goes_where_it_leaves_room_for_a_4g():
    # A 3g.40gb at 4 leaves the 4g.40gb its only start (0); the engine must not take 0.
    got = placed(schedule(Snapshot([node()], catalog()), [mig("a", "3g.40gb", 1), mig("b", "4g.40gb", 2)]))
    assert (got["a"].assignments[0].mig_start, got["b"].assignments[0].mig_start) == (4, 0)


def test_a_layout_gpu_gives_out_only_its_instances():
    layout = (("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4))
    reqs = [mig("a", "1g.10gb", 1), mig("b", "2g.20gb", 2), mig("c", "2g.20gb", 3), mig("d", "2g.20gb", 4)]
    got = placed(schedule(Snapshot([node(layout=layout)], catalog()), reqs))
    # No 1g.10gb in the layout; two 2g.20gb instances; no third.
    assert set(got) == {"b", "c"}
    assert sorted(got[r].assignments[0].mig_start for r in "bc") == [0, 2]
    used = (("2g.20gb", 0),)
    got = placed(schedule(Snapshot([node(layout=layout, used=used)], catalog()), [mig("e", "2g.20gb")]))
    assert got["e"].assignments[0].mig_start == 2


def test_an_a30_has_four_slices():
    reqs = [mig(f"m{k}", "1g.6gb", k, model=A30) for k in range(5)] + [mig("big", "2g.12gb", 9, model=A30)]
    got = placed(schedule(Snapshot([node(model=A30)], catalog()), reqs))
    assert len(got) == 4 and "big" not in got
    assert {p.assignments[0].milli for p in got.values()} == {250}


def test_an_ended_instance_frees_its_slices_for_the_next():
    engine = Engine([node()], catalog(), CycleConfig())
    first = placed(engine.cycle([mig("a", "3g.40gb", 1), mig("b", "3g.40gb", 2)]))
    assert placed(engine.cycle([mig("c", "2g.20gb", 3)])) == {}
    engine.release(first["a"].assignments)
    again = placed(engine.cycle([mig("c", "2g.20gb", 4)]))
    start = again["c"].assignments[0].mig_start
    assert start in fit_starts(H100_80, [("3g.40gb", first["b"].assignments[0].mig_start)], "2g.20gb")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(H100_80.names), min_size=1, max_size=14))
def test_whatever_is_placed_the_hardware_can_make(profiles):
    reqs = [mig(f"r{k}", p, k) for k, p in enumerate(profiles)]
    got = placed(schedule(Snapshot([node(gpus=2)], catalog()), reqs))
    per_gpu: dict[int, list[tuple[str, int]]] = {0: [], 1: []}
    for k, p in enumerate(profiles):
        d = got.get(f"r{k}")
        if d is not None:
            a = d.assignments[0]
            per_gpu[a.gpu_indices[0]].append((p, a.mig_start))
    for instances in per_gpu.values():
        check_placements(H100_80, instances)  # valid starts, no shared memory slice, <= 7 compute
        assert sum(H100_80.fraction_milli(p) for p, _ in instances) <= MILLI
    # Nothing waits that the hardware could still make (instances only grow within one cycle).
    for k, p in enumerate(profiles):
        if f"r{k}" not in got:
            assert all(not fit_starts(H100_80, inst, p) for inst in per_gpu.values()), (p, per_gpu)
