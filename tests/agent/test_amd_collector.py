"""The AMD SMI collector against a fake ``amdsmi`` module shaped like the documented Python API."""

from __future__ import annotations

import sys
import types
from enum import IntEnum
from typing import Any

import pytest

from nodes.agent.collectors import CollectorUnavailable, make_collector
from nodes.agent.collectors.amd import AmdSmiCollector


class AmdSmiException(Exception):
    pass


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        super().__init__(f"amdsmi error {err_code}")
        self.err_code = err_code


NOT_SUPPORTED = 2


def fake_amdsmi(init_fails: bool = False) -> types.ModuleType:
    smi = types.ModuleType("amdsmi")
    smi.AmdSmiException = AmdSmiException
    smi.AmdSmiLibraryException = AmdSmiLibraryException
    smi.AmdSmiTemperatureType = IntEnum("AmdSmiTemperatureType", {"EDGE": 0, "HOTSPOT": 1, "VRAM": 2})
    smi.AmdSmiTemperatureMetric = IntEnum("AmdSmiTemperatureMetric", {"CURRENT": 0, "MAX": 1})
    smi.AmdSmiClkType = IntEnum("AmdSmiClkType", {"SYS": 0, "GFX": 0x1, "MEM": 0x4})
    smi.shut_down = 0
    handles = ["gpu-handle-0", "gpu-handle-1", "gpu-handle-2"]
    info: dict[str, dict[str, Any]] = {
        "gpu-handle-0": {"uuid": "2fff74a1-0000-1000-80fc-cb59ac2a19b4", "bdf": "0000:0C:00.0", "numa": 0},
        "gpu-handle-1": {"uuid": "47ff74a1-0000-1000-8093-a8e24b2ba2d0", "bdf": "0000:22:00.0", "numa": 0},
        "gpu-handle-2": {"uuid": "9cff74a1-0000-1000-80b6-8a1e5fefb2a8", "bdf": "0000:38:00.0", "numa": 1},
    }

    def amdsmi_init(flags: int = 2) -> None:
        if init_fails:
            raise AmdSmiLibraryException(8)

    def amdsmi_shut_down() -> None:
        smi.shut_down += 1

    def amdsmi_get_temp_metric(handle: str, sensor: Any, metric: Any) -> int:
        if sensor == smi.AmdSmiTemperatureType.EDGE:
            raise AmdSmiLibraryException(NOT_SUPPORTED)  # MI300X has no edge sensor
        return 48 if handle == "gpu-handle-0" else 41

    def amdsmi_topo_get_link_type(a: str, b: str) -> dict[str, int]:
        xgmi = {a, b} <= {"gpu-handle-0", "gpu-handle-1"}
        return {"hops": 1, "type": 2 if xgmi else 1}  # AMDSMI_IOLINK_TYPE_XGMI / PCIEXPRESS

    def amdsmi_get_gpu_total_ecc_count(handle: str) -> dict[str, int]:
        if handle == "gpu-handle-2":
            raise AmdSmiLibraryException(NOT_SUPPORTED)
        return {"correctable_count": 5, "uncorrectable_count": 1 if handle == "gpu-handle-1" else 0}

    smi.amdsmi_init = amdsmi_init
    smi.amdsmi_shut_down = amdsmi_shut_down
    smi.amdsmi_get_processor_handles = lambda: list(handles)
    smi.amdsmi_get_gpu_device_uuid = lambda h: info[h]["uuid"]
    smi.amdsmi_get_gpu_device_bdf = lambda h: info[h]["bdf"]
    smi.amdsmi_topo_get_numa_node_number = lambda h: info[h]["numa"]
    smi.amdsmi_get_gpu_asic_info = lambda h: {"market_name": "AMD Instinct MI300X", "vendor_id": "0x1002"}
    smi.amdsmi_get_gpu_vram_usage = lambda h: {
        "vram_total": 196592,
        "vram_used": 1024 if h == "gpu-handle-0" else 0,
    }
    smi.amdsmi_get_gpu_activity = lambda h: {"gfx_activity": 93, "umc_activity": 40, "mm_activity": "N/A"}
    smi.amdsmi_get_power_info = lambda h: {
        "current_socket_power": "N/A",
        "socket_power": 612,
        "power_limit": 750,
    }
    smi.amdsmi_get_clock_info = lambda h, clk: {"clk": 2100, "min_clk": 500, "max_clk": 2100}
    smi.amdsmi_get_temp_metric = amdsmi_get_temp_metric
    smi.amdsmi_get_gpu_total_ecc_count = amdsmi_get_gpu_total_ecc_count
    smi.amdsmi_get_gpu_process_list = lambda h: (
        [
            {
                "name": "python",
                "pid": 777,
                "mem": 0,
                "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": 2 << 30},
            }
        ]
        if h == "gpu-handle-0"
        else []
    )
    smi.amdsmi_topo_get_link_type = amdsmi_topo_get_link_type
    smi.amdsmi_get_gpu_driver_info = lambda h: {"driver_name": "amdgpu", "driver_version": "6.8.5"}
    smi.amdsmi_get_rocm_version = lambda: (True, "6.2.0")
    return smi


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> AmdSmiCollector:
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi())
    collector = AmdSmiCollector()
    yield collector
    collector.close()


def test_discover(collector: AmdSmiCollector) -> None:
    inventory = collector.discover()
    assert (inventory.driver_version, inventory.rocm_version, inventory.cuda_version) == (
        "6.8.5",
        "6.2.0",
        "",
    )
    assert inventory.interconnect == "xgmi"
    assert [g.name for g in inventory.gpus] == ["AMD Instinct MI300X"] * 3
    assert [g.memory_mib for g in inventory.gpus] == [196592] * 3
    assert [g.pci_bus_id for g in inventory.gpus] == ["0000:0c:00.0", "0000:22:00.0", "0000:38:00.0"]
    assert [g.nvlink_island for g in inventory.gpus] == [0, 0, None]
    assert [g.numa_node for g in inventory.gpus] == [0, 0, 1]


def test_sample(collector: AmdSmiCollector) -> None:
    samples = collector.sample(10.0)
    first, second, third = samples
    assert first.gpu_uuid == "2fff74a1-0000-1000-80fc-cb59ac2a19b4"
    assert (first.util_pct, first.mem_used_mib, first.power_w, first.sm_clock_mhz) == (
        93.0,
        1024,
        612.0,
        2100,
    )
    assert first.temp_c == 48  # from the hotspot sensor, as the edge one is not there
    assert (first.ecc_sbe, first.ecc_dbe) == (5, 0)
    assert second.ecc_dbe == 1
    assert (third.ecc_sbe, third.ecc_dbe) == (None, None)
    assert [(p.pid, p.used_mib) for p in first.processes] == [(777, 2048)]
    assert all(s.xid_errors == [] and s.fell_off_bus is False for s in samples)


def test_close_shuts_the_library_down_once(collector: AmdSmiCollector) -> None:
    collector.close()
    collector.close()
    assert sys.modules["amdsmi"].shut_down == 1


def test_not_importable_is_collector_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    with pytest.raises(
        CollectorUnavailable, match=r"^AMD SMI is not available: the amdsmi module cannot be imported"
    ):
        make_collector("amdsmi")


def test_init_failure_is_collector_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(init_fails=True))
    with pytest.raises(CollectorUnavailable, match=r"^AMD SMI is not available: amdsmi error 8$"):
        AmdSmiCollector()
