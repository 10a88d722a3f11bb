"""Simulated workloads: timers. A workload runs for ``sim_duration_s`` (or ``$GPUPOOL_SIM_DURATION_S``
in its env, or its ``max_runtime_s``) and then exits with 0 (or ``$GPUPOOL_SIM_EXIT_CODE``); without
any of them it runs until it is stopped. Its GPUs and share feed the simulated collector.

Cold start: the first start of an image on a node first "pulls" it for the image's cold-start time
(``cold_start_s``, or ``$GPUPOOL_SIM_COLD_START_S`` of the agent: seconds for every image, or
``image=seconds`` pairs separated by commas with an optional bare number for the others); the
workload is ``starting`` meanwhile and ``start`` returns once it runs, as a docker start that pulls
does. ``prewarm`` pulls the image ahead, so a later start of it is immediate."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodes.agent.runtimes import OutputLine, RecordStore, Runtime, RuntimeFailure
from nodes.agent.types import (
    EXITED,
    FAILED,
    RUNNING,
    STARTING,
    STOPPED,
    WorkloadHandle,
    WorkloadSpec,
    WorkloadStatus,
)

SIM_LOG_EVERY_S = 2.0
STOP_EXIT_CODE = 143  # what a process killed by SIGTERM reports
COLD_START_ENV = "GPUPOOL_SIM_COLD_START_S"


def parse_cold_start(text: str) -> dict[str, float]:
    """``"20"`` -> every image 20 s; ``"ghcr.io/a/b:1=30,5"`` -> that image 30 s, others 5 s. The
    key ``""`` holds the time for images not named."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        image, sep, seconds = part.rpartition("=")
        try:
            value = float(seconds)
        except ValueError:
            raise ValueError(f"{COLD_START_ENV}: {part!r} is not image=seconds or seconds") from None
        if value < 0:
            raise ValueError(f"{COLD_START_ENV}: {part!r} is negative")
        out[image if sep else ""] = value
    return out


class SimulatedRuntime(Runtime):
    name = "simulated"
    # Computed from the records in memory: a thread hop per heartbeat would cost more (a fleet
    # process runs a hundred agents).
    status_blocks = False

    def __init__(
        self,
        state_dir: str | Path,
        clock: Callable[[], float] = time.time,
        cold_start_s: dict[str, float] | float | None = None,
        sleep: Callable[[float], None] = time.sleep,
        **sharing: str,
    ) -> None:
        super().__init__(state_dir, **sharing)
        self.clock = clock
        self.sleep = sleep
        if cold_start_s is None:
            cold_start_s = parse_cold_start(os.environ.get(COLD_START_ENV, ""))
        self.cold_start_s = cold_start_s if isinstance(cold_start_s, dict) else {"": float(cold_start_s)}
        # Images on this node: image -> when its pull finishes (or finished).
        self.images = RecordStore(self.state_dir / "runtime-simulated-images.json")

    def _pull(self, image: str) -> float:
        """Start pulling ``image`` unless it is here or coming; returns when it will be here."""
        with self.images.lock:
            ready = self.images.records.get(image)
            if ready is None:
                ready = self.clock() + self.cold_start_s.get(image, self.cold_start_s.get("", 0.0))
                self.images.records[image] = ready
                self.images.save()
            return float(ready)

    def _wait_until(self, t: float) -> None:
        wait = t - self.clock()
        if wait > 0:
            self.sleep(wait)

    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        with self.store.lock:
            record = self.store.records.get(spec.workload_id)
            if record is None:
                self._add(spec, self._pull(spec.image))
                record = self.store.records[spec.workload_id]
        self._wait_until(record["started_at"])  # the pull: starting until then
        return WorkloadHandle(spec.workload_id, f"timer:{spec.workload_id}")

    def _add(self, spec: WorkloadSpec, runs_at: float) -> None:
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
            "started_at": max(runs_at, self.clock()),  # when it runs (after the image pull)
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
        if now < started and record["stopped_at"] is None:
            return WorkloadStatus(state=STARTING, workload_id=workload_id, gpu_uuids=record["gpu_uuids"])
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

    def signal_resize(self, workload_id: str, info: dict[str, Any]) -> None:
        """A simulated elastic job uses its new GPUs at once (its GPUs' load follows)."""
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is None or self._status(workload_id, record, self.clock()).terminal:
                raise RuntimeFailure(f"workload {workload_id} is not running on this node")
            record["gpu_uuids"] = list(info["gpu_uuids"])
            self.store.save()

    def restart_resized(self, workload_id: str, info: dict[str, Any], grace_s: float) -> None:
        """A simulated restart is instant: the same run, on the new GPUs, its end unchanged."""
        self.signal_resize(workload_id, info)

    def logs(self, workload_id: str, tail: int = 100) -> str:
        status = self.get_status(workload_id)
        if status is None:
            raise RuntimeFailure(f"no workload {workload_id} on this node")
        lines = [
            f"simulated workload {workload_id} on {', '.join(status.gpu_uuids) or 'no GPU'}: {status.state}"
        ]
        return "\n".join(lines[-tail:])

    def output(
        self, workload_id: str, cursor: dict[str, Any], limit: int
    ) -> tuple[list[OutputLine], dict[str, Any]]:
        """Lines labelled as simulated, so a demo shows the log view: one when the workload starts,
        one every ``SIM_LOG_EVERY_S`` while it runs (a step, on stderr every fifth), one when it ends.
        Made from the record and the clock, so a restarted agent goes on where it was."""
        record = self.store.records.get(workload_id)
        if record is None:
            return [], cursor
        status = self._status(workload_id, record, self.clock())
        if status.state == STARTING:
            return [], cursor
        started = record["started_at"]
        end = status.finished_at if status.terminal else self.clock()
        steps = int(max(0.0, (end or started) - started) // SIM_LOG_EVERY_S)
        lines: list[OutputLine] = [
            (
                started,
                "stdout",
                f"[simulated] workload {workload_id} started on {', '.join(record['gpu_uuids']) or 'no GPU'}",
            )
        ]
        for k in range(1, steps + 1):
            stream = "stderr" if k % 5 == 0 else "stdout"
            text = (
                f"[simulated] step {k}: loss {1.0 / (k + 1):.4f}"
                if stream == "stdout"
                else f"[simulated] step {k}: checkpoint written"
            )
            lines.append((started + k * SIM_LOG_EVERY_S, stream, text))
        if status.terminal:
            lines.append(
                (
                    status.finished_at or end,
                    "stdout",
                    f"[simulated] {status.state} with exit code {status.exit_code}",
                )
            )
        done = int(cursor.get("n", 0))
        new = lines[done : done + limit]
        return new, {"n": done + len(new)}

    def prewarm(self, image: str) -> dict[str, Any]:
        started = self.clock()
        self._wait_until(self._pull(image))
        return {"image": image, "pulled": True, "pull_s": round(max(self.clock() - started, 0.0), 3)}

    def gpu_load(self, now: float) -> dict[str, list[tuple[str, int]]]:
        """Which workloads run on which GPU at ``now``: the simulated collector's load source."""
        load: dict[str, list[tuple[str, int]]] = {}
        for workload_id, record in self.store.items():
            if self._status(workload_id, record, now).state != RUNNING:
                continue
            for uuid in record["gpu_uuids"]:
                load.setdefault(uuid, []).append((workload_id, int(record["fraction_milli"] or 1000)))
        return load
