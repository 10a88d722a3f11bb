"""Fractional GPUs on the node: the environment and docker arguments that isolate a share (MPS or
time-slicing with a GPU memory limit), and MIG slices made for a workload on start and destroyed when
it ends (the agent with the simulated collector and runtime; NVML at the ``pynvml`` boundary)."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pynvml as real_nvml
import pytest

from nodes.agent.agent import Agent
from nodes.agent.collectors import CollectorError
from nodes.agent.collectors.nvml import NvmlCollector
from nodes.agent.collectors.simulated import SimulatedCollector
from nodes.agent.config import AgentConfig, ConfigError, load_config
from nodes.agent.runtimes import RuntimeFailure, gpu_sharing_env, make_runtime
from nodes.agent.runtimes.docker import DockerRuntime
from nodes.agent.runtimes.process import SubprocessRuntime
from nodes.agent.runtimes.simulated import SimulatedRuntime
from nodes.agent.types import WorkloadSpec
from tests.agent.conftest import process_options  # noqa: F401  (a fixture)
from tests.agent.test_nvml_collector import FakeGpu, fake_pynvml
from tests.docker_engine import TEST_IMAGE, docker_engine  # noqa: F401  (a fixture)

H100 = "NVIDIA H100 80GB HBM3"


def share(milli: int = 250, **fields: Any) -> WorkloadSpec:
    values: dict[str, Any] = {
        "workload_id": "w1",
        "image": TEST_IMAGE,  # local: the docker tests pull nothing
        "command": [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
        "gpu_uuids": ["GPU-aaaa"],
        "gpu_fraction_milli": milli,
        "gpu_memory_limit_mib": milli * 80 * 1024 // 1000,
        "gpu_vendor": "nvidia",
    }
    values.update(fields)
    return WorkloadSpec(**values)


# --- the environment of a share -------------------------------------------------------------------


def test_time_slicing_sets_the_memory_limit_but_no_compute_cap():
    env = gpu_sharing_env(share(250), "time-slicing")
    assert env == {
        "GPUPOOL_GPU_FRACTION_MILLI": "250",
        "GPUPOOL_GPU_SHARING": "time-slicing",
        "GPUPOOL_GPU_MEMORY_LIMIT_MIB": "20480",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M",
    }


def test_mps_caps_threads_at_the_share_and_names_the_pipes():
    env = gpu_sharing_env(share(255), "mps", "/run/mps")
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "26"  # 25.5 % rounded up
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={255 * 80 * 1024 // 1000}M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/mps"
    assert env["GPUPOOL_GPU_SHARING"] == "mps"
    assert gpu_sharing_env(share(1), "mps")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"


@pytest.mark.parametrize(
    "spec",
    [
        share(1000),  # a whole GPU
        share(142, mig_profile="1g.10gb"),  # a MIG slice is isolated by the hardware
        share(500, gpu_uuids=[]),
    ],
)
def test_whole_gpus_and_mig_slices_get_nothing(spec):
    assert gpu_sharing_env(spec, "mps") == {}


def test_amd_shares_are_time_sliced_with_the_advisory_limit_only():
    env = gpu_sharing_env(share(500, gpu_vendor="amd"), "mps")
    assert env == {
        "GPUPOOL_GPU_FRACTION_MILLI": "500",
        "GPUPOOL_GPU_SHARING": "time-slicing",
        "GPUPOOL_GPU_MEMORY_LIMIT_MIB": "40960",
    }


def test_the_sharing_mode_is_an_agent_setting(tmp_path, process_options):  # noqa: F811
    config = load_config(env={"GPUPOOL_GPU_SHARING": "mps", "GPUPOOL_MPS_PIPE_DIR": "/run/mps"})
    assert (config.gpu_sharing, config.mps_pipe_dir) == ("mps", "/run/mps")
    assert load_config(env={}).gpu_sharing == "time-slicing"
    with pytest.raises(ConfigError, match="gpu_sharing must be one of time-slicing, mps"):
        AgentConfig(portal_url="http://portal", gpu_sharing="vgpu").validate()
    runtime = make_runtime(
        "subprocess", tmp_path, gpu_sharing="mps", mps_pipe_dir="/run/mps", **process_options
    )
    assert (runtime.gpu_sharing, runtime.mps_pipe_dir) == ("mps", "/run/mps")


def docker_share(runtime: DockerRuntime, spec: WorkloadSpec, engine: Any) -> dict[str, Any]:
    """Start ``spec`` on the real engine (tests/docker_engine.py) and answer what its container was
    made with. This machine has no NVIDIA runtime: docker refuses to start a GPU container, after
    making it."""
    try:
        with pytest.raises(RuntimeFailure, match="could not select device driver"):
            runtime.start(spec)
        return engine.api.inspect_container(f"gpupool-{spec.workload_id}")
    finally:
        runtime.forget(spec.workload_id)
        runtime.close()


def test_docker_share_under_mps_reaches_the_daemon_and_cannot_override_its_limits(
    tmp_path: Path,
    docker_engine: Any,  # noqa: F811
):
    pipes = tmp_path / "mps"
    pipes.mkdir()
    runtime = DockerRuntime(tmp_path / "state", node_gpus=8, gpu_sharing="mps", mps_pipe_dir=str(pipes))
    with pytest.raises(RuntimeFailure, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set by the platform"):
        runtime.start(share(300, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}))
    info = docker_share(
        runtime, share(300, workload_id=f"w{uuid.uuid4().hex[:8]}", env={"FOO": "bar"}), docker_engine
    )
    assert info["HostConfig"]["DeviceRequests"][0]["DeviceIDs"] == ["GPU-aaaa"]
    assert info["HostConfig"]["IpcMode"] == "host"
    assert (str(pipes), str(pipes), False) in [
        (m["Source"], m["Destination"], m["RW"]) for m in info["Mounts"]
    ]
    env = dict(line.split("=", 1) for line in info["Config"]["Env"])
    assert env["FOO"] == "bar"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=24576M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipes)


def test_docker_time_slicing_and_whole_gpus_keep_their_own_ipc(
    tmp_path: Path,
    docker_engine: Any,  # noqa: F811
):
    sliced = docker_share(
        DockerRuntime(tmp_path / "a", node_gpus=8),
        share(300, workload_id=f"w{uuid.uuid4().hex[:8]}"),
        docker_engine,
    )
    whole = docker_share(
        DockerRuntime(tmp_path / "b", node_gpus=8, gpu_sharing="mps"),
        share(1000, workload_id=f"w{uuid.uuid4().hex[:8]}"),
        docker_engine,
    )
    assert sliced["HostConfig"]["IpcMode"] != "host" and whole["HostConfig"]["IpcMode"] != "host"
    env = sliced["Config"]["Env"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=24576M" in env and not any("ACTIVE_THREAD" in e for e in env)
    assert not any(e.startswith("CUDA_MPS") for e in whole["Config"]["Env"])


def test_subprocess_share_sees_its_gpu_and_limits(
    tmp_path: Path,
    process_options: dict[str, Any],  # noqa: F811
):
    runtime = SubprocessRuntime(tmp_path, gpu_sharing="mps", **process_options)
    with pytest.raises(RuntimeFailure, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT is set by the platform"):
        runtime.start(share(500, env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=999999M"}))
    runtime.start(share(500, command=["/usr/bin/env", "-0"]))  # runnable by the unprivileged user
    deadline = time.monotonic() + 30
    while not runtime.get_status("w1").terminal and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runtime.get_status("w1").exit_code == 0
    env = dict(item.split("=", 1) for item in runtime.logs("w1").split("\0") if item)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env["GPUPOOL_GPU_MEMORY_LIMIT_MIB"] == "40960"


# --- MIG slices made by the agent -----------------------------------------------------------------


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    config = AgentConfig(
        portal_url="http://127.0.0.1:9",
        allow_insecure_http=True,
        state_dir=str(tmp_path / "state"),
        collector="simulated",
        runtime="simulated",
        hostname="mig-node",
        stop_grace_s=0.1,
    )
    collector = SimulatedCollector(gpus=[{"model": H100, "count": 2}], hostname="mig-node")
    runtime = SimulatedRuntime(tmp_path / "state", cold_start_s=0)
    made = Agent(config, collector=collector, runtime=runtime)
    made.inventory = collector.discover()
    yield made
    made.buffer.close()


def run_command(agent: Agent, command_id: str, kind: str, payload: dict) -> tuple[str, dict, str]:
    agent.buffer.command_accepted(command_id, kind, payload, {})
    asyncio.run(agent._execute(command_id, kind, payload))
    record = agent.buffer.command(command_id)
    return record.state, record.result or {}, record.message


def start_payload(agent: Agent, workload_id: str, profile: str | None, gpu: int = 0, **extra: Any) -> dict:
    payload = {
        "workload_id": workload_id,
        "image": "ghcr.io/acme/infer:1",
        "gpu_uuids": [agent.inventory.gpus[gpu].uuid],
        "gpu_fraction_milli": 142,
        **extra,
    }
    if profile:
        payload["mig_profile"] = profile
    return payload


def gpu_info(agent: Agent, index: int = 0):
    return agent.collector.discover().gpus[index]


def mig_on(agent: Agent, gpu: int = 0, profiles: list[str] | None = None, command_id: str = "cm") -> dict:
    payload = {"gpu_uuid": agent.inventory.gpus[gpu].uuid, "enable": True, "profiles": profiles or []}
    state, result, message = run_command(agent, f"{command_id}{gpu}", "configure_mig", payload)
    assert state == "succeeded", message
    return result


def test_a_mig_start_needs_mig_mode_and_never_turns_it_on(agent: Agent):
    state, _, message = run_command(
        agent, "c1", "start_workload", start_payload(agent, "m1", "1g.10gb", mig_start=6)
    )
    assert state == "failed" and "MIG mode is off" in message and "staff turn it on" in message
    assert gpu_info(agent).mig_mode is False and gpu_info(agent).mig_devices == []


def test_a_mig_start_makes_its_instance_at_the_portals_start_and_stop_destroys_it(agent: Agent):
    mig_on(agent)
    parent = agent.inventory.gpus[0].uuid
    state, result, _ = run_command(
        agent, "c1", "start_workload", start_payload(agent, "m1", "1g.10gb", mig_start=6)
    )
    assert state == "succeeded"
    slice1 = result["mig_uuid"]
    assert slice1.startswith("MIG-")
    assert agent.runtime.get_status("m1").gpu_uuids == [slice1]
    assert [(d.profile, d.start) for d in gpu_info(agent).mig_devices] == [("1g.10gb", 6)]
    # A second instance joins the first at its own start without disturbing it.
    state, result, _ = run_command(
        agent, "c2", "start_workload", start_payload(agent, "m2", "3g.40gb", mig_start=0)
    )
    assert state == "succeeded"
    assert [d.uuid for d in gpu_info(agent).mig_devices] == [slice1, result["mig_uuid"]]
    sample = next(s for s in agent.collector.sample(agent.runtime.clock()) if s.gpu_uuid == parent)
    assert {p.workload_id for p in sample.processes} == {"m1", "m2"}
    assert sample.util_pct is None  # a GPU in MIG mode has no utilisation counter

    assert run_command(agent, "c3", "stop_workload", {"workload_id": "m1"})[0] == "succeeded"
    assert [d.uuid for d in gpu_info(agent).mig_devices] == [result["mig_uuid"]]
    assert (
        run_command(agent, "c4", "preempt_workload", {"workload_id": "m2", "notice_s": 0})[0] == "succeeded"
    )
    # The last instance went; MIG mode stays on (only staff change it).
    assert gpu_info(agent).mig_devices == [] and gpu_info(agent).mig_mode is True
    assert agent.mig.records() == {}


def test_the_agent_refuses_what_the_hardware_cannot_make(agent: Agent):
    mig_on(agent)
    for k, start in enumerate((0, 2, 4, 6)):
        payload = start_payload(agent, f"m{k}", "1g.20gb", mig_start=start)
        assert run_command(agent, f"c{k}", "start_workload", payload)[0] == "succeeded"
    state, _, message = run_command(agent, "c5", "start_workload", start_payload(agent, "m5", "1g.20gb"))
    assert state == "failed" and "Insufficient Resources" in message
    mig_on(agent, gpu=1)
    # 1g.20gb never starts at an odd memory slice; 3g.40gb + 3g.40gb leave no slice for a 1g.10gb.
    state, _, message = run_command(
        agent, "c6", "start_workload", start_payload(agent, "x", "1g.20gb", gpu=1, mig_start=1)
    )
    assert state == "failed" and "cannot start at memory slice 1" in message
    for k, start in enumerate((0, 4)):
        payload = start_payload(agent, f"t{k}", "3g.40gb", gpu=1, mig_start=start)
        assert run_command(agent, f"c7{k}", "start_workload", payload)[0] == "succeeded"
    state, _, message = run_command(
        agent, "c8", "start_workload", start_payload(agent, "y", "1g.10gb", gpu=1)
    )
    assert state == "failed" and "no room" in message
    assert len(gpu_info(agent, 1).mig_devices) == 2


def test_a_layout_instance_is_taken_and_kept(agent: Agent):
    result = mig_on(agent, profiles=["3g.40gb", "3g.40gb"])
    assert [(c["profile"], c["start"]) for c in result["created"]] == [("3g.40gb", 0), ("3g.40gb", 4)]
    layout = {c["start"]: c["mig_uuid"] for c in result["created"]}
    state, started, _ = run_command(
        agent, "c1", "start_workload", start_payload(agent, "m1", "3g.40gb", mig_start=4)
    )
    assert state == "succeeded" and started["mig_uuid"] == layout[4]
    # The same instance cannot go to a second workload.
    state, _, message = run_command(
        agent, "c2", "start_workload", start_payload(agent, "m2", "3g.40gb", mig_start=4)
    )
    assert state == "failed" and "is workload m1's" in message
    assert run_command(agent, "c3", "stop_workload", {"workload_id": "m1"})[0] == "succeeded"
    assert sorted(d.uuid for d in gpu_info(agent).mig_devices) == sorted(layout.values())  # kept


def test_a_repeated_start_reuses_its_slice(agent: Agent):
    mig_on(agent)
    first = run_command(agent, "c1", "start_workload", start_payload(agent, "m1", "1g.10gb", mig_start=0))[1]
    # Run again (an agent that died before it stored the command's end runs it once more).
    again = asyncio.run(agent._start_workload(start_payload(agent, "m1", "1g.10gb", mig_start=0)))
    assert again["mig_uuid"] == first["mig_uuid"]
    assert len(gpu_info(agent).mig_devices) == 1


def test_a_slice_goes_when_its_workload_exits_before_the_portal_hears_of_it(agent: Agent):
    mig_on(agent)
    payload = start_payload(agent, "m1", "2g.20gb", mig_start=0, env={"GPUPOOL_SIM_DURATION_S": "0"})
    assert run_command(agent, "c1", "start_workload", payload)[0] == "succeeded"
    seq = asyncio.run(agent.build_heartbeat(sample=False))
    body = next(
        item.body for item in agent.buffer.pending() if item.kind == "heartbeat" and item.key == str(seq)
    )
    assert [(w["workload_id"], w["state"]) for w in body["workloads"]] == [("m1", "exited")]
    assert gpu_info(agent).mig_devices == [] and gpu_info(agent).mig_mode is True


def test_a_failed_start_gives_its_slice_back(agent: Agent):
    mig_on(agent)
    payload = start_payload(
        agent, "m1", "1g.10gb", mig_start=0, env={"GPUPOOL_SIM_EXIT_CODE": "not a number"}
    )
    state, _, message = run_command(agent, "c1", "start_workload", payload)
    assert state == "failed" and "bad simulation setting" in message
    assert gpu_info(agent).mig_devices == [] and agent.mig.records() == {}


def test_configure_mig_checks_the_layout_and_the_gpu(agent: Agent):
    uuid = agent.inventory.gpus[0].uuid
    state, _, message = run_command(
        agent,
        "c1",
        "configure_mig",
        {"gpu_uuid": uuid, "enable": True, "profiles": ["3g.40gb", "3g.40gb", "1g.10gb"]},
    )
    assert state == "failed" and "does not fit one GPU" in message
    bad = {"gpu_uuid": uuid, "enable": True, "placements": [{"profile": "4g.40gb", "start": 4}]}
    state, _, message = run_command(agent, "c2", "configure_mig", bad)
    assert state == "failed" and "cannot start at memory slice 4" in message
    assert gpu_info(agent).mig_mode is False  # nothing changed
    mig_on(agent)
    assert run_command(agent, "c3", "start_workload", start_payload(agent, "m1", "4g.40gb", mig_start=0))[
        0
    ] == ("succeeded")
    # Staff cannot reconfigure MIG under a workload's instance.
    state, _, message = run_command(agent, "c4", "configure_mig", {"gpu_uuid": uuid, "enable": False})
    assert state == "failed" and "m1" in message
    assert gpu_info(agent).mig_mode is True


def test_no_slice_on_a_gpu_running_other_work(agent: Agent):
    assert run_command(agent, "c1", "start_workload", start_payload(agent, "s1", None))[0] == "succeeded"
    state, _, message = run_command(agent, "c2", "start_workload", start_payload(agent, "m1", "1g.10gb"))
    assert state == "failed" and "not on MIG slices" in message
    mig_on(agent, gpu=1)
    assert run_command(agent, "c3", "start_workload", start_payload(agent, "m2", "4g.40gb", gpu=1))[0] == (
        "succeeded"
    )
    # Nor other work on a GPU holding slices.
    state, _, message = run_command(agent, "c6", "start_workload", start_payload(agent, "s2", None, gpu=1))
    assert state == "failed" and "MIG slices of workloads m2 are on its GPU" in message


# --- NVML at the pynvml boundary ------------------------------------------------------------------


@pytest.fixture
def nvml_gpus() -> list[FakeGpu]:
    return [
        FakeGpu("GPU-aaaa", "NVIDIA A100-SXM4-80GB", b"00000000:18:00.0", mig=[1, 1]),
        FakeGpu("GPU-bbbb", "NVIDIA H100 80GB HBM3", b"00000000:2A:00.0", mig=[0, 0]),
    ]


def nvml_collector(monkeypatch, tmp_path, gpus, **kwargs) -> tuple[NvmlCollector, Any]:
    nvml = fake_pynvml(gpus, **kwargs)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return NvmlCollector(sysfs_root=tmp_path), nvml


def test_nvml_makes_instances_at_the_start_asked_and_never_touches_mig_mode(monkeypatch, tmp_path, nvml_gpus):
    collector, nvml = nvml_collector(monkeypatch, tmp_path, nvml_gpus)
    first = collector.create_mig_instance("GPU-aaaa", "3g.40gb", 4)
    assert first == {
        "gpu_uuid": "GPU-aaaa",
        "mig_uuid": "MIG-0001",
        "profile": "3g.40gb",
        "start": 4,
        "made": True,
    }
    assert [(gi.profile.name, gi.start) for gi in nvml.instances] == [("3g.40gb", 4)]
    second = collector.create_mig_instance("GPU-aaaa", "1g.10gb", 2)
    assert (second["mig_uuid"], second["start"]) == ("MIG-0002", 2)
    assert [d.uuid for d in collector.inventory.gpu("GPU-aaaa").mig_devices] == ["MIG-0001", "MIG-0002"]
    # Where the hardware cannot: the driver's error, nothing made.
    with pytest.raises(CollectorError, match="NVML_ERROR_INSUFFICIENT_RESOURCES"):
        collector.create_mig_instance("GPU-aaaa", "4g.40gb", 0)  # slices 0-3 overlap the 1g at 2
    with pytest.raises(CollectorError, match="NVML_ERROR_INVALID_ARGUMENT"):
        collector.create_mig_instance("GPU-aaaa", "1g.20gb", 1)  # not a start of 1g.20gb
    assert len(nvml.instances) == 2

    gone = collector.destroy_mig_instance("GPU-aaaa", "MIG-0001")
    assert gone == {"gpu_uuid": "GPU-aaaa", "mig_uuid": "MIG-0001", "destroyed": True}
    assert collector.destroy_mig_instance("GPU-aaaa", "MIG-0001")["destroyed"] is False  # idempotent
    collector.destroy_mig_instance("GPU-aaaa", "MIG-0002")
    assert [c for c in nvml.calls if c.startswith("destroy")] == [
        "destroy-ci:1",
        "destroy-gi:1",
        "destroy-ci:2",
        "destroy-gi:2",
    ]
    assert nvml_gpus[0].mig == [real_nvml.NVML_DEVICE_MIG_ENABLE] * 2  # still on
    # A GPU in MIG mode off is refused, and left off.
    with pytest.raises(CollectorError, match="MIG mode is off"):
        collector.create_mig_instance("GPU-bbbb", "1g.10gb", 0)
    assert nvml_gpus[1].mig == [0, 0] and nvml.instances == []
    collector.close()


def test_nvml_takes_a_layout_instance_and_refuses_unknown_profiles(monkeypatch, tmp_path, nvml_gpus):
    collector, nvml = nvml_collector(monkeypatch, tmp_path, nvml_gpus)
    made = collector.configure_mig("GPU-bbbb", True, [("4g.40gb", 0), ("3g.40gb", 4)])["created"]
    taken = collector.create_mig_instance("GPU-bbbb", "3g.40gb", 4)
    assert (taken["mig_uuid"], taken["made"]) == (made[1]["mig_uuid"], False)
    with pytest.raises(CollectorError, match=r"no MIG profile named 2g\.10gb"):
        collector.create_mig_instance("GPU-bbbb", "2g.10gb", 0)
    # MIG mode cannot change under instances: the driver says In Use; configure_mig removes them first.
    with pytest.raises(real_nvml.NVMLError) as caught:
        nvml.nvmlDeviceSetMigMode(nvml_gpus[1], 0)
    assert caught.value.value == real_nvml.NVML_ERROR_IN_USE
    collector.close()


def test_nvml_gives_back_a_gpu_instance_whose_compute_instance_fails(monkeypatch, tmp_path, nvml_gpus):
    collector, nvml = nvml_collector(monkeypatch, tmp_path, nvml_gpus, fail_compute=True)
    with pytest.raises(CollectorError, match=r"creating MIG instance 1g\.10gb failed"):
        collector.create_mig_instance("GPU-aaaa", "1g.10gb", 0)
    assert nvml.instances == [] and "destroy-gi:1" in nvml.calls
    collector.close()
