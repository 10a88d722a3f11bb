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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodes.agent.collectors.devices import DeviceFileError, check_device_file
from nodes.agent.types import (
    PREEMPTED,
    STOPPED,
    NodeInventory,
    WorkloadHandle,
    WorkloadSpec,
    WorkloadStatus,
    rfc3339,
)

RUNTIME_KINDS = ("docker", "subprocess", "simulated")
OutputLine = tuple[float, str, str]
STREAMS = ("stdout", "stderr")
GPU_SHARING_MODES = ("time-slicing", "mps")
DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"


class RuntimeFailure(RuntimeError):
    """The runtime could not do what it was asked; the message says why."""


def safe_name(workload_id: str) -> str:
    """A workload id as a file or container name: letters, digits, ``_.-`` only."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", workload_id)
    return cleaned or "_"


READ_CHUNK_BYTES = 1 << 20
LINE_MAX_BYTES = 16 * 1024  # a longer line without its newline yet is sent in pieces


def read_new_lines(
    path: str | Path, offset: int, limit: int, stream: str, *, final: bool
) -> tuple[list[OutputLine], int]:
    """Up to ``limit`` whole lines of a file after byte ``offset``, stamped now, and the offset
    after them. An unfinished last line waits for its newline unless ``final`` (the writer ended)
    or it is longer than ``LINE_MAX_BYTES``."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            chunk = handle.read(READ_CHUNK_BYTES)
    except FileNotFoundError:
        return [], offset
    now = time.time()
    pieces = chunk.split(b"\n")
    rest = pieces.pop()  # after the last newline: b"" or an unfinished line
    lines: list[OutputLine] = []
    for piece in pieces:
        if len(lines) >= limit:
            return lines, offset
        lines.append((now, stream, piece.decode("utf-8", "replace")))
        offset += len(piece) + 1
    at_end = len(chunk) < READ_CHUNK_BYTES
    if rest and len(lines) < limit and ((final and at_end) or len(rest) >= LINE_MAX_BYTES):
        rest = rest[:LINE_MAX_BYTES]
        lines.append((now, stream, rest.decode("utf-8", "replace")))
        offset += len(rest)
    return lines, offset


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


def gpu_sharing_env(
    spec: WorkloadSpec, mode: str, mps_pipe_dir: str = DEFAULT_MPS_PIPE_DIR, vendor: str = ""
) -> dict[str, str]:
    """The environment that isolates a fractional share of one GPU that is not a MIG slice.

    Every share gets ``GPUPOOL_GPU_FRACTION_MILLI`` and, when the portal sent one,
    ``GPUPOOL_GPU_MEMORY_LIMIT_MIB`` (for frameworks to apply, e.g. PyTorch's
    ``set_per_process_memory_fraction``). On NVIDIA GPUs, ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
    (``0=<MiB>M``: the workload sees its one GPU as device 0, and MPS applies limits set by index,
    not by UUID) caps its GPU memory under MPS; in ``mps`` mode ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
    (the share / 10, rounded up) caps its SMs and ``CUDA_MPS_PIPE_DIRECTORY`` names the MPS control
    daemon's pipes. In ``time-slicing`` mode the GPU is shared by time slices without a compute cap;
    the memory variables are set all the same (only an MPS daemon enforces the CUDA one). AMD and
    Intel GPUs have no MPS: their shares are time-sliced and get only the gpupool variables."""
    fraction = spec.gpu_fraction_milli
    if spec.mig_profile or fraction >= 1000 or len(spec.gpu_uuids) != 1:
        return {}
    if vendor not in ("nvidia", "amd", "intel"):
        vendor = spec.gpu_vendor
    amd = vendor in ("amd", "intel")
    env = {
        "GPUPOOL_GPU_FRACTION_MILLI": str(fraction),
        "GPUPOOL_GPU_SHARING": "time-slicing" if amd else mode,
    }
    limit = spec.gpu_memory_limit_mib
    if limit:
        env["GPUPOOL_GPU_MEMORY_LIMIT_MIB"] = str(int(limit))
    if amd:
        return env
    if limit:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={int(limit)}M"
    if mode == "mps":
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, -(-fraction // 10)))
        env["CUDA_MPS_PIPE_DIRECTORY"] = mps_pipe_dir
    return env


@dataclass(frozen=True)
class DevicePlan:
    """What a workload on AMD or Intel GPUs is given: device files (host path, path inside a
    container), the groups that own them (never 0) and the variables that choose its GPUs, for a
    container (which sees only its own GPUs, numbered from 0) and for a host process (which sees
    every GPU of the node, numbered in PCI order by the collector)."""

    vendor: str
    devices: tuple[tuple[str, str], ...] = ()
    groups: tuple[int, ...] = ()
    container_env: dict[str, str] = field(default_factory=dict)
    process_env: dict[str, str] = field(default_factory=dict)


def device_plan(inventory: NodeInventory | None, spec: WorkloadSpec) -> DevicePlan | None:
    """The device plan of ``spec`` on a node whose collector found ``inventory``: None for NVIDIA
    (the NVIDIA container toolkit gives the GPUs) and for a workload without GPUs. Every device
    path comes from the collector and is checked here (an absolute path of a character device; a
    GPU's is a render node); a GPU the collector did not find, or without a render node, is a
    :class:`RuntimeFailure`."""
    vendor = inventory.vendor if inventory is not None else ""
    if vendor not in ("amd", "intel") or not spec.gpu_uuids:
        return None
    assert inventory is not None
    gpus = []
    for uuid in spec.gpu_uuids:
        gpu = inventory.gpu(uuid)
        if gpu is None:
            raise RuntimeFailure(f"GPU {uuid} is not on this node")
        if not gpu.render_node:
            raise RuntimeFailure(f"GPU {uuid} has no render node: the collector found none for it")
        gpus.append(gpu)
    devices: list[tuple[str, str]] = []
    groups: set[int] = set()
    try:
        for path in inventory.node_devices:
            groups.add(check_device_file(path, render=False).st_gid)
            devices.append((path, "/dev/" + os.path.basename(path)))
        for gpu in gpus:
            groups.add(check_device_file(gpu.render_node, render=True).st_gid)
            devices.append((gpu.render_node, "/dev/dri/" + os.path.basename(gpu.render_node)))
    except DeviceFileError as exc:
        raise RuntimeFailure(f"cannot give the workload its GPUs: {exc}") from exc
    inside = ",".join(str(i) for i in range(len(gpus)))
    host = ",".join(str(gpu.index) for gpu in gpus)
    if vendor == "amd":
        # HIP numbers the devices ROCr left visible from 0, in a container and on the host alike.
        container_env = {"ROCR_VISIBLE_DEVICES": inside, "HIP_VISIBLE_DEVICES": inside}
        process_env = {"ROCR_VISIBLE_DEVICES": host, "HIP_VISIBLE_DEVICES": inside}
    else:
        order = {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}
        container_env = {**order, "ZE_AFFINITY_MASK": inside}
        process_env = {**order, "ZE_AFFINITY_MASK": host}
    return DevicePlan(
        vendor=vendor,
        devices=tuple(devices),
        groups=tuple(sorted(g for g in groups if g != 0)),
        container_env=container_env,
        process_env=process_env,
    )


class Runtime(ABC):
    name: str
    # False for a runtime whose ``status`` answers from memory (the simulated one), which the agent
    # then calls on its event loop instead of a thread (Docker and processes are asked on a thread).
    status_blocks: bool = True
    # The node's GPUs, set by the agent once it has found them (the docker runtime sizes the CPU
    # and memory of a workload that names none from its share of them).
    node_gpus: int = 0
    # What the collector found (vendor, each GPU's render node, the node's device files), set by the
    # agent with ``node_gpus``: AMD and Intel workloads get their device files from it.
    inventory: NodeInventory | None = None
    # Whether gang members here get addresses of their own on the region's gang network (the docker
    # runtime with a ``gang_parent``); the agent says so in its heartbeats, and the portal hands out
    # such addresses only when every node of a gang does.
    gang_network: bool = False

    def __init__(
        self,
        state_dir: str | Path,
        gpu_sharing: str = "time-slicing",
        mps_pipe_dir: str = DEFAULT_MPS_PIPE_DIR,
    ) -> None:
        if gpu_sharing not in GPU_SHARING_MODES:
            raise ValueError(
                f"gpu_sharing must be one of {', '.join(GPU_SHARING_MODES)}, not {gpu_sharing!r}"
            )
        self.state_dir = Path(state_dir)
        self.store = RecordStore(self.state_dir / f"runtime-{self.name}.json")
        self.gpu_sharing = gpu_sharing
        self.mps_pipe_dir = mps_pipe_dir
        # The node's volumes (the agent sets its configured root); without a root, none attach.
        # Imported here: nodes.agent.volumes imports this module.
        from nodes.agent.volumes import Volumes

        self.volumes = Volumes("")

    def sharing_env(self, spec: WorkloadSpec) -> dict[str, str]:
        vendor = self.inventory.vendor if self.inventory is not None else ""
        return gpu_sharing_env(spec, self.gpu_sharing, self.mps_pipe_dir, vendor)

    def device_plan(self, spec: WorkloadSpec) -> DevicePlan | None:
        return device_plan(self.inventory, spec)

    def uses_mps(self, spec: WorkloadSpec) -> bool:
        return "CUDA_MPS_PIPE_DIRECTORY" in self.sharing_env(spec)

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

    def output(
        self, workload_id: str, cursor: dict[str, Any], limit: int
    ) -> tuple[list[OutputLine], dict[str, Any]]:
        """At most ``limit`` lines the workload wrote after ``cursor`` (``{}`` at first) and the
        cursor after them: ``(at, stream, text)`` with ``at`` in seconds since the epoch, ``stream``
        ``stdout`` or ``stderr``, ``text`` without its newline. The agent keeps the cursor and asks
        again (``nodes.agent.logship``); a runtime that captures nothing answers no lines."""
        return [], cursor

    @abstractmethod
    def prewarm(self, image: str) -> dict[str, Any]:
        """Fetch an image ahead of time so a later start is fast."""

    def notify_preempt(self, workload_id: str, notice_s: float) -> None:
        """Tell the workload it will be stopped in ``notice_s`` seconds: the file named by
        ``$GPUPOOL_PREEMPT_NOTICE_FILE`` inside the workload appears, holding the deadline."""
        notice = self.workload_dir(workload_id) / "preempt"
        notice.write_text(json.dumps({"deadline": rfc3339(time.time() + notice_s), "notice_s": notice_s}))

    def resize(self, workload_id: str, info: dict[str, Any], *, restart: bool, grace_s: float) -> None:
        """An elastic job's new GPUs (``info``: ``gpu_uuids``, ``gpu_count``, ``world_size``): the
        file named by ``$GPUPOOL_RESIZE_FILE`` holds them as JSON, then the job gets SIGUSR1
        (``signal_resize``), or is restarted on them from its checkpoint (``restart_resized``)."""
        path = self.workload_dir(workload_id) / "resize"
        tmp = path.with_name("resize.tmp")
        tmp.write_text(json.dumps(info))
        os.chmod(tmp, 0o644)  # the workload's user reads it, whatever the agent's umask
        os.replace(tmp, path)  # whole or not at all: the job never reads half a file
        if restart:
            self.restart_resized(workload_id, info, grace_s)
        else:
            self.signal_resize(workload_id, info)

    def signal_resize(self, workload_id: str, info: dict[str, Any]) -> None:
        """Send the workload SIGUSR1 (its resize file is written)."""
        raise RuntimeFailure(f"the {self.name} runtime cannot signal a workload")

    def restart_resized(self, workload_id: str, info: dict[str, Any], grace_s: float) -> None:
        """Stop the workload and start its command again on ``info``'s GPUs, from its checkpoint
        (``GPUPOOL_RESUME=1``, the new ``WORLD_SIZE``), as the same run: it is never reported ended."""
        raise RuntimeFailure(f"the {self.name} runtime cannot restart a workload on other GPUs")

    def preempt(self, workload_id: str, notice_s: float, grace_s: float = 10.0) -> WorkloadStatus:
        """Notice, wait ``notice_s``, then stop; the workload ends ``preempted``. (The agent calls
        the three steps itself so that its shutdown can interrupt the wait.)"""
        self.notify_preempt(workload_id, notice_s)
        time.sleep(notice_s)
        return self.stop(workload_id, grace_s, final_state=PREEMPTED)

    def get_status(self, workload_id: str) -> WorkloadStatus | None:
        return next((status for status in self.status() if status.workload_id == workload_id), None)

    def attempt_of(self, workload_id: str) -> int | None:
        """The portal's attempt number this runtime's record of the workload was started for."""
        with self.store.lock:
            record = self.store.records.get(workload_id)
            return None if record is None else record.get("attempt")

    def attempt_record(self, workload_id: str, attempt: int) -> None:
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is not None and record.get("attempt") != attempt:
                record["attempt"] = attempt
                self.store.save()

    def forget(self, workload_id: str) -> None:
        """Drop a finished workload from the records (it is no longer reported)."""
        if self.store.records.pop(workload_id, None) is not None:
            self.store.save()

    def workload_for_pid(self, pid: int) -> str | None:
        """Which workload a GPU process belongs to, when this runtime can tell."""
        return None


def volume_env(prepared: Any, checkpoint_dir: str) -> dict[str, str]:
    """The checkpoint variables: ``GPUPOOL_CHECKPOINT_DIR`` (the same directory on every placement)
    and ``GPUPOOL_RESUME=1`` on a placement after a preemption or requeue."""
    if prepared.checkpoint_host is None:
        return {}
    env = {"GPUPOOL_CHECKPOINT_DIR": checkpoint_dir}
    if prepared.resume:
        env["GPUPOOL_RESUME"] = "1"
    return env


def make_runtime(
    kind: str,
    state_dir: str | Path,
    *,
    gpu_sharing: str = "time-slicing",
    mps_pipe_dir: str = DEFAULT_MPS_PIPE_DIR,
    **options: Any,
) -> Runtime:
    """``options`` go to the docker or subprocess runtime (``AgentConfig.runtime_options``); the GPU
    sharing settings to every runtime."""
    sharing = {"gpu_sharing": gpu_sharing, "mps_pipe_dir": mps_pipe_dir}
    if kind == "docker":
        from nodes.agent.runtimes.docker import DockerRuntime

        return DockerRuntime(state_dir, **options, **sharing)
    if kind == "subprocess":
        from nodes.agent.runtimes.process import SubprocessRuntime

        return SubprocessRuntime(state_dir, **options, **sharing)
    if kind == "simulated":
        from nodes.agent.runtimes.simulated import SimulatedRuntime

        return SimulatedRuntime(state_dir, **sharing)
    raise ValueError(f"unknown runtime {kind!r}; expected one of {', '.join(RUNTIME_KINDS)}")
