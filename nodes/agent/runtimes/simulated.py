"""Simulated workloads: timers. A workload runs for ``sim_duration_s`` (or ``$GPUPOOL_SIM_DURATION_S``
in its env, or its ``max_runtime_s``) and then exits with 0 (or ``$GPUPOOL_SIM_EXIT_CODE``); without
any of them it runs until it is stopped. Its GPUs and share feed the simulated collector."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodes.agent.runtimes import Runtime, RuntimeFailure
from nodes.agent.types import EXITED, FAILED, RUNNING, STOPPED, WorkloadHandle, WorkloadSpec, WorkloadStatus

STOP_EXIT_CODE = 143  # what a process killed by SIGTERM reports


class SimulatedRuntime(Runtime):
    name = "simulated"

    def __init__(self, state_dir: str | Path, clock: Callable[[], float] = time.time) -> None:
        super().__init__(state_dir)
        self.clock = clock

    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        with self.store.lock:
            if spec.workload_id not in self.store.records:
                self._add(spec)
        return WorkloadHandle(spec.workload_id, f"timer:{spec.workload_id}")

    def _add(self, spec: WorkloadSpec) -> None:
        duration = spec.sim_duration_s
        try:
            if duration is None and "GPUPOOL_SIM_DURATION_S" in spec.env:
                duration = float(spec.env["GPUPOOL_SIM_DURATION_S"])
            exit_code = int(spec.env.get("GPUPOOL_SIM_EXIT_CODE", "0"))
        except ValueError as exc:
            raise RuntimeFailure(f"bad simulation setting in env: {exc}") from exc
        if duration is None and spec.max_runtime_s:
            duration = float(spec.max_runtime_s)
        self.store.records[spec.workload_id] = {
            "gpu_uuids": spec.gpu_uuids,
            "fraction_milli": spec.gpu_fraction_milli,
            "started_at": self.clock(),
            "duration_s": duration,
            "exit_code": exit_code,
            "stopped_at": None,
            "final_state": None,
        }
        self.store.save()

    def _status(self, workload_id: str, record: dict[str, Any], now: float) -> WorkloadStatus:
        started = record["started_at"]
        common = {"workload_id": workload_id, "started_at": started, "gpu_uuids": record["gpu_uuids"]}
        end = started + record["duration_s"] if record["duration_s"] is not None else None
        if record["stopped_at"] is not None and (end is None or record["stopped_at"] < end):
            return WorkloadStatus(
                state=record["final_state"],
                exit_code=STOP_EXIT_CODE,
                finished_at=record["stopped_at"],
                **common,
            )
        if end is not None and now >= end:
            code = record["exit_code"]
            return WorkloadStatus(
                state=EXITED if code == 0 else FAILED, exit_code=code, finished_at=end, **common
            )
        return WorkloadStatus(state=RUNNING, **common)

    def status(self) -> list[WorkloadStatus]:
        now = self.clock()
        return [self._status(wid, record, now) for wid, record in self.store.items()]

    def stop(self, workload_id: str, grace_s: float, *, final_state: str = STOPPED) -> WorkloadStatus:
        record = self.store.records.get(workload_id)
        if record is None:
            return WorkloadStatus(
                workload_id=workload_id, state=final_state, message="not known on this node"
            )
        current = self._status(workload_id, record, self.clock())
        if current.terminal:
            return current
        record["stopped_at"] = self.clock()
        record["final_state"] = final_state
        self.store.save()
        return self._status(workload_id, record, self.clock())

    def logs(self, workload_id: str, tail: int = 100) -> str:
        status = self.get_status(workload_id)
        if status is None:
            raise RuntimeFailure(f"no workload {workload_id} on this node")
        lines = [
            f"simulated workload {workload_id} on {', '.join(status.gpu_uuids) or 'no GPU'}: {status.state}"
        ]
        return "\n".join(lines[-tail:])

    def prewarm(self, image: str) -> dict[str, Any]:
        return {"image": image, "pulled": True}

    def gpu_load(self, now: float) -> dict[str, list[tuple[str, int]]]:
        """Which workloads run on which GPU at ``now``: the simulated collector's load source."""
        load: dict[str, list[tuple[str, int]]] = {}
        for workload_id, record in self.store.items():
            if self._status(workload_id, record, now).state != RUNNING:
                continue
            for uuid in record["gpu_uuids"]:
                load.setdefault(uuid, []).append((workload_id, int(record["fraction_milli"] or 1000)))
        return load
