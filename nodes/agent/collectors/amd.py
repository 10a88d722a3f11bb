"""AMD GPUs through AMD SMI (the ``amdsmi`` Python package that ships with ROCm).

Written against the documented amdsmi Python API (ROCm 6.x): ``amdsmi_init``,
``amdsmi_get_processor_handles``, ``amdsmi_get_gpu_asic_info`` / ``_device_uuid`` / ``_device_bdf`` /
``_vram_usage`` (MB) / ``_activity`` / ``_total_ecc_count`` / ``_process_list``,
``amdsmi_get_power_info`` (W), ``amdsmi_get_temp_metric``, ``amdsmi_get_clock_info`` and
``amdsmi_topo_get_link_type`` / ``amdsmi_topo_get_numa_node_number``, ``amdsmi_get_gpu_vbios_info``
(the firmware). Each GPU's render node comes from its PCI bus id (``collectors.devices``), and the
node's ``/dev/kfd`` (the ROCm compute interface every workload needs) is checked at discovery.
GPUs are numbered in PCI order, the order the ROCm runtime enumerates them in. Values the library answers
"N/A" for, or refuses with an exception, become ``None``. AMD has no XID events; ``xid_errors`` is
always empty here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from nodes.agent.collectors import CollectorError, CollectorUnavailable
from nodes.agent.collectors.devices import render_node
from nodes.agent.collectors.nvml import group_islands
from nodes.agent.types import GpuInfo, GpuSample, NodeInventory, ProcessSample

log = logging.getLogger(__name__)

MIB = 1024 * 1024
XGMI_LINK_TYPE = 2  # AMDSMI_IOLINK_TYPE_XGMI


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(str(value).split()[0])
    except (ValueError, IndexError):  # "N/A"
        return None


class AmdSmiCollector:
    name = "amdsmi"

    def __init__(self, *, dev_root: str | Path = "/dev", sysfs_root: str | Path = "/sys") -> None:
        self.dev_root = Path(dev_root)
        self.sysfs_root = Path(sysfs_root)
        try:
            import amdsmi
        except ImportError as exc:
            raise CollectorUnavailable(
                f"AMD SMI is not available: the amdsmi module cannot be imported ({exc})"
            ) from exc
        self.smi = amdsmi
        try:
            amdsmi.amdsmi_init()
        except amdsmi.AmdSmiException as exc:
            raise CollectorUnavailable(f"AMD SMI is not available: {exc}") from exc
        self._open = True
        self._handles: dict[str, Any] = {}
        self.inventory: NodeInventory | None = None

    def _get(self, fn_name: str, *args: Any) -> Any:
        fn = getattr(self.smi, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.smi.AmdSmiException as exc:
            log.debug("amdsmi %s failed: %s", fn_name, exc)
            return None

    def discover(self) -> NodeInventory:
        smi = self.smi
        gpus: list[GpuInfo] = []
        self._handles = {}
        handles = smi.amdsmi_get_processor_handles()
        bus_ids = {id(h): str(self._get("amdsmi_get_gpu_device_bdf", h) or "").lower() for h in handles}
        for index, handle in enumerate(sorted(handles, key=lambda h: bus_ids[id(h)])):
            uuid = str(smi.amdsmi_get_gpu_device_uuid(handle))
            asic = self._get("amdsmi_get_gpu_asic_info", handle) or {}
            vram = self._get("amdsmi_get_gpu_vram_usage", handle) or {}
            numa = self._get("amdsmi_topo_get_numa_node_number", handle)
            vbios = self._get("amdsmi_get_gpu_vbios_info", handle) or {}
            total = _number(vram.get("vram_total"))
            bus_id = bus_ids[id(handle)]
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=uuid,
                    name=str(asic.get("market_name") or "AMD GPU"),
                    memory_mib=int(total) if total is not None else 0,
                    pci_bus_id=bus_id,
                    numa_node=numa if isinstance(numa, int) and numa >= 0 else None,
                    render_node=render_node(bus_id, dev_root=self.dev_root, sysfs_root=self.sysfs_root),
                    firmware_version=str(vbios.get("version") or vbios.get("vbios_version") or ""),
                )
            )
            self._handles[uuid] = handle
        interconnect = self._assign_xgmi_islands(gpus)
        driver = self._get("amdsmi_get_gpu_driver_info", handles[0]) if handles else None
        rocm = self._get("amdsmi_get_rocm_version")
        if isinstance(rocm, tuple):  # some releases answer (ok, version)
            rocm = rocm[1] if rocm[0] else ""
        self.inventory = NodeInventory(
            gpus=gpus,
            driver_version=str((driver or {}).get("driver_version", "")),
            rocm_version=str(rocm or ""),
            interconnect=interconnect,
            vendor="amd",
            node_devices=[str(self.dev_root / "kfd")],
        )
        return self.inventory

    def _assign_xgmi_islands(self, gpus: list[GpuInfo]) -> str:
        edges: dict[str, set[str]] = {}
        for a in gpus:
            for b in gpus:
                if a.index >= b.index:
                    continue
                link = self._get("amdsmi_topo_get_link_type", self._handles[a.uuid], self._handles[b.uuid])
                if not link or int(link.get("type", -1)) != XGMI_LINK_TYPE:
                    continue
                edges.setdefault(a.uuid, set()).add(b.uuid)
                edges.setdefault(b.uuid, set()).add(a.uuid)
        islands = group_islands(edges, [gpu.uuid for gpu in gpus])
        for gpu in gpus:
            gpu.nvlink_island = islands.get(gpu.uuid)
        return "xgmi" if edges else "pcie"

    def sample(self, now: float) -> list[GpuSample]:
        if self.inventory is None:
            self.discover()
        return [self._sample_gpu(uuid, handle, now) for uuid, handle in self._handles.items()]

    def _temperature(self, handle: Any) -> int | None:
        smi = self.smi
        types = smi.AmdSmiTemperatureType
        # MI300 has no edge sensor; the hotspot (junction) sensor is there on every Instinct part.
        for sensor in ("EDGE", "HOTSPOT", "JUNCTION"):
            if hasattr(types, sensor):
                value = self._get(
                    "amdsmi_get_temp_metric",
                    handle,
                    getattr(types, sensor),
                    smi.AmdSmiTemperatureMetric.CURRENT,
                )
                number = _number(value)
                if number is not None:
                    return int(number)
        return None

    def _processes(self, handle: Any) -> list[ProcessSample]:
        found = []
        for item in self._get("amdsmi_get_gpu_process_list", handle) or []:
            info = item if isinstance(item, dict) else self._get("amdsmi_get_gpu_process_info", handle, item)
            if not info:
                continue
            usage = info.get("memory_usage") or {}
            vram = _number(usage.get("vram_mem"))
            found.append(
                ProcessSample(pid=int(info["pid"]), used_mib=int(vram) // MIB if vram is not None else None)
            )
        return found

    def _sample_gpu(self, uuid: str, handle: Any, now: float) -> GpuSample:
        smi = self.smi
        activity = self._get("amdsmi_get_gpu_activity", handle) or {}
        vram = self._get("amdsmi_get_gpu_vram_usage", handle) or {}
        power = self._get("amdsmi_get_power_info", handle) or {}
        clock = self._get("amdsmi_get_clock_info", handle, smi.AmdSmiClkType.GFX) or {}
        ecc = self._get("amdsmi_get_gpu_total_ecc_count", handle)
        util = _number(activity.get("gfx_activity"))
        used = _number(vram.get("vram_used"))
        watts = next(
            (
                _number(power[key])
                for key in ("socket_power", "current_socket_power", "average_socket_power")
                if _number(power.get(key)) is not None
            ),
            None,
        )
        sm_clock = _number(clock.get("clk", clock.get("cur_clk")))
        sbe = _number(ecc.get("correctable_count")) if ecc else None
        dbe = _number(ecc.get("uncorrectable_count")) if ecc else None
        return GpuSample(
            gpu_uuid=uuid,
            ts=now,
            util_pct=util,
            mem_used_mib=int(used) if used is not None else None,
            power_w=watts,
            temp_c=self._temperature(handle),
            sm_clock_mhz=int(sm_clock) if sm_clock is not None else None,
            ecc_sbe=int(sbe) if sbe is not None else None,
            ecc_dbe=int(dbe) if dbe is not None else None,
            processes=self._processes(handle),
        )

    def configure_mig(self, gpu_uuid: str, enable: bool, placements: list[tuple[str, int]]) -> dict[str, Any]:
        raise CollectorError(
            "MIG is an NVIDIA feature; AMD GPUs are partitioned with compute partitions instead"
        )

    def create_mig_instance(self, gpu_uuid: str, profile: str, start: int | None = None) -> dict[str, Any]:
        return self.configure_mig(gpu_uuid, True, [(profile, start or 0)])

    def destroy_mig_instance(self, gpu_uuid: str, mig_uuid: str) -> dict[str, Any]:
        return self.configure_mig(gpu_uuid, False, [])

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            self.smi.amdsmi_shut_down()
        except self.smi.AmdSmiException as exc:
            log.warning("amdsmi shutdown failed: %s", exc)
