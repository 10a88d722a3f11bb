"""The workload rules in the agent (issue 25 §1, defence in depth): a ``start_workload`` whose
payload breaks them never reaches the runtime and is reported ``start_failed`` with the reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from nodes.agent.agent import Agent
from nodes.agent.config import AgentConfig
from nodes.agent.workload_rules import (
    WorkloadRuleError,
    check_command,
    check_env,
    check_gpu_uuids,
    check_image,
    check_ports,
    check_start_payload,
    check_workload_id,
)
from tests.agent.conftest import AgentThread, wait_for
from tests.agent.fakeportal import FakePortal

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "image",
    [
        "alpine",
        "busybox:1.36",
        "nvcr.io/nvidia/pytorch:24.08-py3",
        "localhost:5000/team/app",
        f"registry.example.com:5000/team/sub__path/app-x.y:v1.2_rc@{DIGEST}",
        f"alpine@{DIGEST}",
        "[::1]:5000/app:latest",
    ],
)
def test_image_references_of_the_grammar_are_accepted(image: str) -> None:
    assert check_image(image) == image


@pytest.mark.parametrize(
    ("image", "reason"),
    [
        ("--privileged", "start with '-'"),
        ("-v", "start with '-'"),
        ("alpine --privileged", "whitespace"),
        ("alpine\t", "whitespace"),
        ("alpine\x1b", "control characters"),
        ("Alpine", "not an image name"),
        ("team//app", "not an image name"),
        ("/app", "not an image name"),
        ("app:", "not a tag"),
        ("app:-x", "not a tag"),
        ("app:" + "t" * 129, "not a tag"),
        ("app@sha256:abc", "not a digest"),
        ("app@sha256:" + "a" * 63, "64 hex digits"),
        ("a" * 256, "At most 255"),
        ("", "Must not be empty"),
    ],
)
def test_images_outside_the_grammar_are_refused_with_the_reason(image: str, reason: str) -> None:
    with pytest.raises(WorkloadRuleError) as e:
        check_image(image)
    assert e.value.field == "image" and reason in e.value.message
    assert str(e.value).startswith("image: ")


def test_env_names_values_and_limits() -> None:
    env = {"A": "x\ny", "_b2": "", "PATH": "/opt/bin", "GPUPOOL_SIM_DURATION_S": "3"}
    assert check_env(env) == env
    for bad, reason in [
        ({"A\nB": "1"}, "not a variable name"),
        ({"A B": "1"}, "not a variable name"),
        ({"": "1"}, "not a variable name"),
        ({"Ä": "1"}, "not a variable name"),
        ({"A": "a\x00b"}, "NUL"),
        ({"GPUPOOL_BOOTSTRAP_TOKEN": "x"}, "set by the platform"),
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, "set by the platform"),
        ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1M"}, "set by the platform"),
        ({"ROCR_VISIBLE_DEVICES": "0"}, "set by the platform"),
        ({"LD_LIBRARY_PATH": "/tmp"}, "set by the platform"),
        ({"DOCKER_HOST": "tcp://x"}, "set by the platform"),
        ({f"V{i}": "" for i in range(257)}, "At most 256"),
        ({"A": "é" * 32 * 1024}, "64 KiB"),
    ]:
        with pytest.raises(WorkloadRuleError, match=reason) as e:
            check_env(bad)
        assert e.value.field == "env"


def test_command_ports_ids_and_gpus() -> None:
    assert check_command(["-v", "/:/host"]) == ["-v", "/:/host"]  # the workload's own argv
    with pytest.raises(WorkloadRuleError, match="NUL"):
        check_command(["a\x00"])
    with pytest.raises(WorkloadRuleError, match="list of strings"):
        check_command("sh -c id")
    # A number is an HTTP port; an object names its protocol; duplicates count once.
    assert check_ports([8888, 22, {"port": 8888, "protocol": "http"}, {"port": 5432, "protocol": "tcp"}]) == [
        {"port": 22, "protocol": "http"},
        {"port": 5432, "protocol": "tcp"},
        {"port": 8888, "protocol": "http"},
    ]
    assert check_ports([{"port": 80}]) == [{"port": 80, "protocol": "http"}]
    for bad, reason in (
        ([0], "not a port"),
        ([65536], "not a port"),
        (["22"], "not a port"),
        ([True], "not a port"),
        ([{"port": "80"}], "not a port"),
        ([{"host": 22, "container": 22}], "Unknown key"),
        ([{"port": 80, "protocol": "udp"}], "protocol must be one of http, tcp"),
        ([{"port": 80, "protocol": None}], "protocol must be"),
        ([80, {"port": 80, "protocol": "tcp"}], "twice with different protocols"),
        (list(range(1, 66)), "At most 64"),
        ("8080", "Must be a list"),
    ):
        with pytest.raises(WorkloadRuleError, match=reason) as e:
            check_ports(bad)
        assert e.value.field == "ports"
    assert check_workload_id(42) == "42"
    for bad in ("../etc", "a/b", "-x", "", "x" * 65, True):
        with pytest.raises(WorkloadRuleError):
            check_workload_id(bad)
    assert check_gpu_uuids(["GPU-1a2b", "MIG-3c4d"]) == ["GPU-1a2b", "MIG-3c4d"]
    for bad in (['GPU-a","device=all'], ["GPU-a,GPU-b"], ["GPU-a", "GPU-a"], [""], "GPU-a"):
        with pytest.raises(WorkloadRuleError):
            check_gpu_uuids(bad)


def test_a_start_payload_is_checked_field_by_field_and_keeps_unknown_fields() -> None:
    payload = {
        "workload_id": "7",
        "image": "x:1",
        "command": ["python"],
        "env": {"A": "b"},
        "gpu_uuids": ["GPU-a"],
        "ports": [{"port": 8888, "protocol": "http"}],
        "cpu_millicores": 2000,
        "ram_mib": 4096,
        "mig_profile": "1g.10gb",
        "gpu_vendor": "nvidia",
        "attempt": 3,
        "some_future_field": {"kept": True},
    }
    assert check_start_payload(payload) == payload
    for field, bad in [
        ("ram_mib", "1g --privileged"),
        ("cpu_millicores", True),
        ("mig_profile", "1g.10gb --x"),
        ("gpu_vendor", "nvidia,amd"),
        ("template", "-t"),
        ("ssh_public_key", "ssh-ed25519 AAAA\nssh-rsa BBBB"),
    ]:
        with pytest.raises(WorkloadRuleError) as e:
            check_start_payload({**payload, field: bad})
        assert e.value.field == field


# (a payload's fields over the valid start's, a phrase of the reason)
REFUSED = [
    (
        {"image": "--privileged", "command": ["-v", "/:/host", "alpine", "sh"]},
        "image: Must not start with '-'",
    ),
    (
        {"env": {"GPUPOOL_BOOTSTRAP_TOKEN\nX": "1"}},
        "env: 'GPUPOOL_BOOTSTRAP_TOKEN\\nX' is not a variable name",
    ),
    (
        {"env": {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=999999M"}},
        "env: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT is set",
    ),
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "env: LD_PRELOAD is set by the platform"),
    ({"gpu_uuids": ['GPU-a","device=all']}, "gpu_uuids: "),
    ({"workload_id": "../../etc"}, "workload_id: "),
]


def test_a_start_that_breaks_the_rules_never_reaches_the_runtime(
    portal: FakePortal, make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    agent = Agent(make_config())
    starts: list[str] = []
    original_start = agent.runtime.start
    agent.runtime.start = lambda spec: (starts.append(spec.workload_id), original_start(spec))[1]
    run_agent(agent)
    wait_for(lambda: portal.seqs(1), what="registration")
    uuid = portal.nodes[1]["register"]["gpus"][0]["uuid"]
    valid: dict[str, Any] = {
        "workload_id": "42",
        "image": f"registry.example.com:5000/team/app:1@{DIGEST}",
        "command": ["python", "train.py"],
        "env": {"NOTE": "two\nlines"},
        "gpu_uuids": [uuid],
    }
    for i, (fields, _) in enumerate(REFUSED):
        payload = {**valid, "workload_id": f"bad{i}", **fields}
        portal.queue_command(1, {"id": f"c-bad{i}", "kind": "start_workload", "payload": payload})
    for i in range(len(REFUSED)):
        wait_for(lambda i=i: "failed" in portal.reports_for(f"c-bad{i}"), what=f"start {i} refused")
    # The positive control: the same start with valid fields runs.
    portal.queue_command(1, {"id": "c-ok", "kind": "start_workload", "payload": valid})
    wait_for(lambda: "succeeded" in portal.reports_for("c-ok"), what="the valid start")
    assert starts == ["42"]
    failed = {cid: (result, message) for cid, status, result, message in portal.reports if status == "failed"}
    for i, (_, reason) in enumerate(REFUSED):
        result, message = failed[f"c-bad{i}"]
        assert result["error"] == "start_failed" and reason in result["reason"], result
        assert result["rejected"] is True
        assert reason in message
    assert failed["c-bad0"][0]["workload_id"] == "bad0"
    assert not any(status.workload_id.startswith("bad") for status in agent.runtime.status())


def test_a_prewarm_of_an_option_is_refused(
    portal: FakePortal, make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    agent = Agent(make_config())
    pulls: list[str] = []
    agent.runtime.prewarm = lambda image: (pulls.append(image), {"image": image, "pulled": True})[1]
    run_agent(agent)
    wait_for(lambda: portal.seqs(1), what="registration")
    portal.queue_command(1, {"id": "p-bad", "kind": "prewarm", "payload": {"image": "--all-tags"}})
    portal.queue_command(1, {"id": "p-ok", "kind": "prewarm", "payload": {"image": "busybox:1.36"}})
    wait_for(lambda: "succeeded" in portal.reports_for("p-ok"), what="the valid prewarm")
    wait_for(lambda: "failed" in portal.reports_for("p-bad"), what="the refused prewarm")
    assert pulls == ["busybox:1.36"]
