"""Staff set a GPU's MIG mode and layout: the service (checked against the GPU's profile table,
refused while work holds the GPU, the GPU out of placement until the agent answers, audited), the
agent's answer recorded, the node page (form, errors in the row, the state shown) and the staff API.
The agent side and the whole path are in tests/nodes/test_fractional_agent.py and
test_fractional_e2e.py."""

from __future__ import annotations

import pytest
from django.test import Client

from nodes.models import CommandKind, Gpu, NodeCommand
from nodes.services.commands import node_command_report
from nodes.services.mig import gpu_mig_configure
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.models import AuditEvent, StaffScope, User
from portal.staff_tokens import staff_token_create
from scheduling.models import WorkloadState as S
from tests.scheduling.conftest import reload

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


def test_refused_while_work_holds_the_gpu(make_node, staff, tenant, submit, cycle):
    node = make_node(gpus=1)
    w = submit(tenant)
    cycle()
    assert reload(w).state == S.SCHEDULED
    with pytest.raises(Conflict, match=f"runs workloads {w.pk}"):
        gpu_mig_configure(gpu=_gpu(node), enable=True, profiles=[], actor=Actor(user=staff))
    assert not NodeCommand.objects.filter(kind=CommandKind.CONFIGURE_MIG).exists()
    assert reload_gpu(_gpu(node)).mig_configuring is False


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
