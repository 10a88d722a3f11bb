"""The subprocess runtime with real processes: only on a single-tenant node, never as root, argv and
environment exactly as given."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from nodes.agent.agent import Agent
from nodes.agent.config import AgentConfig, ConfigError
from nodes.agent.runtimes import RuntimeFailure, make_runtime
from nodes.agent.runtimes.process import SubprocessRuntime
from nodes.agent.types import WorkloadSpec
from tests.agent.conftest import wait_for

SH = "/bin/sh"


@pytest.fixture
def runtime(tmp_path: Path, process_options: dict[str, Any]) -> SubprocessRuntime:
    runtime = SubprocessRuntime(tmp_path / "state", **process_options)
    yield runtime
    for status in runtime.status():
        if not status.terminal:
            runtime.stop(status.workload_id, grace_s=0.5)


def sh(script: str) -> list[str]:
    return [SH, "-c", script]


def done(runtime: SubprocessRuntime, workload_id: str):
    return wait_for(
        lambda: (s := runtime.get_status(workload_id)) is not None and s.terminal and s,
        what=f"{workload_id} to end",
    )


def home(runtime: SubprocessRuntime, workload_id: str) -> Path:
    return runtime.work_dir / workload_id / "home"


def test_refused_unless_the_node_is_single_tenant(tmp_path: Path, process_options: dict[str, Any]) -> None:
    # At start-up: the runtime, the agent's settings, the agent itself.
    options = {**process_options, "single_tenant": False}
    with pytest.raises(RuntimeFailure, match="single-tenant"):
        SubprocessRuntime(tmp_path / "state", **options)
    with pytest.raises(RuntimeFailure, match="single-tenant"):
        make_runtime("subprocess", tmp_path / "state")
    config = AgentConfig(portal_url="https://portal", runtime="subprocess", state_dir=str(tmp_path / "a"))
    with pytest.raises(ConfigError, match="GPUPOOL_SINGLE_TENANT=1"):
        Agent(config)
    # At each start: a runtime whose setting is taken back starts nothing.
    runtime = SubprocessRuntime(tmp_path / "state", **process_options)
    runtime.single_tenant = False
    with pytest.raises(RuntimeFailure, match="single-tenant"):
        runtime.start(WorkloadSpec("w1", command=sh("true")))
    assert runtime.status() == []


def test_workloads_never_run_as_root(tmp_path: Path, process_options: dict[str, Any]) -> None:
    """Root, a user that does not exist, and (for an agent running as root, as the suite does
    here) no user at all are refused; an agent of another user runs workloads as itself."""
    root = os.geteuid() == 0
    cases = [("root", "is root"), ("no-such-user-x", "no user"), ("", "set process_user" if root else None)]
    for user, reason in cases:
        options = {**process_options, "process_user": user}
        config = AgentConfig(
            portal_url="https://portal",
            runtime="subprocess",
            single_tenant=True,
            process_user=user,
            state_dir=str(tmp_path / "a"),
        )
        if reason is None:
            assert SubprocessRuntime(tmp_path / "state", **options).user.uid == os.geteuid() != 0
            assert config.validate() is config
            continue
        with pytest.raises(RuntimeFailure, match=reason):
            SubprocessRuntime(tmp_path / "state", **options)
        with pytest.raises(ConfigError, match=reason):
            config.validate()


def test_the_workload_runs_unprivileged_with_its_env_byte_for_byte(
    runtime: SubprocessRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUPOOL_BOOTSTRAP_TOKEN", "gpb_1_agent-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-agent's-own")
    env = {
        "MULTILINE": "first\nsecond\n",
        "PADDED": "  x  ",
        "EQ": "a=b=c",
        "QUOTES": "'\"$HOME`id`",
        "UTF": "é",
        "EMPTY": "",
    }
    runtime.start(
        WorkloadSpec("w1", command=sh("id -u; id -g; id -G; exec env -0"), env=env, gpu_uuids=["GPU-a"])
    )
    status = done(runtime, "w1")
    assert (status.state, status.exit_code) == ("exited", 0), runtime.logs("w1")
    output = Path(runtime.store.records["w1"]["log"]).read_bytes()
    uid, gid, groups, rest = output.split(b"\n", 3)
    assert int(uid) != 0 and int(gid) != 0 and b"0" not in groups.split()
    if runtime.user.switch:
        assert (int(uid), int(gid), groups.split()) == (runtime.user.uid, runtime.user.gid, [gid])
    seen = dict(item.split(b"=", 1) for item in rest.split(b"\0") if item)
    for key, value in env.items():
        assert seen[key.encode()] == value.encode(), key
    assert seen[b"CUDA_VISIBLE_DEVICES"] == b"GPU-a" and seen[b"GPUPOOL_WORKLOAD_ID"] == b"w1"
    assert b"GPUPOOL_BOOTSTRAP_TOKEN" not in seen and b"AWS_SECRET_ACCESS_KEY" not in seen
    assert seen[b"HOME"] == str(home(runtime, "w1")).encode()


def test_the_argv_is_never_read_by_a_shell(runtime: SubprocessRuntime, tmp_path: Path) -> None:
    runtime.start(WorkloadSpec("w1", command=["/bin/echo", "$(id)", ";", "touch", "pwned", "|", "*"]))
    done(runtime, "w1")
    assert runtime.logs("w1") == "$(id) ; touch pwned | *\n"
    assert not (home(runtime, "w1") / "pwned").exists()


def test_the_runtime_applies_the_workload_rules_itself(runtime: SubprocessRuntime) -> None:
    for spec, reason in [
        (WorkloadSpec("w1", command=sh("true"), env={"LD_PRELOAD": "/tmp/x.so"}), "LD_PRELOAD"),
        (WorkloadSpec("w2", command=sh("true"), env={"A\nB": "1"}), "not a variable name"),
        (WorkloadSpec("w3", command=["/bin/echo", "a\x00b"]), "NUL"),
        (WorkloadSpec("w4", command=sh("true"), gpu_uuids=["GPU-a,GPU-b"]), "not a GPU UUID"),
    ]:
        with pytest.raises(RuntimeFailure, match=reason):
            runtime.start(spec)
    assert runtime.status() == []


def test_the_log_stays_out_of_the_workloads_reach(runtime: SubprocessRuntime) -> None:
    """The workload owns its working directory, not its log: a link it puts where a log could be is
    never read out by the agent (which would send a root-only file's text to the portal)."""
    runtime.start(WorkloadSpec("w1", command=sh('ln -sf /etc/hostname "$PWD/output.log"; echo hello')))
    done(runtime, "w1")
    assert runtime.logs("w1") == "hello\n"
    log = Path(runtime.store.records["w1"]["log"])
    assert runtime.state_dir in log.parents and not log.is_symlink()
    notice_dir = runtime.work_dir / "w1"
    assert (notice_dir.stat().st_uid, oct(notice_dir.stat().st_mode & 0o777)) == (os.geteuid(), "0o755")


def test_exit_codes(runtime: SubprocessRuntime) -> None:
    runtime.start(WorkloadSpec("fail", command=sh("echo boom >&2; exit 3")))
    status = done(runtime, "fail")
    assert (status.state, status.exit_code) == ("failed", 3)
    assert "boom" in runtime.logs("fail")
    with pytest.raises(RuntimeFailure, match="cannot run"):
        runtime.start(WorkloadSpec("nope", command=["/no/such/program"]))
    with pytest.raises(RuntimeFailure, match="needs a command"):
        runtime.start(WorkloadSpec("empty"))


def test_start_is_idempotent_by_workload_id(runtime: SubprocessRuntime) -> None:
    command = sh("printf x >> runs")
    first = runtime.start(WorkloadSpec("once", command=command))
    second = runtime.start(WorkloadSpec("once", command=command))
    done(runtime, "once")
    assert first.ref == second.ref
    assert (home(runtime, "once") / "runs").read_text() == "x"


def test_stop_sends_sigterm_then_waits(runtime: SubprocessRuntime) -> None:
    runtime.start(
        WorkloadSpec("polite", command=sh("trap 'echo got TERM; exit 0' TERM; echo ready; sleep 60 & wait"))
    )
    wait_for(lambda: "ready" in runtime.logs("polite"), what="the process to start")
    status = runtime.stop("polite", grace_s=5)
    assert (status.state, status.exit_code) == ("stopped", 0)
    assert "got TERM" in runtime.logs("polite")


def test_stop_kills_after_the_grace_period(runtime: SubprocessRuntime) -> None:
    runtime.start(WorkloadSpec("stubborn", command=sh("trap '' TERM; echo ready; while :; do sleep 1; done")))
    wait_for(lambda: "ready" in runtime.logs("stubborn"), what="the process to start")
    began = time.monotonic()
    status = runtime.stop("stubborn", grace_s=0.5)
    assert time.monotonic() - began >= 0.5
    assert (status.state, status.exit_code) == ("stopped", 137)  # 128 + SIGKILL


def test_stop_reaches_the_whole_process_group(runtime: SubprocessRuntime) -> None:
    runtime.start(WorkloadSpec("tree", command=sh("sleep 60 & echo child=$!; wait")))
    line = wait_for(lambda: "child=" in (text := runtime.logs("tree")) and text, what="the child pid")
    child = int(line.split("child=")[1].split()[0])
    assert runtime.workload_for_pid(child) == "tree"
    runtime.stop("tree", grace_s=2)

    def child_gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        # A killed child of a killed parent is reparented and reaped by init; a zombie counts as gone.
        return Path(f"/proc/{child}/stat").read_text().split(")")[1].split()[0] == "Z"

    wait_for(child_gone, what="the child to end")


def test_preempt_gives_notice_then_stops(runtime: SubprocessRuntime) -> None:
    script = (
        'while [ ! -e "$GPUPOOL_PREEMPT_NOTICE_FILE" ]; do sleep 0.05; done; '
        'cat "$GPUPOOL_PREEMPT_NOTICE_FILE"; echo; echo noticed; sleep 60'
    )
    runtime.start(WorkloadSpec("spot", command=sh(script)))
    previous = os.umask(0o077)  # the systemd unit's: the notice must be readable all the same
    try:
        status = runtime.preempt("spot", notice_s=0.5, grace_s=1)
    finally:
        os.umask(previous)
    assert status.state == "preempted"
    assert "noticed" in runtime.logs("spot") and '"deadline"' in runtime.logs("spot")


def test_records_survive_an_agent_restart(
    runtime: SubprocessRuntime, tmp_path: Path, process_options: dict[str, Any]
) -> None:
    runtime.start(WorkloadSpec("long", command=sh("sleep 60")))
    pid = int(runtime.store.records["long"]["pid"])
    restarted = SubprocessRuntime(tmp_path / "state", **process_options)
    assert restarted.get_status("long").state == "running"
    assert restarted.stop("long", grace_s=2).state == "stopped"
    wait_for(lambda: runtime.get_status("long").terminal, what="the first runtime to see the exit")
    # The restarted agent could not wait() for a process it did not start: the code is unknown.
    status = restarted.get_status("long")
    assert status.exit_code is None and "exit code is unknown" in status.message
    assert pid > 0


def test_ports_are_free_host_ports_the_workload_is_told(
    tmp_path: Path, process_options: dict[str, Any]
) -> None:
    runtime = SubprocessRuntime(tmp_path / "state", **{**process_options, "tcp_publish_address": "0.0.0.0"})
    script = (
        'echo "$GPUPOOL_PORT_8080 $GPUPOOL_PORT_8080_ADDRESS $GPUPOOL_PORT_22 $GPUPOOL_PORT_22_ADDRESS" > out'
    )
    ports = [8080, {"port": 22, "protocol": "tcp"}]
    handle = runtime.start(WorkloadSpec("wp", command=sh(script), ports=ports))
    assert done(runtime, "wp").exit_code == 0
    assert set(handle.ports) == {"8080", "22"} and all(p > 1024 for p in handle.ports.values())
    told = (home(runtime, "wp") / "out").read_text().split()
    assert told == [str(handle.ports["8080"]), "127.0.0.1", str(handle.ports["22"]), "0.0.0.0"]
    # The mapping survives the agent: a runtime on the same state answers it again.
    again = SubprocessRuntime(tmp_path / "state", **process_options)
    assert again.start(WorkloadSpec("wp", command=sh(script), ports=ports)).ports == handle.ports
    with pytest.raises(RuntimeFailure, match="ports"):
        runtime.start(WorkloadSpec("wbad", command=sh("true"), ports=[{"port": 1, "protocol": "udp"}]))


def test_platform_env_is_set_after_the_workloads_own(runtime: SubprocessRuntime) -> None:
    runtime.start(
        WorkloadSpec(
            "w-rank",
            command=sh('printf "<%s>" "$NODE_RANK" "$MASTER_PORT" "$GPUPOOL_WORKLOAD_ID"'),
            env={"NODE_RANK": "9"},
            platform_env={"NODE_RANK": "0", "MASTER_PORT": "29500"},
        )
    )
    status = done(runtime, "w-rank")
    assert (status.state, status.exit_code) == ("exited", 0), runtime.logs("w-rank")
    assert runtime.logs("w-rank") == "<0><29500><w-rank>"
    with pytest.raises(RuntimeFailure, match="platform_env"):
        runtime.start(WorkloadSpec("w-bad", command=sh("env"), platform_env={"CUDA_VISIBLE_DEVICES": "all"}))
