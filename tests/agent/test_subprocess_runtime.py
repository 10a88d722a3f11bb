"""The subprocess runtime with real processes."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.runtimes.process import SubprocessRuntime
from nodes.agent.types import WorkloadSpec
from tests.agent.conftest import wait_for

PY = sys.executable


@pytest.fixture
def runtime(tmp_path: Path) -> SubprocessRuntime:
    runtime = SubprocessRuntime(tmp_path / "state")
    yield runtime
    for status in runtime.status():
        if not status.terminal:
            runtime.stop(status.workload_id, grace_s=0.5)


def done(runtime: SubprocessRuntime, workload_id: str):
    return wait_for(
        lambda: (s := runtime.get_status(workload_id)) is not None and s.terminal and s,
        what=f"{workload_id} to end",
    )


def test_environment_and_output(runtime: SubprocessRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_BOOTSTRAP_TOKEN", "gpb_1_agent-secret")
    code = (
        "import os; print('CVD=' + os.environ['CUDA_VISIBLE_DEVICES']); print('FOO=' + os.environ['FOO']);"
        "print('TOKEN=' + os.environ.get('GPUPOOL_BOOTSTRAP_TOKEN', 'absent'));"
        "print('ID=' + os.environ['GPUPOOL_WORKLOAD_ID'])"
    )
    runtime.start(
        WorkloadSpec("w1", command=[PY, "-c", code], env={"FOO": "bar"}, gpu_uuids=["GPU-a", "GPU-b"])
    )
    status = done(runtime, "w1")
    assert (status.state, status.exit_code) == ("exited", 0)
    assert status.started_at is not None and status.finished_at >= status.started_at
    assert runtime.logs("w1").splitlines() == ["CVD=GPU-a,GPU-b", "FOO=bar", "TOKEN=absent", "ID=w1"]
    assert runtime.logs("w1", tail=1) == "ID=w1\n"


def test_exit_codes(runtime: SubprocessRuntime) -> None:
    runtime.start(
        WorkloadSpec("fail", command=[PY, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"])
    )
    status = done(runtime, "fail")
    assert (status.state, status.exit_code) == ("failed", 3)
    assert "boom" in runtime.logs("fail")
    with pytest.raises(RuntimeFailure, match="cannot run"):
        runtime.start(WorkloadSpec("nope", command=["/no/such/program"]))
    with pytest.raises(RuntimeFailure, match="needs a command"):
        runtime.start(WorkloadSpec("empty"))


def test_start_is_idempotent_by_workload_id(runtime: SubprocessRuntime, tmp_path: Path) -> None:
    marker = tmp_path / "runs"
    command = [PY, "-c", f"open({str(marker)!r}, 'a').write('x')"]
    first = runtime.start(WorkloadSpec("once", command=command))
    second = runtime.start(WorkloadSpec("once", command=command))
    done(runtime, "once")
    assert first.ref == second.ref
    assert marker.read_text() == "x"


def test_stop_sends_sigterm_then_waits(runtime: SubprocessRuntime) -> None:
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got TERM', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    runtime.start(WorkloadSpec("polite", command=[PY, "-c", code]))
    wait_for(lambda: "ready" in runtime.logs("polite"), what="the process to start")
    status = runtime.stop("polite", grace_s=5)
    assert (status.state, status.exit_code) == ("stopped", 0)
    assert "got TERM" in runtime.logs("polite")


def test_stop_kills_after_the_grace_period(runtime: SubprocessRuntime) -> None:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)\n"
    runtime.start(WorkloadSpec("stubborn", command=[PY, "-c", code]))
    wait_for(lambda: "ready" in runtime.logs("stubborn"), what="the process to start")
    began = time.monotonic()
    status = runtime.stop("stubborn", grace_s=0.5)
    assert time.monotonic() - began >= 0.5
    assert (status.state, status.exit_code) == ("stopped", 137)  # 128 + SIGKILL


def test_stop_reaches_the_whole_process_group(runtime: SubprocessRuntime, tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    runtime.start(WorkloadSpec("tree", command=[PY, "-c", code]))
    child = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), what="the child pid"))
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
    code = (
        "import os, time\n"
        "notice = os.environ['GPUPOOL_PREEMPT_NOTICE_FILE']\n"
        "while not os.path.exists(notice): time.sleep(0.02)\n"
        "print('noticed', flush=True)\n"
        "time.sleep(60)\n"
    )
    runtime.start(WorkloadSpec("spot", command=[PY, "-c", code]))
    status = runtime.preempt("spot", notice_s=0.5, grace_s=1)
    assert status.state == "preempted"
    assert "noticed" in runtime.logs("spot")


def test_records_survive_an_agent_restart(runtime: SubprocessRuntime, tmp_path: Path) -> None:
    runtime.start(WorkloadSpec("long", command=[PY, "-c", "import time; time.sleep(60)"]))
    pid = int(runtime.store.records["long"]["pid"])
    restarted = SubprocessRuntime(tmp_path / "state")
    assert restarted.get_status("long").state == "running"
    assert restarted.stop("long", grace_s=2).state == "stopped"
    wait_for(lambda: runtime.get_status("long").terminal, what="the first runtime to see the exit")
    # The restarted agent could not wait() for a process it did not start: the code is unknown.
    status = restarted.get_status("long")
    assert status.exit_code is None and "exit code is unknown" in status.message
    assert pid > 0
