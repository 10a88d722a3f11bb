"""Minimum driver, CUDA and ROCm versions: validated at submission, matched by the engine against
each node's reported versions, named in the pending reason when no node qualifies."""

from __future__ import annotations

import pytest

from nodes.models import Node
from portal.errors import ValidationFailed
from scheduling.engine import Engine, GpuModelInfo, Reason, Request, SoftwareVersions, Vendor, version_key
from scheduling.engine import types as E
from scheduling.models import Allocation
from tests.scheduling.conftest import H100, reload

INTEL = "Intel Data Center GPU Max 1100"
MI300X = "AMD Instinct MI300X"


# --- the engine ---------------------------------------------------------------------------------------


def test_version_keys_compare_as_releases() -> None:
    assert version_key("12.0") == version_key("12") == (12,)
    assert version_key("550.54.15") > version_key("550.54") > version_key("535.183.01")
    assert version_key("6.2.0-1787201") == (6, 2)
    assert version_key("I915_23.10.32") is None and version_key("") is None
    node = SoftwareVersions(driver=(550, 54), cuda=(12, 4))
    assert node.meets(SoftwareVersions(cuda=(12,))) and node.meets(SoftwareVersions(driver=(550, 54)))
    assert not node.meets(SoftwareVersions(cuda=(12, 6)))
    assert not node.meets(SoftwareVersions(rocm=(6,)))  # not reported: meets no minimum


def test_the_engine_places_only_where_the_versions_qualify() -> None:
    models = {"H100": GpuModelInfo("H100", Vendor.NVIDIA, 81920)}

    def node(i: str, cuda: str) -> E.Node:
        return E.Node(
            id=i,
            model="H100",
            gpus=[E.Gpu(index=g) for g in range(8)],
            cpu_milli=96000,
            memory_mib=1 << 20,
            software=SoftwareVersions(driver=version_key("550.54"), cuda=version_key(cuda)),
        )

    engine = Engine([node("old", "11.8"), node("new", "12.4")], models)
    needs_12 = Request("a", "t", gpus=8, min_versions=SoftwareVersions(cuda=(12,)))
    any_node = Request("b", "t", gpus=8)
    needs_13 = Request("c", "t", gpus=1, min_versions=SoftwareVersions(cuda=(13,)))
    decisions = {d.request_id: d for d in engine.cycle([needs_12, any_node, needs_13])}
    assert decisions["a"].assignments[0].node_id == "new"
    assert decisions["b"].assignments[0].node_id == "old"
    pending = decisions["c"]
    assert pending.reason == Reason.VERSIONS and "CUDA >= 13 (newest: 12.4)" in pending.message


# --- submission ---------------------------------------------------------------------------------------

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"min_cuda": "twelve"}, "min_cuda", "Not a version"),
        ({"min_cuda": "12.4rc1"}, "min_cuda", "release version"),
        ({"min_driver": "1!550"}, "min_driver", "release version"),
        ({"min_rocm": "6.1+local"}, "min_rocm", "release version"),
        ({"min_cuda": 12}, "min_cuda", "version string"),
        ({"min_cuda": "1" * 40}, "min_cuda", "At most 32"),
        ({"min_cuda": "12", "min_rocm": "6"}, "min_rocm", "not both"),
        ({"min_rocm": "6.1"}, "min_rocm", "No GPU model of the request has ROCm"),
        ({"min_driver": "550", "gpu_models": [H100, MI300X]}, "min_driver", "differ by vendor"),
    ],
)
def test_minimums_are_validated(tenant, make_node, submit, spec, field, message) -> None:
    make_node()
    with pytest.raises(ValidationFailed) as caught:
        submit(tenant, **spec)
    assert field in caught.value.fields and message in caught.value.fields[field][0]


def test_a_job_that_needs_cuda_12_lands_on_a_node_that_has_it(tenant, make_node, submit, cycle) -> None:
    old, new = make_node(), make_node()
    Node.objects.filter(pk=old.pk).update(driver_version="520.61.05", cuda_version="11.8")
    Node.objects.filter(pk=new.pk).update(driver_version="550.54.15", cuda_version="12.4")
    w = submit(tenant, gpu_count=8, min_cuda="12.0", min_driver="550")
    assert (w.min_cuda, w.min_driver) == ("12.0", "550")
    too_new = submit(tenant, gpu_count=1, min_cuda="12.6")
    r = cycle()
    assert w.pk in r.placed and too_new.pk not in r.placed
    assert {a.node_id for a in Allocation.objects.filter(workload=w)} == {new.pk}
    waiting = reload(too_new)
    assert waiting.pending_reason == "versions"
    assert "CUDA >= 12.6 (newest: 12.4)" in waiting.pending_message
    # The node is upgraded (its heartbeat says so): the next cycle places it.
    Node.objects.filter(pk=old.pk).update(cuda_version="12.8")
    assert too_new.pk in cycle().placed


def test_intel_gpus_are_schedulable(tenant, make_node, submit, cycle) -> None:
    node = make_node(INTEL, gpus=4)
    w = submit(tenant, gpu_models=[INTEL], gpu_count=2)
    assert w.pk in cycle().placed
    assert {a.node_id for a in Allocation.objects.filter(workload=w)} == {node.pk}
