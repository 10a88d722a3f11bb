"""Volumes on a node with the real runtimes: the docker runtime on the real engine (busybox) and the
subprocess runtime with real processes. A file one workload writes is there for the next; a volume
over its size is refused; a payload cannot reach a host path; deleting removes the data."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from docker.errors import NotFound

from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.runtimes.docker import DockerRuntime
from nodes.agent.runtimes.process import SubprocessRuntime
from nodes.agent.types import WorkloadSpec
from nodes.agent.volumes import CHECKPOINTS_DIR, GIB, Volumes, measure
from nodes.agent.workload_rules import WorkloadRuleError
from tests.agent.conftest import wait_for
from tests.docker_engine import TEST_IMAGE


@pytest.fixture
def volumes_root() -> Iterator[Path]:
    """The region's shared filesystem, as every node mounts it: outside pytest's 0700 tree, so the
    subprocess runtime's unprivileged user can reach its own volume."""
    root = Path(tempfile.mkdtemp(prefix="gpupool-volumes-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def docker_runtime(tmp_path: Path, docker_engine: docker.DockerClient, volumes_root: Path):
    runtime = DockerRuntime(tmp_path / "docker-state", node_gpus=8)
    runtime.volumes = Volumes(volumes_root)
    made: list[str] = []
    yield runtime, made
    for wid in made:
        with contextlib.suppress(NotFound):
            docker_engine.api.remove_container(f"gpupool-{wid}", force=True)
    runtime.close()


@pytest.fixture
def process_runtime(tmp_path: Path, process_options: dict[str, Any], volumes_root: Path):
    runtime = SubprocessRuntime(tmp_path / "process-state", **process_options)
    runtime.volumes = Volumes(volumes_root)
    yield runtime
    for status in runtime.status():
        if not status.terminal:
            runtime.stop(status.workload_id, grace_s=0.5)


def ended(runtime, workload_id: str):
    return wait_for(
        lambda: (s := runtime.get_status(workload_id)) is not None and s.terminal and s,
        timeout=20,
        what=f"{workload_id} to end",
    )


def vol(volume_id: str = "7", mount_path: str = "/workspace", size_gib: int = 1) -> dict[str, Any]:
    return {"volume_id": volume_id, "mount_path": mount_path, "size_gib": size_gib}


def docker_spec(made: list[str], script: str, **fields: Any) -> WorkloadSpec:
    wid = f"v{uuid.uuid4().hex[:10]}"
    made.append(wid)
    values: dict[str, Any] = {"image": TEST_IMAGE, "cpu_millicores": 500, "ram_mib": 64}
    values.update(fields)
    return WorkloadSpec(wid, command=["sh", "-c", script], **values)


def process_spec(script: str, **fields: Any) -> WorkloadSpec:
    return WorkloadSpec(f"p{uuid.uuid4().hex[:10]}", command=["/bin/sh", "-c", script], **fields)


def test_docker_a_file_written_by_one_workload_is_there_for_the_next(docker_runtime, volumes_root):
    runtime, made = docker_runtime
    first = docker_spec(made, "echo hello from the first > /workspace/note.txt", volumes=[vol()])
    runtime.start(first)
    assert ended(runtime, first.workload_id).exit_code == 0
    assert (volumes_root / "vol-7" / "note.txt").read_text() == "hello from the first\n"
    second = docker_spec(made, "cat /workspace/note.txt; mount | grep ' /workspace '", volumes=[vol()])
    runtime.start(second)
    assert ended(runtime, second.workload_id).exit_code == 0
    output = runtime.logs(second.workload_id)
    assert "hello from the first" in output
    assert "(rw" in output.split(" /workspace ")[1]  # mounted read-write


def test_docker_checkpoint_env_and_resume(docker_runtime, volumes_root):
    runtime, made = docker_runtime
    script = (
        'echo "dir=$GPUPOOL_CHECKPOINT_DIR resume=${GPUPOOL_RESUME:-0}"; echo x > "$GPUPOOL_CHECKPOINT_DIR/c"'
    )
    spec = docker_spec(made, script, volumes=[vol()], checkpoint={"volume_id": "7", "resume": True})
    runtime.start(spec)
    assert ended(runtime, spec.workload_id).exit_code == 0
    inside = f"/workspace/{CHECKPOINTS_DIR}/{spec.workload_id}"
    assert f"dir={inside} resume=1" in runtime.logs(spec.workload_id)
    assert (volumes_root / "vol-7" / CHECKPOINTS_DIR / spec.workload_id / "c").read_text() == "x\n"
    fresh = docker_spec(made, script, volumes=[vol()], checkpoint={"volume_id": "7", "resume": False})
    runtime.start(fresh)
    assert ended(runtime, fresh.workload_id).exit_code == 0
    assert "resume=0" in runtime.logs(fresh.workload_id)


def test_docker_preemption_gives_notice_then_sigterm_and_time_to_write(docker_runtime, volumes_root):
    """The notice file appears inside the container, then SIGTERM comes, and the grace period
    lets the job write its checkpoint before it is killed."""
    runtime, made = docker_runtime
    script = (
        'd="$GPUPOOL_CHECKPOINT_DIR"; '
        "trap 'sleep 1; echo saved > \"$d/state\"; exit 143' TERM; "
        'while [ ! -e "$GPUPOOL_PREEMPT_NOTICE_FILE" ]; do sleep 0.05; done; '
        'echo noticed > "$d/notice"; '
        "while true; do sleep 0.1; done"
    )
    spec = docker_spec(made, script, volumes=[vol()], checkpoint={"volume_id": "7", "resume": False})
    runtime.start(spec)
    wait_for(lambda: runtime.get_status(spec.workload_id).state == "running", what="the container to run")
    status = runtime.preempt(spec.workload_id, notice_s=1.0, grace_s=10)
    assert status.state == "preempted" and status.exit_code == 143
    where = volumes_root / "vol-7" / CHECKPOINTS_DIR / spec.workload_id
    assert (where / "notice").read_text() == "noticed\n"
    assert (where / "state").read_text() == "saved\n"  # written in the grace period, after SIGTERM


def test_docker_refuses_a_volume_over_its_size(docker_runtime, volumes_root, docker_engine):
    runtime, made = docker_runtime
    (volumes_root / "vol-7").mkdir()
    with open(volumes_root / "vol-7" / "big", "wb") as handle:
        handle.truncate(GIB + 1)  # a sparse file: its apparent size counts
    spec = docker_spec(made, "true", volumes=[vol(size_gib=1)])
    with pytest.raises(RuntimeFailure, match="over its size of 1 GiB"):
        runtime.start(spec)
    with pytest.raises(NotFound):
        docker_engine.containers.get(f"gpupool-{spec.workload_id}")
    bigger = docker_spec(made, "true", volumes=[vol(size_gib=2)])
    runtime.start(bigger)
    assert ended(runtime, bigger.workload_id).exit_code == 0


def test_process_a_file_written_by_one_workload_is_there_for_the_next(process_runtime, volumes_root):
    first = process_spec("echo hello > workspace/note.txt", volumes=[vol()])
    process_runtime.start(first)
    assert ended(process_runtime, first.workload_id).exit_code == 0
    note = volumes_root / "vol-7" / "note.txt"
    assert note.read_text() == "hello\n"
    if os.geteuid() == 0:  # the workload's user owns its volume, not root
        assert (volumes_root / "vol-7").stat().st_uid == process_runtime.user.uid
    second = process_spec(
        'cat "$HOME/workspace/note.txt"; echo "ckpt=$GPUPOOL_CHECKPOINT_DIR"', volumes=[vol()]
    )
    process_runtime.start(second)
    assert ended(process_runtime, second.workload_id).exit_code == 0
    assert process_runtime.logs(second.workload_id).startswith("hello\nckpt=\n")


def test_process_checkpoint_dir_is_the_same_for_every_placement(process_runtime, volumes_root):
    script = 'echo "$GPUPOOL_CHECKPOINT_DIR ${GPUPOOL_RESUME:-0}"; echo 1 >> "$GPUPOOL_CHECKPOINT_DIR/n"'
    spec = process_spec(
        script, volumes=[vol(mount_path="/data/ckpt")], checkpoint={"volume_id": "7", "resume": False}
    )
    process_runtime.start(spec)
    assert ended(process_runtime, spec.workload_id).exit_code == 0
    where = volumes_root / "vol-7" / CHECKPOINTS_DIR / spec.workload_id
    assert process_runtime.logs(spec.workload_id) == f"{where} 0\n"
    assert (process_runtime.work_dir / spec.workload_id / "home" / "data_ckpt").resolve() == (
        volumes_root / "vol-7"
    )
    # The same workload on another node of the region (another runtime, the same shared root).
    other = SubprocessRuntime(process_runtime.state_dir.parent / "other", **_options(process_runtime))
    other.volumes = Volumes(volumes_root)
    again = WorkloadSpec(
        spec.workload_id,
        command=spec.command,
        volumes=spec.volumes,
        checkpoint={"volume_id": "7", "resume": True},
    )
    other.start(again)
    assert ended(other, spec.workload_id).exit_code == 0
    assert other.logs(spec.workload_id) == f"{where} 1\n"
    assert (where / "n").read_text() == "1\n1\n"


def _options(runtime: SubprocessRuntime) -> dict[str, Any]:
    return {
        "single_tenant": True,
        "process_user": runtime.process_user,
        "process_work_dir": str(runtime.work_dir.parent / "other-work"),
    }


def test_process_refuses_a_volume_over_its_size(process_runtime, volumes_root):
    (volumes_root / "vol-9").mkdir()
    with open(volumes_root / "vol-9" / "big", "wb") as handle:
        handle.truncate(3 * GIB)
    spec = process_spec("true", volumes=[vol("9", size_gib=2)])
    with pytest.raises(RuntimeFailure, match=r"volume 9 holds 3\.00 GiB, over its size of 2 GiB"):
        process_runtime.start(spec)
    assert process_runtime.get_status(spec.workload_id) is None


@pytest.mark.parametrize(
    ("volumes", "checkpoint"),
    [
        ([vol("../../etc")], None),
        ([vol("7/../../etc")], None),
        ([vol("0")], None),
        ([{**vol(), "mount_path": "/etc"}], None),
        ([{**vol(), "mount_path": "/proc/1"}], None),
        ([{**vol(), "mount_path": "/a/../run"}], None),
        ([{**vol(), "mount_path": "/"}], None),
        ([{**vol(), "size_gib": 0}], None),
        ([vol("7"), vol("8")], None),  # one path twice
        ([vol("7"), vol("7", "/other")], None),
        ([vol("7")], {"volume_id": "8", "resume": True}),  # checkpoints on a volume it lacks
        ([vol("7")], {"volume_id": "7", "resume": "yes"}),
        ("/etc", None),
    ],
)
def test_a_forged_payload_never_reaches_a_host_path(volumes, checkpoint):
    payload = {"workload_id": "w1", "image": TEST_IMAGE, "volumes": volumes}
    if checkpoint is not None:
        payload["checkpoint"] = checkpoint
    with pytest.raises(WorkloadRuleError):
        WorkloadSpec.from_payload(payload)


def test_links_a_workload_left_in_its_volume_are_never_followed(process_runtime, volumes_root, tmp_path):
    target = Path(tempfile.mkdtemp(prefix="gpupool-target-"))
    try:
        os.makedirs(volumes_root / "vol-7")
        os.symlink(target, volumes_root / "vol-7" / CHECKPOINTS_DIR)  # as a workload could leave it
        spec = process_spec("true", volumes=[vol()], checkpoint={"volume_id": "7", "resume": False})
        with pytest.raises(RuntimeFailure, match=CHECKPOINTS_DIR):
            process_runtime.start(spec)
        assert list(target.iterdir()) == []  # nothing made, nothing chowned there
        # Its use does not count what a link points at.
        (target / "f").write_bytes(b"x" * 1000)
        assert measure(volumes_root / "vol-7") == 0
        # Deleting the volume removes the link, not what it points at.
        assert Volumes(volumes_root).delete("7") == {"volume_id": "7", "deleted": True}
        assert not (volumes_root / "vol-7").exists() and (target / "f").exists()
    finally:
        shutil.rmtree(target, ignore_errors=True)


def test_a_node_without_a_volumes_root_attaches_nothing(tmp_path, process_options):
    runtime = SubprocessRuntime(tmp_path / "state", **process_options)  # Volumes("") by default
    with pytest.raises(RuntimeFailure, match="no volumes_root"):
        runtime.start(process_spec("true", volumes=[vol()]))


def test_usage_reports(volumes_root):
    volumes = Volumes(volumes_root)
    spec = WorkloadSpec("w1", volumes=[vol()])
    volumes.prepare(spec)
    (volumes_root / "vol-7" / "a").write_bytes(b"x" * 5000)
    (first,) = volumes.report(active={"w1"})  # the start's measurement, taken before the write
    assert (first["volume_id"], first["used_bytes"]) == ("7", 0)
    assert volumes.report(active={"w1"}) == []  # measured less than MEASURE_INTERVAL_S ago
    (last,) = volumes.report(active=set())  # it ended: measured once more
    assert last["used_bytes"] == 5000
    assert volumes.report(active=set()) == []


def test_the_agent_attaches_measures_and_deletes_a_volume(
    portal, make_config, run_agent, process_options, volumes_root
):
    """Through the agent loop (a fake portal over real HTTP): a start with a volume writes to it,
    the heartbeats carry its measured use, a forged mount path is rejected, a volume over its size
    fails the start with the reason, and ``delete_volume`` removes its directory."""
    from nodes.agent.agent import Agent

    agent = Agent(make_config(runtime="subprocess", volumes_root=str(volumes_root), **process_options))
    thread = run_agent(agent)
    wait_for(lambda: portal.seqs(1), what="registration")
    uuid = portal.nodes[1]["register"]["gpus"][0]["uuid"]

    def start(cid: str, wid: str, script: str, volumes: list[dict[str, Any]]) -> None:
        payload = {
            "workload_id": wid,
            "image": "x",
            "gpu_uuids": [uuid],
            "command": ["/bin/sh", "-c", script],
        }
        portal.queue_command(
            1, {"id": cid, "kind": "start_workload", "payload": {**payload, "volumes": volumes}}
        )

    start("c1", "51", "head -c 3000 /dev/zero > workspace/blob", [vol("5")])
    wait_for(lambda: "succeeded" in portal.reports_for("c1"), what="the start")
    wait_for(
        lambda: (
            (volumes_root / "vol-5" / "blob").exists()
            and (volumes_root / "vol-5" / "blob").stat().st_size == 3000
        ),
        what="the write",
    )

    def measured(size: int) -> bool:
        return any(
            v == {"volume_id": "5", "used_bytes": size, "measured_at": v["measured_at"]}
            for body in portal.heartbeats[1].values()
            for v in body.get("volumes", [])
        )

    wait_for(lambda: measured(3000), timeout=15, what="the use in a heartbeat once the workload ended")

    start("c2", "52", "true", [vol("5", mount_path="/etc")])
    with open(volumes_root / "vol-5" / "big", "wb") as handle:
        handle.truncate(GIB)
    start("c3", "53", "true", [vol("5", size_gib=1)])
    wait_for(
        lambda: "failed" in portal.reports_for("c2") and "failed" in portal.reports_for("c3"), what="refusals"
    )
    results = {cid: result for cid, status, result, _ in portal.reports if status == "failed"}
    assert results["c2"]["rejected"] is True and results["c2"]["reason"].startswith(
        "volumes: Must not be at or under /etc"
    )
    assert results["c3"]["rejected"] is False and "over its size of 1 GiB" in results["c3"]["reason"]

    portal.queue_command(1, {"id": "c4", "kind": "delete_volume", "payload": {"volume_id": "5"}})
    wait_for(lambda: "succeeded" in portal.reports_for("c4"), what="the deletion")
    assert not (volumes_root / "vol-5").exists()
    thread.stop()
    assert thread.error is None


def test_the_agent_with_docker_gives_the_next_workload_what_the_last_wrote(
    portal, make_config, run_agent, volumes_root, docker_engine
):
    """The agent loop with the docker runtime (busybox on the real engine): the second workload
    finds the first one's file on the volume, as its exit code in the heartbeats shows."""
    from nodes.agent.agent import Agent

    agent = Agent(make_config(runtime="docker", volumes_root=str(volumes_root)))
    thread = run_agent(agent)
    wait_for(lambda: portal.seqs(1), what="registration")
    made: list[str] = []

    def start(cid: str, script: str) -> str:
        wid = f"a{uuid.uuid4().hex[:10]}"
        made.append(wid)
        payload = {
            "workload_id": wid,
            "image": TEST_IMAGE,
            "command": ["sh", "-c", script],
            "gpu_uuids": [],
            "cpu_millicores": 500,
            "ram_mib": 64,
            "volumes": [vol("3")],
        }
        portal.queue_command(1, {"id": cid, "kind": "start_workload", "payload": payload})
        return wid

    def exit_code(wid: str) -> int | None:
        for seq in sorted(portal.seqs(1), reverse=True):
            for w in portal.heartbeats[1][seq]["workloads"]:
                if w["workload_id"] == wid and w["state"] in ("exited", "failed"):
                    return w["exit_code"]
        return None

    try:
        first = start("d1", "echo from-the-first > /workspace/note")
        wait_for(lambda: exit_code(first) == 0, timeout=30, what="the first workload to end")
        second = start("d2", "grep -q from-the-first /workspace/note")
        wait_for(lambda: exit_code(second) is not None, timeout=30, what="the second workload to end")
        assert exit_code(second) == 0
        control = start("d3", "grep -q never-written /workspace/note")  # the check can fail
        wait_for(lambda: exit_code(control) is not None, timeout=30, what="the control to end")
        assert exit_code(control) == 1
    finally:
        thread.stop()
        for wid in made:
            with contextlib.suppress(NotFound):
                docker_engine.api.remove_container(f"gpupool-{wid}", force=True)
    assert thread.error is None


def test_volumes_are_idle_until_a_workload_uses_one_or_a_measurement_waits(volumes_root):
    """``idle``: the heartbeat skips measuring (a thread hop) only when nothing can be reported."""
    volumes = Volumes(volumes_root)
    assert volumes.idle and volumes.report(set()) == []
    volumes.note("vol-1", 1024)
    assert not volumes.idle
    assert [r["volume_id"] for r in volumes.report(set())] == ["vol-1"]
    assert volumes.idle
    volumes.using["w-1"] = ["vol-1"]
    assert not volumes.idle
