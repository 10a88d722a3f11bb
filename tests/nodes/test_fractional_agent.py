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
from tests.agent.test_nvml_collector import FakeGpu, _Struct, fake_pynvml
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


def test_a_mig_start_makes_a_slice_runs_on_it_and_stop_destroys_it(agent: Agent):
    parent = agent.inventory.gpus[0].uuid
    state, result, _ = run_command(agent, "c1", "start_workload", start_payload(agent, "m1", "1g.10gb"))
    assert state == "succeeded"
    slice1 = result["mig_uuid"]
    assert slice1.startswith("MIG-")
    assert agent.runtime.get_status("m1").gpu_uuids == [slice1]
    assert agent.inventory.gpu(parent).mig_mode is True  # the agent's inventory follows
    # A second slice joins the first on the same GPU without disturbing it.
    state, result, _ = run_command(agent, "c2", "start_workload", start_payload(agent, "m2", "3g.40gb"))
    assert state == "succeeded"
    assert [d.uuid for d in gpu_info(agent).mig_devices] == [slice1, result["mig_uuid"]]
    # Its telemetry lands on the slice's GPU.
    sample = next(s for s in agent.collector.sample(agent.runtime.clock()) if s.gpu_uuid == parent)
    assert {p.workload_id for p in sample.processes} == {"m1", "m2"}
    assert sample.util_pct is None  # a GPU in MIG mode has no utilisation counter

    assert run_command(agent, "c3", "stop_workload", {"workload_id": "m1"})[0] == "succeeded"
    assert [d.uuid for d in gpu_info(agent).mig_devices] == [result["mig_uuid"]]
    assert gpu_info(agent).mig_mode is True
    assert (
        run_command(agent, "c4", "preempt_workload", {"workload_id": "m2", "notice_s": 0})[0] == "succeeded"
    )
    assert gpu_info(agent).mig_devices == [] and gpu_info(agent).mig_mode is False
    assert agent.mig.records() == {}


def test_a_repeated_start_reuses_its_slice(agent: Agent):
    first = run_command(agent, "c1", "start_workload", start_payload(agent, "m1", "1g.10gb"))[1]
    # Run again (an agent that died before it stored the command's end runs it once more).
    again = asyncio.run(agent._start_workload(start_payload(agent, "m1", "1g.10gb")))
    assert again["mig_uuid"] == first["mig_uuid"]
    assert len(gpu_info(agent).mig_devices) == 1


def test_a_slice_goes_when_its_workload_exits_before_the_portal_hears_of_it(agent: Agent):
    payload = start_payload(agent, "m1", "2g.20gb", env={"GPUPOOL_SIM_DURATION_S": "0"})
    assert run_command(agent, "c1", "start_workload", payload)[0] == "succeeded"
    seq = asyncio.run(agent.build_heartbeat(sample=False))
    body = next(
        item.body for item in agent.buffer.pending() if item.kind == "heartbeat" and item.key == str(seq)
    )
    assert [(w["workload_id"], w["state"]) for w in body["workloads"]] == [("m1", "exited")]
    assert gpu_info(agent).mig_devices == [] and gpu_info(agent).mig_mode is False


def test_a_failed_start_gives_its_slice_back(agent: Agent):
    payload = start_payload(agent, "m1", "1g.10gb", env={"GPUPOOL_SIM_EXIT_CODE": "not a number"})
    state, _, message = run_command(agent, "c1", "start_workload", payload)
    assert state == "failed" and "bad simulation setting" in message
    assert gpu_info(agent).mig_devices == [] and agent.mig.records() == {}


def test_no_slice_on_a_gpu_running_other_work_nor_past_seven_slices(agent: Agent):
    assert run_command(agent, "c1", "start_workload", start_payload(agent, "s1", None))[0] == "succeeded"
    state, _, message = run_command(agent, "c2", "start_workload", start_payload(agent, "m1", "1g.10gb"))
    assert state == "failed" and "not on MIG slices" in message
    assert run_command(agent, "c3", "start_workload", start_payload(agent, "m2", "4g.40gb", gpu=1))[0] == (
        "succeeded"
    )
    state, _, message = run_command(
        agent, "c4", "start_workload", start_payload(agent, "m3", "4g.40gb", gpu=1)
    )
    assert state == "failed" and "4 of 7 slices in use" in message
    assert len(gpu_info(agent, 1).mig_devices) == 1
    # Nor other work on a GPU holding slices.
    state, _, message = run_command(agent, "c6", "start_workload", start_payload(agent, "s2", None, gpu=1))
    assert state == "failed" and "MIG slices of workloads m2 are on its GPU" in message
    # Staff cannot reconfigure MIG under a workload's slice.
    state, _, message = run_command(
        agent, "c5", "configure_mig", {"gpu_uuid": agent.inventory.gpus[1].uuid, "enable": False}
    )
    assert state == "failed" and "m2" in message


# --- NVML at the pynvml boundary ------------------------------------------------------------------


def nvml_with_instances(gpus: list[FakeGpu], fail_compute: bool = False):
    """The fake of the NVML collector tests, with GPU and compute instances that have ids, MIG
    devices that say which instances they are, and destroy calls."""
    nvml = fake_pynvml(gpus)
    serial = iter(range(1, 100))

    def create_gi(h: FakeGpu, profile_id: int) -> _Struct:
        gi = _Struct(parent=h, id=next(serial), profile_id=profile_id, cis=[])
        nvml.instances.append(gi)
        return gi

    def create_ci(gi: _Struct, profile_id: int) -> _Struct:
        if fail_compute:
            raise real_nvml.NVMLError(real_nvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci = _Struct(gi=gi, id=0)
        gi.cis.append(ci)
        device = FakeGpu(f"MIG-{gi.id:04d}", f"{gi.parent.name} MIG 1g.10gb", b"", total=9856 * 1024**2)
        device.gi_id, device.ci_id = gi.id, ci.id
        gi.parent.mig_devices.append(device)
        return ci

    def destroy_ci(ci: _Struct) -> None:
        nvml.calls.append(f"destroy-ci:{ci.gi.id}")
        ci.gi.cis.remove(ci)
        ci.gi.parent.mig_devices[:] = [d for d in ci.gi.parent.mig_devices if d.gi_id != ci.gi.id]

    def destroy_gi(gi: _Struct) -> None:
        nvml.calls.append(f"destroy-gi:{gi.id}")
        assert not gi.cis, "a GPU instance goes after its compute instances"
        nvml.instances.remove(gi)

    nvml.nvmlDeviceCreateGpuInstance = create_gi
    nvml.nvmlGpuInstanceCreateComputeInstance = create_ci
    nvml.nvmlGpuInstanceGetInfo = lambda gi: _Struct(id=gi.id, profileId=gi.profile_id)
    nvml.nvmlComputeInstanceGetInfo = lambda ci: _Struct(id=ci.id)
    nvml.nvmlDeviceGetGpuInstanceId = lambda mig: mig.gi_id
    nvml.nvmlDeviceGetComputeInstanceId = lambda mig: mig.ci_id
    nvml.nvmlDeviceGetGpuInstanceById = lambda h, gi_id: next(
        gi for gi in nvml.instances if gi.parent is h and gi.id == gi_id
    )
    nvml.nvmlGpuInstanceGetComputeInstanceById = lambda gi, ci_id: next(ci for ci in gi.cis if ci.id == ci_id)
    nvml.nvmlComputeInstanceDestroy = destroy_ci
    nvml.nvmlGpuInstanceDestroy = destroy_gi
    return nvml


@pytest.fixture
def nvml_gpus() -> list[FakeGpu]:
    return [
        FakeGpu("GPU-aaaa", "NVIDIA A100-SXM4-80GB", b"00000000:18:00.0", mig=[0, 0]),
        FakeGpu("GPU-bbbb", "NVIDIA L4", b"00000000:2A:00.0"),  # no MIG
    ]


def nvml_collector(monkeypatch, tmp_path, gpus, **kwargs) -> tuple[NvmlCollector, Any]:
    nvml = nvml_with_instances(gpus, **kwargs)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return NvmlCollector(sysfs_root=tmp_path), nvml


def test_nvml_makes_slices_beside_others_and_turns_mig_off_after_the_last(monkeypatch, tmp_path, nvml_gpus):
    collector, nvml = nvml_collector(monkeypatch, tmp_path, nvml_gpus)
    first = collector.create_mig_instance("GPU-aaaa", "1g.10gb")
    assert first == {
        "gpu_uuid": "GPU-aaaa",
        "mig_uuid": "MIG-0001",
        "profile": "1g.10gb",
        "mig_mode_enabled": True,
    }
    assert nvml_gpus[0].mig == [real_nvml.NVML_DEVICE_MIG_ENABLE] * 2
    second = collector.create_mig_instance("GPU-aaaa", "1g.10gb")
    assert (second["mig_uuid"], second["mig_mode_enabled"]) == ("MIG-0002", False)
    assert [d.uuid for d in collector.inventory.gpu("GPU-aaaa").mig_devices] == ["MIG-0001", "MIG-0002"]

    gone = collector.destroy_mig_instance("GPU-aaaa", "MIG-0001")
    assert gone == {"gpu_uuid": "GPU-aaaa", "mig_uuid": "MIG-0001", "destroyed": True, "mig_mode": True}
    assert [d.uuid for d in nvml_gpus[0].mig_devices] == ["MIG-0002"]
    assert collector.destroy_mig_instance("GPU-aaaa", "MIG-0001")["destroyed"] is False  # idempotent
    assert collector.destroy_mig_instance("GPU-aaaa", "MIG-0002")["mig_mode"] is False
    assert nvml_gpus[0].mig == [real_nvml.NVML_DEVICE_MIG_DISABLE] * 2
    assert [c for c in nvml.calls if c.startswith("destroy")] == [
        "destroy-ci:1",
        "destroy-gi:1",
        "destroy-ci:2",
        "destroy-gi:2",
    ]
    assert collector.inventory.gpu("GPU-aaaa").mig_mode is False
    collector.close()


def test_nvml_refuses_what_it_cannot_do(monkeypatch, tmp_path, nvml_gpus):
    collector, nvml = nvml_collector(monkeypatch, tmp_path, nvml_gpus)
    with pytest.raises(CollectorError, match="cannot be turned on"):
        collector.create_mig_instance("GPU-bbbb", "1g.10gb")
    with pytest.raises(CollectorError, match="no GPU GPU-cccc"):
        collector.create_mig_instance("GPU-cccc", "1g.10gb")
    with pytest.raises(CollectorError, match=r"no MIG profile named 2g\.20gb"):
        collector.create_mig_instance("GPU-aaaa", "2g.20gb")
    # MIG mode that needs a GPU reset is reported, nothing is made.
    nvml.nvmlDeviceSetMigMode = lambda h, mode: h.mig.__setitem__(1, mode)
    nvml_gpus[0].mig = [0, 0]
    with pytest.raises(CollectorError, match="needs a GPU reset"):
        collector.create_mig_instance("GPU-aaaa", "1g.10gb")
    assert nvml.instances == []
    collector.close()


def test_nvml_gives_back_a_gpu_instance_whose_compute_instance_fails(monkeypatch, tmp_path, nvml_gpus):
    collector, nvml = nvml_collector(monkeypatch, tmp_path, nvml_gpus, fail_compute=True)
    with pytest.raises(CollectorError, match=r"creating MIG instance 1g\.10gb failed"):
        collector.create_mig_instance("GPU-aaaa", "1g.10gb")
    assert nvml.instances == [] and "destroy-gi:1" in nvml.calls
    collector.close()
