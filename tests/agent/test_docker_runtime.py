"""The docker runtime on the real Docker Engine (tests/docker_engine.py): what each container runs
with, read back with ``docker inspect``, and what its process sees.

Containers run the local busybox image on ``--network none`` or on the networks the runtime makes
for them; every container and network a test makes is removed after it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from docker.errors import NotFound

from nodes.agent.config import load_config
from nodes.agent.runtimes import RuntimeFailure, make_runtime
from nodes.agent.runtimes.docker import DockerRuntime, parse_docker_time
from nodes.agent.types import WorkloadSpec, WorkloadStatus
from tests.docker_engine import TEST_IMAGE

MIB = 1024 * 1024
NODE_GPUS = 8


@pytest.fixture
def new_id(docker_engine: docker.DockerClient) -> Iterator[Callable[[], str]]:
    """Workload ids for this test; whatever the engine holds under their names goes afterwards."""
    made: list[str] = []

    def make() -> str:
        made.append(f"t{uuid.uuid4().hex[:10]}")
        return made[-1]

    yield make
    for workload_id in made:
        name = f"gpupool-{workload_id}"
        with contextlib.suppress(NotFound):
            docker_engine.api.remove_container(name, force=True)
        with contextlib.suppress(NotFound):
            docker_engine.networks.get(name).remove()


@pytest.fixture
def runtimes(tmp_path: Path, docker_engine: docker.DockerClient) -> Iterator[Callable[..., DockerRuntime]]:
    """Docker runtimes on the test's own state directories, closed afterwards."""
    made: list[DockerRuntime] = []

    def make(name: str = "state", **options: Any) -> DockerRuntime:
        made.append(DockerRuntime(tmp_path / name, **{"node_gpus": NODE_GPUS, **options}))
        return made[-1]

    yield make
    for runtime in made:
        runtime.close()


@pytest.fixture
def runtime(runtimes: Callable[..., DockerRuntime]) -> DockerRuntime:
    return runtimes()


def spec(workload_id: str, *command: str, **fields: Any) -> WorkloadSpec:
    values: dict[str, Any] = {"image": TEST_IMAGE, "cpu_millicores": 500, "ram_mib": 64}
    values.update(fields)
    return WorkloadSpec(workload_id, command=list(command), **values)


def inspect(engine: docker.DockerClient, workload_id: str) -> dict[str, Any]:
    return engine.api.inspect_container(f"gpupool-{workload_id}")


def finished(runtime: DockerRuntime, workload_id: str, timeout: float = 10) -> WorkloadStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = runtime.get_status(workload_id)
        if status is not None and status.terminal:
            return status
        time.sleep(0.05)
    raise AssertionError(f"{workload_id} did not finish within {timeout} s")


def http_get(host: str, port: int, timeout: float = 5) -> str:
    """A plain HTTP/1.0 GET of ``/``, retried until the server listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2) as conn:
                conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
                return b"".join(iter(lambda: conn.recv(4096), b"")).decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def host_address() -> str | None:
    """An address of this host other than loopback (the one its default route leaves from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_tcp_ports_listen_on_their_own_address(
    runtimes: Callable[..., DockerRuntime], docker_engine: docker.DockerClient, new_id: Callable[[], str]
) -> None:
    runtime = runtimes(publish_address="127.0.0.1", tcp_publish_address="0.0.0.0")
    wid = new_id()
    handle = runtime.start(spec(wid, "sleep", "30", ports=[{"port": 5432, "protocol": "tcp"}, 8888]))
    assert inspect(docker_engine, wid)["HostConfig"]["PortBindings"] == {
        "5432/tcp": [{"HostIp": "0.0.0.0", "HostPort": ""}],
        "8888/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}],
    }
    assert set(handle.ports) == {"5432", "8888"}


def run_in(engine: docker.DockerClient, workload_id: str, *argv: str) -> tuple[int, str]:
    """Run ``argv`` inside the workload's container (as a second process of the workload)."""
    code, output = engine.containers.get(f"gpupool-{workload_id}").exec_run(list(argv))
    return code, output.decode()


def test_a_container_runs_hardened(
    runtime: DockerRuntime, docker_engine: docker.DockerClient, new_id: Callable[[], str], tmp_path: Path
) -> None:
    wid = new_id()
    handle = runtime.start(spec(wid, "sleep", "30"))
    info = inspect(docker_engine, wid)
    host = info["HostConfig"]

    assert host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert host["PidsLimit"] == 4096
    assert (host["NanoCpus"], host["Memory"], host["MemorySwap"]) == (500_000_000, 64 * MIB, 64 * MIB)
    # No host namespace, no network, no device.
    assert host["NetworkMode"] == "none" and list(info["NetworkSettings"]["Networks"]) == ["none"]
    assert host["IpcMode"] != "host" and host["PidMode"] == "" and host["UTSMode"] == ""
    assert host["UsernsMode"] == "" and not host["Devices"] and not host["DeviceRequests"]
    assert not host["PortBindings"] and not host["Binds"]
    # The host paths it gets are exactly the platform's: its notice directory, read-only.
    assert [(m["Type"], m["Source"], m["Destination"], m["RW"]) for m in info["Mounts"]] == [
        ("bind", str(tmp_path / "state" / "workloads" / wid), "/run/gpupool", False)
    ]
    assert "NVIDIA_VISIBLE_DEVICES=void" in info["Config"]["Env"]
    # Inside: no capability at all, no_new_privs set, the notice directory not writable.
    code, status = run_in(docker_engine, wid, "cat", "/proc/self/status")
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert code == 0 and fields["CapEff"].strip() == fields["CapBnd"].strip() == "0" * 16
    assert fields["NoNewPrivs"].strip() == "1"
    assert run_in(docker_engine, wid, "touch", "/run/gpupool/x")[0] != 0
    assert run_in(docker_engine, wid, "ip", "-o", "link")[1].split()[1] == "lo:"  # loopback only

    assert info["Config"]["Labels"]["gpupool.workload_id"] == wid
    assert handle.ref == info["Id"] and handle.ports == {}
    assert runtime.stop(wid, grace_s=0).state == "stopped"


def test_env_reaches_the_process_exactly(
    runtime: DockerRuntime, docker_engine: docker.DockerClient, new_id: Callable[[], str]
) -> None:
    env = {
        "MULTI": "line one\nFOO=injected\n\nlast ",
        "UNICODE": "héllo ✓ 日本語 \U0001f680",
        "EMPTY": "",
        "QUOTES": "'\"$HOME `id` \\n",
    }
    wid = new_id()
    runtime.start(
        spec(wid, "sh", "-c", 'printf "<%s>" "$MULTI" "$UNICODE" "$EMPTY" "$QUOTES" "$FOO"', env=env)
    )
    assert finished(runtime, wid).state == "exited"
    assert runtime.logs(wid) == "".join(f"<{v}>" for v in env.values()) + "<>"
    names = {line.split("=", 1)[0] for line in inspect(docker_engine, wid)["Config"]["Env"]}
    assert {"GPUPOOL_WORKLOAD_ID", "GPUPOOL_PREEMPT_NOTICE_FILE", *env} <= names and "FOO" not in names


def test_an_env_name_cannot_import_or_override_the_platforms(
    runtime: DockerRuntime,
    docker_engine: docker.DockerClient,
    new_id: Callable[[], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A newline in a name made a bare line of docker's env file: docker copied the agent's own value.
    monkeypatch.setenv("GPUPOOL_BOOTSTRAP_TOKEN", "gpb_agent_secret")
    for env in (
        {"A\nGPUPOOL_BOOTSTRAP_TOKEN\nB": "x"},
        {"GPUPOOL_WORKLOAD_ID": "someone-else"},
        {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=80000M"},
    ):
        wid = new_id()
        with pytest.raises(RuntimeFailure, match="env"):
            runtime.start(spec(wid, "env", env=env))
        with pytest.raises(NotFound):
            inspect(docker_engine, wid)
    assert runtime.status() == []


def test_the_image_and_command_never_become_docker_options(
    runtime: DockerRuntime, docker_engine: docker.DockerClient, new_id: Callable[[], str]
) -> None:
    before = {c.id for c in docker_engine.containers.list(all=True)}
    wid = new_id()
    attack = spec(wid, "-v", "/:/host", TEST_IMAGE, "ls", "/host", image="--privileged")
    with pytest.raises(RuntimeFailure, match="image"):
        runtime.start(attack)
    made = [c for c in docker_engine.containers.list(all=True) if c.id not in before]
    assert [c.attrs["HostConfig"]["Privileged"] for c in made] == []
    assert runtime.status() == []
    # The same command with a real image is only the container's argv (there is no program "-v").
    with pytest.raises(RuntimeFailure, match='"-v": executable file not found'):
        runtime.start(spec(wid, "-v", "/:/host"))
    info = inspect(docker_engine, wid)
    assert info["Config"]["Image"] == TEST_IMAGE and info["Path"] == "-v"
    assert info["HostConfig"]["Privileged"] is False and len(info["Mounts"]) == 1


def test_ports_get_a_network_of_their_own_and_engine_picked_host_ports(
    runtime: DockerRuntime, docker_engine: docker.DockerClient, new_id: Callable[[], str]
) -> None:
    serve = ("sh", "-c", "mkdir -p /www && echo ok > /www/index.html && exec httpd -f -p 8080 -h /www")
    first, second = new_id(), new_id()
    ports = [8080, {"port": 9000, "protocol": "tcp"}]
    handles = [runtime.start(spec(wid, *serve, ports=ports)) for wid in (first, second)]
    infos = [inspect(docker_engine, wid) for wid in (first, second)]
    for wid, handle, info in zip((first, second), handles, infos, strict=True):
        network = f"gpupool-{wid}"
        assert info["HostConfig"]["NetworkMode"] == network
        assert list(info["NetworkSettings"]["Networks"]) == [network]
        options = docker_engine.networks.get(network).attrs["Options"]
        assert options["com.docker.network.bridge.enable_icc"] == "false"
        assert set(handle.ports) == {"8080", "9000"}
        assert all(port > 0 for port in handle.ports.values())
        bound = info["HostConfig"]["PortBindings"]
        # On the configured addresses only (loopback by default), never every interface.
        assert bound == {
            "8080/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}],
            "9000/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}],
        }
    # A repeated start answers the same ports, and so does a runtime restarted on the same state.
    assert runtime.start(spec(first, *serve, ports=ports)).ports == handles[0].ports
    again = DockerRuntime(runtime.state_dir, node_gpus=NODE_GPUS)
    assert again.start(spec(first, *serve, ports=ports)).ports == handles[0].ports
    again.close()

    # Positive controls: the host reaches the first workload's server on the host port read back,
    # and so does the workload itself on its own address.
    assert http_get("127.0.0.1", handles[0].ports["8080"]).endswith("ok\n")
    # Another address of this host does not lead to it.
    other = host_address()
    if other is not None:
        with pytest.raises(OSError), socket.create_connection((other, handles[0].ports["8080"]), timeout=2):
            pass
    address = infos[0]["NetworkSettings"]["Networks"][f"gpupool-{first}"]["IPAddress"]
    fetch = ("sh", "-c", f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 1 {address} 8080")
    code, output = run_in(docker_engine, first, *fetch)
    assert code == 0 and output.endswith("ok\n"), output
    # The second workload cannot reach it: another network, kept apart by the engine.
    code, output = run_in(docker_engine, second, *fetch)
    assert code != 0 and "ok" not in output, output

    runtime.stop(first, grace_s=0)
    runtime.forget(first)
    with pytest.raises(NotFound):
        docker_engine.networks.get(f"gpupool-{first}")
    with pytest.raises(NotFound):
        inspect(docker_engine, first)


def test_start_is_idempotent(
    runtimes: Callable[..., DockerRuntime], docker_engine: docker.DockerClient, new_id: Callable[[], str]
) -> None:
    runtime = runtimes()
    wid = new_id()
    handle = runtime.start(spec(wid, "sleep", "30"))
    assert runtime.start(spec(wid, "sleep", "30")).ref == handle.ref
    # A new agent that lost its records finds the container by name.
    again = runtimes("state2")
    assert again.start(spec(wid, "sleep", "30")).ref == handle.ref
    labelled = docker_engine.containers.list(all=True, filters={"label": f"gpupool.workload_id={wid}"})
    assert [c.id for c in labelled] == [handle.ref]
    status = runtime.get_status(wid)
    assert status is not None and status.state == "running" and status.started_at is not None


def test_exit_codes_stop_oom_and_logs(
    runtime: DockerRuntime, docker_engine: docker.DockerClient, new_id: Callable[[], str]
) -> None:
    ok, bad, stopped, oom = new_id(), new_id(), new_id(), new_id()
    runtime.start(spec(ok, "sh", "-c", "echo warn >&2; for i in 1 2 3; do echo epoch $i; done"))
    runtime.start(spec(bad, "sh", "-c", "exit 3"))
    runtime.start(spec(stopped, "sleep", "30"))
    # Held in a shell variable, 64 MiB of text do not fit in 16 MiB.
    runtime.start(
        spec(oom, "sh", "-c", "x=$(head -c 67108864 /dev/zero | tr '\\0' a); echo ${#x}", ram_mib=16)
    )

    assert (finished(runtime, ok).state, finished(runtime, ok).exit_code) == ("exited", 0)
    assert sorted(runtime.logs(ok).splitlines()) == ["epoch 1", "epoch 2", "epoch 3", "warn"]
    assert runtime.logs(ok, tail=1) in ("epoch 3\n", "warn\n")  # two streams: either may be last
    status = finished(runtime, bad)
    assert (status.state, status.exit_code) == ("failed", 3)
    assert status.finished_at is not None and status.started_at is not None
    status = runtime.stop(stopped, grace_s=0)
    assert (status.state, status.exit_code) == ("stopped", 137)
    assert runtime.stop(stopped, grace_s=0).state == "stopped"  # a second stop is a no-op
    status = finished(runtime, oom)
    assert (status.state, status.message) == ("failed", "out of memory (OOMKilled)")

    docker_engine.api.remove_container(f"gpupool-{ok}", force=True)
    runtime.forget(bad)
    statuses = {s.workload_id: s for s in runtime.status()}
    assert bad not in statuses
    assert statuses[ok].state == "exited"  # finished before it vanished: remembered
    with pytest.raises(RuntimeFailure, match="no workload"):
        runtime.logs(bad)


def test_a_vanished_container_is_failed(
    runtime: DockerRuntime, docker_engine: docker.DockerClient, new_id: Callable[[], str]
) -> None:
    wid = new_id()
    runtime.start(spec(wid, "sleep", "30"))
    docker_engine.api.remove_container(f"gpupool-{wid}", force=True)
    (status,) = runtime.status()
    assert (status.state, status.message) == ("failed", "the container is gone")


def test_a_missing_image_fails_clearly_without_the_network(
    runtime: DockerRuntime, new_id: Callable[[], str]
) -> None:
    # 127.0.0.1:1 is this machine, where nothing listens: the pull fails at once.
    missing = "127.0.0.1:1/gpupool/none:1"
    with pytest.raises(
        RuntimeFailure, match=r"could not pull 127\.0\.0\.1:1/gpupool/none:1: .*127\.0\.0\.1:1"
    ):
        runtime.prewarm(missing)
    with pytest.raises(RuntimeFailure, match="image"):
        runtime.prewarm("--privileged")
    wid = new_id()
    with pytest.raises(RuntimeFailure, match="could not pull"):
        runtime.start(spec(wid, "true", image=missing))
    assert runtime.status() == []


def test_gpus_are_device_requests_and_a_failed_start_says_why(
    runtime: DockerRuntime, docker_engine: docker.DockerClient, new_id: Callable[[], str]
) -> None:
    uuids = ["GPU-6d1a0c5e-0000-4000-8000-000000000001", "MIG-5c0e6a7b-0000-4000-8000-000000000002"]
    wid = new_id()
    # No cpu_millicores or ram_mib: the node's share for 2 of its 8 GPUs.
    request = spec(wid, "true", gpu_uuids=uuids, cpu_millicores=None, ram_mib=None)
    # This machine has no NVIDIA runtime: docker itself refuses to start the container.
    with pytest.raises(RuntimeFailure, match="could not select device driver"):
        runtime.start(request)
    info = inspect(docker_engine, wid)
    (device,) = info["HostConfig"]["DeviceRequests"]
    assert (device["Driver"], device["DeviceIDs"], device["Capabilities"]) == ("", uuids, [["gpu"]])
    assert f"NVIDIA_VISIBLE_DEVICES={','.join(uuids)}" in info["Config"]["Env"]
    engine = docker_engine.info()
    assert info["HostConfig"]["NanoCpus"] == int(engine["NCPU"] * 2 / NODE_GPUS * 1e9)
    assert info["HostConfig"]["Memory"] == int(engine["MemTotal"] * 2 / NODE_GPUS)
    (status,) = runtime.status()
    assert status.state == "failed" and "could not select device driver" in status.message
    # A retry tries again (and fails the same way), it does not answer the failed container.
    first = info["Id"]
    with pytest.raises(RuntimeFailure, match="could not select device driver"):
        runtime.start(request)
    assert inspect(docker_engine, wid)["Id"] != first
    runtime.forget(wid)
    with pytest.raises(NotFound):
        inspect(docker_engine, wid)

    # A workload without GPUs names its CPU and memory, or is refused.
    with pytest.raises(RuntimeFailure, match="cpu_millicores and ram_mib"):
        runtime.start(spec(new_id(), "true", cpu_millicores=None))


def test_mps_mode_shares_host_ipc_and_the_pipe_directory_only(
    tmp_path: Path,
    runtimes: Callable[..., DockerRuntime],
    docker_engine: docker.DockerClient,
    new_id: Callable[[], str],
) -> None:
    pipes = tmp_path / "nvidia-mps"
    pipes.mkdir()
    runtime = runtimes(gpu_sharing="mps", mps_pipe_dir=str(pipes))
    wid = new_id()
    with pytest.raises(RuntimeFailure, match="could not select device driver"):
        runtime.start(
            spec(wid, "true", gpu_uuids=["GPU-1"], gpu_fraction_milli=500, gpu_memory_limit_mib=40000)
        )
    info = inspect(docker_engine, wid)
    assert info["HostConfig"]["IpcMode"] == "host"
    assert sorted((m["Source"], m["Destination"], m["RW"]) for m in info["Mounts"]) == sorted(
        [
            (str(tmp_path / "state" / "workloads" / wid), "/run/gpupool", False),
            (str(pipes), str(pipes), False),
        ]
    )
    env = info["Config"]["Env"]
    assert f"CUDA_MPS_PIPE_DIRECTORY={pipes}" in env and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in env
    assert info["HostConfig"]["NanoCpus"] == 500_000_000


def test_times_from_docker() -> None:
    assert parse_docker_time("0001-01-01T00:00:00Z") is None
    assert parse_docker_time("2026-12-02T12:00:00.123456789Z") == pytest.approx(1796212800.123456)


def test_the_agents_docker_settings_reach_the_container(
    tmp_path: Path,
    runtimes: Callable[..., DockerRuntime],
    docker_engine: docker.DockerClient,
    new_id: Callable[[], str],
    request: pytest.FixtureRequest,
) -> None:
    env = {
        "GPUPOOL_PORTAL_URL": "https://portal.example",
        "GPUPOOL_DOCKER_HOST": os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"),
        "GPUPOOL_DOCKER_PIDS_LIMIT": "64",
    }
    config = load_config(env=env).validate()
    runtime = make_runtime(config.runtime, tmp_path / "state", **config.runtime_options())
    assert isinstance(runtime, DockerRuntime)
    request.addfinalizer(runtime.close)
    wid = new_id()
    runtime.start(spec(wid, "sleep", "30"))
    assert inspect(docker_engine, wid)["HostConfig"]["PidsLimit"] == 64
    # 64 processes at most: the 65th fork fails inside the container.
    code, output = run_in(
        docker_engine, wid, "sh", "-c", "for i in $(seq 80); do sleep 2 >/dev/null 2>&1 & done"
    )
    assert "can't fork" in output or "Resource temporarily unavailable" in output, (code, output)

    nowhere = runtimes("other", docker_host="tcp://127.0.0.1:1")  # this machine; nothing listens
    with pytest.raises(RuntimeFailure, match="does not answer"):
        nowhere.start(spec(new_id(), "true"))


def test_platform_env_reaches_the_container_and_cannot_take_the_runtimes_names(
    runtime: DockerRuntime, docker_engine: docker.DockerClient, new_id: Callable[[], str]
) -> None:
    wid = new_id()
    platform = {"NODE_RANK": "1", "WORLD_SIZE": "16", "MASTER_ADDR": "10.0.0.1", "GPUPOOL_PEERS": "a,b"}
    # The tenant's own NODE_RANK is overridden by the platform's.
    runtime.start(spec(wid, "sh", "-c", 'printf "<%s>" "$NODE_RANK" "$WORLD_SIZE" "$MASTER_ADDR" "$GPUPOOL_PEERS"',
                       env={"NODE_RANK": "7"}, platform_env=platform))  # fmt: skip
    assert finished(runtime, wid).state == "exited"
    assert runtime.logs(wid) == "<1><16><10.0.0.1><a,b>"
    for bad in (
        {"GPUPOOL_WORKLOAD_ID": "someone-else"},
        {"NVIDIA_VISIBLE_DEVICES": "all"},
        {"LD_PRELOAD": "/x"},
    ):
        other = new_id()
        with pytest.raises(RuntimeFailure, match="platform_env"):
            runtime.start(spec(other, "env", platform_env=bad))
        with pytest.raises(NotFound):
            inspect(docker_engine, other)
