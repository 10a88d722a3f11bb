"""Staff set a GPU's MIG mode and layout: the service (checked against the GPU's profile table,
the GPU out of placement from the request until the agent answers, a busy GPU drained first and its
change sent when the last of its work ends, cancel, audited), the agent's answer recorded, the node
page (form, errors in the row, the state and a pending change shown) and the staff API.
The agent side and the whole path are in tests/nodes/test_fractional_agent.py and
test_fractional_e2e.py."""

from __future__ import annotations

import pytest
from django.test import Client
from django.utils import timezone

from nodes.models import CommandKind, Gpu, Node, NodeCommand, NodeState, Region, RegionBackend
from nodes.services.commands import node_command_report
from nodes.services.mig import gpu_mig_cancel, gpu_mig_configure, gpu_mig_drained_send, gpu_mig_waiting_for
from nodes.signals import workload_exited
from nodes.tasks import send_drained_mig
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.models import AuditEvent, StaffScope, User
from portal.staff_tokens import staff_token_create
from scheduling.models import Allocation
from scheduling.models import WorkloadState as S
from tests.scheduling.conftest import reload, report_start

pytestmark = pytest.mark.django_db

A10 = "NVIDIA A10"


@pytest.fixture
def staff(db) -> User:
    return User.objects.create_user(email="ops@gpupool.test", password="pw-for-tests-1", is_staff=True)


def _gpu(node, index: int = 0) -> Gpu:
    return Gpu.objects.select_related("node", "model").get(node=node, index=index)


def _command(gpu: Gpu) -> NodeCommand:
    return NodeCommand.objects.filter(kind=CommandKind.CONFIGURE_MIG, payload__gpu_uuid=gpu.uuid).latest(
        "created_at"
    )


def _agent_answers(command: NodeCommand, state: str, result: dict) -> None:
    """The agent's report, through the service the agent view calls."""
    NodeCommand.objects.filter(pk=command.pk).update(state="delivered")  # the long poll gave it out
    node_command_report(node_id=command.node_id, command_id=command.pk, status="accepted")
    node_command_report(node_id=command.node_id, command_id=command.pk, status=state, result=result)


def test_a_layout_is_checked_placed_sent_and_recorded(
    make_node, staff, tenant, submit, cycle, django_capture_on_commit_callbacks
):
    node = make_node(gpus=2)
    gpu = _gpu(node)
    with django_capture_on_commit_callbacks(execute=True):
        command = gpu_mig_configure(
            gpu=gpu,
            enable=True,
            profiles=["1g.10gb", "3g.40gb", "2g.20gb", "1g.10gb"],
            actor=Actor(user=staff),
        )
    # The starts the hardware needs (a 3g.40gb at 4 leaves 0-3 for the others) go to the agent.
    layout = [
        {"profile": "2g.20gb", "start": 0},
        {"profile": "1g.10gb", "start": 2},
        {"profile": "1g.10gb", "start": 3},
        {"profile": "3g.40gb", "start": 4},
    ]
    assert command.payload["placements"] == layout and command.payload["enable"] is True
    assert reload_gpu(gpu).mig_configuring is True
    event = AuditEvent.objects.get(action="gpu.mig_configure")
    assert event.data["layout"] == layout and event.data["before"]["mig_mode"] is False
    # While the change is under way the GPU takes no work, not even whole-GPU work elsewhere's spill.
    w = submit(tenant, gpu_count=2)
    cycle()
    assert reload(w).state == S.QUEUED
    created = [{**row, "mig_uuid": f"MIG-{k}"} for k, row in enumerate(layout)]
    with django_capture_on_commit_callbacks(execute=True):
        _agent_answers(command, "succeeded", {"gpu_uuid": gpu.uuid, "mig_mode": True, "created": created})
    gpu = reload_gpu(gpu)
    assert (gpu.mig_mode, gpu.mig_configuring, gpu.mig_layout) == (True, False, layout)
    # A MIG job lands on a layout instance; whole-GPU work never goes to the GPU in MIG mode.
    m = submit(tenant, mig_profile="2g.20gb")
    cycle()
    assert reload(m).state == S.SCHEDULED and reload(w).state == S.QUEUED


def reload_gpu(gpu: Gpu) -> Gpu:
    return Gpu.objects.select_related("node", "model").get(pk=gpu.pk)


def test_a_failed_change_leaves_mode_and_layout(make_node, staff, django_capture_on_commit_callbacks):
    gpu = _gpu(make_node(gpus=1))
    with django_capture_on_commit_callbacks(execute=True):
        command = gpu_mig_configure(gpu=gpu, enable=True, profiles=["7g.80gb"], actor=Actor(user=staff))
        _agent_answers(command, "failed", {"error": "needs a GPU reset"})
    gpu = reload_gpu(gpu)
    assert (gpu.mig_mode, gpu.mig_configuring, gpu.mig_layout) == (False, False, [])


@pytest.mark.parametrize(
    ("model", "enable", "profiles", "field", "message"),
    [
        (None, True, ["3g.40gb", "3g.40gb", "1g.10gb"], "profiles", "does not fit one GPU"),
        (None, True, ["1g.20gb"] * 5, "profiles", "does not fit one GPU"),
        (None, True, ["1g.5gb"], "profiles", "not a MIG profile of this GPU"),
        (None, True, "3g.40gb", "profiles", "must be a list"),
        (None, "yes", [], "enable", "true or false"),
        (None, False, ["7g.80gb"], "profiles", "keeps no layout"),
        (A10, True, [], "enable", "has no MIG"),
    ],
)
def test_bad_layouts_are_400s_naming_the_field(make_node, staff, model, enable, profiles, field, message):
    gpu = _gpu(make_node(gpus=1, **({"model": model} if model else {})))
    with pytest.raises(ValidationFailed, match=message) as caught:
        gpu_mig_configure(gpu=gpu, enable=enable, profiles=profiles, actor=Actor(user=staff))
    assert field in caught.value.fields
    assert not NodeCommand.objects.exists() and reload_gpu(gpu).mig_configuring is False


def _exit(node, w) -> None:
    """The node reports the workload ended (the signal its heartbeat sends; scheduling listens)."""
    workload_exited.send(
        sender=type(node),
        node=node,
        workload_id=str(w.pk),
        state="exited",
        exit_code=0,
        finished_at=timezone.now(),
        message="",
    )


def test_a_busy_gpu_drains_and_gets_its_change_when_its_last_work_ends(
    make_node, staff, tenant, submit, cycle, django_capture_on_commit_callbacks
):
    node = make_node(gpus=1)
    a, b = submit(tenant, gpu_fraction_milli=300), submit(tenant, gpu_fraction_milli=300)
    cycle()
    assert {reload(a).state, reload(b).state} == {S.SCHEDULED}
    report_start(a, node), report_start(b, node)
    gpu = _gpu(node)
    # Accepted: nothing is sent and nothing is stopped; the GPU takes no new work from now on.
    assert gpu_mig_configure(gpu=gpu, enable=True, profiles=["7g.80gb"], actor=Actor(user=staff)) is None
    gpu = reload_gpu(gpu)
    assert gpu.mig_configuring is True and gpu.mig_sent_at is None
    assert gpu.mig_pending["layout"] == [{"profile": "7g.80gb", "start": 0}]
    assert gpu.mig_pending["requested_by"] == staff.email and gpu.mig_requested_at is not None
    assert gpu_mig_waiting_for(gpu=gpu) == sorted([str(a.pk), str(b.pk)])
    event = AuditEvent.objects.get(action="gpu.mig_configure")
    assert event.data["waiting_for"] == sorted([str(a.pk), str(b.pk)])
    assert not NodeCommand.objects.filter(kind=CommandKind.CONFIGURE_MIG).exists()
    assert not NodeCommand.objects.filter(kind__in=[CommandKind.STOP_WORKLOAD, CommandKind.PREEMPT_WORKLOAD])
    assert {reload(a).state, reload(b).state} == {S.RUNNING}
    # A third share would fit beside the two, but the draining GPU takes nothing.
    c = submit(tenant, gpu_fraction_milli=300)
    cycle()
    assert reload(c).state == S.QUEUED
    # A second change waits for staff to cancel this one.
    with pytest.raises(Conflict, match="pending already"):
        gpu_mig_configure(gpu=gpu, enable=False, profiles=[], actor=Actor(user=staff))
    # The first one ends: the other still holds the GPU.
    _exit(node, a)
    assert reload(a).state == S.SUCCEEDED
    assert not NodeCommand.objects.filter(kind=CommandKind.CONFIGURE_MIG).exists()
    assert gpu_mig_waiting_for(gpu=reload_gpu(gpu)) == [str(b.pk)]
    # The last one ends: the change goes to the agent at once, audited.
    _exit(node, b)
    command = _command(gpu)
    assert command.payload["placements"] == [{"profile": "7g.80gb", "start": 0}]
    assert command.payload["enable"] is True
    gpu = reload_gpu(gpu)
    assert gpu.mig_sent_at is not None and gpu.mig_pending["command"] == str(command.pk)
    sent = AuditEvent.objects.get(action="gpu.mig_send")
    assert sent.data["command"] == str(command.pk) and sent.actor_type == "system"
    with pytest.raises(Conflict, match="sent to its agent"):
        gpu_mig_cancel(gpu=gpu, actor=Actor(user=staff))
    # The agent's answer puts the GPU back in service, in its new shape.
    with django_capture_on_commit_callbacks(execute=True):
        _agent_answers(
            command,
            "succeeded",
            {"gpu_uuid": gpu.uuid, "mig_mode": True, "created": [{"profile": "7g.80gb", "start": 0}]},
        )
    gpu = reload_gpu(gpu)
    assert (gpu.mig_mode, gpu.mig_configuring, gpu.mig_pending, gpu.mig_sent_at) == (True, False, None, None)
    m = submit(tenant, mig_profile="7g.80gb")
    cycle()
    assert reload(m).state == S.SCHEDULED and reload(c).state == S.QUEUED


def test_a_change_left_by_a_lost_signal_is_sent_by_the_beat(make_node, staff, tenant, submit, cycle):
    node = make_node(gpus=1)
    w = submit(tenant)
    cycle()
    gpu = _gpu(node)
    assert gpu_mig_configure(gpu=gpu, enable=True, profiles=[], actor=Actor(user=staff)) is None
    assert gpu_mig_drained_send() == 0  # still held
    # The allocation ends without the signal (a staff stop whose answer never came, say).
    Allocation.objects.filter(workload=w).update(ended_at=timezone.now())
    # A forced stop the node has not confirmed still holds it.
    Allocation.objects.filter(workload=w).update(stop_forced_at=timezone.now())
    assert gpu_mig_drained_send() == 0
    Allocation.objects.filter(workload=w).update(stop_confirmed_at=timezone.now())
    # A DOWN node keeps the change until it is back.
    Node.objects.filter(pk=node.pk).update(state=NodeState.DOWN)
    assert gpu_mig_drained_send() == 0
    Node.objects.filter(pk=node.pk).update(state=NodeState.READY)
    assert send_drained_mig.apply().get() == 1  # the beat's task
    assert _command(gpu).payload["enable"] is True
    assert gpu_mig_drained_send() == 0  # twice is once


def test_staff_cancel_a_pending_change_and_the_gpu_takes_work_again(make_node, staff, tenant, submit, cycle):
    node = make_node(gpus=1)
    a = submit(tenant, gpu_fraction_milli=500)
    cycle()
    gpu = _gpu(node)
    gpu_mig_configure(gpu=gpu, enable=True, profiles=["7g.80gb"], actor=Actor(user=staff), reason="infer")
    b = submit(tenant, gpu_fraction_milli=500)
    cycle()
    assert reload(b).state == S.QUEUED
    gpu_mig_cancel(gpu=gpu, actor=Actor(user=staff), reason="not now")
    gpu = reload_gpu(gpu)
    assert (gpu.mig_configuring, gpu.mig_pending, gpu.mig_requested_at) == (False, None, None)
    event = AuditEvent.objects.get(action="gpu.mig_cancel")
    assert event.data["reason"] == "not now" and event.data["waiting_for"] == [str(a.pk)]
    with pytest.raises(Conflict, match="no MIG change pending"):
        gpu_mig_cancel(gpu=gpu, actor=Actor(user=staff))
    cycle()
    assert reload(b).state == S.SCHEDULED
    # Its work ending later sends nothing.
    _exit(node, a)
    assert gpu_mig_drained_send() == 0
    assert not NodeCommand.objects.filter(kind=CommandKind.CONFIGURE_MIG).exists()


def test_the_node_page_shows_mig_and_takes_the_form(make_node, staff):
    node = make_node(gpus=2)
    Gpu.objects.filter(node=node, index=1).update(
        mig_mode=True, mig_layout=[{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]
    )
    client = Client()
    client.force_login(staff)
    page = client.get(f"/fleet/nodes/{node.pk}/").content.decode()
    assert "MIG off" in page and "layout <code>3g.40gb@0, 3g.40gb@4</code>" in page
    assert "Profiles of this GPU: 1g.10gb, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb" in page
    gpu = _gpu(node)
    url = f"/fleet/gpus/{gpu.pk}/mig/"
    bad = client.post(url, {"enable": "on", "profiles": "4g.40gb 4g.40gb"}, HTTP_HX_REQUEST="true")
    assert bad.status_code == 400 and "does not fit one GPU" in bad.content.decode()
    assert not NodeCommand.objects.exists()
    ok = client.post(
        url, {"enable": "on", "profiles": "4g.40gb, 3g.40gb", "reason": "inference"}, HTTP_HX_REQUEST="true"
    )
    assert ok.status_code == 200 and "MIG change sent to its agent" in ok.content.decode()
    assert "MIG change under way" in ok.content.decode()
    assert _command(gpu).payload["placements"] == [
        {"profile": "4g.40gb", "start": 0},
        {"profile": "3g.40gb", "start": 4},
    ]
    # A tenant user never reaches it.
    other = Client()
    other.force_login(User.objects.create_user(email="t@x.test", password="pw-for-tests-1"))
    assert other.post(url, {"enable": "on"}).status_code in (302, 403, 404)


def test_the_staff_api_reads_and_changes_mig(make_node, staff, api):
    node = make_node(gpus=1)
    gpu = _gpu(node)
    _, wrong = staff_token_create(
        user=staff, name="queues", scopes=[StaffScope.SCHEDULING_WRITE], actor=Actor(user=staff)
    )
    _, token = staff_token_create(
        user=staff, name="ops", scopes=[StaffScope.FLEET_WRITE], actor=Actor(user=staff)
    )
    url = f"/api/staff/v1/gpus/{gpu.pk}/mig/"
    # A MIG layout is a fleet operation: a token for queue policies does not reach it.
    assert api(wrong).get(url).status_code == 403
    read = api(token).get(url).json()
    assert (read["mig_capable"], read["mig_mode"], read["profiles"][0]) == (True, False, "1g.10gb")
    bad = api(token).patch(
        url, {"enable": True, "profiles": ["7g.80gb", "1g.10gb"]}, content_type="application/json"
    )
    assert bad.status_code == 400 and "profiles" in bad.json()["error"]["fields"]
    unknown = api(token).patch(url, {"enable": True, "layout": []}, content_type="application/json")
    assert unknown.status_code == 400 and "layout" in unknown.json()["error"]["fields"]
    done = api(token).patch(url, {"enable": True, "profiles": ["7g.80gb"]}, content_type="application/json")
    assert done.status_code == 200 and done.json()["configuring"] is True
    assert NodeCommand.objects.get(pk=done.json()["command"]).payload["placements"] == [
        {"profile": "7g.80gb", "start": 0}
    ]
    again = api(token).patch(url, {"enable": False}, content_type="application/json")
    assert again.status_code == 409


def test_the_staff_api_accepts_a_change_on_a_busy_gpu_and_cancels_it(
    make_node, staff, api, tenant, submit, cycle
):
    node = make_node(gpus=1)
    w = submit(tenant)
    cycle()
    gpu = _gpu(node)
    _, wrong = staff_token_create(
        user=staff, name="queues", scopes=[StaffScope.SCHEDULING_WRITE], actor=Actor(user=staff)
    )
    _, token = staff_token_create(
        user=staff, name="ops", scopes=[StaffScope.FLEET_WRITE], actor=Actor(user=staff)
    )
    url = f"/api/staff/v1/gpus/{gpu.pk}/mig/"
    cancel = f"{url}cancel/"
    body = {"enable": True, "profiles": ["3g.40gb", "3g.40gb"], "reason": "inference"}
    assert api(wrong).patch(url, body, content_type="application/json").status_code == 403
    # Nothing pending yet: cancel is a 409, and a bad body a 400 naming the field.
    assert api(token).post(cancel, {}, content_type="application/json").status_code == 409
    bad = api(token).post(cancel, {"why": "x"}, content_type="application/json")
    assert bad.status_code == 400 and "why" in bad.json()["error"]["fields"]
    accepted = api(token).patch(url, body, content_type="application/json")
    assert accepted.status_code == 202, accepted.content
    pending = accepted.json()["pending"]
    assert accepted.json()["command"] is None and accepted.json()["configuring"] is True
    assert (pending["state"], pending["waiting_for"], pending["reason"]) == (
        "draining",
        [str(w.pk)],
        "inference",
    )
    assert pending["layout"] == [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]
    assert pending["requested_by"] == staff.email and pending["requested_at"]
    assert api(token).get(url).json()["pending"] == pending
    # A change already pending: 409.
    again = api(token).patch(url, {"enable": False}, content_type="application/json")
    assert again.status_code == 409 and "cancel it first" in again.json()["error"]["message"]
    # The wrong scope cannot cancel; the right one can, once.
    assert api(wrong).post(cancel, {}, content_type="application/json").status_code == 403
    done = api(token).post(cancel, {"reason": "later"}, content_type="application/json")
    assert done.status_code == 200 and done.json()["pending"] is None and done.json()["configuring"] is False
    assert api(token).post(cancel, {}, content_type="application/json").status_code == 409
    assert AuditEvent.objects.filter(action="gpu.mig_cancel", target_id=str(gpu.pk)).count() == 1
    assert not NodeCommand.objects.filter(kind=CommandKind.CONFIGURE_MIG).exists()


def test_the_node_page_shows_a_pending_change_and_cancels_it(make_node, staff, tenant, submit, cycle):
    node = make_node(gpus=1)
    w = submit(tenant)
    cycle()
    gpu = _gpu(node)
    client = Client()
    client.force_login(staff)
    url = f"/fleet/gpus/{gpu.pk}/mig/"
    row = client.post(url, {"enable": "on", "profiles": "4g.40gb 3g.40gb"}, HTTP_HX_REQUEST="true")
    text = row.content.decode()
    assert row.status_code == 200 and "drains: it takes no new work" in text
    assert "MIG change waiting" in text and f"<code>{w.pk}</code> to end" in text
    page = client.get(f"/fleet/nodes/{node.pk}/").content.decode()
    assert "MIG change waiting" in page and "To <strong>MIG on, layout 4g.40gb@0, 3g.40gb@4</strong>" in page
    assert f"asked by {staff.email}" in page and f"<code>{w.pk}</code> to end" in page
    assert "Cancel MIG change" in page
    # A tenant user cannot cancel it.
    other = Client()
    other.force_login(User.objects.create_user(email="t@x.test", password="pw-for-tests-1"))
    assert other.post(f"{url}cancel/", {}).status_code in (302, 403, 404)
    assert reload_gpu(gpu).mig_pending is not None
    cancelled = client.post(f"{url}cancel/", {"reason": "wrong GPU"}, HTTP_HX_REQUEST="true")
    assert cancelled.status_code == 200 and "MIG change cancelled" in cancelled.content.decode()
    assert "MIG change waiting" not in cancelled.content.decode()
    again = client.post(f"{url}cancel/", {}, HTTP_HX_REQUEST="true")
    assert again.status_code == 409 and "no MIG change pending" in again.content.decode()
    assert reload_gpu(gpu).mig_configuring is False


def test_a_slurm_node_gpu_is_not_reconfigured(make_node, staff):
    node = make_node(gpus=1)
    Region.objects.filter(pk=node.region_id).update(backend=RegionBackend.SLURM)
    with pytest.raises(Conflict, match="Slurm node"):
        gpu_mig_configure(gpu=_gpu(node), enable=True, profiles=[], actor=Actor(user=staff))
    assert not NodeCommand.objects.exists() and reload_gpu(_gpu(node)).mig_pending is None


def test_the_admin_shows_mig_but_does_not_change_it(make_node):
    gpu = _gpu(make_node(gpus=1))
    admin = User.objects.create_superuser(email="root@gpupool.test", password="pw-for-tests-1")
    client = Client()
    client.force_login(admin)
    page = client.get(f"/admin/nodes/gpu/{gpu.pk}/change/")
    assert page.status_code == 200 and "Mig pending" in page.content.decode()
    for field in ("mig_mode", "mig_layout", "mig_configuring", "mig_pending", "mig_sent_at"):
        assert f'name="{field}"' not in page.content.decode()  # the audited service is the one way in
