from scheduling.engine import GpuSpec, NodeState, Place, Reason, Request, Vendor, schedule
from scheduling.engine.spec import allowed_models

from .factories import CATALOG, node, snapshot


def place(snap, **kw):
    kw.setdefault("id", "r1")
    kw.setdefault("tenant", "t")
    [d] = schedule(snap, [Request(**kw)])
    return d


def test_model_list_picks_only_listed_models():
    snap = snapshot(node("h", "H100"), node("t", "T4"))
    d = place(snap, gpu=GpuSpec(models=("T4",)))
    assert isinstance(d, Place) and d.assignments[0].node_id == "t"


def test_constraints_min_memory_compute_and_vendor():
    assert allowed_models(GpuSpec(min_memory_mib=60000), CATALOG) == {"H100", "MI250", "MI300"}
    assert allowed_models(GpuSpec(min_compute_weight=3.0), CATALOG) == {"H100", "MI250", "MI300"}
    assert allowed_models(GpuSpec(vendor=Vendor.AMD), CATALOG) == {"MI250", "MI300"}
    assert allowed_models(GpuSpec(min_memory_mib=60000, vendor=Vendor.NVIDIA), CATALOG) == {"H100"}


def test_cuda_capability_is_a_minimum_and_excludes_amd():
    assert allowed_models(GpuSpec(cuda_capability=(8, 0)), CATALOG) == {"H100", "A100"}
    assert allowed_models(GpuSpec(cuda_capability=(9, 0)), CATALOG) == {"H100"}


def test_rocm_target_matches_exactly():
    assert allowed_models(GpuSpec(rocm_target="gfx90a"), CATALOG) == {"MI250"}
    snap = snapshot(node("a", "A100"), node("m", "MI300"), node("m2", "MI250"))
    d = place(snap, gpu=GpuSpec(rocm_target="gfx942"))
    assert d.assignments[0].node_id == "m"


def test_no_matching_model_is_a_reason():
    d = place(snapshot(node("a", "A100")), gpu=GpuSpec(models=("H100",)))
    assert d.reason == Reason.NO_MATCHING_MODEL


def test_preferred_region_first_then_others_when_allowed():
    snap = snapshot(node("us1", region="us"), node("eu1", region="eu"))
    assert place(snap, region="us").assignments[0].node_id == "us1"
    snap = snapshot(node("us1", region="us", free=dict.fromkeys(range(8), 0)), node("eu1", region="eu"))
    assert place(snap, region="us").assignments[0].node_id == "eu1"
    d = place(snap, region="us", other_regions_ok=False)
    assert not isinstance(d, Place)


def test_region_only_elsewhere_is_reason_region():
    d = place(snapshot(node("eu1", region="eu")), region="us", other_regions_ok=False)
    assert d.reason == Reason.REGION


def test_unhealthy_gpus_and_non_ready_nodes_are_skipped():
    snap = snapshot(
        node("down", state=NodeState.DOWN),
        node("sick", gpus=2, unhealthy=(0, 1)),
        node("half", gpus=2, unhealthy=(0,)),
    )
    d = place(snap)
    assert d.assignments[0].node_id == "half" and d.assignments[0].gpu_indices == (1,)
    d2 = place(snap, gpus=2)
    assert not isinstance(d2, Place) and d2.reason == Reason.CAPACITY


def test_cpu_and_ram_must_fit():
    snap = snapshot(node("small", cpu=8000, mem=32768), node("big", cpu=64000, mem=262144))
    assert place(snap, cpu_milli=16000).assignments[0].node_id == "big"
    assert place(snap, memory_mib=65536).assignments[0].node_id == "big"
    snap = snapshot(node("used", cpu=64000, cpu_used=60000))
    assert not isinstance(place(snap, cpu_milli=8000), Place)


def test_reserved_capacity_belongs_to_its_owner():
    snap = snapshot(node("res", reserved_for="acme"), node("pub"))
    d = place(snap, tenant="acme", plan="reserved")
    assert d.assignments[0].node_id == "res"
    # on-demand work of anyone never lands on reserved capacity
    snap = snapshot(node("res", reserved_for="acme"))
    assert not isinstance(place(snap, tenant="other"), Place)
    # spot work may borrow it
    assert isinstance(place(snap, tenant="other", plan="spot"), Place)
    # a reserved request without a reservation of its own
    d = place(snapshot(node("pub")), tenant="other", plan="reserved")
    assert d.reason == Reason.RESERVATION


def test_excluded_model_region_pairs_are_filtered_and_named_as_price():
    snap = snapshot(node("us", "H100", region="us"), node("eu", "H100", region="eu"))
    d = place(snap, gpu=GpuSpec(models=("H100",)), excluded=frozenset({("H100", "us")}))
    assert isinstance(d, Place) and d.assignments[0].node_id == "eu"
    d = place(snap, gpu=GpuSpec(models=("H100",)), excluded=frozenset({("H100", "us"), ("H100", "eu")}))
    assert d.reason == Reason.PRICE
