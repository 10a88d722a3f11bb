"""Workloads as docker containers, through the ``docker`` command line (argv lists, no shell).

``docker run -d --gpus '"device=UUID1,UUID2"'`` with the workload's image, command, environment
(an env file, 0600, so secrets stay out of ``ps``), ``--cpus`` and ``--memory``; each container is
labelled with its workload id and named ``gpupool-<id>``, which makes a second start of the same
workload find the first container instead of making another. The preemption notice file is mounted
read-only at ``/run/gpupool/preempt``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from nodes.agent.runtimes import Runtime, RuntimeFailure, safe_name
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

log = logging.getLogger(__name__)

LABEL = "gpupool.workload_id"
NOTICE_DIR_IN_CONTAINER = "/run/gpupool"


def parse_docker_time(value: str | None) -> float | None:
    """Docker writes RFC 3339 with nanoseconds; its zero time means "never"."""
    if not value or value.startswith("0001-01-01"):
        return None
    text = value.replace("Z", "+00:00")
    if "." in text:
        head, rest = text.split(".", 1)
        digits = ""
        while rest and rest[0].isdigit():
            digits, rest = digits + rest[0], rest[1:]
        text = f"{head}.{digits[:6]}{rest}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


class DockerRuntime(Runtime):
    name = "docker"

    def __init__(
        self,
        state_dir: str | Path,
        docker_bin: str = "docker",
        command_timeout_s: float = 120,
        **sharing: str,
    ) -> None:
        super().__init__(state_dir, **sharing)
        self.docker_bin = docker_bin
        self.command_timeout_s = command_timeout_s

    def _docker(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        binary = shutil.which(self.docker_bin)
        if binary is None:
            raise RuntimeFailure(f"the docker command ({self.docker_bin}) is not on PATH")
        try:
            return subprocess.run(
                [binary, *args],
                capture_output=True,
                text=True,
                timeout=timeout or self.command_timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeFailure(f"docker {args[0]} did not answer within {exc.timeout:.0f} s") from exc

    @staticmethod
    def container_name(workload_id: str) -> str:
        return f"gpupool-{safe_name(workload_id)}"

    def run_argv(self, spec: WorkloadSpec, env_file: Path, notice_dir: Path) -> list[str]:
        argv = [
            "run",
            "-d",
            "--name",
            self.container_name(spec.workload_id),
            "--label",
            f"{LABEL}={spec.workload_id}",
        ]
        if spec.gpu_uuids:
            # The quotes are part of the value: docker reads --gpus as CSV, and the device list has commas.
            argv += ["--gpus", f'"device={",".join(spec.gpu_uuids)}"']
        if spec.cpu_millicores:
            argv += ["--cpus", f"{spec.cpu_millicores / 1000:g}"]
        if spec.ram_mib:
            argv += ["--memory", f"{int(spec.ram_mib)}m"]
        argv += ["--env-file", str(env_file)]
        argv += ["-v", f"{notice_dir}:{NOTICE_DIR_IN_CONTAINER}:ro"]
        if self.uses_mps(spec):
            # An MPS client in a container reaches the host's MPS daemon through its pipe directory
            # and shared memory (NVIDIA's MPS-in-containers setup).
            argv += ["--ipc", "host", "-v", f"{self.mps_pipe_dir}:{self.mps_pipe_dir}"]
        for port in spec.ports:
            if isinstance(port, dict):
                container = port.get("container") or port.get("container_port") or port.get("port")
                host = port.get("host") or port.get("host_port")
                argv += ["-p", f"{host}:{container}" if host else str(container)]
            else:
                argv += ["-p", str(port)]
        argv.append(spec.image)
        argv += spec.command
        return argv

    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        if not spec.image:
            raise RuntimeFailure("the docker runtime needs an image")
        with self.store.lock:
            record = self.store.records.get(spec.workload_id)
            if record is not None:
                return WorkloadHandle(spec.workload_id, record["container_id"])
            name = self.container_name(spec.workload_id)
            existing = self._docker("inspect", "--type", "container", "--format", "{{.Id}}", name)
            if existing.returncode == 0 and existing.stdout.strip():
                container_id = existing.stdout.strip()  # made by an earlier try that lost its record
            else:
                workdir = self.workload_dir(spec.workload_id)
                env_file = workdir / "env"
                env = {**spec.env, "GPUPOOL_WORKLOAD_ID": spec.workload_id}
                env["GPUPOOL_PREEMPT_NOTICE_FILE"] = f"{NOTICE_DIR_IN_CONTAINER}/preempt"
                env.update(self.sharing_env(spec))
                fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as handle:
                    for key, value in sorted(env.items()):
                        handle.write(f"{key}={value.replace(chr(10), ' ')}\n")
                result = self._docker(
                    *self.run_argv(spec, env_file, workdir), timeout=max(self.command_timeout_s, 1800)
                )
                if result.returncode != 0:
                    raise RuntimeFailure(
                        f"docker run failed: {result.stderr.strip() or result.stdout.strip()}"
                    )
                container_id = result.stdout.strip().splitlines()[-1]
            self.store.records[spec.workload_id] = {
                "container_id": container_id,
                "name": name,
                "gpu_uuids": spec.gpu_uuids,
                "final_state": None,
                "status": None,
            }
            self.store.save()
            return WorkloadHandle(spec.workload_id, container_id)

    def _from_inspect(
        self, workload_id: str, record: dict[str, Any], info: dict[str, Any] | None
    ) -> WorkloadStatus:
        if info is None:
            return WorkloadStatus(
                workload_id=workload_id,
                state=record["final_state"] or FAILED,
                gpu_uuids=record["gpu_uuids"],
                message="the container is gone",
                finished_at=time.time(),
            )
        state = info.get("State") or {}
        docker_status = state.get("Status", "")
        started = parse_docker_time(state.get("StartedAt"))
        common = {"workload_id": workload_id, "started_at": started, "gpu_uuids": record["gpu_uuids"]}
        if docker_status == "created":
            return WorkloadStatus(state=STARTING, **common)
        if docker_status in ("running", "paused", "restarting"):
            return WorkloadStatus(state=RUNNING, **common)
        code = state.get("ExitCode")
        message = "out of memory (OOMKilled)" if state.get("OOMKilled") else str(state.get("Error") or "")
        final = record["final_state"] or (EXITED if code == 0 else FAILED)
        return WorkloadStatus(
            state=final,
            exit_code=code,
            finished_at=parse_docker_time(state.get("FinishedAt")),
            message=message,
            **common,
        )

    def status(self) -> list[WorkloadStatus]:
        records = self.store.items()
        pending = [(wid, record) for wid, record in records if record.get("status") is None]
        inspected: dict[str, dict[str, Any]] = {}
        if pending:
            result = self._docker(
                "inspect", "--type", "container", *[record["container_id"] for _, record in pending]
            )
            try:
                for info in json.loads(result.stdout or "[]"):
                    inspected[info.get("Id", "")] = info
            except ValueError as exc:
                raise RuntimeFailure(
                    f"docker inspect answered something that is not JSON: {result.stderr.strip()}"
                ) from exc
        statuses = []
        changed = False
        for wid, record in records:
            if record.get("status") is not None:
                statuses.append(WorkloadStatus(**record["status"]))
                continue
            info = next((i for cid, i in inspected.items() if cid.startswith(record["container_id"])), None)
            status = self._from_inspect(wid, record, info)
            if status.terminal:
                record["status"] = dict(vars(status))
                changed = True
            statuses.append(status)
        if changed:
            self.store.save()
        return statuses

    def stop(self, workload_id: str, grace_s: float, *, final_state: str = STOPPED) -> WorkloadStatus:
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is None:
                return WorkloadStatus(
                    workload_id=workload_id, state=final_state, message="not known on this node"
                )
            current = self.get_status(workload_id)
            if current is not None and current.terminal:
                return current
            record["final_state"] = final_state
            self.store.save()
        result = self._docker(
            "stop", "-t", str(int(grace_s)), record["name"], timeout=grace_s + self.command_timeout_s
        )
        if result.returncode != 0:
            log.warning("docker stop %s: %s", record["name"], result.stderr.strip())
        status = self.get_status(workload_id)
        return status or WorkloadStatus(workload_id=workload_id, state=final_state)

    def logs(self, workload_id: str, tail: int = 100) -> str:
        record = self.store.records.get(workload_id)
        if record is None:
            raise RuntimeFailure(f"no workload {workload_id} on this node")
        result = self._docker("logs", "--tail", str(tail), record["name"])
        if result.returncode != 0:
            raise RuntimeFailure(f"docker logs failed: {result.stderr.strip()}")
        return result.stdout + result.stderr

    def prewarm(self, image: str) -> dict[str, Any]:
        result = self._docker("pull", image, timeout=max(self.command_timeout_s, 1800))
        if result.returncode != 0:
            raise RuntimeFailure(f"docker pull {image} failed: {result.stderr.strip()}")
        return {"image": image, "pulled": True}

    def forget(self, workload_id: str) -> None:
        record = self.store.records.get(workload_id)
        if record is None:
            return
        result = self._docker("rm", "-f", record["name"])
        if result.returncode != 0:
            log.warning("docker rm %s: %s", record["name"], result.stderr.strip())
        super().forget(workload_id)

    def workload_for_pid(self, pid: int) -> str | None:
        try:
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return None
        return next((wid for wid, record in self.store.items() if record["container_id"] in cgroup), None)
