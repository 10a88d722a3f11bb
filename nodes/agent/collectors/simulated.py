"""A simulated GPU server for demos, tests and capacity planning.

Its GPUs are declared by the fleet file (models and counts per node). Their numbers follow the
workloads the simulated runtime runs on them: utilisation near 0 when idle and high when running,
memory used in proportion to the workloads' share, power between idle and TDP with utilisation,
temperature following power with a lag. Everything is deterministic for a given seed. Faults (an
XID, a double-bit ECC error, a GPU falling off the bus, ...) can be injected through
``inject_fault`` or a JSON control file that the next sample reads and removes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import threading
import uuid as uuidlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodes.agent.collectors import CollectorError
from nodes.agent.types import GpuInfo, GpuSample, MigDevice, NodeInventory, ProcessSample
from nodes.mig_profiles import MigTable, best_start_free, check_placements, occupancy, starts_free, table_for

log = logging.getLogger(__name__)

UUID_NAMESPACE = uuidlib.UUID("6f1c3b52-5a0e-4f0b-9a51-8c8d7e0c2a11")
FAULT_KINDS = ("xid", "dbe", "sbe", "fell_off_bus", "retired_pages", "row_remap_failure", "clear")


@dataclass(frozen=True)
class ModelSpec:
    memory_mib: int
    tdp_w: float
    idle_w: float
    max_sm_clock_mhz: int
    vendor: str = "nvidia"


# Public specifications; the names are what the driver reports (what a real agent would send).
MODELS: dict[str, ModelSpec] = {
    "NVIDIA H200": ModelSpec(143771, 700, 90, 1980),
    "NVIDIA H100 80GB HBM3": ModelSpec(81559, 700, 70, 1980),
    "NVIDIA H100 PCIe": ModelSpec(81559, 350, 50, 1755),
    "NVIDIA A100-SXM4-80GB": ModelSpec(81920, 400, 55, 1410),
    "NVIDIA A100-SXM4-40GB": ModelSpec(40960, 400, 50, 1410),
    "NVIDIA A100-PCIE-40GB": ModelSpec(40960, 250, 35, 1410),
    "NVIDIA A100 80GB PCIe": ModelSpec(81920, 300, 40, 1410),
    "NVIDIA L40S": ModelSpec(46068, 350, 35, 2520),
    "NVIDIA L4": ModelSpec(23034, 72, 16, 2040),
    "NVIDIA A10": ModelSpec(23028, 150, 20, 1695),
    "Tesla T4": ModelSpec(15360, 70, 10, 1590),
    "Tesla V100-SXM2-16GB": ModelSpec(16384, 300, 40, 1530),
    "Tesla V100-SXM2-32GB": ModelSpec(32768, 300, 40, 1530),
    "AMD Instinct MI300X": ModelSpec(196592, 750, 140, 2100, "amd"),
    "AMD Instinct MI250": ModelSpec(65536, 500, 90, 1700, "amd"),
    "AMD Instinct MI250X": ModelSpec(65536, 500, 90, 1700, "amd"),
    "Intel(R) Data Center GPU Max 1550": ModelSpec(131072, 600, 100, 1600, "intel"),
    "Intel(R) Data Center GPU Max 1100": ModelSpec(49152, 300, 60, 1550, "intel"),
}
SIMULATED_FIRMWARE = "96.00.99.00.01"
DEFAULT_SPEC = ModelSpec(81920, 400, 50, 1500)
AMBIENT_C = 30.0
TEMP_TIME_CONSTANT_S = 20.0

# The load source answers, for a moment, which workloads run on which GPU and with what share
# (gpu_fraction_milli): {gpu_uuid: [(workload_id, fraction_milli), ...]}.
LoadSource = Callable[[float], dict[str, list[tuple[str, int]]]]


def spec_for(model: str) -> ModelSpec:
    if model in MODELS:
        return MODELS[model]
    lowered = model.lower()
    for name, spec in MODELS.items():
        if name.lower() in lowered or lowered in name.lower():
            return spec
    vendor = "amd" if "amd" in lowered else "intel" if "intel" in lowered else "nvidia"
    return ModelSpec(DEFAULT_SPEC.memory_mib, DEFAULT_SPEC.tdp_w, DEFAULT_SPEC.idle_w, 1500, vendor)


def simulated_gpu_uuid(hostname: str, index: int) -> str:
    return f"GPU-{uuidlib.uuid5(UUID_NAMESPACE, f'{hostname}/{index}')}"


class SimulatedCollector:
    name = "simulated"
    # Computed readings: a thread hop would cost more than the sample (a fleet process runs a
    # hundred agents sampling once a second).
    sample_blocks = False

    def __init__(
        self,
        gpus: list[dict[str, Any]] | None = None,
        hostname: str = "sim-node",
        seed: int = 0,
        interconnect: str = "nvswitch",
        control_file: str | Path | None = None,
        load_source: LoadSource | None = None,
    ) -> None:
        self.hostname = hostname
        self.seed = seed
        self.interconnect = interconnect
        self.control_file = Path(control_file) if control_file else None
        self.load_source = load_source
        self._lock = threading.Lock()
        self._gpus: list[tuple[GpuInfo, ModelSpec]] = []
        index = 0
        for entry in gpus or []:
            model = str(entry["model"])
            spec = spec_for(model)
            if entry.get("memory_mib"):  # the fleet file may state the catalog's memory
                spec = dataclasses.replace(spec, memory_mib=int(entry["memory_mib"]))
            for _ in range(int(entry.get("count", 1))):
                self._gpus.append((self._gpu_info(index, model, spec, len(self._gpus)), spec))
                index += 1
        count = len(self._gpus)
        for gpu, _ in self._gpus:
            gpu.numa_node = 0 if gpu.index < max(1, count // 2) else 1
        self._rngs = {gpu.uuid: random.Random(f"{seed}:{gpu.uuid}") for gpu, _ in self._gpus}
        self._temps: dict[str, tuple[float, float]] = {}  # uuid -> (ts, temp)
        self._ecc: dict[str, list[int]] = {gpu.uuid: [0, 0] for gpu, _ in self._gpus}
        self._sticky: dict[str, set[str]] = {gpu.uuid: set() for gpu, _ in self._gpus}
        self._pending_xids: dict[str, list[int]] = {}
        self._mig_serial = 0

    def _gpu_info(self, index: int, model: str, spec: ModelSpec, position: int) -> GpuInfo:
        if self.interconnect in ("nvswitch", "xgmi"):
            island: int | None = 0
        elif self.interconnect == "nvlink":
            island = index // 2
        else:
            island = None
        return GpuInfo(
            index=index,
            uuid=simulated_gpu_uuid(self.hostname, index),
            name=model,
            memory_mib=spec.memory_mib,
            pci_bus_id=f"0000:{0x18 + 0x10 * position:02x}:00.0",
            nvlink_island=island,
            firmware_version=SIMULATED_FIRMWARE,
        )

    def attach(self, load_source: LoadSource) -> None:
        """Make the numbers follow the workloads of a runtime (``SimulatedRuntime.gpu_load``)."""
        self.load_source = load_source

    def discover(self) -> NodeInventory:
        vendors = {spec.vendor for _, spec in self._gpus}
        return NodeInventory(
            gpus=[GpuInfo(**{**vars(gpu), "mig_devices": list(gpu.mig_devices)}) for gpu, _ in self._gpus],
            driver_version="560.35.03" if "nvidia" in vendors else "",
            cuda_version="12.6" if "nvidia" in vendors else "",
            rocm_version="6.2.0" if "amd" in vendors else "",
            interconnect=self.interconnect if self._gpus else "pcie",
            vendor="simulated",
        )

    # -- faults -----------------------------------------------------------------------------------

    def _resolve(self, gpu: str | int) -> str:
        for info, _ in self._gpus:
            if gpu in (info.uuid, info.index, str(info.index)):
                return info.uuid
        raise KeyError(f"no simulated GPU {gpu!r} on {self.hostname}")

    def inject_fault(self, gpu: str | int, kind: str, xid: int | None = None) -> None:
        """``xid`` (reported once, default XID 79), ``dbe``/``sbe`` (counter + 1), ``fell_off_bus``,
        ``retired_pages``, ``row_remap_failure`` (sticky), ``clear`` (sticky faults off)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; expected one of {', '.join(FAULT_KINDS)}")
        uuid = self._resolve(gpu)
        with self._lock:
            if kind == "xid":
                self._pending_xids.setdefault(uuid, []).append(int(xid if xid is not None else 79))
            elif kind == "sbe":
                self._ecc[uuid][0] += 1
            elif kind == "dbe":
                self._ecc[uuid][1] += 1
            elif kind == "clear":
                self._sticky[uuid].clear()
            else:
                self._sticky[uuid].add(kind)

    def _read_control_file(self) -> None:
        path = self.control_file
        # os.path rather than Path.exists: once a second per simulated node, pathlib's overhead shows.
        if path is None or not os.path.exists(path):
            return
        try:
            faults = json.loads(path.read_text() or "[]")
            path.unlink()
        except (OSError, ValueError) as exc:
            log.warning("fault control file %s cannot be read: %s", path, exc)
            return
        for fault in faults if isinstance(faults, list) else [faults]:
            try:
                self.inject_fault(fault["gpu"], fault["kind"], fault.get("xid"))
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("fault %r ignored: %s", fault, exc)

    # -- sampling ---------------------------------------------------------------------------------

    def sample(self, now: float) -> list[GpuSample]:
        self._read_control_file()
        load = self.load_source(now) if self.load_source else {}
        samples = []
        with self._lock:
            # Work on a MIG slice loads the slice's GPU.
            parents = {d.uuid: gpu.uuid for gpu, _ in self._gpus for d in gpu.mig_devices}
            if parents:
                by_gpu: dict[str, list[tuple[str, int]]] = {}
                for uuid, running in load.items():
                    by_gpu.setdefault(parents.get(uuid, uuid), []).extend(running)
                load = by_gpu
            xids, self._pending_xids = self._pending_xids, {}
            for gpu, spec in self._gpus:
                samples.append(
                    self._sample_gpu(gpu, spec, now, load.get(gpu.uuid, []), xids.get(gpu.uuid, []))
                )
        return samples

    def _sample_gpu(
        self, gpu: GpuInfo, spec: ModelSpec, now: float, workloads: list[tuple[str, int]], xids: list[int]
    ) -> GpuSample:
        sticky = self._sticky[gpu.uuid]
        if "fell_off_bus" in sticky:
            return GpuSample(gpu_uuid=gpu.uuid, ts=now, fell_off_bus=True, xid_errors=xids or [79])
        rng = self._rngs[gpu.uuid]
        share = min(1.0, sum(fraction for _, fraction in workloads) / 1000.0)
        util = min(100.0, share * rng.uniform(88.0, 99.0)) if workloads else rng.uniform(0.0, 2.0)
        processes = []
        mem_used = 0
        for workload_id, fraction in workloads:
            # Each workload holds a steady share of memory: 60-90% of its slice, fixed per workload.
            ratio = 0.6 + 0.3 * (zlib.crc32(workload_id.encode()) % 1000) / 1000.0
            used = int(spec.memory_mib * min(1.0, fraction / 1000.0) * ratio)
            mem_used += used
            pid = 10000 + zlib.crc32(f"{gpu.uuid}/{workload_id}".encode()) % 50000
            processes.append(ProcessSample(pid=pid, used_mib=used, workload_id=workload_id))
        power = spec.idle_w + (spec.tdp_w - spec.idle_w) * (util / 100.0) * rng.uniform(0.92, 1.0)
        power = min(spec.tdp_w, power)
        target = AMBIENT_C + 55.0 * power / spec.tdp_w
        previous = self._temps.get(gpu.uuid)
        if previous is None:
            temp = target
        else:
            elapsed = max(0.0, now - previous[0])
            temp = previous[1] + (target - previous[1]) * min(1.0, elapsed / TEMP_TIME_CONSTANT_S)
        self._temps[gpu.uuid] = (now, temp)
        clock = int(spec.max_sm_clock_mhz * rng.uniform(0.95, 1.0)) if workloads else 345
        sbe, dbe = self._ecc[gpu.uuid]
        return GpuSample(
            gpu_uuid=gpu.uuid,
            ts=now,
            util_pct=None if gpu.mig_mode else round(util, 1),  # NVML has no utilisation in MIG mode
            mem_used_mib=min(spec.memory_mib, mem_used),
            power_w=round(power, 1),
            temp_c=round(temp),
            sm_clock_mhz=clock,
            ecc_sbe=sbe,
            ecc_dbe=dbe,
            xid_errors=xids,
            throttle_reasons=0,
            retired_pages_pending="retired_pages" in sticky,
            row_remap_failure="row_remap_failure" in sticky,
            processes=processes,
        )

    # MIG as the hardware does it (``nodes.mig_profiles``): instances at valid starts on free memory
    # slices within the compute slices; MIG mode changes only by ``configure_mig``.

    def _mig_table(self, gpu: GpuInfo) -> MigTable:
        table = table_for(gpu.name)
        if table is None:
            raise CollectorError(f"{gpu.name} does not support MIG")
        return table

    def _mig_device(self, gpu: GpuInfo, table: MigTable, profile: str, start: int) -> MigDevice:
        p = table.profile(profile)
        if p is None or start not in p.starts:
            raise CollectorError(f"Invalid Argument: {profile} cannot start at memory slice {start}")
        if start not in starts_free(table, *self._occupancy(gpu, table), profile):
            raise CollectorError(
                f"Insufficient Resources: no {profile} instance can start at memory slice {start} on {gpu.uuid}"
            )
        self._mig_serial += 1
        memory_gb = int(profile.split(".", 1)[1].removesuffix("gb"))
        device = MigDevice(
            uuid=f"MIG-{uuidlib.uuid5(UUID_NAMESPACE, f'{gpu.uuid}/{self._mig_serial}/{profile}/{start}')}",
            name=f"{gpu.name} MIG {profile}",
            memory_mib=memory_gb * 1024,
            profile=profile,
            start=start,
        )
        gpu.mig_devices.append(device)
        return device

    @staticmethod
    def _occupancy(gpu: GpuInfo, table: MigTable) -> tuple[int, int]:
        found = occupancy(table, [(d.profile, d.start or 0) for d in gpu.mig_devices])
        return found if found is not None else (0, 0)

    def configure_mig(self, gpu_uuid: str, enable: bool, placements: list[tuple[str, int]]) -> dict[str, Any]:
        gpu = self._gpu(gpu_uuid)
        table = self._mig_table(gpu)
        try:
            check_placements(table, placements)
        except ValueError as exc:
            raise CollectorError(str(exc)) from exc
        with self._lock:
            gpu.mig_devices = []
            gpu.mig_mode = enable
            created = []
            for profile, start in placements if enable else []:
                device = self._mig_device(gpu, table, profile, start)
                created.append({"profile": profile, "start": start, "mig_uuid": device.uuid})
        return {"gpu_uuid": gpu.uuid, "mig_mode": enable, "created": created}

    def _gpu(self, gpu_uuid: str) -> GpuInfo:
        try:
            uuid = self._resolve(gpu_uuid)
        except KeyError as exc:
            raise CollectorError(str(exc)) from exc
        return next(info for info, _ in self._gpus if info.uuid == uuid)

    def create_mig_instance(self, gpu_uuid: str, profile: str, start: int | None = None) -> dict[str, Any]:
        gpu = self._gpu(gpu_uuid)
        table = self._mig_table(gpu)
        if table.profile(profile) is None:
            raise CollectorError(f"this GPU has no MIG profile named {profile}")
        with self._lock:
            if not gpu.mig_mode:
                raise CollectorError(f"MIG mode is off on {gpu.uuid}; staff turn it on (configure_mig)")
            if start is None:
                start = best_start_free(table, *self._occupancy(gpu, table), profile)
                if start is None:
                    raise CollectorError(
                        f"Insufficient Resources: no room for a {profile} instance on {gpu.uuid}"
                    )
            there = next((d for d in gpu.mig_devices if (d.profile, d.start) == (profile, start)), None)
            made = there is None
            device = there or self._mig_device(gpu, table, profile, start)
        return {
            "gpu_uuid": gpu.uuid,
            "mig_uuid": device.uuid,
            "profile": profile,
            "start": start,
            "made": made,
        }

    def destroy_mig_instance(self, gpu_uuid: str, mig_uuid: str) -> dict[str, Any]:
        gpu = self._gpu(gpu_uuid)
        with self._lock:
            kept = [d for d in gpu.mig_devices if d.uuid != mig_uuid]
            destroyed = len(kept) < len(gpu.mig_devices)
            gpu.mig_devices = kept
        return {"gpu_uuid": gpu.uuid, "mig_uuid": mig_uuid, "destroyed": destroyed}

    def close(self) -> None:
        self.load_source = None
