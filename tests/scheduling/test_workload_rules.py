"""The workload rules at submission (issue 25 §1): every attack through ``image``, ``env``,
``command`` and ``ports`` is a 400 naming the field and stores nothing, through the API, the launch
form and the service; valid input reaches the stored workload exactly as given."""

from __future__ import annotations

import pytest

from nodes.agent.commands import start_failed
from nodes.agent.types import WorkloadSpec
from nodes.agent.workload_rules import MAX_ENV_BYTES, MAX_ENV_COUNT, WorkloadRuleError
from nodes.models import CommandKind, NodeCommand
from nodes.services.commands import node_command_report
from portal.errors import ValidationFailed
from scheduling.models import Workload, WorkloadEvent
from tests.portal.conftest import signed_in  # noqa: F401  (fixture)
from tests.scheduling.conftest import H100, reload

pytestmark = pytest.mark.django_db

JOB = {"gpu_models": ["H100"], "image": "ghcr.io/acme/train:1", "command": ["python", "train.py"]}
PINNED = "registry.example.com:5000/team/train:v1.2@sha256:" + "0123456789abcdef" * 4

# (what the tenant sends, the field the 400 names, a phrase of its message)
ATTACKS = [
    # `docker run --privileged -v /:/host alpine sh`: root on the node.
    ({"image": "--privileged", "command": ["-v", "/:/host", "alpine", "sh"]}, "image", "start with '-'"),
    ({"image": "-v"}, "image", "start with '-'"),
    ({"image": "alpine --privileged"}, "image", "whitespace"),
    ({"image": "alpine\n--privileged"}, "image", "whitespace"),
    ({"image": "ALPINE"}, "image", "not an image name"),
    ({"image": "alpine@sha256:abc"}, "image", "not a digest"),
    # A newline in a key adds lines to docker's --env-file; a bare name there imports the agent's own
    # variable (its bootstrap token).
    ({"env": {"A\nB": "1"}}, "env", "not a variable name"),
    ({"env": {"GPUPOOL_BOOTSTRAP_TOKEN\nX": "1"}}, "env", "not a variable name"),
    ({"env": {"GPUPOOL_BOOTSTRAP_TOKEN": ""}}, "env", "GPUPOOL_BOOTSTRAP_TOKEN is set by the platform"),
    ({"env": {"A=B": "1"}}, "env", "not a variable name"),
    ({"env": {"1A": "1"}}, "env", "not a variable name"),
    # The MPS share's memory limit, the GPUs the container toolkit mounts, the loader.
    ({"env": {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=999999M"}}, "env", "set by the platform"),
    ({"env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}}, "env", "set by the platform"),
    ({"env": {"NVIDIA_VISIBLE_DEVICES": "all"}}, "env", "set by the platform"),
    ({"env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}}, "env", "set by the platform"),
    ({"env": {"LD_PRELOAD": "/tmp/evil.so"}}, "env", "set by the platform"),
    ({"env": {"GPUPOOL_WORKLOAD_ID": "7"}}, "env", "set by the platform"),
    ({"env": {f"V{i}": "x" for i in range(MAX_ENV_COUNT + 1)}}, "env", f"At most {MAX_ENV_COUNT} variables"),
    ({"env": {"BIG": "x" * MAX_ENV_BYTES}}, "env", "KiB of names and values"),
]


def _ids(cases):
    return [f"{field}-{i}" for i, (_, field, _) in enumerate(cases)]


@pytest.fixture
def client(tenant, make_token, api):
    return api(make_token(tenant))


@pytest.mark.parametrize(("spec", "field", "message"), ATTACKS, ids=_ids(ATTACKS))
def test_an_attack_through_the_api_is_a_400_naming_the_field(client, make_node, spec, field, message):
    make_node()
    r = client.post("/api/v1/jobs/", {**JOB, **spec}, content_type="application/json")
    assert r.status_code == 400, r.content
    error = r.json()["error"]
    assert field in error["fields"], error
    assert any(message in text for text in error["fields"][field]), error
    assert not Workload.objects.exists() and not WorkloadEvent.objects.exists()


@pytest.mark.parametrize(("spec", "field", "message"), ATTACKS, ids=_ids(ATTACKS))
def test_an_attack_through_the_service_is_refused_naming_the_field(
    tenant, make_node, submit, spec, field, message
):
    make_node()
    with pytest.raises(ValidationFailed) as e:
        submit(tenant, **spec)
    assert message in e.value.fields[field][0], e.value.fields
    assert not Workload.objects.exists()


SERVICE_ONLY = [  # shapes the API's serializer already refuses, checked by the service all the same
    ({"command": ["python", "-c", "print(1)\x00"]}, "command", "NUL"),
    ({"command": ["x"] * 1025}, "command", "At most 1024 arguments"),
    ({"command": ["x" * (128 * 1024 + 1)]}, "command", "KiB together"),
    ({"env": {"A": "a\x00b"}}, "env", "NUL"),
    ({"env": {"A": 1}}, "env", "must be a string"),
    ({"kind": "instance", "ports": [0]}, "ports", "not a port number"),
    ({"kind": "instance", "ports": [{"host": 22, "container": 22}]}, "ports", "Unknown key 'container'"),
    ({"kind": "instance", "ports": list(range(1000, 1065))}, "ports", "At most 64 ports"),
    ({"kind": "instance", "template": "--privileged"}, "template", "A template name"),
    ({"kind": "instance", "ssh_public_key": "ssh-ed25519 AAAA me\rcommand=x"}, "ssh_public_key", "One line"),
]


@pytest.mark.parametrize(("spec", "field", "message"), SERVICE_ONLY, ids=_ids(SERVICE_ONLY))
def test_the_service_checks_every_field_it_stores(tenant, make_node, submit, spec, field, message):
    make_node()
    with pytest.raises(ValidationFailed) as e:
        submit(tenant, **spec)
    assert message in e.value.fields[field][0], e.value.fields
    assert not Workload.objects.exists()


def test_a_valid_workload_is_stored_exactly_as_given(client, make_node):
    """The positive control: a pinned image with registry, port, tag and digest, and env values
    with newlines, spaces and = reach the stored workload (and so the agent) byte for byte."""
    make_node()
    env = {
        "MULTILINE": "line one\nline two\n",
        "PADDED": "  spaced  ",
        "EQ": "a=b",
        "_x1": "",
        "HF_TOKEN": "é",
    }
    command = ["python", "-c", "print('hi')\n", "  arg with spaces  "]
    r = client.post(
        "/api/v1/jobs/",
        {**JOB, "image": PINNED, "env": env, "command": command},
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    w = Workload.objects.get(pk=r.json()["id"])
    assert (w.image, w.env, w.command) == (PINNED, env, command)
    # The simulated runtime's settings are the workload's own.
    r = client.post(
        "/api/v1/jobs/", {**JOB, "env": {"GPUPOOL_SIM_DURATION_S": "2"}}, content_type="application/json"
    )
    assert r.status_code == 201, r.content


def test_ports_are_container_ports_deduplicated(client, make_node):
    make_node()
    spec = {"gpu_models": ["H100"], "image": "ghcr.io/acme/notebook:1", "ports": [8888, 22, 8888]}
    r = client.post("/api/v1/instances/", spec, content_type="application/json")
    assert r.status_code == 201, r.content
    assert Workload.objects.get().ports == [
        {"port": 22, "protocol": "http"},
        {"port": 8888, "protocol": "http"},
    ]
    r = client.post("/api/v1/instances/", {**spec, "ports": [70000]}, content_type="application/json")
    assert r.status_code == 400 and "ports" in r.json()["error"]["fields"]


def test_the_launch_form_refuses_an_option_as_image(signed_in, owner, tenant, make_node):  # noqa: F811
    make_node()
    client = signed_in(owner, tenant)
    data = {
        "kind": "job",
        "name": "escape",
        "gpu_model": H100,
        "gpu_count": "1",
        "fraction": "1000",
        "plan": "on_demand",
        "image": "--privileged",
        "command": "-v /:/host alpine sh",
    }
    r = client.post("/launch/", data)
    html = r.content.decode()
    assert r.status_code == 400
    error = html[html.index('id="id_image_error"') :]
    assert "start with" in error[:400], error[:400]
    assert not Workload.objects.exists()
    assert client.post("/launch/", {**data, "image": "alpine:3", "command": "sh -c true"}).status_code == 302


def test_the_agent_refusing_a_start_shows_its_reason_on_the_workload(
    client, tenant, make_node, submit, cycle, django_capture_on_commit_callbacks
):
    """A row stored before these rules reaches the agent, which refuses it (tests/agent/
    test_workload_rules.py); its ``start_failed`` result puts the reason on the workload."""
    make_node()
    w = submit(tenant)
    Workload.objects.filter(pk=w.pk).update(image="--privileged", command=["-v", "/:/host", "alpine", "sh"])
    cycle()
    command = NodeCommand.objects.get(kind=CommandKind.START_WORKLOAD)
    with pytest.raises(WorkloadRuleError) as refused:
        WorkloadSpec.from_payload(command.payload)
    reason = str(refused.value)
    with django_capture_on_commit_callbacks(execute=True):
        node_command_report(
            node_id=command.node_id,
            command_id=command.pk,
            status="failed",
            result=start_failed(command.payload, reason, rejected=True),
            message=reason,
        )
    # Every node would refuse it: failed at once, not placed again until the attempts run out.
    assert reload(w).state == "failed"
    detail = client.get(f"/api/v1/jobs/{w.pk}/").json()
    assert detail["state_reason"] == (
        "Refused by the node: image: Must not start with '-' (an image reference is not an option)."
    )
    events = client.get(f"/api/v1/jobs/{w.pk}/events/").json()
    assert (events[-1]["reason"], events[-1]["message"]) == ("start_failed", f"Refused by the node: {reason}")
