"""The dashboard's workloads panel: GPUs held now per GPU model and the workloads that failed in the
last 7 days, the tenant's own only, in a fixed number of queries and fast."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.actors import Actor
from portal.models import Role
from scheduling.models import Allocation, Workload, WorkloadState
from scheduling.services.states import workload_transition
from tests.portal.conftest import HTMX, add_member, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import A100, reload

pytestmark = pytest.mark.django_db
URL = "/panels/workloads/"
X = "\u00d7"  # the multiplication sign


@pytest.fixture
def client(signed_in, owner, tenant):  # noqa: F811
    return signed_in(owner, tenant)


def gpus_in_use(html: str) -> str:
    line = re.search(r"<p class=\"small\" data-gpus-in-use>(.*?)</p>", html, re.S).group(1)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", line)).strip()


def test_gpus_in_use_add_up_shares_per_model_and_ignore_other_tenants(
    client, tenant, make_tenant, make_node, submit, cycle
):
    assert gpus_in_use(client.get(URL, **HTMX).content.decode()) == "GPUs in use: none"
    make_node(gpus=8)
    make_node(gpus=8)
    make_node(model=A100, gpus=2)
    submit(tenant, gpu_count=4)
    submit(tenant, gpu_count=2)
    submit(tenant, gpu_models=[A100])
    submit(tenant, gpu_models=[A100], gpu_fraction_milli=500)
    submit(make_tenant("bravo"), gpu_count=2)  # someone else's: never counted here
    done = submit(tenant, gpu_count=1)
    cycle()
    assert Allocation.objects.filter(tenant=tenant, ended_at__isnull=True).count() == 9
    workload_transition(
        workload=reload(done), to=WorkloadState.STOPPED, reason="stopped", actor=Actor.system()
    )
    # the stopped one's GPU is free again: 6 H100s and one and a half A100s held now
    assert gpus_in_use(client.get(URL, **HTMX).content.decode()) == f"GPUs in use: H100 {X}6, A100-80 {X}1.5"


def test_failed_workloads_of_the_last_seven_days_with_their_reason(
    signed_in,  # noqa: F811
    tenant,
    make_tenant,
    add_member,  # noqa: F811
    make_node,
    submit,
):
    make_node()
    old = submit(tenant, name="old-failure")
    recent = submit(tenant, name="fresh-failure")
    other = submit(make_tenant("bravo"), name="bravo-failure")
    for w in (old, recent, other):
        workload_transition(
            workload=w, to=WorkloadState.FAILED, reason="start_failed", actor=Actor.system(),
            message=f"image pull failed for {w.name}",
        )  # fmt: skip
    Workload.objects.filter(pk=old.pk).update(state_changed_at=timezone.now() - timedelta(days=8))
    viewer = signed_in(add_member(tenant, Role.VIEWER).user, tenant)  # reading is enough to see them
    html = viewer.get(URL, **HTMX).content.decode()
    assert "Failed in the last 7 days" in html
    assert f'href="/workloads/{recent.pk}/" data-failed-workload="{recent.pk}"' in html
    assert "image pull failed for fresh-failure" in html
    assert "old-failure" not in html and "bravo-failure" not in html
    assert "All failed workloads" not in html


def test_more_than_five_failures_link_to_the_list(client, tenant, make_node, submit):
    make_node()
    for i in range(6):
        w = submit(tenant, name=f"f{i}")
        workload_transition(workload=w, to=WorkloadState.FAILED, reason="start_failed", actor=Actor.system())
    html = client.get(URL, **HTMX).content.decode()
    assert html.count("data-failed-workload=") == 5 and 'href="/workloads/?state=failed"' in html


def test_no_failures_no_section(client, tenant, make_node, submit):
    make_node()
    submit(tenant, name="waiting")
    html = client.get(URL, **HTMX).content.decode()
    assert "Failed in the last 7 days" not in html and "data-failed-workload" not in html


def test_the_panel_reads_few_queries_and_is_fast_with_many_workloads(
    client, tenant, make_node, submit, cycle, django_assert_max_num_queries
):
    for _ in range(4):
        make_node(gpus=8)
    for i in range(30):
        submit(tenant, name=f"w{i}")
    cycle()
    failed = list(Workload.objects.filter(tenant=tenant).order_by("id")[:10])
    for w in failed:
        workload_transition(workload=w, to=WorkloadState.FAILED, reason="node_lost", actor=Actor.system())
    with django_assert_max_num_queries(9):
        html = client.get(URL, **HTMX).content.decode()
    assert f"H100 {X}20" in html and html.count("data-failed-workload=") == 5
    times = []
    for _ in range(3):
        start = time.perf_counter()
        assert client.get(URL, **HTMX).status_code == 200
        times.append(time.perf_counter() - start)
    print(f"workloads panel: {min(times) * 1000:.0f} ms")
    assert min(times) < 0.3
