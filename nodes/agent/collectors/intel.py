"""Intel data-center GPUs (Max, Flex) through ``xpu-smi``, the XPU Manager's command line.

PyPI has no maintained Level Zero Sysman binding, so this collector runs ``xpu-smi`` (an argv, never
a shell) and reads its machine-readable output, by column name:

- ``xpu-smi discovery --dump 1,2,4,8,9,11,16``: CSV of device id, name, UUID, driver version, GFX
  firmware version, PCI BDF address and memory size (``65536.00 MiB``);
- ``xpu-smi -v``: the versions, of which ``Level Zero Version: 1.14.0``;
- ``xpu-smi dump -d <ids> -m 0,1,2,3,18 -n 1``: CSV of one reading per device (utilisation %, power
  W, frequency MHz, core temperature, memory used MiB); an empty or ``N/A`` cell is None.

GPUs are numbered in PCI order (Level Zero's order with ``ZE_ENABLE_PCI_ID_DEVICE_ORDER=1``, which
the runtimes set), and each one's render node comes from its PCI bus id (``collectors.devices``).
Intel GPUs have no XID events and no MIG; ECC counters are not read (``None``).
"""

from __future__ import annotations

import csv
import io
import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

from nodes.agent.collectors import CollectorError, CollectorUnavailable
from nodes.agent.collectors.devices import render_node
from nodes.agent.collectors.nvml import normalize_bus_id, read_numa_node
from nodes.agent.types import GpuInfo, GpuSample, NodeInventory

log = logging.getLogger(__name__)

DISCOVERY_FIELDS = "1,2,4,8,9,11,16"
SAMPLE_METRICS = "0,1,2,3,18"
TIMEOUT_S = 20.0


def _cell(row: dict[str, str], *names: str) -> str:
    """The first of ``names`` a row has (xpu-smi's headers differ a little between releases)."""
    lowered = {(k or "").strip().lower(): (v or "").strip() for k, v in row.items()}
    for name in names:
        value = lowered.get(name.lower())
        if value is not None:
            return value
    return ""


def _number(text: str) -> float | None:
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):  # "", "N/A"
        return None


def _csv_rows(text: str) -> list[dict[str, str]]:
    lines = [line for line in text.splitlines() if line.strip()]
    return list(csv.DictReader(io.StringIO("\n".join(lines)), skipinitialspace=True))


class XpuSmiCollector:
    name = "xpusmi"

    def __init__(
        self,
        *,
        executable: str = "xpu-smi",
        dev_root: str | Path = "/dev",
        sysfs_root: str | Path = "/sys",
    ) -> None:
        found = shutil.which(executable)
        if found is None:
            raise CollectorUnavailable(f"xpu-smi is not available: {executable!r} is not on the PATH")
        self.executable = found
        self.dev_root = Path(dev_root)
        self.sysfs_root = Path(sysfs_root)
        self._ids: dict[str, str] = {}  # uuid -> xpu-smi device id
        self.inventory: NodeInventory | None = None
        try:
            self._run("discovery", "--dump", DISCOVERY_FIELDS)
        except CollectorError as exc:
            raise CollectorUnavailable(f"xpu-smi is not available: {exc}") from exc

    def _run(self, *args: str) -> str:
        try:
            done = subprocess.run(
                [self.executable, *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CollectorError(f"xpu-smi {' '.join(args)}: {exc}") from exc
        if done.returncode != 0:
            reason = (done.stderr or done.stdout).strip().splitlines()
            raise CollectorError(
                f"xpu-smi {' '.join(args)} exited {done.returncode}: {reason[-1] if reason else ''}"
            )
        return done.stdout

    def _level_zero_version(self) -> str:
        try:
            text = self._run("-v")
        except CollectorError as exc:
            log.debug("%s", exc)
            return ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip().lower() == "level zero version":
                return value.strip()
        return ""

    def discover(self) -> NodeInventory:
        rows = _csv_rows(self._run("discovery", "--dump", DISCOVERY_FIELDS))
        found = []
        for row in rows:
            device_id = _cell(row, "Device ID")
            uuid = _cell(row, "UUID")
            if not device_id.isdigit() or not uuid:
                continue
            found.append((normalize_bus_id(_cell(row, "PCI BDF Address")), device_id, uuid, row))
        found.sort()
        gpus: list[GpuInfo] = []
        self._ids = {}
        driver = ""
        for index, (bus_id, device_id, uuid, row) in enumerate(found):
            memory = _number(_cell(row, "Memory Physical Size"))
            driver = driver or _cell(row, "Driver Version")
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=uuid,
                    name=_cell(row, "Device Name") or "Intel GPU",
                    memory_mib=int(memory) if memory is not None else 0,
                    pci_bus_id=bus_id,
                    numa_node=read_numa_node(bus_id, self.sysfs_root) if bus_id else None,
                    render_node=render_node(bus_id, dev_root=self.dev_root, sysfs_root=self.sysfs_root),
                    firmware_version=_cell(row, "GFX Firmware Version"),
                )
            )
            self._ids[uuid] = device_id
        self.inventory = NodeInventory(
            gpus=gpus,
            driver_version=driver,
            level_zero_version=self._level_zero_version(),
            interconnect="pcie",
            vendor="intel",
        )
        return self.inventory

    def sample(self, now: float) -> list[GpuSample]:
        if self.inventory is None:
            self.discover()
        if not self._ids:
            return []
        text = self._run("dump", "-d", ",".join(self._ids.values()), "-m", SAMPLE_METRICS, "-n", "1")
        readings = {_cell(row, "DeviceId", "Device ID"): row for row in _csv_rows(text)}
        samples = []
        for uuid, device_id in self._ids.items():
            row = readings.get(device_id, {})
            util = _number(_cell(row, "GPU Utilization (%)"))
            used = _number(_cell(row, "GPU Memory Used (MiB)"))
            temp = _number(_cell(row, "GPU Core Temperature (Celsius Degree)", "GPU Core Temperature (C)"))
            clock = _number(_cell(row, "GPU Frequency (MHz)"))
            samples.append(
                GpuSample(
                    gpu_uuid=uuid,
                    ts=now,
                    util_pct=min(100.0, max(0.0, util)) if util is not None else None,
                    mem_used_mib=int(used) if used is not None else None,
                    power_w=_number(_cell(row, "GPU Power (W)")),
                    temp_c=int(temp) if temp is not None else None,
                    sm_clock_mhz=int(clock) if clock is not None else None,
                )
            )
        return samples

    def configure_mig(self, gpu_uuid: str, enable: bool, profiles: list[str]) -> dict[str, Any]:
        raise CollectorError("MIG is an NVIDIA feature; Intel GPUs have none")

    def create_mig_instance(self, gpu_uuid: str, profile: str) -> dict[str, Any]:
        return self.configure_mig(gpu_uuid, True, [profile])

    def destroy_mig_instance(self, gpu_uuid: str, mig_uuid: str) -> dict[str, Any]:
        return self.configure_mig(gpu_uuid, False, [])

    def close(self) -> None:
        """Nothing is held between commands."""
