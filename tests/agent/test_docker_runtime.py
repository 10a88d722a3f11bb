"""The docker runtime drives a fake ``docker`` executable on PATH that records its argv and keeps
container state in a JSON file, answering ``inspect`` the way docker does."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.runtimes.docker import DockerRuntime, parse_docker_time
from nodes.agent.types import WorkloadSpec

FAKE_DOCKER = r"""
import json, os, sys
home = os.environ["FAKE_DOCKER_HOME"]
calls, state_path = os.path.join(home, "calls.jsonl"), os.path.join(home, "state.json")
args = sys.argv[1:]
with open(calls, "a") as f:
    f.write(json.dumps(args) + "\n")
state = json.load(open(state_path)) if os.path.exists(state_path) else {}
def save():
    json.dump(state, open(state_path, "w"))
def find(ref):
    return next((c for c in state.values() if c["Name"] == ref or c["Id"].startswith(ref)), None)
cmd = args[0]
if cmd == "run":
    name = args[args.index("--name") + 1]
    if os.environ.get("FAKE_DOCKER_RUN_FAILS"):
        sys.stderr.write("docker: Error response from daemon: could not select device driver\n")
        sys.exit(125)
    cid = "%064x" % (len(state) + 0xABC)
    state[name] = {"Id": cid, "Name": name, "State": {"Status": "running", "ExitCode": 0, "OOMKilled": False,
                   "Error": "", "StartedAt": "2026-12-02T12:00:00.123456789Z",
                   "FinishedAt": "0001-01-01T00:00:00Z"}}
    save()
    print(cid)
elif cmd == "inspect":
    refs = [a for a in args[1:] if not a.startswith("--") and a not in ("container", "{{.Id}}")]
    found = [find(r) for r in refs]
    if "--format" in args:
        if found and found[0]:
            print(found[0]["Id"])
        else:
            sys.stderr.write("Error: No such object\n"); sys.exit(1)
    else:
        print(json.dumps([c for c in found if c]))
        if not all(found):
            sys.stderr.write("Error: No such object\n"); sys.exit(1)
elif cmd == "stop":
    c = find(args[-1])
    c["State"].update(Status="exited", ExitCode=143, FinishedAt="2026-12-02T12:05:00Z")
    save()
    print(args[-1])
elif cmd == "logs":
    print("epoch 1 loss 0.9\nepoch 2 loss 0.5")
    sys.stderr.write("warning: something\n")
elif cmd == "pull":
    if args[1].startswith("missing/"):
        sys.stderr.write("Error response from daemon: pull access denied\n"); sys.exit(1)
    print("Status: Downloaded newer image for " + args[1])
elif cmd == "rm":
    state.pop(args[-1], None); save()
else:
    sys.exit(2)
"""


@pytest.fixture
def docker_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "docker"
    bin_dir = tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    script = bin_dir / "docker"
    script.write_text(f"#!{sys.executable}\n{FAKE_DOCKER}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_HOME", str(home))
    return home


def calls(home: Path) -> list[list[str]]:
    path = home / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def set_state(home: Path, name: str, **values: object) -> None:
    state = json.loads((home / "state.json").read_text())
    state[name]["State"].update(values)
    (home / "state.json").write_text(json.dumps(state))


@pytest.fixture
def runtime(tmp_path: Path, docker_home: Path) -> DockerRuntime:
    return DockerRuntime(tmp_path / "state")


SPEC = WorkloadSpec(
    workload_id="123",
    image="nvcr.io/nvidia/pytorch:24.08-py3",
    command=["python", "train.py", "--epochs", "2"],
    env={"FOO": "bar", "HF_TOKEN": "secret"},
    gpu_uuids=["GPU-aaaa", "GPU-bbbb"],
    cpu_millicores=8000,
    ram_mib=65536,
    ports=[8888],
)


def test_start_runs_docker_with_the_workload(
    runtime: DockerRuntime, docker_home: Path, tmp_path: Path
) -> None:
    handle = runtime.start(SPEC)

    run = next(argv for argv in calls(docker_home) if argv[0] == "run")
    workdir = tmp_path / "state" / "workloads" / "123"
    assert run == [
        "run",
        "-d",
        "--name",
        "gpupool-123",
        "--label",
        "gpupool.workload_id=123",
        "--gpus",
        '"device=GPU-aaaa,GPU-bbbb"',
        "--cpus",
        "8",
        "--memory",
        "65536m",
        "--env-file",
        str(workdir / "env"),
        "-v",
        f"{workdir}:/run/gpupool:ro",
        "-p",
        "8888",
        "nvcr.io/nvidia/pytorch:24.08-py3",
        "python",
        "train.py",
        "--epochs",
        "2",
    ]
    env_file = workdir / "env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert env_file.read_text().splitlines() == [
        "FOO=bar",
        "GPUPOOL_PREEMPT_NOTICE_FILE=/run/gpupool/preempt",
        "GPUPOOL_WORKLOAD_ID=123",
        "HF_TOKEN=secret",
    ]
    assert "secret" not in json.dumps(calls(docker_home))  # secrets stay out of argv
    assert handle.ref == f"{0xABC:064x}"

    # Starting the same workload again makes no second container.
    assert runtime.start(SPEC).ref == handle.ref
    assert [argv[0] for argv in calls(docker_home)].count("run") == 1
    # Nor does a new agent that lost its records: it finds the container by name.
    again = DockerRuntime(tmp_path / "state2")
    assert again.start(SPEC).ref == handle.ref
    assert [argv[0] for argv in calls(docker_home)].count("run") == 1


def test_status_from_docker_inspect(runtime: DockerRuntime, docker_home: Path) -> None:
    runtime.start(SPEC)
    runtime.start(WorkloadSpec("456", image="busybox", command=["false"]))
    status = {s.workload_id: s for s in runtime.status()}
    assert status["123"].state == "running"
    assert status["123"].started_at == pytest.approx(parse_docker_time("2026-12-02T12:00:00.123456Z"))

    set_state(docker_home, "gpupool-456", Status="exited", ExitCode=1, FinishedAt="2026-12-02T12:01:00Z")
    set_state(docker_home, "gpupool-123", Status="exited", ExitCode=137, OOMKilled=True)
    status = {s.workload_id: s for s in runtime.status()}
    assert (status["456"].state, status["456"].exit_code) == ("failed", 1)
    assert status["456"].finished_at == parse_docker_time("2026-12-02T12:01:00Z")
    assert (status["123"].state, status["123"].message) == ("failed", "out of memory (OOMKilled)")
    inspects = [argv for argv in calls(docker_home) if argv[0] == "inspect" and "--format" not in argv]
    # Finished containers are remembered, not inspected again.
    runtime.status()
    assert len([a for a in calls(docker_home) if a[0] == "inspect" and "--format" not in a]) == len(inspects)


def test_vanished_container_is_failed(runtime: DockerRuntime, docker_home: Path) -> None:
    runtime.start(SPEC)
    (docker_home / "state.json").write_text("{}")
    (status,) = runtime.status()
    assert (status.state, status.message) == ("failed", "the container is gone")


def test_stop_logs_prewarm_forget(runtime: DockerRuntime, docker_home: Path) -> None:
    runtime.start(SPEC)
    status = runtime.stop("123", grace_s=15)
    assert ["stop", "-t", "15", "gpupool-123"] in calls(docker_home)
    assert (status.state, status.exit_code) == ("stopped", 143)
    assert runtime.stop("123", grace_s=15).state == "stopped"
    assert [a[0] for a in calls(docker_home)].count("stop") == 1

    assert runtime.logs("123", tail=50) == "epoch 1 loss 0.9\nepoch 2 loss 0.5\nwarning: something\n"
    assert ["logs", "--tail", "50", "gpupool-123"] in calls(docker_home)
    assert runtime.prewarm("busybox:1.36") == {"image": "busybox:1.36", "pulled": True}
    with pytest.raises(RuntimeFailure, match="pull access denied"):
        runtime.prewarm("missing/image")
    runtime.forget("123")
    assert ["rm", "-f", "gpupool-123"] in calls(docker_home)
    assert runtime.status() == []


def test_failures_are_clear(runtime: DockerRuntime, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(RuntimeFailure, match="needs an image"):
        runtime.start(WorkloadSpec("x"))
    monkeypatch.setenv("FAKE_DOCKER_RUN_FAILS", "1")
    with pytest.raises(RuntimeFailure, match="could not select device driver"):
        runtime.start(SPEC)
    assert runtime.status() == []
    missing = DockerRuntime(tmp_path / "other", docker_bin="no-such-docker-binary")
    with pytest.raises(RuntimeFailure, match="not on PATH"):
        missing.start(SPEC)
