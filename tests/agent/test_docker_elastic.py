"""Elastic jobs on the docker runtime, on the real Docker Engine (tests/docker_engine.py): growth in
restart mode (a new container on the new GPUs, from the job's checkpoint, never reported ended),
and growth refused in signal mode, with the reason.

The GPUs are AMD ones with placeholder device files (tests/agent/test_vendor_devices.py), so the
containers really start with their devices on a machine without GPUs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from docker.errors import NotFound

from nodes.agent.collectors.amd import AmdSmiCollector
from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.runtimes.docker import DockerRuntime
from nodes.agent.types import WorkloadSpec
from nodes.agent.volumes import CHECKPOINTS_DIR, Volumes
from tests.agent.conftest import wait_for
from tests.agent.test_amd_collector import fake_amdsmi
from tests.agent.test_vendor_devices import AMD_BUS_IDS, make_dev_tree, needs_root
from tests.docker_engine import TEST_IMAGE

# A training loop's shape: say what it runs on, resume from its checkpoint when told, save it, and
# leave on SIGTERM (the restart's stop).
SCRIPT = (
    'ck="$GPUPOOL_CHECKPOINT_DIR/step"; '
    "trap 'echo term; exit 0' TERM; trap 'echo resized' USR1; "
    'echo "start world=$WORLD_SIZE local=$LOCAL_WORLD_SIZE resume=${GPUPOOL_RESUME:-0} '
    'rocr=$ROCR_VISIBLE_DEVICES flavour=$FLAVOUR"; '
    'if [ "$GPUPOOL_RESUME" = 1 ]; then echo "resumed from $(cat "$ck")"; fi; '
    'echo "dri $(ls /dev/dri | tr "\\n" " ")"; '
    'echo "step-$WORLD_SIZE" > "$ck"; '
    "while true; do sleep 0.1; done"
)


@pytest.fixture
def volumes_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gpupool-volumes-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def runtime(
    tmp_path: Path, docker_engine: docker.DockerClient, volumes_root: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[DockerRuntime]:
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi())
    collector = AmdSmiCollector(dev_root=make_dev_tree(tmp_path, AMD_BUS_IDS, kfd=True), sysfs_root=tmp_path)
    rt = DockerRuntime(tmp_path / "state", node_gpus=len(AMD_BUS_IDS))
    rt.inventory = collector.discover()  # as the agent sets it from its collector
    collector.close()
    rt.volumes = Volumes(volumes_root)
    yield rt
    for record in list(rt.store.records.values()):
        for ref in [*record.get("previous", []), record["container_id"]]:
            with contextlib.suppress(NotFound):
                docker_engine.api.remove_container(ref, force=True)
    rt.close()


def _start(rt: DockerRuntime, gpus: list[str]) -> WorkloadSpec:
    spec = WorkloadSpec(
        f"e{uuid.uuid4().hex[:10]}",
        image=TEST_IMAGE,
        command=["sh", "-c", SCRIPT],
        env={"FLAVOUR": "a b\tc"},
        gpu_uuids=gpus,
        cpu_millicores=300,
        ram_mib=48,
        volumes=[{"volume_id": "7", "mount_path": "/workspace", "size_gib": 1}],
        checkpoint={"volume_id": "7", "resume": False},
        platform_env={"WORLD_SIZE": str(len(gpus)), "LOCAL_WORLD_SIZE": str(len(gpus))},
    )
    rt.start(spec)
    wait_for(lambda: "dri " in rt.logs(spec.workload_id), what="the job to start")
    return spec


def _info(rt: DockerRuntime, gpus: list[str]) -> dict:
    return {"gpu_uuids": gpus, "gpu_count": len(gpus), "world_size": len(gpus), "local_world_size": len(gpus)}


@needs_root
def test_restart_mode_grows_a_container_onto_new_gpus_as_the_same_run(
    runtime: DockerRuntime, docker_engine: docker.DockerClient, volumes_root: Path
) -> None:
    gpus = [g.uuid for g in runtime.inventory.gpus]
    spec = _start(runtime, gpus[:1])
    wid = spec.workload_id
    before = docker_engine.api.inspect_container(runtime.container_name(wid))

    # The agent's status polls go on during the restart: none may see the workload end.
    seen: list[str] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.extend(s.state for s in runtime.status() if s.workload_id == wid)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        runtime.resize(wid, _info(runtime, gpus), restart=True, grace_s=5)
    finally:
        stop.set()
        poller.join()
    assert seen and set(seen) == {"running"}, seen

    after = docker_engine.api.inspect_container(runtime.container_name(wid))
    assert after["Id"] != before["Id"] and after["State"]["Status"] == "running"
    env = set(after["Config"]["Env"])
    assert {
        "WORLD_SIZE=3",
        "LOCAL_WORLD_SIZE=3",
        "GPUPOOL_RESUME=1",
        "ROCR_VISIBLE_DEVICES=0,1,2",
        "HIP_VISIBLE_DEVICES=0,1,2",
        "FLAVOUR=a b\tc",
        f"GPUPOOL_WORKLOAD_ID={wid}",
    } <= env
    assert sorted(d["PathInContainer"] for d in after["HostConfig"]["Devices"]) == [
        "/dev/dri/renderD128",
        "/dev/dri/renderD129",
        "/dev/dri/renderD130",
        "/dev/kfd",
    ]
    # Same mounts (the notice directory, the volume), limits and hardening, same image.
    for key in ("Mounts", "NanoCpus", "Memory", "MemorySwap", "PidsLimit", "CapDrop", "SecurityOpt"):
        assert after["HostConfig"][key] == before["HostConfig"][key], key
    assert after["HostConfig"]["Privileged"] is False and after["HostConfig"]["NetworkMode"] == "none"
    for key in ("Cmd", "Hostname", "User", "WorkingDir"):
        assert after["Config"][key] == before["Config"][key], key
    assert after["Image"] == before["Image"]

    # It resumed from the checkpoint the first run wrote, on the three GPUs.
    wait_for(lambda: "resumed from" in runtime.logs(wid), what="the restarted job to start")
    assert "resumed from step-1" in runtime.logs(wid)
    assert (volumes_root / "vol-7" / CHECKPOINTS_DIR / wid / "step").read_text() == "step-3\n"
    assert runtime.get_status(wid).state == "running"
    assert runtime.store.records[wid]["gpu_uuids"] == gpus
    assert (runtime.workload_dir(wid) / "resize").exists()

    # Log shipping reads the stopped container's last lines first, then the new one's; once the
    # stopped one has nothing left to send, it is removed.
    lines, cursor = runtime.output(wid, {}, 100)
    texts = [text for _, stream, text in lines if stream == "stdout"]
    assert texts[0].startswith("start world=1 local=1 resume=0 rocr=0 ")
    assert "term" in texts
    assert texts.index("term") < texts.index("resumed from step-1")
    assert any(t.startswith("start world=3 local=3 resume=1 rocr=0,1,2") for t in texts)
    docker_engine.api.inspect_container(before["Id"])  # kept: the poll sent its lines
    assert runtime.output(wid, cursor, 100)[0] == []
    with pytest.raises(NotFound):
        docker_engine.api.inspect_container(before["Id"])
    assert runtime.store.records[wid]["previous"] == []

    assert runtime.stop(wid, grace_s=5).state == "stopped"


@needs_root
def test_signal_mode_shrinks_but_cannot_grow_on_docker(
    runtime: DockerRuntime, docker_engine: docker.DockerClient
) -> None:
    gpus = [g.uuid for g in runtime.inventory.gpus]
    spec = _start(runtime, gpus[:2])
    wid = spec.workload_id
    first = docker_engine.api.inspect_container(runtime.container_name(wid))["Id"]
    with pytest.raises(RuntimeFailure, match='grows on docker with on_resize "restart"'):
        runtime.resize(wid, _info(runtime, gpus), restart=False, grace_s=5)
    # A shrink is a signal: the same container runs on.
    runtime.resize(wid, _info(runtime, gpus[:1]), restart=False, grace_s=5)
    current = docker_engine.api.inspect_container(runtime.container_name(wid))
    assert current["Id"] == first and current["State"]["Status"] == "running"
    assert runtime.get_status(wid).state == "running"


@needs_root
def test_a_restart_onto_a_gpu_the_node_lacks_leaves_the_job_running(
    runtime: DockerRuntime, docker_engine: docker.DockerClient
) -> None:
    gpus = [g.uuid for g in runtime.inventory.gpus]
    spec = _start(runtime, gpus[:1])
    wid = spec.workload_id
    first = docker_engine.api.inspect_container(runtime.container_name(wid))["Id"]
    with pytest.raises(RuntimeFailure, match="is not on this node"):
        runtime.resize(wid, _info(runtime, [gpus[0], "GPU-not-here"]), restart=True, grace_s=5)
    assert docker_engine.api.inspect_container(runtime.container_name(wid))["Id"] == first
    assert runtime.get_status(wid).state == "running"


def test_on_nvidia_the_new_container_asks_for_the_new_gpus_and_a_failed_start_fails_the_job(
    runtime: DockerRuntime, docker_engine: docker.DockerClient
) -> None:
    # This machine has no NVIDIA runtime: the job starts without GPUs, and the engine refuses to
    # start its new container with the device request; the request is there, and the job fails
    # with docker's reason (the portal then requeues or fails it as for any failed workload).
    runtime.inventory = None
    spec = _start(runtime, [])
    wid = spec.workload_id
    before = docker_engine.api.inspect_container(runtime.container_name(wid))
    uuids = ["GPU-6d1a0c5e-0000-4000-8000-000000000001", "GPU-6d1a0c5e-0000-4000-8000-000000000002"]
    with pytest.raises(RuntimeFailure, match=r"elastic restart failed: .*could not select device driver"):
        runtime.resize(wid, _info(runtime, uuids), restart=True, grace_s=5)
    after = docker_engine.api.inspect_container(runtime.container_name(wid))
    assert after["Id"] != before["Id"]
    (device,) = after["HostConfig"]["DeviceRequests"]
    assert (device["DeviceIDs"], device["Capabilities"]) == (uuids, [["gpu"]])
    assert {f"NVIDIA_VISIBLE_DEVICES={','.join(uuids)}", "WORLD_SIZE=2", "GPUPOOL_RESUME=1"} <= set(
        after["Config"]["Env"]
    )
    status = runtime.get_status(wid)
    assert status.state == "failed" and "elastic restart failed" in status.message
    # The first run's lines are still shipped.
    lines, _ = runtime.output(wid, {}, 100)
    assert any(text.startswith("start world=0") for _, _, text in lines)


@needs_root
def test_a_restart_keeps_the_network_and_the_published_host_ports(
    runtime: DockerRuntime, docker_engine: docker.DockerClient
) -> None:
    gpus = [g.uuid for g in runtime.inventory.gpus]
    spec = WorkloadSpec(
        f"e{uuid.uuid4().hex[:10]}",
        image=TEST_IMAGE,
        command=["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.1; done"],
        gpu_uuids=gpus[:1],
        cpu_millicores=300,
        ram_mib=48,
        ports=[8888],
    )
    try:
        handle = runtime.start(spec)
        wid = spec.workload_id
        runtime.resize(wid, _info(runtime, gpus[:2]), restart=True, grace_s=5)
        after = docker_engine.api.inspect_container(runtime.container_name(wid))
        assert after["State"]["Status"] == "running"
        assert after["HostConfig"]["NetworkMode"] == runtime.container_name(wid)
        assert after["HostConfig"]["PortBindings"] == {
            "8888/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(handle.ports["8888"])}]
        }
        assert runtime.store.records[wid]["ports"] == handle.ports
        assert runtime.start(spec).ports == handle.ports  # what the agent answers again
    finally:
        runtime.forget(spec.workload_id)
    with pytest.raises(NotFound):
        docker_engine.networks.get(runtime.container_name(spec.workload_id))
