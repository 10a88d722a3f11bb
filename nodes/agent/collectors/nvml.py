"""NVIDIA GPUs through NVML (the ``pynvml`` module of the ``nvidia-ml-py`` package).

Every query that a GPU does not support (``NVML_ERROR_NOT_SUPPORTED`` and friends) gives ``None``
for that field; a GPU that fell off the bus (``NVML_ERROR_GPU_IS_LOST``) gives a sample with
``fell_off_bus: true``. XID errors come from an NVML event set that each sample drains without
waiting.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from pathlib import Path
from typing import Any

from nodes.agent.collectors import CollectorError, CollectorUnavailable
from nodes.agent.types import GpuInfo, GpuSample, MigDevice, NodeInventory, ProcessSample
from nodes.mig_profiles import MigProfile, MigTable, best_start, check_placements, table_for

log = logging.getLogger(__name__)

MIB = 1024 * 1024
MAX_EVENTS_PER_SAMPLE = 1000


class _GpuLost(Exception):
    pass


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML writes ``00000000:18:00.0``; sysfs and the portal use ``0000:18:00.0`` (lower case)."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    text = text.strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        with contextlib.suppress(ValueError):
            parts[0] = f"{int(parts[0], 16):04x}"
    return ":".join(parts)


def read_numa_node(bus_id: str, sysfs_root: Path) -> int | None:
    path = sysfs_root / "bus" / "pci" / "devices" / bus_id / "numa_node"
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def group_islands(edges: dict[str, set[str]], order: list[str]) -> dict[str, int]:
    """Union GPUs that share an NVLink endpoint (a peer GPU or an NVSwitch); islands are numbered
    in the order of ``order`` (GPU index). GPUs absent from ``edges`` have no island."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        parent.setdefault(key, key)
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for gpu, peers in edges.items():
        for peer in peers:
            parent[find(peer)] = find(gpu)
    islands: dict[str, int] = {}
    numbers: dict[str, int] = {}
    for gpu in order:
        if gpu not in edges:
            continue
        root = find(gpu)
        islands[gpu] = numbers.setdefault(root, len(numbers))
    return islands


class NvmlCollector:
    name = "nvml"

    def __init__(self, sysfs_root: str | Path = "/sys") -> None:
        try:
            import pynvml
        except ImportError as exc:  # nvidia-ml-py is a dependency; this is a broken install
            raise CollectorUnavailable(
                f"NVML is not available: the pynvml module cannot be imported ({exc})"
            ) from exc
        self.nvml = pynvml
        self.sysfs_root = Path(sysfs_root)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise CollectorUnavailable(f"NVML is not available: {exc}") from exc
        self._open = True
        self._handles: dict[str, Any] = {}  # uuid -> device handle
        self._event_set: Any = None
        self.lost_indices: list[int] = []
        self.inventory: NodeInventory | None = None

    # -- helpers ----------------------------------------------------------------------------------

    def _code(self, exc: Exception) -> int | None:
        return getattr(exc, "value", None)

    def _get(self, fn_name: str, *args: Any) -> Any:
        """Call an NVML function; ``None`` when this GPU or driver cannot answer it; raises
        ``_GpuLost`` when the GPU fell off the bus."""
        nvml = self.nvml
        fn = getattr(nvml, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            code = self._code(exc)
            if code == nvml.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost() from exc
            if code not in (
                nvml.NVML_ERROR_NOT_SUPPORTED,
                nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                nvml.NVML_ERROR_NO_PERMISSION,
                nvml.NVML_ERROR_NOT_FOUND,
                nvml.NVML_ERROR_INVALID_ARGUMENT,
            ):
                log.warning("NVML %s failed: %s", fn_name, exc)
            return None

    @staticmethod
    def _text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    # -- discovery --------------------------------------------------------------------------------

    def discover(self) -> NodeInventory:
        nvml = self.nvml
        count = nvml.nvmlDeviceGetCount()
        gpus: list[GpuInfo] = []
        self._handles = {}
        self.lost_indices = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                gpu = self._describe(index, handle)
            except (_GpuLost, nvml.NVMLError) as exc:
                # Without a handle or UUID there is nothing to report this GPU under; it shows as
                # missing from the inventory, and gpu-check prints it.
                log.error(
                    "GPU %d cannot be read (%s); it is left out of the inventory",
                    index,
                    str(exc) or "GPU is lost",
                )
                self.lost_indices.append(index)
                continue
            self._handles[gpu.uuid] = handle
            gpus.append(gpu)
        interconnect = self._assign_nvlink_islands(gpus)
        cuda = self._get("nvmlSystemGetCudaDriverVersion")
        self.inventory = NodeInventory(
            gpus=gpus,
            driver_version=self._text(self._get("nvmlSystemGetDriverVersion") or ""),
            cuda_version=f"{cuda // 1000}.{(cuda % 1000) // 10}" if cuda else "",
            interconnect=interconnect,
            vendor="nvidia",
        )
        self._register_events()
        return self.inventory

    def _describe(self, index: int, handle: Any) -> GpuInfo:
        nvml = self.nvml
        uuid = self._text(nvml.nvmlDeviceGetUUID(handle))
        name = self._text(nvml.nvmlDeviceGetName(handle))
        memory = self._get("nvmlDeviceGetMemoryInfo", handle)
        pci = self._get("nvmlDeviceGetPciInfo", handle)
        bus_id = normalize_bus_id(pci.busId) if pci is not None else ""
        numa = read_numa_node(bus_id, self.sysfs_root) if bus_id else None
        if numa is None:
            numa_id = self._get("nvmlDeviceGetNumaNodeId", handle)
            numa = numa_id if isinstance(numa_id, int) and numa_id >= 0 else None
        mig = self._get("nvmlDeviceGetMigMode", handle)
        mig_mode = bool(mig) and mig[0] == nvml.NVML_DEVICE_MIG_ENABLE
        return GpuInfo(
            index=index,
            uuid=uuid,
            name=name,
            memory_mib=memory.total // MIB if memory is not None else 0,
            pci_bus_id=bus_id,
            numa_node=numa,
            mig_mode=mig_mode,
            mig_devices=self._mig_devices(handle) if mig_mode else [],
            firmware_version=self._text(self._get("nvmlDeviceGetVbiosVersion", handle) or ""),
        )

    def _mig_devices(self, handle: Any) -> list[MigDevice]:
        nvml = self.nvml
        devices = []
        for slot in range(self._get("nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
            mig_handle = self._get("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            if mig_handle is None:  # an empty slot answers NVML_ERROR_NOT_FOUND
                continue
            memory = self._get("nvmlDeviceGetMemoryInfo", mig_handle)
            devices.append(
                MigDevice(
                    uuid=self._text(nvml.nvmlDeviceGetUUID(mig_handle)),
                    name=self._text(self._get("nvmlDeviceGetName", mig_handle) or ""),
                    memory_mib=memory.total // MIB if memory is not None else 0,
                )
            )
        return devices

    def _assign_nvlink_islands(self, gpus: list[GpuInfo]) -> str:
        """Group GPUs joined by active NVLinks (directly or through NVSwitches) into islands."""
        nvml = self.nvml
        gpu_buses = {gpu.pci_bus_id for gpu in gpus}
        edges: dict[str, set[str]] = {}
        through_switch = False
        for gpu in gpus:
            handle = self._handles[gpu.uuid]
            for link in range(nvml.NVML_NVLINK_MAX_LINKS):
                try:
                    active = self._get("nvmlDeviceGetNvLinkState", handle, link)
                    if active != nvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = self._get("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
                    kind = self._get("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
                except _GpuLost:
                    break
                if remote is None:
                    continue
                remote_bus = normalize_bus_id(remote.busId)
                if kind == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH or remote_bus not in gpu_buses:
                    through_switch = True
                    peer = f"switch:{remote_bus}"
                else:
                    peer = f"gpu:{remote_bus}"
                edges.setdefault(f"gpu:{gpu.pci_bus_id}", set()).add(peer)
        islands = group_islands(edges, [f"gpu:{gpu.pci_bus_id}" for gpu in gpus])
        for gpu in gpus:
            gpu.nvlink_island = islands.get(f"gpu:{gpu.pci_bus_id}")
        if not edges:
            return "pcie"
        return "nvswitch" if through_switch else "nvlink"

    def _register_events(self) -> None:
        nvml = self.nvml
        if self._event_set is None:
            try:
                self._event_set = nvml.nvmlEventSetCreate()
            except nvml.NVMLError as exc:
                log.warning("NVML event set cannot be created, XID errors will not be seen: %s", exc)
                return
        for uuid, handle in self._handles.items():
            try:
                supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
                wanted = nvml.nvmlEventTypeXidCriticalError & supported
                if wanted:
                    nvml.nvmlDeviceRegisterEvents(handle, wanted, self._event_set)
                else:
                    log.warning("GPU %s does not report XID events", uuid)
            except nvml.NVMLError as exc:
                log.warning("GPU %s: XID events cannot be registered: %s", uuid, exc)

    # -- sampling ---------------------------------------------------------------------------------

    def _drain_xid_events(self) -> dict[str, list[int]]:
        nvml = self.nvml
        found: dict[str, list[int]] = {}
        if self._event_set is None:
            return found
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            try:
                data = nvml.nvmlEventSetWait(self._event_set, 0)
            except nvml.NVMLError as exc:
                if self._code(exc) != nvml.NVML_ERROR_TIMEOUT:
                    log.warning("NVML event wait failed: %s", exc)
                break
            if not data.eventType & nvml.nvmlEventTypeXidCriticalError:
                continue
            uuid = self._uuid_of_event_device(data.device)
            found.setdefault(uuid, []).append(int(data.eventData))
        return found

    def _uuid_of_event_device(self, device: Any) -> str:
        nvml = self.nvml
        try:
            uuid = self._text(nvml.nvmlDeviceGetUUID(device))
        except nvml.NVMLError:
            return ""
        if uuid in self._handles:
            return uuid
        # An event on a MIG device: report it on its parent GPU.
        try:
            parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(device)
            return self._text(nvml.nvmlDeviceGetUUID(parent))
        except (nvml.NVMLError, AttributeError):
            return uuid

    def sample(self, now: float) -> list[GpuSample]:
        if self.inventory is None:
            self.discover()
        xids = self._drain_xid_events()
        samples = []
        for uuid, handle in self._handles.items():
            try:
                sample = self._sample_gpu(uuid, handle, now)
            except _GpuLost:
                log.error("GPU %s fell off the bus (NVML_ERROR_GPU_IS_LOST)", uuid)
                sample = GpuSample(gpu_uuid=uuid, ts=now, fell_off_bus=True)
            sample.xid_errors = xids.get(uuid, [])
            samples.append(sample)
        return samples

    def _sample_gpu(self, uuid: str, handle: Any, now: float) -> GpuSample:
        nvml = self.nvml
        get = self._get
        util = get("nvmlDeviceGetUtilizationRates", handle)
        memory = get("nvmlDeviceGetMemoryInfo", handle)
        power_mw = get("nvmlDeviceGetPowerUsage", handle)
        if hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons"):
            throttle = get("nvmlDeviceGetCurrentClocksEventReasons", handle)
        else:
            throttle = get("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        retired = get("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        remapped = get("nvmlDeviceGetRemappedRows", handle)
        processes = get("nvmlDeviceGetComputeRunningProcesses", handle) or []
        return GpuSample(
            gpu_uuid=uuid,
            ts=now,
            util_pct=float(util.gpu) if util is not None else None,
            mem_used_mib=memory.used // MIB if memory is not None else None,
            power_w=round(power_mw / 1000.0, 3) if power_mw is not None else None,
            temp_c=get("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU),
            sm_clock_mhz=get("nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM),
            ecc_sbe=get(
                "nvmlDeviceGetTotalEccErrors",
                handle,
                nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nvml.NVML_VOLATILE_ECC,
            ),
            ecc_dbe=get(
                "nvmlDeviceGetTotalEccErrors",
                handle,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            ),
            throttle_reasons=throttle,
            retired_pages_pending=(retired == nvml.NVML_FEATURE_ENABLED) if retired is not None else None,
            row_remap_failure=bool(remapped[3]) if remapped is not None else None,
            processes=[
                ProcessSample(
                    pid=int(proc.pid),
                    used_mib=proc.usedGpuMemory // MIB if proc.usedGpuMemory is not None else None,
                )
                for proc in processes
            ],
        )

    # -- MIG --------------------------------------------------------------------------------------
    # MIG mode changes only by ``configure_mig`` (staff, through the portal); making and destroying
    # a workload's instance never touches it. Instances are made at the start the portal chose
    # (``nvmlDeviceCreateGpuInstanceWithPlacement``), checked first against the profile table of
    # ``nodes.mig_profiles`` so that what the portal placed and what the GPU holds agree.

    def _handle(self, gpu_uuid: str) -> Any:
        if self.inventory is None:
            self.discover()
        handle = self._handles.get(gpu_uuid)
        if handle is None:
            raise CollectorError(f"no GPU {gpu_uuid} on this node")
        return handle

    def _why(self, exc: Any) -> str:
        """An NVML error with its code's name (``NVML_ERROR_INSUFFICIENT_RESOURCES``): the driver's
        text for some codes is only a number."""
        code = getattr(exc, "value", None)
        name = next(
            (n for n in dir(self.nvml) if n.startswith("NVML_ERROR_") and getattr(self.nvml, n) == code), None
        )
        return f"{exc} ({name})" if name else str(exc)

    def _table(self, handle: Any) -> MigTable:
        name = self._text(self.nvml.nvmlDeviceGetName(handle))
        table = table_for(name)
        if table is None:
            raise CollectorError(f"{name} has no MIG profiles this agent knows")
        return table

    def _mig_on(self, handle: Any, gpu_uuid: str) -> None:
        nvml = self.nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as exc:
            raise CollectorError(f"MIG mode of {gpu_uuid} cannot be read: {exc}") from exc
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            raise CollectorError(f"MIG mode is off on {gpu_uuid}; staff turn it on (configure_mig)")

    def _profile_id(self, handle: Any, profile: MigProfile) -> int:
        nvml = self.nvml
        try:
            constant = getattr(nvml, f"NVML_GPU_INSTANCE_PROFILE_{profile.nvml_profile}")
            return int(nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant).id)
        except (nvml.NVMLError, AttributeError) as exc:
            raise CollectorError(f"this GPU cannot make MIG profile {profile.name}: {exc}") from exc

    def _instances(self, handle: Any, table: MigTable) -> list[dict[str, Any]]:
        """The GPU's instances as ``{"profile", "start", "mig_uuid", "gi", "ci"}``, from its MIG devices."""
        nvml = self.nvml
        names = {}
        for profile in table.profiles:
            with contextlib.suppress(CollectorError):
                names[self._profile_id(handle, profile)] = profile.name
        found = []
        for mig in self._mig_handles(handle):
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle, nvml.nvmlDeviceGetGpuInstanceId(mig))
            info = nvml.nvmlGpuInstanceGetInfo(gi)
            found.append(
                {
                    "profile": names.get(int(info.profileId), ""),
                    "start": int(info.placement.start),
                    "mig_uuid": self._text(nvml.nvmlDeviceGetUUID(mig)),
                    "gi": gi,
                    "ci": nvml.nvmlGpuInstanceGetComputeInstanceById(
                        gi, nvml.nvmlDeviceGetComputeInstanceId(mig)
                    ),
                }
            )
        return found

    def _make_instance(self, handle: Any, table: MigTable, profile_name: str, start: int) -> str:
        """Make one GPU instance of ``profile_name`` at ``start`` with one compute instance over all
        of it; returns its MIG device UUID. A GPU instance whose compute instance fails goes again."""
        nvml = self.nvml
        profile = table.profile(profile_name)
        if profile is None:
            raise CollectorError(f"this GPU has no MIG profile named {profile_name}")
        placement = nvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, profile.memory
        try:
            instance = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                handle, self._profile_id(handle, profile), ctypes.pointer(placement)
            )
        except nvml.NVMLError as exc:
            raise CollectorError(
                f"creating MIG instance {profile_name} at {start} failed: {self._why(exc)}"
            ) from exc
        try:
            compute = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                instance,
                getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{profile.compute}_SLICE"),
                nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
            )
            made = nvml.nvmlGpuInstanceCreateComputeInstance(instance, compute.id)
            gi_id = nvml.nvmlGpuInstanceGetInfo(instance).id
            ci_id = nvml.nvmlComputeInstanceGetInfo(made).id
            mig_uuid = next(
                (
                    self._text(nvml.nvmlDeviceGetUUID(mig))
                    for mig in self._mig_handles(handle)
                    if nvml.nvmlDeviceGetGpuInstanceId(mig) == gi_id
                    and nvml.nvmlDeviceGetComputeInstanceId(mig) == ci_id
                ),
                None,
            )
            if mig_uuid is None:
                nvml.nvmlComputeInstanceDestroy(made)
                raise CollectorError(f"the new {profile_name} instance has no MIG device")
        except (nvml.NVMLError, AttributeError, CollectorError) as exc:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlGpuInstanceDestroy(instance)
            why = self._why(exc) if isinstance(exc, nvml.NVMLError) else str(exc)
            raise CollectorError(f"creating MIG instance {profile_name} failed: {why}") from exc
        return mig_uuid

    def _destroy(self, instance: dict[str, Any]) -> None:
        nvml = self.nvml
        try:
            nvml.nvmlComputeInstanceDestroy(instance["ci"])
            nvml.nvmlGpuInstanceDestroy(instance["gi"])
        except nvml.NVMLError as exc:
            raise CollectorError(f"destroying MIG instance {instance['mig_uuid']} failed: {exc}") from exc

    def configure_mig(self, gpu_uuid: str, enable: bool, placements: list[tuple[str, int]]) -> dict[str, Any]:
        nvml = self.nvml
        handle = self._handle(gpu_uuid)
        table = self._table(handle)
        try:
            check_placements(table, placements)
        except ValueError as exc:
            raise CollectorError(str(exc)) from exc
        current = nvml.NVML_DEVICE_MIG_DISABLE
        with contextlib.suppress(nvml.NVMLError):
            current = nvml.nvmlDeviceGetMigMode(handle)[0]
        if current == nvml.NVML_DEVICE_MIG_ENABLE:
            for instance in self._instances(handle, table):
                self._destroy(instance)
        mode = nvml.NVML_DEVICE_MIG_ENABLE if enable else nvml.NVML_DEVICE_MIG_DISABLE
        try:
            nvml.nvmlDeviceSetMigMode(handle, mode)
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as exc:
            raise CollectorError(f"setting MIG mode on {gpu_uuid} failed: {exc}") from exc
        if current != mode:
            raise CollectorError(f"MIG mode on {gpu_uuid} is pending ({pending}) and needs a GPU reset")
        created = []
        for profile, start in placements if enable else []:
            mig_uuid = self._make_instance(handle, table, profile, start)
            created.append({"profile": profile, "start": start, "mig_uuid": mig_uuid})
        self.discover()
        return {"gpu_uuid": gpu_uuid, "mig_mode": enable, "created": created}

    def _mig_handles(self, handle: Any) -> list[Any]:
        found = []
        for slot in range(self._get("nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
            mig_handle = self._get("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            if mig_handle is not None:  # an empty slot answers NVML_ERROR_NOT_FOUND
                found.append(mig_handle)
        return found

    def create_mig_instance(self, gpu_uuid: str, profile: str, start: int | None = None) -> dict[str, Any]:
        handle = self._handle(gpu_uuid)
        self._mig_on(handle, gpu_uuid)
        table = self._table(handle)
        instances = self._instances(handle, table)
        if start is None:
            start = best_start(table, [(i["profile"], i["start"]) for i in instances], profile)
            if start is None:
                raise CollectorError(f"no room for a {profile} instance on {gpu_uuid}")
        there = next((i for i in instances if (i["profile"], i["start"]) == (profile, start)), None)
        if there is not None:  # an instance of the staff layout
            return {
                "gpu_uuid": gpu_uuid,
                "mig_uuid": there["mig_uuid"],
                "profile": profile,
                "start": start,
                "made": False,
            }
        mig_uuid = self._make_instance(handle, table, profile, start)
        self.discover()
        return {"gpu_uuid": gpu_uuid, "mig_uuid": mig_uuid, "profile": profile, "start": start, "made": True}

    def destroy_mig_instance(self, gpu_uuid: str, mig_uuid: str) -> dict[str, Any]:
        handle = self._handle(gpu_uuid)
        target = next(
            (i for i in self._instances(handle, self._table(handle)) if i["mig_uuid"] == mig_uuid), None
        )
        if target is not None:
            self._destroy(target)
            self.discover()
        return {"gpu_uuid": gpu_uuid, "mig_uuid": mig_uuid, "destroyed": target is not None}

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        nvml = self.nvml
        try:
            if self._event_set is not None:
                nvml.nvmlEventSetFree(self._event_set)
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.warning("NVML shutdown failed: %s", exc)
