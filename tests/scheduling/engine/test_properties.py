"""Whatever the fleet and the queue, placements never exceed capacity and avoid sick hardware."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling.engine import CycleConfig, NodeState, Place, Request, schedule

from .factories import node, snapshot

MODELS = ("H100", "A100", "T4")


@st.composite
def fleets(draw):
    nodes = []
    for i in range(draw(st.integers(1, 6))):
        gpus = draw(st.sampled_from([1, 2, 4, 8]))
        free = {g: draw(st.sampled_from([0, 250, 500, 1000])) for g in range(gpus)}
        cpu = draw(st.sampled_from([8000, 32000, 128000]))
        mem = draw(st.sampled_from([32768, 262144]))
        nodes.append(
            node(
                f"n{i}",
                draw(st.sampled_from(MODELS)),
                gpus,
                cpu=cpu,
                mem=mem,
                cpu_used=draw(st.integers(0, cpu)),
                mem_used=draw(st.integers(0, mem)),
                islands=draw(st.sampled_from([1, 2])) if gpus > 1 else 1,
                free=free,
                unhealthy=tuple(g for g in range(gpus) if draw(st.booleans()) and draw(st.booleans())),
                state=draw(st.sampled_from([NodeState.READY] * 3 + [NodeState.DOWN, NodeState.SUSPECT])),
                region=draw(st.sampled_from(["eu", "us"])),
            )
        )
    return nodes


@st.composite
def queues(draw):
    out = []
    for i in range(draw(st.integers(1, 25))):
        frac = draw(st.booleans())
        out.append(
            Request(
                id=f"r{i}",
                tenant=draw(st.sampled_from(["a", "b", "c"])),
                gpus=1 if frac else draw(st.sampled_from([0, 1, 2, 4, 8])),
                milli=draw(st.sampled_from([100, 250, 500, 750])) if frac else 1000,
                cpu_milli=draw(st.sampled_from([0, 2000, 8000, 16000])),
                memory_mib=draw(st.sampled_from([0, 4096, 65536])),
                region=draw(st.sampled_from([None, "eu", "us"])),
                other_regions_ok=draw(st.booleans()),
                submit_time=float(i),
            )
        )
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), queues(), st.sampled_from(["gpupool", "fgd", "bestfit", "random"]))
def test_placements_respect_capacity_health_and_readiness(nodes, reqs, policy):
    snap = snapshot(*nodes)
    by_id = {n.id: n for n in nodes}
    gpu_used: dict[tuple[str, int], int] = {}
    cpu_used = {n.id: n.cpu_used for n in nodes}
    mem_used = {n.id: n.memory_used for n in nodes}
    for d in schedule(snap, reqs, CycleConfig(policy=policy)):
        if not isinstance(d, Place):
            continue
        for a in d.assignments:
            n = by_id[a.node_id]
            assert n.state == NodeState.READY
            for g in a.gpu_indices:
                gpu = n.gpus[g]
                assert gpu.healthy
                gpu_used[(n.id, g)] = gpu_used.get((n.id, g), 1000 - gpu.free_milli) + a.milli
                assert gpu_used[(n.id, g)] <= 1000
            cpu_used[n.id] += a.cpu_milli
            mem_used[n.id] += a.memory_mib
            assert cpu_used[n.id] <= n.cpu_milli and mem_used[n.id] <= n.memory_mib


@settings(max_examples=60, deadline=None)
@given(fleets(), queues())
def test_every_request_gets_exactly_one_decision(nodes, reqs):
    out = schedule(snapshot(*nodes), reqs)
    assert sorted(d.request_id for d in out) == sorted(r.id for r in reqs)
