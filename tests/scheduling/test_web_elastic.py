"""The resize form of an elastic job's page: through the view and its htmx partial, with the API's
rules (the tenant's write scope, 404 for another tenant's job, 409 unless running, the bounds)."""

from __future__ import annotations

import pytest

from nodes.models import CommandKind, NodeCommand
from portal.models import AuditEvent, Role
from scheduling.models import Allocation, Workload
from scheduling.services.lifecycle import workload_on_running
from tests.portal.conftest import HTMX, add_member, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import H100, reload

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(signed_in, owner, tenant):  # noqa: F811
    return signed_in(owner, tenant)


def _running(tenant, make_node, submit, cycle, **elastic) -> tuple[Workload, object]:
    node = make_node(H100, gpus=8)
    w = submit(tenant, elastic={"min_gpus": 2, "max_gpus": 6, **elastic})
    cycle()
    workload_on_running(node_id=node.pk, workload_id=str(w.pk))
    cycle()  # grows into the node's idle GPUs, up to its maximum
    return reload(w), node


def test_the_owner_shrinks_and_grows_a_running_elastic_job_from_its_page(
    client, tenant, make_node, submit, cycle
):
    w, node = _running(tenant, make_node, submit, cycle, on_resize="restart")
    assert w.gpu_count == 6
    html = client.get(f"/workloads/{w.pk}/").content.decode()
    assert "data-resize-form" in html and 'min="2"' in html and 'max="6"' in html
    assert "holds <strong data-elastic-held>6</strong> GPUs" in html and "between 2 and 6 GPUs" in html

    r = client.post(f"/workloads/{w.pk}/resize/", {"gpu_count": "3"}, **HTMX)
    html = r.content.decode()
    assert r.status_code == 200 and html.startswith('<div id="workload-live"')
    assert "Shrunk to 3 GPUs; its node is told." in html
    assert "holds <strong data-elastic-held>3</strong> GPUs" in html
    assert Allocation.objects.active().filter(workload=w).count() == 3
    sizes = [
        (c.payload["world_size"], c.payload["on_resize"])
        for c in NodeCommand.objects.filter(kind=CommandKind.RESIZE_WORKLOAD, node=node).order_by(
            "created_at"
        )
    ]
    assert sizes == [(6, "restart"), (3, "restart")]  # grown by the cycle, then the owner's shrink
    audit = AuditEvent.objects.filter(action="job.resize").latest("pk")
    assert audit.tenant == tenant and audit.data["gpu_count"] == 3 and audit.data["held_before"] == 6

    # A growth sets the target; the next cycle gives it the node's free GPUs.
    r = client.post(f"/workloads/{w.pk}/resize/", {"gpu_count": "5"}, **HTMX)
    assert "Target 5 GPUs: it grows as GPUs of its node are free." in r.content.decode()
    assert reload(w).elastic_target_gpus == 5 and reload(w).gpu_count == 3
    cycle()
    assert reload(w).gpu_count == 5

    # Without htmx: a redirect to the page, the message shown there.
    r = client.post(f"/workloads/{w.pk}/resize/", {"gpu_count": "2"})
    assert r.status_code == 302 and r["Location"] == f"/workloads/{w.pk}/"
    assert "Shrunk to 2 GPUs" in client.get(r["Location"]).content.decode()


@pytest.mark.parametrize("value", ["1", "7", "x", "", "-2", "2.5", "99999"])
def test_a_size_outside_the_bounds_or_not_a_number_is_a_400_naming_gpu_count(
    client, tenant, make_node, submit, cycle, value
):
    w, _ = _running(tenant, make_node, submit, cycle)
    r = client.post(f"/workloads/{w.pk}/resize/", {"gpu_count": value}, **HTMX)
    assert r.status_code == 400 and "gpu_count" in r.content.decode()
    assert 'role="alert"' in r.content.decode()
    assert reload(w).elastic_target_gpus == 6 and reload(w).gpu_count == 6


def test_only_a_running_elastic_job_has_the_form_and_is_resized(client, tenant, make_node, submit, cycle):
    make_node(H100, gpus=8)
    waiting = submit(tenant, elastic={"min_gpus": 2, "max_gpus": 4})  # no cycle: it waits
    html = client.get(f"/workloads/{waiting.pk}/").content.decode()
    assert "between 2 and 4 GPUs" in html and "data-resize-form" not in html
    r = client.post(f"/workloads/{waiting.pk}/resize/", {"gpu_count": "3"}, **HTMX)
    assert r.status_code == 409 and "only a running job can be resized" in r.content.decode()
    plain = submit(tenant, gpu_count=1)
    assert "data-resize-form" not in client.get(f"/workloads/{plain.pk}/").content.decode()
    r = client.post(f"/workloads/{plain.pk}/resize/", {"gpu_count": "2"}, **HTMX)
    assert r.status_code == 409 and "Only elastic jobs can be resized" in r.content.decode()


def test_another_tenant_gets_404_and_a_viewer_403(
    client,
    tenant,
    make_node,
    submit,
    cycle,
    make_tenant,
    signed_in,  # noqa: F811
    add_member,  # noqa: F811
):
    w, _ = _running(tenant, make_node, submit, cycle)
    # Positive control: the owner reaches it by the same route.
    assert client.post(f"/workloads/{w.pk}/resize/", {"gpu_count": "4"}, **HTMX).status_code == 200
    other = make_tenant("bravo")
    outsider = signed_in(add_member(other, Role.OWNER).user, other)
    r = outsider.post(f"/workloads/{w.pk}/resize/", {"gpu_count": "2"}, **HTMX)
    assert r.status_code == 404
    viewer = signed_in(add_member(tenant, Role.VIEWER).user, tenant)
    assert "data-resize-form" not in viewer.get(f"/workloads/{w.pk}/").content.decode()
    assert viewer.post(f"/workloads/{w.pk}/resize/", {"gpu_count": "2"}).status_code == 403
    assert reload(w).elastic_target_gpus == 4 and reload(w).gpu_count == 4
