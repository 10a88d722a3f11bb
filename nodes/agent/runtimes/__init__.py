"""Runtimes run workloads on this node: docker containers, bare-metal processes, or timers.

All of them implement :class:`Runtime`. Each is idempotent by workload id: starting a workload id
that the runtime already knows returns the existing handle and starts nothing, stopping one that is
already finished (or unknown) is a no-op that answers its status.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from nodes.agent.types import PREEMPTED, STOPPED, WorkloadHandle, WorkloadSpec, WorkloadStatus, rfc3339

RUNTIME_KINDS = ("docker", "subprocess", "simulated")


class RuntimeFailure(RuntimeError):
    """The runtime could not do what it was asked; the message says why."""


def safe_name(workload_id: str) -> str:
    """A workload id as a file or container name: letters, digits, ``_.-`` only."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", workload_id)
    return cleaned or "_"


class RecordStore:
    """A small JSON file of per-workload records, so a restarted agent still knows its workloads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        self.lock = threading.RLock()
        if path.exists():
            try:
                self.records = json.loads(path.read_text())
            except ValueError:
                self.records = {}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            text = json.dumps(self.records)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".records-")
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(tmp, self.path)

    def items(self) -> list[tuple[str, dict[str, Any]]]:
        with self.lock:
            return list(self.records.items())


class Runtime(ABC):
    name: str

    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = Path(state_dir)
        self.store = RecordStore(self.state_dir / f"runtime-{self.name}.json")

    def workload_dir(self, workload_id: str) -> Path:
        path = self.state_dir / "workloads" / safe_name(workload_id)
        path.mkdir(parents=True, exist_ok=True)
        return path

    @abstractmethod
    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        """Start a workload (or return the handle of the one already started under this id)."""

    @abstractmethod
    def stop(self, workload_id: str, grace_s: float, *, final_state: str = STOPPED) -> WorkloadStatus:
        """Ask the workload to stop, kill it after ``grace_s``; answers its final status."""

    @abstractmethod
    def status(self) -> list[WorkloadStatus]:
        """Every workload this runtime knows and has not forgotten."""

    @abstractmethod
    def logs(self, workload_id: str, tail: int = 100) -> str:
        """The last ``tail`` lines of the workload's output."""

    @abstractmethod
    def prewarm(self, image: str) -> dict[str, Any]:
        """Fetch an image ahead of time so a later start is fast."""

    def notify_preempt(self, workload_id: str, notice_s: float) -> None:
        """Tell the workload it will be stopped in ``notice_s`` seconds: the file named by
        ``$GPUPOOL_PREEMPT_NOTICE_FILE`` inside the workload appears, holding the deadline."""
        notice = self.workload_dir(workload_id) / "preempt"
        notice.write_text(json.dumps({"deadline": rfc3339(time.time() + notice_s), "notice_s": notice_s}))

    def preempt(self, workload_id: str, notice_s: float, grace_s: float = 10.0) -> WorkloadStatus:
        """Notice, wait ``notice_s``, then stop; the workload ends ``preempted``. (The agent calls
        the three steps itself so that its shutdown can interrupt the wait.)"""
        self.notify_preempt(workload_id, notice_s)
        time.sleep(notice_s)
        return self.stop(workload_id, grace_s, final_state=PREEMPTED)

    def get_status(self, workload_id: str) -> WorkloadStatus | None:
        return next((status for status in self.status() if status.workload_id == workload_id), None)

    def forget(self, workload_id: str) -> None:
        """Drop a finished workload from the records (it is no longer reported)."""
        if self.store.records.pop(workload_id, None) is not None:
            self.store.save()

    def workload_for_pid(self, pid: int) -> str | None:
        """Which workload a GPU process belongs to, when this runtime can tell."""
        return None


def make_runtime(kind: str, state_dir: str | Path, **options: Any) -> Runtime:
    if kind == "docker":
        from nodes.agent.runtimes.docker import DockerRuntime

        return DockerRuntime(state_dir, **options)
    if kind == "subprocess":
        from nodes.agent.runtimes.process import SubprocessRuntime

        return SubprocessRuntime(state_dir)
    if kind == "simulated":
        from nodes.agent.runtimes.simulated import SimulatedRuntime

        return SimulatedRuntime(state_dir)
    raise ValueError(f"unknown runtime {kind!r}; expected one of {', '.join(RUNTIME_KINDS)}")
