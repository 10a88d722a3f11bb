"""The default policy keeps scarce hardware for the work that can run nowhere else."""

from scheduling.engine import ClusterState, Distribution, GpuModelInfo
from scheduling.engine.fragmentation import host_weights
from scheduling.engine.policies import get_policy
from scheduling.engine.spec import Demand

from .factories import node

EQUAL = {"A": GpuModelInfo("A"), "B": GpuModelInfo("B")}


def d(models, gpus=1, cpu=4000, mem=8192):
    return Demand(frozenset(models), 1000, gpus, cpu, mem)


FLEX, A1, A2, B1, B2 = d("AB"), d("A"), d("A", 2), d("B"), d("B", 2)
# The workload: a few flexible pods, a few that need the scarce model A, many that need B.
WORKLOAD = [FLEX] * 2 + [A1, A2] + [B1] * 4 + [B2]


def cluster(policy: str, seed: int) -> ClusterState:
    nodes = [node("a0", "A", gpus=2)] + [node(f"b{i}", "B", gpus=2) for i in range(2)]
    pol = get_policy(policy)
    pol.set_distribution(Distribution.from_demands(WORKLOAD))
    return ClusterState(nodes, EQUAL, pol, seed=seed)


def test_flexible_request_leaves_the_only_gpus_a_constrained_request_can_use():
    for seed in range(20):
        st = cluster("gpupool", seed)
        [slot] = st.place(FLEX)
        assert st.ids[slot.node] != "a0", seed
        assert st.place(A2) is not None, seed


def test_fgd_as_published_takes_them_so_the_property_is_not_free():
    # FGD counts the A server's free GPUs as fragmented for every B-only task, so using them
    # looks like progress: the flexible pod lands there and the A-only pair no longer fits.
    st = cluster("fgd", 0)
    [slot] = st.place(FLEX)
    assert st.ids[slot.node] == "a0"
    assert st.place(A2) is None


def test_scarcity_weights_follow_the_servers_that_can_host_each_type():
    dist = Distribution.from_demands(WORKLOAD)
    servers = [("A", 2, 128_000, 1_048_576, 1), ("B", 2, 128_000, 1_048_576, 2), ("B", 1, 8000, 65536, 2)]
    w = {(t[0], t[2]): t[5] for t in host_weights(dist, servers)}
    base = {(t[0], t[2]): t[5] for t in dist.types}
    total = 2 + 4 + 2
    assert w[(frozenset("AB"), 1)] == base[(frozenset("AB"), 1)]  # any server: weight unchanged
    assert w[(frozenset("A"), 2)] == base[(frozenset("A"), 2)] * total / 2
    assert w[(frozenset("B"), 1)] == base[(frozenset("B"), 1)] * total / 6
    assert w[(frozenset("B"), 2)] == base[(frozenset("B"), 2)] * total / 4  # not the 1-GPU servers
    # a type no server can host is dropped
    huge = Distribution.from_demands([d("A", cpu=10**6)])
    assert host_weights(huge, servers) == ()


def test_a_request_that_accepts_several_models_takes_the_weakest_that_fits_as_well():
    from .factories import CATALOG

    for seed in range(10):
        st = ClusterState([node("h", "H100"), node("a", "A100")], CATALOG, get_policy("gpupool"), seed=seed)
        [slot] = st.place(d(("H100", "A100")))
        assert st.ids[slot.node] == "a", seed
        [slot] = st.place(d(("H100",)))
        assert st.ids[slot.node] == "h"


def test_a_request_for_vendor_intel_lands_on_intel_gpus():
    from scheduling.engine import CycleConfig, GpuSpec, Place, Request, Vendor, schedule

    from .factories import CATALOG, snapshot

    snap = snapshot(node("nv", "A100"), node("amd", "MI250"), node("xe", "Max-1550", gpus=4))
    snap.models["Max-1550"] = GpuModelInfo("Max-1550", Vendor.INTEL, 131072, 3.0)
    assert "Max-1550" not in CATALOG
    for policy in ("gpupool", "fgd", "bestfit"):
        reqs = [Request(id=str(i), tenant="t", gpu=GpuSpec(vendor=Vendor.INTEL), gpus=2) for i in range(3)]
        out = schedule(snap, reqs, CycleConfig(policy=policy))
        assert [isinstance(x, Place) for x in out] == [True, True, False], policy
        assert {x.assignments[0].node_id for x in out[:2]} == {"xe"}
        [x] = schedule(
            snap, [Request(id="c", tenant="t", gpu=GpuSpec(vendor=Vendor.INTEL, cuda_capability=(7, 0)))]
        )
        assert not isinstance(x, Place)  # CUDA is NVIDIA's
