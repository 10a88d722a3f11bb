"""The NVML collector against a fake at the ``pynvml`` module boundary.

The fake answers the functions the collector calls with the types the real module returns (byte
strings in PCI structs, bytes of memory, milliwatts, lists for MIG mode) and raises the real
``pynvml`` error classes with their real codes. Its constants and the placement struct come from the
real module. Its MIG is the hardware's: GPU instances only at a profile's valid starts
(``NVML_ERROR_INVALID_ARGUMENT`` otherwise), never on a memory slice another holds nor past the
compute slices (``NVML_ERROR_INSUFFICIENT_RESOURCES``), only in MIG mode (``NVML_ERROR_NOT_SUPPORTED``),
MIG mode unchangeable while instances exist and a GPU instance undestroyable while it has compute
instances (``NVML_ERROR_IN_USE``).
"""

from __future__ import annotations

import runpy
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml as real_nvml
import pytest

from nodes.agent.collectors import CollectorError, CollectorUnavailable, make_collector
from nodes.agent.collectors.nvml import NvmlCollector
from nodes.mig_profiles import table_for

GIB = 1024**3
MIB = 1024**2


@dataclass
class FakeGpu:
    uuid: str
    name: str
    bus_id: bytes
    total: int = 80 * GIB
    used: int = 0
    util: int = 0
    power_mw: int = 70_000
    temp: int = 35
    sm_clock: int = 1980
    ecc: tuple[int, int] | None = (0, 0)  # None: ECC not supported
    retired_pending: int | None = 0
    remapped: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    mig: list[int] | None = None  # [current, pending]; None: not supported
    mig_devices: list[FakeGpu] = field(default_factory=list)
    links: list[tuple[bytes, int]] = field(default_factory=list)  # (remote bus id, remote type)
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    lost: bool = False
    gi_id: int = 0
    ci_id: int = 0


class _Struct:
    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


# NVIDIA's GPU instance profile ids (``nvidia-smi mig -lgip``) per table entry.
PROFILE_IDS = {"1_SLICE": 19, "1_SLICE_REV2": 15, "2_SLICE": 14, "3_SLICE": 9, "4_SLICE": 5, "7_SLICE": 0}
A30_PROFILE_IDS = {"1_SLICE": 14, "2_SLICE": 5, "4_SLICE": 0}


def fake_pynvml(
    gpus: list[FakeGpu], init_error: int | None = None, fail_compute: bool = False
) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    for name in dir(real_nvml):
        if name.startswith(("NVML_", "NVMLError", "nvmlEventType")):
            setattr(nvml, name, getattr(real_nvml, name))
    nvml.c_nvmlGpuInstancePlacement_t = real_nvml.c_nvmlGpuInstancePlacement_t
    events: list[_Struct] = []
    calls: list[str] = []
    nvml.events = events
    nvml.calls = calls
    nvml.instances = []

    def err(code: int) -> Exception:
        return real_nvml.NVMLError(code)

    def device(handle: FakeGpu) -> FakeGpu:
        if handle.lost:
            raise err(real_nvml.NVML_ERROR_GPU_IS_LOST)
        return handle

    def nvmlInit() -> None:
        calls.append("init")
        if init_error is not None:
            raise err(init_error)

    nvml.nvmlInit = nvmlInit
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    nvml.nvmlSystemGetDriverVersion = lambda: "560.35.03"
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 12060
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    nvml.nvmlDeviceGetUUID = lambda h: device(h).uuid
    nvml.nvmlDeviceGetName = lambda h: device(h).name
    nvml.nvmlDeviceGetMemoryInfo = lambda h: _Struct(
        total=device(h).total, used=device(h).used, free=device(h).total - device(h).used
    )
    nvml.nvmlDeviceGetPciInfo = lambda h: _Struct(busId=device(h).bus_id, busIdLegacy=device(h).bus_id)

    def nvmlDeviceGetMigMode(h: FakeGpu) -> list[int]:
        if device(h).mig is None:
            raise err(real_nvml.NVML_ERROR_NOT_SUPPORTED)
        return list(h.mig)

    def nvmlDeviceSetMigMode(h: FakeGpu, mode: int) -> int:
        if device(h).mig is None:
            raise err(real_nvml.NVML_ERROR_NOT_SUPPORTED)
        if any(gi.parent is h for gi in nvml.instances):
            raise err(real_nvml.NVML_ERROR_IN_USE)
        h.mig = [mode, mode]
        return 0

    nvml.nvmlDeviceGetMigMode = nvmlDeviceGetMigMode
    nvml.nvmlDeviceSetMigMode = nvmlDeviceSetMigMode
    nvml.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7 if device(h).mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(h: FakeGpu, index: int) -> FakeGpu:
        if index >= len(device(h).mig_devices):
            raise err(real_nvml.NVML_ERROR_NOT_FOUND)
        return h.mig_devices[index]

    nvml.nvmlDeviceGetMigDeviceHandleByIndex = nvmlDeviceGetMigDeviceHandleByIndex

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h: FakeGpu) -> FakeGpu:
        return next(gpu for gpu in gpus if h in gpu.mig_devices)

    nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = nvmlDeviceGetDeviceHandleFromMigDeviceHandle

    def nvmlDeviceGetUtilizationRates(h: FakeGpu) -> _Struct:
        if device(h).mig and h.mig[0]:
            raise err(real_nvml.NVML_ERROR_NOT_SUPPORTED)  # as on a real GPU in MIG mode
        return _Struct(gpu=h.util, memory=h.util // 2)

    nvml.nvmlDeviceGetUtilizationRates = nvmlDeviceGetUtilizationRates
    nvml.nvmlDeviceGetPowerUsage = lambda h: device(h).power_mw

    def nvmlDeviceGetTemperature(h: FakeGpu, sensor: int) -> int:
        assert sensor == real_nvml.NVML_TEMPERATURE_GPU
        return device(h).temp

    def nvmlDeviceGetClockInfo(h: FakeGpu, clock: int) -> int:
        assert clock == real_nvml.NVML_CLOCK_SM
        return device(h).sm_clock

    def nvmlDeviceGetTotalEccErrors(h: FakeGpu, error_type: int, counter: int) -> int:
        assert counter == real_nvml.NVML_VOLATILE_ECC
        if device(h).ecc is None:
            raise err(real_nvml.NVML_ERROR_NOT_SUPPORTED)
        return h.ecc[0] if error_type == real_nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else h.ecc[1]

    def nvmlDeviceGetRetiredPagesPendingStatus(h: FakeGpu) -> int:
        if device(h).retired_pending is None:
            raise err(real_nvml.NVML_ERROR_NOT_SUPPORTED)
        return h.retired_pending

    def nvmlDeviceGetRemappedRows(h: FakeGpu) -> tuple[int, int, int, int]:
        if device(h).remapped is None:
            raise err(real_nvml.NVML_ERROR_NOT_SUPPORTED)
        return h.remapped

    nvml.nvmlDeviceGetTemperature = nvmlDeviceGetTemperature
    nvml.nvmlDeviceGetClockInfo = nvmlDeviceGetClockInfo
    nvml.nvmlDeviceGetTotalEccErrors = nvmlDeviceGetTotalEccErrors
    nvml.nvmlDeviceGetRetiredPagesPendingStatus = nvmlDeviceGetRetiredPagesPendingStatus
    nvml.nvmlDeviceGetRemappedRows = nvmlDeviceGetRemappedRows
    nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4 if device(h).util > 90 else 0
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        _Struct(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
        for pid, used in device(h).processes
    ]

    def link(h: FakeGpu, index: int) -> tuple[bytes, int]:
        if index >= len(device(h).links):
            raise err(
                real_nvml.NVML_ERROR_INVALID_ARGUMENT if h.links else real_nvml.NVML_ERROR_NOT_SUPPORTED
            )
        return h.links[index]

    nvml.nvmlDeviceGetNvLinkState = lambda h, i: (link(h, i), real_nvml.NVML_FEATURE_ENABLED)[1]
    nvml.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, i: _Struct(busId=link(h, i)[0])
    nvml.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, i: link(h, i)[1]

    event_set = object()
    nvml.nvmlEventSetCreate = lambda: event_set
    nvml.nvmlDeviceGetSupportedEventTypes = lambda h: real_nvml.nvmlEventTypeXidCriticalError | 0x1

    def nvmlDeviceRegisterEvents(h: FakeGpu, event_types: int, handle: object) -> None:
        assert handle is event_set
        assert event_types == real_nvml.nvmlEventTypeXidCriticalError
        calls.append(f"register:{device(h).uuid}")

    def nvmlEventSetWait(handle: object, timeout_ms: int) -> _Struct:
        assert handle is event_set
        assert timeout_ms == 0, "the collector must not block on the event set"
        if not events:
            raise err(real_nvml.NVML_ERROR_TIMEOUT)
        return events.pop(0)

    nvml.nvmlDeviceRegisterEvents = nvmlDeviceRegisterEvents
    nvml.nvmlEventSetWait = nvmlEventSetWait
    nvml.nvmlEventSetFree = lambda handle: calls.append("event-set-free")

    # -- MIG, as the hardware does it (nodes.mig_profiles has NVIDIA's tables) ------------------
    serial = iter(range(1, 1000))

    def table(h: FakeGpu):
        found = table_for(device(h).name)
        if found is None or h.mig is None:
            raise err(real_nvml.NVML_ERROR_NOT_SUPPORTED)
        return found

    def profile_by_constant(h: FakeGpu, constant: int):
        t = table(h)
        ids = A30_PROFILE_IDS if t.key == "A30" else PROFILE_IDS
        for p in t.profiles:
            if getattr(real_nvml, f"NVML_GPU_INSTANCE_PROFILE_{p.nvml_profile}") == constant:
                return p, ids[p.nvml_profile]
        raise err(real_nvml.NVML_ERROR_NOT_SUPPORTED)

    def profile_by_id(h: FakeGpu, profile_id: int):
        t = table(h)
        ids = A30_PROFILE_IDS if t.key == "A30" else PROFILE_IDS
        for p in t.profiles:
            if ids[p.nvml_profile] == profile_id:
                return p
        raise err(real_nvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetGpuInstanceProfileInfo(h: FakeGpu, constant: int) -> _Struct:
        p, pid = profile_by_constant(h, constant)
        memory_mb = table(h).memory_slices and (h.total // MIB) * p.memory // table(h).memory_slices
        return _Struct(
            id=pid,
            name=f"MIG {p.name}".encode(),
            sliceCount=p.compute,
            instanceCount=p.max_count,
            memorySizeMB=memory_mb,
        )

    def create(h: FakeGpu, profile_id: int, start: int | None, size: int | None) -> _Struct:
        t = table(h)
        if not h.mig[0]:
            raise err(real_nvml.NVML_ERROR_NOT_SUPPORTED)  # MIG mode is off
        p = profile_by_id(h, profile_id)
        mine = [gi for gi in nvml.instances if gi.parent is h]
        mask = compute = 0
        for gi in mine:
            mask |= gi.profile.mask(gi.start)
            compute += gi.profile.compute
        if start is None:  # the driver picks the first start that is free
            start = next((x for x in p.starts if not mask & p.mask(x)), None)
            if start is None:
                raise err(real_nvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        elif start not in p.starts or size != p.memory:
            raise err(real_nvml.NVML_ERROR_INVALID_ARGUMENT)
        if mask & p.mask(start) or compute + p.compute > t.compute_slices:
            raise err(real_nvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi = _Struct(parent=h, id=next(serial), profile=p, profile_id=profile_id, start=start, cis=[])
        nvml.instances.append(gi)
        return gi

    def nvmlDeviceCreateGpuInstance(h: FakeGpu, profile_id: int) -> _Struct:
        return create(h, profile_id, None, None)

    def nvmlDeviceCreateGpuInstanceWithPlacement(h: FakeGpu, profile_id: int, placement: Any) -> _Struct:
        return create(h, profile_id, placement.contents.start, placement.contents.size)

    def nvmlGpuInstanceCreateComputeInstance(gi: _Struct, profile_id: int) -> _Struct:
        if fail_compute:
            raise err(real_nvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        if gi not in nvml.instances or gi.cis:
            raise err(real_nvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci = _Struct(gi=gi, id=0)
        gi.cis.append(ci)
        h = gi.parent
        memory = (h.total // table(h).memory_slices) * gi.profile.memory
        mig = FakeGpu(f"MIG-{gi.id:04d}", f"{h.name} MIG {gi.profile.name}", b"", total=memory)
        mig.gi_id, mig.ci_id = gi.id, ci.id
        h.mig_devices.append(mig)
        return ci

    def nvmlComputeInstanceDestroy(ci: _Struct) -> None:
        nvml.calls.append(f"destroy-ci:{ci.gi.id}")
        ci.gi.cis.remove(ci)
        parent = ci.gi.parent
        parent.mig_devices[:] = [d for d in parent.mig_devices if d.gi_id != ci.gi.id]

    def nvmlGpuInstanceDestroy(gi: _Struct) -> None:
        if gi.cis:
            raise err(real_nvml.NVML_ERROR_IN_USE)
        nvml.calls.append(f"destroy-gi:{gi.id}")
        nvml.instances.remove(gi)

    def nvmlDeviceGetGpuInstanceById(h: FakeGpu, gi_id: int) -> _Struct:
        for gi in nvml.instances:
            if gi.parent is h and gi.id == gi_id:
                return gi
        raise err(real_nvml.NVML_ERROR_NOT_FOUND)

    def nvmlGpuInstanceGetComputeInstanceById(gi: _Struct, ci_id: int) -> _Struct:
        for ci in gi.cis:
            if ci.id == ci_id:
                return ci
        raise err(real_nvml.NVML_ERROR_NOT_FOUND)

    nvml.nvmlDeviceGetGpuInstanceProfileInfo = nvmlDeviceGetGpuInstanceProfileInfo
    nvml.nvmlDeviceCreateGpuInstance = nvmlDeviceCreateGpuInstance
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement = nvmlDeviceCreateGpuInstanceWithPlacement
    nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo = lambda gi, profile, engine: _Struct(id=profile)
    nvml.nvmlGpuInstanceCreateComputeInstance = nvmlGpuInstanceCreateComputeInstance
    nvml.nvmlGpuInstanceGetInfo = lambda gi: _Struct(
        id=gi.id, profileId=gi.profile_id, placement=_Struct(start=gi.start, size=gi.profile.memory)
    )
    nvml.nvmlComputeInstanceGetInfo = lambda ci: _Struct(id=ci.id)
    nvml.nvmlDeviceGetGpuInstanceId = lambda mig: mig.gi_id
    nvml.nvmlDeviceGetComputeInstanceId = lambda mig: mig.ci_id
    nvml.nvmlDeviceGetGpuInstanceById = nvmlDeviceGetGpuInstanceById
    nvml.nvmlGpuInstanceGetComputeInstanceById = nvmlGpuInstanceGetComputeInstanceById
    nvml.nvmlComputeInstanceDestroy = nvmlComputeInstanceDestroy
    nvml.nvmlGpuInstanceDestroy = nvmlGpuInstanceDestroy
    return nvml


def xid_event(gpu: FakeGpu, xid: int) -> _Struct:
    return _Struct(device=gpu, eventType=real_nvml.nvmlEventTypeXidCriticalError, eventData=xid)


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    for bus, node in (("0000:18:00.0", "0"), ("0000:2a:00.0", "1"), ("0000:3a:00.0", "-1")):
        path = root / "bus" / "pci" / "devices" / bus
        path.mkdir(parents=True)
        (path / "numa_node").write_text(f"{node}\n")
    return root


@pytest.fixture
def gpus() -> list[FakeGpu]:
    gpu0 = FakeGpu(
        "GPU-aaaa", "NVIDIA H100 80GB HBM3", b"00000000:18:00.0", links=[(b"00000000:2A:00.0", 0)] * 2
    )
    gpu1 = FakeGpu(
        "GPU-bbbb",
        "NVIDIA H100 80GB HBM3",
        b"00000000:2A:00.0",
        ecc=None,
        retired_pending=None,
        links=[(b"00000000:18:00.0", 0)] * 2,
    )
    mig0 = FakeGpu("MIG-1111", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", b"", total=40 * GIB)
    mig1 = FakeGpu("MIG-2222", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", b"", total=40 * GIB)
    gpu2 = FakeGpu(
        "GPU-cccc", "NVIDIA A100-SXM4-80GB", b"00000000:3A:00.0", mig=[1, 1], mig_devices=[mig0, mig1]
    )
    gpu3 = FakeGpu("GPU-dddd", "NVIDIA L4", b"00000000:4A:00.0", total=24 * GIB, mig=[0, 0])
    return [gpu0, gpu1, gpu2, gpu3]


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu], sysfs: Path) -> NvmlCollector:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus))
    collector = NvmlCollector(sysfs_root=sysfs)
    yield collector
    collector.close()


def test_discover_reads_every_gpu_with_topology(collector: NvmlCollector) -> None:
    inventory = collector.discover()

    assert inventory.driver_version == "560.35.03"
    assert inventory.cuda_version == "12.6"
    assert inventory.interconnect == "nvlink"
    by_uuid = {gpu.uuid: gpu for gpu in inventory.gpus}
    assert [gpu.index for gpu in inventory.gpus] == [0, 1, 2, 3]
    h100 = by_uuid["GPU-aaaa"]
    assert (h100.name, h100.memory_mib, h100.pci_bus_id) == ("NVIDIA H100 80GB HBM3", 81920, "0000:18:00.0")
    # GPUs 0 and 1 are joined by active NVLinks: one island; the others are PCIe only.
    assert by_uuid["GPU-aaaa"].nvlink_island == by_uuid["GPU-bbbb"].nvlink_island == 0
    assert by_uuid["GPU-cccc"].nvlink_island is None
    assert by_uuid["GPU-dddd"].nvlink_island is None
    # NUMA from sysfs; -1 (no affinity) and a missing file are None.
    assert [gpu.numa_node for gpu in inventory.gpus] == [0, 1, None, None]
    assert [gpu.mig_mode for gpu in inventory.gpus] == [False, False, True, False]
    assert [(m.uuid, m.memory_mib) for m in by_uuid["GPU-cccc"].mig_devices] == [
        ("MIG-1111", 40960),
        ("MIG-2222", 40960),
    ]
    assert sys.modules["pynvml"].calls.count("register:GPU-aaaa") == 1


def test_nvswitch_systems_make_one_island(monkeypatch: pytest.MonkeyPatch, sysfs: Path) -> None:
    switch = real_nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    gpus = [
        FakeGpu(f"GPU-{i}", "NVIDIA H100 80GB HBM3", f"00000000:{0x18 + i:02X}:00.0".encode(), links=links)
        for i, links in enumerate(
            [
                [(b"00000000:A1:00.0", switch), (b"00000000:A2:00.0", switch)],
                [(b"00000000:A2:00.0", switch)],
                [(b"00000000:A1:00.0", switch)],
            ]
        )
    ]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus))
    collector = NvmlCollector(sysfs_root=sysfs)
    try:
        inventory = collector.discover()
    finally:
        collector.close()
    assert inventory.interconnect == "nvswitch"
    assert [gpu.nvlink_island for gpu in inventory.gpus] == [0, 0, 0]


def test_sample_units_unsupported_fields_and_processes(collector: NvmlCollector, gpus: list[FakeGpu]) -> None:
    gpus[0].util, gpus[0].used, gpus[0].power_mw, gpus[0].temp = 97, 40 * GIB, 612_500, 71
    gpus[0].ecc = (3, 0)
    gpus[0].processes = [(4242, 40_000 * MIB), (4243, None)]
    gpus[1].remapped = (0, 2, 0, 1)

    samples = {s.gpu_uuid: s for s in collector.sample(1_700_000_000.0)}

    first = samples["GPU-aaaa"]
    assert first.util_pct == 97.0
    assert first.mem_used_mib == 40960
    assert first.power_w == 612.5
    assert (first.temp_c, first.sm_clock_mhz) == (71, 1980)
    assert (first.ecc_sbe, first.ecc_dbe) == (3, 0)
    assert first.throttle_reasons == 0x4
    assert (first.retired_pages_pending, first.row_remap_failure, first.fell_off_bus) == (False, False, False)
    assert [(p.pid, p.used_mib) for p in first.processes] == [(4242, 40000), (4243, None)]
    assert [p["used_mib"] for p in first.to_json()["processes"]] == [40000, None]
    # GPU 1 has no ECC and no retired-page reporting: None, not a crash.
    second = samples["GPU-bbbb"]
    assert (second.ecc_sbe, second.ecc_dbe, second.retired_pages_pending) == (None, None, None)
    assert second.row_remap_failure is True
    # A GPU in MIG mode has no utilisation counter: null on the wire, not a made-up 0.
    assert samples["GPU-cccc"].util_pct is None
    assert samples["GPU-cccc"].to_json()["util_pct"] is None
    assert first.to_json()["ts"] == "2023-11-14T22:13:20.000Z"


def test_xid_events_are_drained_without_blocking_and_attributed(
    collector: NvmlCollector, gpus: list[FakeGpu]
) -> None:
    collector.discover()
    nvml = sys.modules["pynvml"]
    nvml.events.extend(
        [xid_event(gpus[1], 79), xid_event(gpus[1], 48), xid_event(gpus[2].mig_devices[0], 63)]
    )

    samples = {s.gpu_uuid: s for s in collector.sample(1.0)}
    assert samples["GPU-bbbb"].xid_errors == [79, 48]
    assert samples["GPU-cccc"].xid_errors == [63]  # a MIG device's XID lands on its parent GPU
    assert samples["GPU-aaaa"].xid_errors == []

    again = {s.gpu_uuid: s for s in collector.sample(2.0)}
    assert all(s.xid_errors == [] for s in again.values())


def test_gpu_that_fell_off_the_bus(collector: NvmlCollector, gpus: list[FakeGpu]) -> None:
    collector.discover()
    gpus[3].lost = True

    samples = {s.gpu_uuid: s for s in collector.sample(1.0)}

    lost = samples["GPU-dddd"]
    assert lost.fell_off_bus is True
    assert lost.util_pct is None and lost.mem_used_mib is None
    # On the wire its gauges are null (unknown), which the portal stores as NULL.
    wire = lost.to_json()
    assert (wire["util_pct"], wire["mem_used_mib"], wire["power_w"], wire["temp_c"]) == (
        None,
        None,
        None,
        None,
    )
    assert (wire["fell_off_bus"], wire["ecc_dbe"], wire["retired_pages_pending"]) == (True, None, None)
    assert samples["GPU-aaaa"].fell_off_bus is False
    assert samples["GPU-aaaa"].util_pct == 0.0


def test_gpu_lost_before_discovery_is_left_out(
    monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu], sysfs: Path
):
    gpus[1].lost = True
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus))
    collector = NvmlCollector(sysfs_root=sysfs)
    try:
        inventory = collector.discover()
    finally:
        collector.close()
    assert [gpu.uuid for gpu in inventory.gpus] == ["GPU-aaaa", "GPU-cccc", "GPU-dddd"]
    assert collector.lost_indices == [1]


def test_configure_mig_sets_the_mode_and_makes_the_layout(
    collector: NvmlCollector, gpus: list[FakeGpu]
) -> None:
    gpus[3].name, gpus[3].total = "NVIDIA A100-SXM4-80GB", 80 * GIB
    collector.discover()

    layout = [("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]
    result = collector.configure_mig("GPU-dddd", True, layout)

    assert result["mig_mode"] is True
    assert [(c["profile"], c["start"]) for c in result["created"]] == layout
    assert [d.name.rsplit(" ", 1)[-1] for d in gpus[3].mig_devices] == [
        "2g.20gb",
        "1g.10gb",
        "1g.10gb",
        "3g.40gb",
    ]
    assert [d.memory_mib for d in collector.inventory.gpu("GPU-dddd").mig_devices] == [
        20480,
        10240,
        10240,
        40960,
    ]
    # A layout the hardware cannot make is refused before anything changes.
    with pytest.raises(CollectorError, match="cannot start at memory slice 4"):
        collector.configure_mig("GPU-dddd", True, [("3g.40gb", 0), ("3g.40gb", 4), ("1g.10gb", 4)])
    assert len(gpus[3].mig_devices) == 4
    # Reconfiguring replaces the layout; turning MIG off leaves no instance.
    assert [c["start"] for c in collector.configure_mig("GPU-dddd", True, [("7g.80gb", 0)])["created"]] == [0]
    off = collector.configure_mig("GPU-dddd", False, [])
    assert off == {"gpu_uuid": "GPU-dddd", "mig_mode": False, "created": []}
    assert gpus[3].mig == [real_nvml.NVML_DEVICE_MIG_DISABLE] * 2 and gpus[3].mig_devices == []
    # An H100 whose driver has MIG off-limits answers Not Supported.
    with pytest.raises(CollectorError, match="Not Supported"):
        collector.configure_mig("GPU-bbbb", True, [])


def test_close_frees_the_event_set_and_shuts_down(collector: NvmlCollector) -> None:
    collector.discover()
    collector.close()
    collector.close()
    assert sys.modules["pynvml"].calls[-2:] == ["event-set-free", "shutdown"]


def test_init_failure_is_a_clear_collector_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        sys.modules, "pynvml", fake_pynvml([], init_error=real_nvml.NVML_ERROR_DRIVER_NOT_LOADED)
    )
    with pytest.raises(CollectorUnavailable, match=r"^NVML is not available: Driver Not Loaded$"):
        NvmlCollector()


def _machine_has_nvml() -> bool:
    try:
        real_nvml.nvmlInit()
    except real_nvml.NVMLError:
        return False
    real_nvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_machine_has_nvml(), reason="this machine has NVML; scripts/gpu-check covers it")
def test_real_pynvml_without_a_gpu_says_nvml_is_not_available() -> None:
    with pytest.raises(CollectorUnavailable) as caught:
        make_collector("nvml")
    assert str(caught.value).startswith("NVML is not available: ")
    assert "Library Not Found" in str(caught.value) or "Driver Not Loaded" in str(caught.value)


@pytest.mark.skipif(_machine_has_nvml(), reason="this machine has NVML")
def test_auto_fails_clearly_when_no_collector_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # not importable
    with pytest.raises(CollectorUnavailable) as caught:
        make_collector("auto")
    message = str(caught.value)
    assert message.startswith("no GPU collector is available: NVML is not available: ")
    assert "AMD SMI is not available: the amdsmi module cannot be imported" in message


def test_auto_says_which_collector_it_chose(
    monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu], caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus))
    with caplog.at_level("INFO"):
        collector = make_collector("auto")
    collector.close()
    assert collector.name == "nvml"
    assert "collector auto: chose nvml" in caplog.text


GPU_CHECK = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"


def run_gpu_check(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", [str(GPU_CHECK), *argv])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(GPU_CHECK), run_name="__main__")
    return exited.value.code


def test_gpu_check_prints_gpus_samples_and_xids(
    monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu], capsys: pytest.CaptureFixture[str]
) -> None:
    nvml = fake_pynvml(gpus)
    nvml.events.append(xid_event(gpus[0], 79))
    gpus[0].util = 55
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    assert run_gpu_check(monkeypatch, "--samples", "2", "--interval", "0") == 0

    out = capsys.readouterr().out
    assert "driver 560.35.03, CUDA 12.6, interconnect nvlink" in out
    assert (
        "GPU 0: NVIDIA H100 80GB HBM3  GPU-aaaa  81920 MiB  bus 0000:18:00.0  MIG off  NVLink island 0" in out
    )
    assert "GPU 2: NVIDIA A100-SXM4-80GB  GPU-cccc" in out and "MIG on, 2 instance(s)" in out
    assert "    MIG-1111  NVIDIA A100-SXM4-80GB MIG 3g.40gb  40960 MiB" in out
    assert out.count("-- sample") == 2
    assert "GPU-aaaa: util 55.0%" in out
    assert "XID events seen: [('GPU-aaaa', 79)]" in out


@pytest.mark.skipif(_machine_has_nvml(), reason="this machine has NVML")
def test_gpu_check_without_nvml_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_gpu_check(monkeypatch) == 2
    assert capsys.readouterr().err.startswith("gpu-check: NVML is not available: ")


def test_gpu_check_checks_mig_placement_against_the_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = [FakeGpu("GPU-eeee", "NVIDIA H100 80GB HBM3", b"00000000:18:00.0", mig=[1, 1])]
    nvml = fake_pynvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    assert run_gpu_check(monkeypatch, "--samples", "0", "--mig", "0") == 0
    out = capsys.readouterr().out
    assert "MIG placement on GPU 0: agrees with the table" in out
    assert "1g.20gb at 1: refused" in out and nvml.instances == [] and gpus[0].mig_devices == []

    # A GPU that makes what the table forbids (a driver that ignores the start) is reported.
    monkeypatch.setattr(
        nvml,
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        lambda h, pid, p: nvml.nvmlDeviceCreateGpuInstance(h, pid),
    )
    assert run_gpu_check(monkeypatch, "--samples", "0", "--mig", "0") == 3
    assert "DIFFERS:" in capsys.readouterr().out
    assert nvml.instances == []
