"""An instance's own command: accepted by the API and the launch form, checked by the same rules as
a job's (``nodes.agent.workload_rules.check_command``, at the API and again on the node), stored,
sent in the start command, and run by the real subprocess runtime. Before, the API dropped it
silently and the service refused it."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodes.agent.runtimes.process import SubprocessRuntime
from nodes.agent.types import WorkloadSpec
from nodes.agent.workload_rules import MAX_COMMAND_COUNT
from nodes.models import CommandKind
from nodes.services.commands import command_as_wire, node_commands_deliver_due
from scheduling.models import Workload
from tests.agent.conftest import process_options, wait_for  # noqa: F401  (a fixture)
from tests.portal.conftest import signed_in  # noqa: F401  (a fixture)
from tests.scheduling.conftest import H100

pytestmark = pytest.mark.django_db

INSTANCE = {"gpu_models": [H100], "image": "ghcr.io/acme/notebook:1"}
JOB = {"gpu_models": [H100], "image": "ghcr.io/acme/train:1"}


@pytest.fixture
def tapi(tenant, make_token, api):
    return api(make_token(tenant))


def post(tapi, url, body):
    return tapi.post(url, body, content_type="application/json")


def test_an_instance_keeps_its_command_and_the_node_gets_it(tapi, make_node, cycle):
    node = make_node()
    command = ["jupyter", "lab", "--ip=0.0.0.0", "  spaced  "]  # kept exactly, no trimming
    r = post(tapi, "/api/v1/instances/", {**INSTANCE, "command": command})
    assert r.status_code == 201, r.content
    assert r.json()["command"] == command
    assert Workload.objects.get(pk=r.json()["id"]).command == command
    assert tapi.get(f"/api/v1/instances/{r.json()['id']}/").json()["command"] == command
    cycle()
    commands, _ = node_commands_deliver_due(node_id=node.pk)
    [wire] = [command_as_wire(c) for c in commands if c.kind == CommandKind.START_WORKLOAD]
    assert wire["payload"]["command"] == command
    # Without one, an instance runs its image's default: an empty command.
    r = post(tapi, "/api/v1/instances/", INSTANCE)
    assert r.status_code == 201 and r.json()["command"] == []


@pytest.mark.parametrize(
    "command",
    [
        "python train.py",  # a string, not a list
        ["ok", ["nested"]],
        ["ok", True],
        ["bad\x00arg"],
        ["x"] * (MAX_COMMAND_COUNT + 1),
        ["y" * (128 * 1024 + 1)],
    ],
)
@pytest.mark.parametrize(("url", "spec"), [("/api/v1/instances/", INSTANCE), ("/api/v1/jobs/", JOB)])
def test_instances_and_jobs_refuse_the_same_commands_naming_command(tapi, make_node, url, spec, command):
    make_node()
    r = post(tapi, url, {**spec, "command": command})
    assert r.status_code == 400, r.content
    assert "command" in r.json()["error"]["fields"], r.json()
    assert Workload.objects.count() == 0
    # Positive control: the same route takes a plain command.
    assert post(tapi, url, {**spec, "command": ["/bin/true"]}).status_code == 201


def test_an_instances_own_command_wins_over_its_templates(tapi, make_node):
    make_node()
    r = post(
        tapi,
        "/api/v1/templates/",
        {"name": "nb", "image": "ghcr.io/acme/nb:1", "command": ["from", "template"]},
    )
    assert r.status_code == 201, r.content
    own = post(tapi, "/api/v1/instances/", {"gpu_models": [H100], "template": "nb", "command": ["mine"]})
    assert own.status_code == 201 and own.json()["command"] == ["mine"]
    filled = post(tapi, "/api/v1/instances/", {"gpu_models": [H100], "template": "nb"})
    assert filled.status_code == 201 and filled.json()["command"] == ["from", "template"]


def test_the_launch_form_takes_an_instances_command(signed_in, owner, tenant, make_node):  # noqa: F811
    make_node(H100, gpus=8, region="us")
    client = signed_in(owner, tenant)
    page = client.get("/launch/").content.decode()
    assert 'id="id_command"' in page
    r = client.post(
        "/launch/",
        {
            "kind": "instance", "name": "nb", "gpu_model": H100, "gpu_count": "1", "fraction": "1000",
            "region": "us-east-1", "plan": "on_demand", "image": "ghcr.io/acme/notebook:1",
            "command": "jupyter lab --NotebookApp.token='a b'",
        },
    )  # fmt: skip
    assert r.status_code == 302, r.content.decode()[:2000]
    w = Workload.objects.get(kind="instance")
    assert w.command == ["jupyter", "lab", "--NotebookApp.token=a b"]


def test_the_process_runtime_runs_an_instances_command(
    tapi,
    make_node,
    cycle,
    tmp_path: Path,
    process_options,  # noqa: F811  (the fixture)
):
    node = make_node()
    r = post(
        tapi,
        "/api/v1/instances/",
        {**INSTANCE, "command": ["/bin/sh", "-c", 'printf "<%s>" "$1"', "sh", "from the instance"]},
    )
    assert r.status_code == 201, r.content
    cycle()
    commands, _ = node_commands_deliver_due(node_id=node.pk)
    [wire] = [command_as_wire(c) for c in commands if c.kind == CommandKind.START_WORKLOAD]
    runtime = SubprocessRuntime(tmp_path / "state", **process_options)
    spec = WorkloadSpec.from_payload(wire["payload"])  # the agent's own check of the payload
    runtime.start(spec)
    status = wait_for(
        lambda: (s := runtime.get_status(spec.workload_id)) is not None and s.terminal and s, what="the end"
    )
    assert (status.state, status.exit_code) == ("exited", 0), runtime.logs(spec.workload_id)
    assert runtime.logs(spec.workload_id) == "<from the instance>"
