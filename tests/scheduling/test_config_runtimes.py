"""An instance's env, a secret's value among it, reaches the workload's process: submitted through
the API, placed by a cycle, delivered as the agent's long poll delivers it, checked by the agent's
rules and started by the real runtimes (host processes; the Docker Engine)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import docker
import pytest
from docker.errors import NotFound

from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.runtimes.docker import DockerRuntime
from nodes.agent.runtimes.process import SubprocessRuntime
from nodes.agent.types import WorkloadSpec
from nodes.models import CommandKind
from nodes.services.commands import command_as_wire, node_commands_deliver_due
from scheduling.models import Workload
from tests.agent.conftest import process_options, wait_for  # noqa: F401  (a fixture)
from tests.docker_engine import TEST_IMAGE, docker_engine  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db

SECRET = "tok en;$(id)\n"  # reaches the process byte for byte, never through a shell
SCRIPT = 'printf "<%s>" "$PLAIN" "$TOKEN" "$FROM_TEMPLATE"'


@pytest.fixture
def tapi(tenant, make_token, api):
    return api(make_token(tenant))


def launch(tapi, make_node, cycle, image: str) -> tuple[Workload, dict[str, Any]]:
    """An instance from the tenant's own template with a secret in its env; the start payload as
    the node receives it."""
    node = make_node()
    post = lambda url, body: tapi.post(url, body, content_type="application/json")  # noqa: E731
    assert post("/api/v1/secrets/", {"name": "token", "value": SECRET}).status_code == 201
    r = post(
        "/api/v1/templates/",
        {
            "name": "printer",
            "image": image,
            "command": ["/bin/sh", "-c", SCRIPT],
            "env": {"FROM_TEMPLATE": "t"},
        },
    )
    assert r.status_code == 201, r.content
    r = post(
        "/api/v1/instances/",
        {
            "gpu_models": ["H100"],
            "template": "printer",
            "env": {"PLAIN": "a b", "TOKEN": {"secret": "token"}},
        },
    )
    assert r.status_code == 201, r.content
    w = Workload.objects.get(pk=r.json()["id"])
    assert w.env == {"FROM_TEMPLATE": "t", "PLAIN": "a b", "TOKEN": {"secret": "token"}}
    cycle()
    commands, _ = node_commands_deliver_due(node_id=node.pk)
    [wire] = [command_as_wire(c) for c in commands if c.kind == CommandKind.START_WORKLOAD]
    return w, wire["payload"]


def test_the_process_runtime_prints_the_env(tapi, make_node, cycle, tmp_path: Path, process_options):  # noqa: F811
    w, payload = launch(tapi, make_node, cycle, "ghcr.io/acme/printer:1")
    runtime = SubprocessRuntime(tmp_path / "state", **process_options)
    spec = WorkloadSpec.from_payload(payload)  # the agent's own check of the payload
    runtime.start(spec)
    status = wait_for(
        lambda: (s := runtime.get_status(spec.workload_id)) is not None and s.terminal and s, what="the end"
    )
    assert (status.state, status.exit_code) == ("exited", 0), runtime.logs(spec.workload_id)
    assert runtime.logs(spec.workload_id) == f"<a b><{SECRET}><t>"
    assert Workload.objects.get(pk=w.pk).env["TOKEN"] == {"secret": "token"}


def test_the_docker_container_gets_the_env(
    tapi,
    make_node,
    cycle,
    tmp_path: Path,
    docker_engine: docker.DockerClient,  # noqa: F811
):
    _, payload = launch(tapi, make_node, cycle, TEST_IMAGE)
    spec = WorkloadSpec.from_payload(payload)
    runtime = DockerRuntime(tmp_path / "state", node_gpus=8)
    try:
        # This machine has no NVIDIA runtime: docker creates the container, then cannot start it
        # on the placed GPUs. What it was created with is what it would run with.
        with pytest.raises(RuntimeFailure, match="could not select device driver"):
            runtime.start(spec)
        info = docker_engine.api.inspect_container(f"gpupool-{spec.workload_id}")
        env = info["Config"]["Env"]
        assert {"PLAIN=a b", f"TOKEN={SECRET}", "FROM_TEMPLATE=t"} <= set(env)
        assert info["Config"]["Cmd"] == ["/bin/sh", "-c", SCRIPT] and info["Config"]["Image"] == TEST_IMAGE
        # The same env without GPUs, on this engine: busybox prints it.
        plain = WorkloadSpec.from_payload({**payload, "gpu_uuids": [], "cpu_millicores": 500, "ram_mib": 64})
        plain.workload_id = f"{spec.workload_id}-nogpu"
        runtime.start(plain)
        wait_for(
            lambda: (s := runtime.get_status(plain.workload_id)) is not None and s.terminal, what="the end"
        )
        assert runtime.logs(plain.workload_id) == f"<a b><{SECRET}><t>"
    finally:
        for wid in (spec.workload_id, f"{spec.workload_id}-nogpu"):
            with contextlib.suppress(NotFound):
                docker_engine.api.remove_container(f"gpupool-{wid}", force=True)
        runtime.close()
