"""Plain data that crosses the agent's internal interfaces (collectors, runtimes, the loop)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nodes.agent.workload_rules import check_start_payload


def rfc3339(ts: float | datetime) -> str:
    """RFC 3339 UTC with milliseconds, as the protocol writes times: ``2026-12-02T12:00:00.000Z``."""
    if isinstance(ts, datetime):
        return _rfc3339(ts)
    return _rfc3339_epoch(ts)


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


@functools.lru_cache(maxsize=256)
def _rfc3339_epoch(ts: float) -> str:
    # The readings of one sampling tick share its time: a heartbeat of an eight-GPU node formats ten
    # times, not eighty.
    return _rfc3339(datetime.fromtimestamp(ts, tz=UTC))


@dataclass
class MigDevice:
    uuid: str
    name: str = ""
    memory_mib: int = 0
    profile: str = ""
    start: int | None = None
    """The GPU instance's profile and start (memory slice), where the collector knows them."""


@dataclass
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_mib: int
    pci_bus_id: str = ""
    nvlink_island: int | None = None
    numa_node: int | None = None
    mig_mode: bool = False
    mig_devices: list[MigDevice] = field(default_factory=list)
    render_node: str = ""
    """AMD and Intel: the GPU's DRM render node (``/dev/dri/renderD128``), found by the collector from
    its PCI bus id; the runtimes give a workload the render nodes of its GPUs."""
    firmware_version: str = ""
    """The GPU's firmware as its driver reports it (VBIOS on NVIDIA and AMD, GFX firmware on Intel)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class NodeInventory:
    gpus: list[GpuInfo]
    driver_version: str = ""
    cuda_version: str = ""
    rocm_version: str = ""
    level_zero_version: str = ""
    interconnect: str = "pcie"
    vendor: str = ""
    node_devices: list[str] = field(default_factory=list)
    """Device files every workload on these GPUs needs besides its GPUs' own (AMD: ``/dev/kfd``)."""

    def versions(self) -> dict[str, Any]:
        """The driver stack's versions and each GPU's firmware, as heartbeats carry them."""
        return {
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "rocm_version": self.rocm_version,
            "level_zero_version": self.level_zero_version,
            "gpus": [{"uuid": gpu.uuid, "firmware_version": gpu.firmware_version} for gpu in self.gpus],
        }

    def gpu(self, uuid: str) -> GpuInfo | None:
        return next((gpu for gpu in self.gpus if gpu.uuid == uuid), None)


@dataclass
class ProcessSample:
    pid: int
    used_mib: int | None
    workload_id: str | None = None


@dataclass
class GpuSample:
    """One GPU at one moment; the fields of a heartbeat ``samples`` entry. ``None``: not supported."""

    gpu_uuid: str
    ts: float
    util_pct: float | None = None
    mem_used_mib: int | None = None
    power_w: float | None = None
    temp_c: int | None = None
    sm_clock_mhz: int | None = None
    ecc_sbe: int | None = None
    ecc_dbe: int | None = None
    xid_errors: list[int] = field(default_factory=list)
    throttle_reasons: int | None = None
    retired_pages_pending: bool | None = None
    row_remap_failure: bool | None = None
    fell_off_bus: bool = False
    processes: list[ProcessSample] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The wire form. A gauge the GPU cannot report (utilisation in MIG mode, everything of a GPU
        that fell off the bus), a process's memory the driver does not tell, and the counters and
        flags not supported go as null: the portal stores "unknown", never a made-up 0."""
        # By hand rather than dataclasses.asdict (a deep copy through every field): 500 simulated
        # agents send ten samples of eight GPUs each per heartbeat.
        return {
            "gpu_uuid": self.gpu_uuid,
            "ts": rfc3339(self.ts),
            "util_pct": self.util_pct,
            "mem_used_mib": self.mem_used_mib,
            "power_w": self.power_w,
            "temp_c": self.temp_c,
            "sm_clock_mhz": self.sm_clock_mhz,
            "ecc_sbe": self.ecc_sbe,
            "ecc_dbe": self.ecc_dbe,
            "xid_errors": list(self.xid_errors),
            "throttle_reasons": self.throttle_reasons,
            "retired_pages_pending": self.retired_pages_pending,
            "row_remap_failure": self.row_remap_failure,
            "fell_off_bus": self.fell_off_bus,
            "processes": [
                {"pid": p.pid, "used_mib": p.used_mib, "workload_id": p.workload_id} for p in self.processes
            ],
        }


# Workload states, as the protocol names them.
STARTING = "starting"
RUNNING = "running"
EXITED = "exited"
FAILED = "failed"
STOPPED = "stopped"
PREEMPTED = "preempted"
TERMINAL_STATES = frozenset({EXITED, FAILED, STOPPED, PREEMPTED})


@dataclass
class WorkloadSpec:
    """The payload of a ``start_workload`` command."""

    workload_id: str
    image: str = ""
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    gpu_uuids: list[str] = field(default_factory=list)
    gpu_fraction_milli: int = 1000
    cpu_millicores: int | None = None
    ram_mib: int | None = None
    ports: list[Any] = field(default_factory=list)
    max_runtime_s: int | None = None
    sim_duration_s: float | None = None
    mig_profile: str = ""
    """Run on a MIG instance of this profile on ``gpu_uuids[0]`` (``1g.10gb``)."""
    mig_start: int | None = None
    """The memory slice the portal placed the instance at (made there, or the staff layout's)."""
    gpu_memory_limit_mib: int | None = None
    """GPU memory a fractional (non-MIG) share may use."""
    gpu_vendor: str = ""
    volumes: list[dict[str, Any]] = field(default_factory=list)
    """``{"volume_id", "mount_path", "size_gib"}`` each (see ``nodes.agent.volumes``)."""
    checkpoint: dict[str, Any] | None = None
    """``{"volume_id", "resume"}``: a checkpoint directory on that volume; ``resume`` after a requeue."""
    attempt: int = 0
    """The portal's placement number: a start of another attempt than the ended one's runs afresh."""
    platform_env: dict[str, str] = field(default_factory=dict)
    """Variables the platform sets for this placement (``workload_rules.PLATFORM_ENV_NAMES``)."""
    gang_network: dict[str, str] | None = None
    """A gang member's own address on the region's gang network (``check_gang_network``); None:
    the rendezvous goes through rank 0's node."""

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> WorkloadSpec:
        """The spec of a payload that obeys the workload rules; raises ``WorkloadRuleError`` (a
        ValueError naming the field) for one that does not, before any runtime sees it."""
        checked = check_start_payload(payload)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in checked.items() if key in known})


@dataclass
class WorkloadHandle:
    workload_id: str
    ref: str  # container id, process id, or timer name
    ports: dict[str, int] = field(default_factory=dict)  # container port -> the host port published


@dataclass
class WorkloadStatus:
    workload_id: str
    state: str
    exit_code: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    message: str = ""
    gpu_uuids: list[str] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_json(self) -> dict[str, Any]:
        return {
            "workload_id": self.workload_id,
            "state": self.state,
            "exit_code": self.exit_code,
            "started_at": rfc3339(self.started_at) if self.started_at is not None else None,
            "finished_at": rfc3339(self.finished_at) if self.finished_at is not None else None,
            "message": self.message,
        }
