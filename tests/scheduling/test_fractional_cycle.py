"""Fractional GPUs through the scheduling cycle and the database: over-subscription per model (the
allocation rows, the constraint, the memory limit sent to the agent) and MIG slices kept apart."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.forms.models import model_to_dict
from django.utils import timezone

from metering.models import RateCard, UsageRecord
from metering.services.rates import rate_card_version_create
from metering.services.usage import usage_build
from nodes.models import CommandKind, GpuModel, NodeCommand
from portal.models import User
from scheduling.models import Allocation, Plan
from scheduling.models import WorkloadState as S
from scheduling.services.lifecycle import workload_on_command_finished, workload_on_exited
from tests.scheduling.conftest import H100, reload

pytestmark = pytest.mark.django_db

H100_MIB = 80 * 1024


def _factor(value: str, name: str = H100) -> None:
    GpuModel.objects.filter(name=name).update(oversubscription=Decimal(value))


def _payload(w) -> dict:
    return NodeCommand.objects.get(kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk)).payload


def _ranges(gpu_id: int) -> list[tuple[int, int]]:
    rows = Allocation.objects.active().filter(gpu_id=gpu_id).order_by("milli_offset")
    return [(a.milli_offset, a.milli_offset + a.span) for a in rows]


@pytest.mark.parametrize(("factor", "both"), [("1.00", False), ("1.19", False), ("1.20", True)])
def test_two_600_milli_shares_share_a_gpu_only_from_factor_1_2(
    tenant, make_node, submit, cycle, factor, both
):
    _factor(factor)
    make_node(gpus=1)
    a = submit(tenant, gpu_fraction_milli=600)
    b = submit(tenant, gpu_fraction_milli=600)
    cycle()
    assert reload(a).state == S.SCHEDULED
    assert (reload(b).state == S.SCHEDULED) is both
    if not both:
        assert reload(b).pending_reason == "capacity"
        return
    rows = list(Allocation.objects.active().order_by("milli_offset"))
    # Billing and quotas see the fraction asked for; the GPU's range holds 600 / 1.2 = 500.
    assert [(r.fraction_milli, r.span_milli, r.span) for r in rows] == [(600, 500, 500), (600, 500, 500)]
    assert _ranges(rows[0].gpu_id) == [(0, 500), (500, 1000)]
    # Memory per share: its span of the GPU's memory, so that both fit at once.
    assert _payload(a)["gpu_fraction_milli"] == 600
    assert _payload(a)["gpu_memory_limit_mib"] == 500 * H100_MIB // 1000
    assert _payload(a)["gpu_vendor"] == "nvidia"
    third = submit(tenant, gpu_fraction_milli=100)
    cycle()
    assert reload(third).state == S.QUEUED


def test_whole_gpu_work_never_joins_an_over_subscribed_share(tenant, make_node, submit, cycle):
    _factor("4.00")
    make_node(gpus=2)
    shares = [submit(tenant, gpu_fraction_milli=250) for _ in range(3)]
    two = submit(tenant, gpu_count=2)
    one = submit(tenant, gpu_count=1)
    cycle()
    assert all(reload(w).state == S.SCHEDULED for w in shares)
    assert reload(two).state == S.QUEUED
    assert reload(one).state == S.SCHEDULED
    whole = Allocation.objects.get(workload=one)
    assert (whole.fraction_milli, whole.span_milli, whole.milli_offset) == (1000, None, 0)
    assert {a.gpu_id for a in Allocation.objects.filter(workload__in=shares)} != {whole.gpu_id}
    assert "gpu_memory_limit_mib" not in _payload(one)
    # 3 x 250 / 4: 63 units each (rounded up), packed side by side.
    assert sorted(a.span for a in Allocation.objects.filter(workload__in=shares)) == [63, 63, 63]


def test_a_lower_factor_applies_to_new_shares_and_keeps_the_old(tenant, make_node, submit, cycle):
    _factor("2.00")
    make_node(gpus=1)
    first = submit(tenant, gpu_fraction_milli=800)
    cycle()
    _factor("1.00")
    fits = submit(tenant, gpu_fraction_milli=600)
    too_big = submit(tenant, gpu_fraction_milli=700)
    cycle()
    assert Allocation.objects.get(workload=first).span == 400
    assert reload(fits).state == S.SCHEDULED and Allocation.objects.get(workload=fits).span_milli is None
    assert reload(too_big).state == S.QUEUED


def test_the_database_checks_spans(tenant, make_node, submit, cycle):
    _factor("2.00")
    make_node(gpus=1)
    w = submit(tenant, gpu_fraction_milli=600)
    cycle()
    held = Allocation.objects.get(workload=w)
    assert (held.milli_offset, held.span) == (0, 300)
    other = submit(tenant, gpu_fraction_milli=600)
    base = {
        "tenant": tenant,
        "workload": other,
        "node_id": held.node_id,
        "gpu_id": held.gpu_id,
        "gpu_model_id": held.gpu_model_id,
        "plan": "on_demand",
        "fraction_milli": 600,
    }
    bad = [
        {"milli_offset": 200, "span_milli": 300},  # overlaps [0, 300)
        {"milli_offset": 300, "span_milli": 700},  # more than its fraction
        {"milli_offset": 800, "span_milli": 300},  # past the GPU's end
        {"milli_offset": 300, "span_milli": 0},
        {"milli_offset": 300, "fraction_milli": 1000, "span_milli": 500},  # a whole GPU spans all of it
    ]
    for fields in bad:
        with pytest.raises(IntegrityError), transaction.atomic():
            Allocation.objects.create(**{**base, **fields})
    ok = Allocation.objects.create(**base, milli_offset=300, span_milli=300)
    # Moving a span onto another is refused as well (the update trigger / exclusion constraint).
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.filter(pk=ok.pk).update(span_milli=400, milli_offset=0)
    assert _ranges(held.gpu_id) == [(0, 300), (300, 600)]


def test_oversubscription_is_validated_by_model_and_database(db):
    model = GpuModel.objects.get(name=H100)
    assert model.oversubscription == Decimal("1.00")
    for value in ("0.99", "4.01"):
        model.oversubscription = Decimal(value)
        with pytest.raises(ValidationError) as err:
            model.full_clean()
        assert "oversubscription" in err.value.message_dict
        with pytest.raises(IntegrityError), transaction.atomic():
            GpuModel.objects.filter(pk=model.pk).update(oversubscription=Decimal(value))


def _mig_mode(node, *indices: int, layout=None) -> None:
    node.gpus.filter(index__in=indices).update(mig_mode=True, mig_layout=layout or [])


def test_mig_slices_share_a_gpu_apart_from_other_shares(tenant, make_node, submit, cycle):
    _factor("2.00")
    node = make_node(gpus=2)
    _mig_mode(node, 0)
    m1 = submit(tenant, mig_profile="1g.10gb")
    s1 = submit(tenant, gpu_fraction_milli=300)
    m2 = submit(tenant, mig_profile="3g.40gb")
    s2 = submit(tenant, gpu_fraction_milli=300)
    cycle()
    assert all(reload(w).state == S.SCHEDULED for w in (m1, m2, s1, s2))
    gpu = {w.pk: Allocation.objects.get(workload=w).gpu_id for w in (m1, m2, s1, s2)}
    assert gpu[m1.pk] == gpu[m2.pk] != gpu[s1.pk] == gpu[s2.pk]
    mig = Allocation.objects.get(workload=m2)
    assert (mig.fraction_milli, mig.span_milli) == (428, None)  # 3/7, never over-subscribed
    payload = _payload(m2)
    assert payload["mig_profile"] == "3g.40gb"
    # The 1g.10gb went to slice 6 (it keeps the 4g.40gb and the 3g.40gb at 0 possible): the 3g at 0.
    assert Allocation.objects.get(workload=m1).mig_start == 6
    assert payload["mig_start"] == mig.mig_start == 0
    assert payload["gpu_uuids"] == [node.gpus.get(pk=gpu[m2.pk]).uuid]
    assert "gpu_memory_limit_mib" not in payload
    assert _payload(m1)["mig_start"] == Allocation.objects.get(workload=m1).mig_start
    assert _payload(s1)["gpu_memory_limit_mib"] == 150 * H100_MIB // 1000
    assert Allocation.objects.get(workload=s1).mig_start is None


def test_mig_work_goes_only_to_a_gpu_in_mig_mode_and_other_work_never(tenant, make_node, submit, cycle):
    node = make_node(gpus=1)
    m = submit(tenant, mig_profile="1g.10gb")
    cycle()
    assert reload(m).state == S.QUEUED  # no GPU in MIG mode: the agent would not turn it on
    _mig_mode(node, 0)
    s = submit(tenant, gpu_fraction_milli=100)
    cycle()
    assert reload(m).state == S.SCHEDULED
    assert reload(s).state == S.QUEUED and reload(s).pending_reason == "capacity"


def test_the_cycle_places_mig_instances_only_where_the_hardware_can(tenant, make_node, submit, cycle):
    # The two cases, through the live cycle and the database.
    node = make_node(gpus=1)
    _mig_mode(node, 0)
    seven = [submit(tenant, mig_profile="1g.20gb") for _ in range(7)]
    cycle()
    placed = [w for w in seven if reload(w).state == S.SCHEDULED]
    assert len(placed) == 4
    assert sorted(Allocation.objects.get(workload=w).mig_start for w in placed) == [0, 2, 4, 6]
    other = make_node(gpus=1)
    _mig_mode(other, 0)
    for w in seven:
        if w not in placed:
            w.delete()
    a, b, c = (submit(tenant, mig_profile=p) for p in ("3g.40gb", "3g.40gb", "1g.10gb"))
    cycle()
    assert reload(a).state == reload(b).state == S.SCHEDULED
    assert reload(c).state == S.QUEUED  # a 9th memory slice does not exist


def test_a_layout_gpu_hands_out_its_instances(tenant, make_node, submit, cycle):
    node = make_node(gpus=1)
    _mig_mode(node, 0, layout=[{"profile": "4g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}])
    big, small, again = (submit(tenant, mig_profile=p) for p in ("4g.40gb", "1g.10gb", "3g.40gb"))
    cycle()
    assert reload(big).state == reload(again).state == S.SCHEDULED
    assert reload(small).state == S.QUEUED  # no 1g.10gb instance in the layout
    assert (_payload(big)["mig_start"], _payload(again)["mig_start"]) == (0, 4)


def test_billing_counts_the_fraction_asked_for_not_the_span(tenant, make_node, submit, cycle):
    h100 = GpuModel.objects.get(name=H100)
    card = RateCard.objects.create(name="Standard", currency="USD", is_default=True)
    start = timezone.now() - timedelta(hours=2)
    rate_card_version_create(
        rate_card=card, effective_from=start, gpu_prices={(h100.pk, Plan.ON_DEMAND): "2.00"}, allow_past=True
    )
    _factor("1.20")
    node = make_node(gpus=1)
    a, b = submit(tenant, gpu_fraction_milli=600), submit(tenant, gpu_fraction_milli=600)
    cycle()
    for w in (a, b):
        started = {"state": "running"}
        payload = _payload(w)
        workload_on_command_finished(
            kind=CommandKind.START_WORKLOAD,
            payload=payload,
            node_id=node.pk,
            state="succeeded",
            result=started,
        )
        workload_on_exited(node_id=node.pk, workload_id=w.pk, state="exited", exit_code=0)
    usage_build(tenant=tenant)
    records = list(UsageRecord.objects.filter(workload__in=[a, b]))
    assert len(records) == 2
    for r in records:
        assert r.fraction_milli == 600
        assert r.gpu_seconds == (r.seconds + r.minimum_topup_s) * Decimal("0.6")


def test_staff_set_the_factor_in_the_catalog_admin(client):
    client.force_login(User.objects.create_superuser(email="ops@gpupool.test", password="pw-staff-1"))
    model = GpuModel.objects.get(name=H100)
    listing = client.get("/admin/nodes/gpumodel/")
    assert listing.status_code == 200 and b"oversubscription" in listing.content
    url = f"/admin/nodes/gpumodel/{model.pk}/change/"
    form = {k: v for k, v in model_to_dict(model).items() if v is not None}
    form.update(aliases=json.dumps(model.aliases), mig_profiles=json.dumps(model.mig_profiles))
    refused = client.post(url, {**form, "oversubscription": "4.50"})
    assert refused.status_code == 200
    assert "oversubscription" in refused.context["adminform"].form.errors
    assert client.post(url, {**form, "oversubscription": "1.50"}).status_code == 302
    model.refresh_from_db()
    assert model.oversubscription == Decimal("1.50")
