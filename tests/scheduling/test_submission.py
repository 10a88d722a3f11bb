from __future__ import annotations

import pytest

from portal.errors import ValidationFailed
from scheduling.admission import AdmissionRefused, register_admission_check, unregister_admission_check
from scheduling.models import Quota, QuotaModelLimit, Workload, WorkloadEvent, WorkloadState
from scheduling.services.submission import QuotaExceeded
from tests.scheduling.conftest import A100, H100

pytestmark = pytest.mark.django_db


def test_a_valid_job_is_stored_pending_with_its_event(tenant, make_node, submit):
    make_node()
    w = submit(tenant, gpu_count=2, cpu_millicores=8000, ram_mib=65536, estimated_runtime_s=600)
    assert w.state == WorkloadState.PENDING
    assert [m.name for m in w.gpu_models.all()] == [H100]
    ev = WorkloadEvent.objects.get(workload=w)
    assert (ev.from_state, ev.to_state, ev.reason) == ("", "pending", "submitted")


def test_models_can_be_named_by_short_name_and_constraints_narrow_them(tenant, make_node, submit):
    make_node(model=A100)
    w = submit(tenant, gpu_models=["A100-80", "H100"], min_gpu_memory_gib=80)
    assert {m.name for m in w.gpu_models.all()} == {A100, H100}
    with pytest.raises(ValidationFailed) as e:
        submit(tenant, gpu_models=["A100-80"], cuda_capability="9.0")
    assert "gpu_models" in e.value.fields


BAD = [
    ({"gpu_models": ["B300-imaginary"]}, "gpu_models"),
    ({"region": "mars-1"}, "region"),
    ({"gpu_count": 0}, "gpu_count"),
    ({"gpu_count": 9}, "gpu_count"),
    ({"gpu_count": 2, "gpu_fraction_milli": 500}, "gpu_fraction_milli"),
    ({"gpu_count": 12, "gang": True}, "gpu_count"),
    ({"plan": "spot", "spot_max_price": "0.10"}, "spot_max_price"),
    ({"ram_mib": 4 * 1024 * 1024}, "ram_mib"),
    ({"cpu_millicores": 500_000}, "cpu_millicores"),
    ({"gpu_models": [A100]}, "gpu_models"),  # no node has it
    ({"region": "eu-west-1", "other_regions_ok": False}, "gpu_models"),  # none in that region
    ({"mig_profile": "9g.99gb"}, "mig_profile"),
    ({"command": []}, "command"),
    ({"plan": "reserved"}, "reservation"),
]


@pytest.mark.parametrize(("spec", "field"), BAD, ids=[f for _, f in BAD])
def test_bad_input_names_the_field_and_stores_nothing(tenant, make_node, submit, settings, spec, field):
    settings.SCHEDULING_SPOT_PRICE_FLOOR = "0.50"
    make_node()
    with pytest.raises(ValidationFailed) as e:
        submit(tenant, **spec)
    assert field in e.value.fields, e.value.fields
    assert not Workload.objects.exists() and not WorkloadEvent.objects.exists()


def test_gangs_fractions_and_mig(tenant, make_node, submit):
    make_node()
    make_node()
    assert submit(tenant, gpu_count=16, gang=True).gang
    assert submit(tenant, gpu_fraction_milli=250).gpu_fraction_milli == 250
    assert submit(tenant, mig_profile="3g.40gb").gpu_fraction_milli == 428


def test_an_exceeded_quota_names_the_quota_its_limit_and_use(tenant, make_node, submit):
    make_node()
    Quota.objects.create(tenant=tenant, max_gpus_total=4)
    submit(tenant, gpu_count=3)
    with pytest.raises(QuotaExceeded) as e:
        submit(tenant, gpu_count=2)
    assert e.value.fields == {"quota": "max_gpus_total", "limit": 4, "in_use": 3, "requested": 2}
    assert Workload.objects.count() == 1


def test_concurrent_workloads_spot_and_per_request_quotas(tenant, make_node, submit):
    make_node()
    Quota.objects.create(tenant=tenant, max_concurrent_workloads=2, max_spot_gpus=1, max_gpus_per_request=4)
    with pytest.raises(QuotaExceeded) as e:
        submit(tenant, gpu_count=5)
    assert e.value.fields["quota"] == "max_gpus_per_request"
    submit(tenant, plan="spot")
    with pytest.raises(QuotaExceeded) as e:
        submit(tenant, plan="spot")
    assert e.value.fields["quota"] == "max_spot_gpus"
    submit(tenant)
    with pytest.raises(QuotaExceeded) as e:
        submit(tenant)
    assert e.value.fields["quota"] == "max_concurrent_workloads"


def test_per_model_quota_admits_while_one_acceptable_model_has_room(tenant, make_node, submit):
    make_node()
    make_node(model=A100)
    quota = Quota.objects.create(tenant=tenant)
    QuotaModelLimit.objects.create(quota=quota, gpu_model_id=_model_id(H100), max_gpus=2)
    submit(tenant, gpu_count=2)
    with pytest.raises(QuotaExceeded) as e:
        submit(tenant, gpu_count=1)
    assert e.value.fields["quota"] == f"max_gpus[{H100}]"
    assert submit(tenant, gpu_models=[H100, A100]).pk


def _model_id(name):
    from nodes.models import GpuModel

    return GpuModel.objects.get(name=name).pk


def test_admission_checks_can_refuse(tenant, make_node, submit):
    make_node()
    seen = []

    def no_big_jobs(*, tenant, workload, actor):
        seen.append(workload.gpu_count)
        if workload.gpu_count > 4:
            raise AdmissionRefused("Budget exhausted.", code="budget_exhausted")

    register_admission_check(no_big_jobs)
    try:
        submit(tenant, gpu_count=1)
        with pytest.raises(AdmissionRefused):
            submit(tenant, gpu_count=8)
    finally:
        unregister_admission_check(no_big_jobs)
    assert seen == [1, 8]
    assert Workload.objects.count() == 1


def test_the_fleet_shapes_are_read_once_for_a_while_and_a_refusal_only_on_a_fresh_read(
    tenant, make_node, submit, settings, monkeypatch
):
    """SCHEDULING_FLEET_SHAPES_CACHE_S: a submission checks that some node could hold it against
    node shapes the process read at most that long ago; it refuses a request only on a fresh read,
    so a node that just came is never missed. One that just left may still admit a request, which
    then waits with its reason."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from nodes.models import NodeState
    from scheduling.services import submission

    settings.SCHEDULING_FLEET_SHAPES_CACHE_S = 60
    monkeypatch.setattr(submission, "_shapes", {})

    def shape_reads(**spec) -> int:
        with CaptureQueriesContext(connection) as queries:
            submit(tenant, **spec)
        return sum('COUNT("nodes_gpu"."id")' in q["sql"] for q in queries.captured_queries)

    small = make_node(gpus=4)
    assert shape_reads(gpu_count=4) == 1
    assert shape_reads(gpu_count=2) == 0  # the shapes just read
    make_node(gpus=8)
    # The kept shapes have no 8-GPU node: read again before refusing, and admitted.
    assert shape_reads(gpu_count=8) == 1
    assert shape_reads(gpu_count=8) == 0
    # Every node gone: the kept shapes still admit (the request waits); a request they cannot hold
    # is refused on a fresh read, and from then on the fleet is known to be empty.
    type(small).objects.update(state=NodeState.DOWN)
    assert shape_reads(gpu_count=8) == 0
    with pytest.raises(ValidationFailed) as e:
        submit(tenant, gpu_count=1, ram_mib=4 * 1024 * 1024)
    assert e.value.fields == {"gpu_models": ["No node has these GPUs."]}
    with pytest.raises(ValidationFailed):
        submit(tenant, gpu_count=1)
