"""Bare-metal workloads: the command runs as a process group on the host.

``CUDA_VISIBLE_DEVICES`` is set to the workload's GPU UUIDs; stdout and stderr go to
``<state dir>/workloads/<id>/output.log``; stop sends SIGTERM to the group and SIGKILL after the
grace period. The image field is ignored (there is nothing to pull) and CPU and memory limits are
not enforced by this runtime: use the docker runtime where they matter.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Any

from nodes.agent.runtimes import Runtime, RuntimeFailure
from nodes.agent.types import EXITED, FAILED, RUNNING, STOPPED, WorkloadHandle, WorkloadSpec, WorkloadStatus

AGENT_ENV_PREFIX = "GPUPOOL_"  # the agent's own settings (its bootstrap token) never reach a workload


def _exit_code(returncode: int) -> int:
    """Popen answers -N for a process killed by signal N; shells and docker say 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def _alive(pid: int) -> bool:
    """Whether a process that is not our child still runs (a zombie has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


class SubprocessRuntime(Runtime):
    name = "subprocess"

    def __init__(self, state_dir: str | Path, **sharing: str) -> None:
        super().__init__(state_dir, **sharing)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        with self.store.lock:
            record = self.store.records.get(spec.workload_id)
            if record is not None:
                return WorkloadHandle(spec.workload_id, str(record["pid"]))
            if not spec.command:
                raise RuntimeFailure("the subprocess runtime needs a command")
            workdir = self.workload_dir(spec.workload_id)
            log_path = workdir / "output.log"
            env = {key: value for key, value in os.environ.items() if not key.startswith(AGENT_ENV_PREFIX)}
            env.update(spec.env)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_uuids)
            env["GPUPOOL_WORKLOAD_ID"] = spec.workload_id
            env["GPUPOOL_PREEMPT_NOTICE_FILE"] = str(workdir / "preempt")
            env.update(self.sharing_env(spec))
            with open(log_path, "ab") as log_file:
                try:
                    proc = subprocess.Popen(
                        spec.command,
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=workdir,
                        start_new_session=True,
                    )
                except OSError as exc:
                    raise RuntimeFailure(f"cannot run {spec.command[0]!r}: {exc}") from exc
            self._procs[spec.workload_id] = proc
            self.store.records[spec.workload_id] = {
                "pid": proc.pid,
                "pgid": proc.pid,
                "gpu_uuids": spec.gpu_uuids,
                "log": str(log_path),
                "started_at": time.time(),
                "finished_at": None,
                "exit_code": None,
                "final_state": None,
                "message": "",
            }
            self.store.save()
            return WorkloadHandle(spec.workload_id, str(proc.pid))

    def _refresh(self, workload_id: str, record: dict[str, Any]) -> None:
        """Record the exit of a finished process (once)."""
        if record["finished_at"] is not None:
            return
        proc = self._procs.get(workload_id)
        if proc is not None:
            returncode = proc.poll()
            if returncode is None:
                return
            record["exit_code"] = _exit_code(returncode)
        elif _alive(record["pid"]):
            return
        else:
            # Started by an earlier run of the agent: its exit code went with that process.
            record["message"] = "the process ended while the agent was not running; its exit code is unknown"
        record["finished_at"] = time.time()
        self.store.save()

    def _status(self, workload_id: str, record: dict[str, Any]) -> WorkloadStatus:
        self._refresh(workload_id, record)
        common = {
            "workload_id": workload_id,
            "started_at": record["started_at"],
            "gpu_uuids": record["gpu_uuids"],
            "message": record["message"],
        }
        if record["finished_at"] is None:
            return WorkloadStatus(state=RUNNING, **common)
        code = record["exit_code"]
        state = record["final_state"] or (EXITED if code == 0 else FAILED)
        return WorkloadStatus(state=state, exit_code=code, finished_at=record["finished_at"], **common)

    def status(self) -> list[WorkloadStatus]:
        with self.store.lock:
            return [self._status(wid, record) for wid, record in self.store.items()]

    def stop(self, workload_id: str, grace_s: float, *, final_state: str = STOPPED) -> WorkloadStatus:
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is None:
                return WorkloadStatus(
                    workload_id=workload_id, state=final_state, message="not known on this node"
                )
            current = self._status(workload_id, record)
            if current.terminal:
                return current
            record["final_state"] = final_state
            self.store.save()
        self._signal(record["pgid"], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not self._status(workload_id, record).terminal:
            time.sleep(0.05)
        if not self._status(workload_id, record).terminal:
            self._signal(record["pgid"], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not self._status(workload_id, record).terminal:
                time.sleep(0.05)
        # The leader may be gone while others of its group live on; they go too.
        self._signal(record["pgid"], signal.SIGKILL)
        return self._status(workload_id, record)

    @staticmethod
    def _signal(pgid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signum)

    def logs(self, workload_id: str, tail: int = 100) -> str:
        record = self.store.records.get(workload_id)
        if record is None:
            raise RuntimeFailure(f"no workload {workload_id} on this node")
        try:
            with open(record["log"], errors="replace") as handle:
                return "".join(deque(handle, maxlen=tail))
        except FileNotFoundError:
            return ""

    def prewarm(self, image: str) -> dict[str, Any]:
        return {
            "image": image,
            "pulled": False,
            "message": "the subprocess runtime runs host commands; no image",
        }

    def forget(self, workload_id: str) -> None:
        proc = self._procs.get(workload_id)
        if proc is not None and proc.poll() is None:
            return  # still running: keep it
        self._procs.pop(workload_id, None)
        super().forget(workload_id)

    def workload_for_pid(self, pid: int) -> str | None:
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            return None
        return next((wid for wid, record in self.store.items() if record["pgid"] == pgid), None)
