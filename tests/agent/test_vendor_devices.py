"""AMD and Intel GPUs run work: the collectors find each GPU's render node from its PCI bus id, and
the runtimes give a workload exactly its GPUs' device files, groups and visibility variables.

The device files are placeholders this test makes (character devices with /dev/null's numbers, in a
temporary ``dev`` tree with udev's ``dri/by-path`` links); the AMD collector runs against a fake
``amdsmi`` module and the Intel one against a fake ``xpu-smi`` program, at the library and command
boundary. Containers run on the real Docker Engine (tests/docker_engine.py), processes for real.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from docker.errors import NotFound

from nodes.agent.collectors import CollectorUnavailable
from nodes.agent.collectors.amd import AmdSmiCollector
from nodes.agent.collectors.devices import render_node
from nodes.agent.collectors.intel import XpuSmiCollector
from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.runtimes.docker import DockerRuntime
from nodes.agent.runtimes.process import SubprocessRuntime
from nodes.agent.types import GpuInfo, NodeInventory, WorkloadSpec
from tests.agent.conftest import wait_for
from tests.agent.test_amd_collector import fake_amdsmi
from tests.docker_engine import TEST_IMAGE

AMD_BUS_IDS = ("0000:0c:00.0", "0000:22:00.0", "0000:38:00.0")
DEVICE_GID = 4321


def make_dev_tree(root: Path, bus_ids: tuple[str, ...], *, kfd: bool) -> Path:
    """``root/dev`` with a character device per render node (numbered against the bus order, as the
    kernel may), ``kfd`` for AMD, and udev's by-path links; everything owned by group DEVICE_GID."""
    dev = root / "dev"
    (dev / "dri" / "by-path").mkdir(parents=True)
    null = os.stat("/dev/null").st_rdev
    paths = []
    for n, bus_id in enumerate(bus_ids):
        name = f"renderD{130 - n}"
        paths.append(dev / "dri" / name)
        (dev / "dri" / "by-path" / f"pci-{bus_id}-render").symlink_to(f"../{name}")
    if kfd:
        paths.append(dev / "kfd")
    for path in paths:
        os.mknod(path, 0o660 | stat.S_IFCHR, null)
        os.chown(path, 0, DEVICE_GID)
    return dev


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making device files needs root (mknod)")


# --- render nodes -------------------------------------------------------------------------------------


@needs_root
def test_the_render_node_comes_from_the_bus_id_not_the_index(tmp_path: Path) -> None:
    dev = make_dev_tree(tmp_path, AMD_BUS_IDS, kfd=False)
    assert render_node("0000:0C:00.0", dev_root=dev) == str(dev / "dri" / "renderD130")
    assert render_node("0000:38:00.0", dev_root=dev) == str(dev / "dri" / "renderD128")
    # No udev link: sysfs's drm directory of the PCI device.
    sysfs = tmp_path / "sys"
    (sysfs / "bus" / "pci" / "devices" / "0000:99:00.0" / "drm" / "renderD140").mkdir(parents=True)
    (sysfs / "bus" / "pci" / "devices" / "0000:99:00.0" / "drm" / "card7").mkdir()
    assert render_node("0000:99:00.0", dev_root=dev, sysfs_root=sysfs) == str(dev / "dri" / "renderD140")
    # Nothing found, or no bus id at all: none (never a guess).
    assert render_node("0000:aa:00.0", dev_root=dev, sysfs_root=sysfs) == ""
    assert render_node("../../etc", dev_root=dev, sysfs_root=sysfs) == ""
    # A by-path link that leads out of dri/ is not a render node.
    (dev / "dri" / "by-path" / "pci-0000:bb:00.0-render").symlink_to("/dev/null")
    assert render_node("0000:bb:00.0", dev_root=dev, sysfs_root=sysfs) == ""


# --- collectors -------------------------------------------------------------------------------------


@needs_root
def test_the_amd_collector_gives_render_nodes_kfd_and_firmware(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = fake_amdsmi()
    smi.amdsmi_get_gpu_vbios_info = lambda h: {"name": "MI300X", "version": f"113-M3000100-{h[-1]}"}
    handles = smi.amdsmi_get_processor_handles()
    smi.amdsmi_get_processor_handles = lambda: list(reversed(handles))  # not in PCI order
    monkeypatch.setitem(sys.modules, "amdsmi", smi)
    dev = make_dev_tree(tmp_path, AMD_BUS_IDS, kfd=True)
    collector = AmdSmiCollector(dev_root=dev, sysfs_root=tmp_path / "sys")
    try:
        inventory = collector.discover()
    finally:
        collector.close()
    assert [g.pci_bus_id for g in inventory.gpus] == list(AMD_BUS_IDS)  # numbered in PCI order
    assert [g.index for g in inventory.gpus] == [0, 1, 2]
    assert [g.render_node for g in inventory.gpus] == [
        str(dev / "dri" / f"renderD{n}") for n in (130, 129, 128)
    ]
    assert [g.firmware_version for g in inventory.gpus] == [f"113-M3000100-{n}" for n in (0, 1, 2)]
    assert inventory.node_devices == [str(dev / "kfd")] and inventory.vendor == "amd"


FAKE_XPU_SMI = """\
#!{python}
import sys
args = sys.argv[1:]
if {fail}:
    print("Level Zero initialization failed", file=sys.stderr)
    sys.exit(1)
if args[:2] == ["discovery", "--dump"]:
    print("Device ID,Device Name,UUID,Driver Version,GFX Firmware Version,PCI BDF Address,Memory Physical Size")
    print('1,"Intel(R) Data Center GPU Max 1550",01000000-0000-0000-0000-000000290000,'
          'I915_23.10.32_PSB_231129.32,PVC2_1.23263,0000:9a:00.0,131072.00 MiB')
    print('0,"Intel(R) Data Center GPU Max 1550",01000000-0000-0000-0000-000000180000,'
          'I915_23.10.32_PSB_231129.32,PVC2_1.23263,0000:29:00.0,131072.00 MiB')
elif args == ["-v"]:
    print("CLI:\\n    Version: 1.2.13\\n\\nService:\\n    Version: 1.2.13\\n    Level Zero Version: 1.14.0")
elif args[:1] == ["dump"]:
    assert args[1:3] == ["-d", "0,1"] and args[3:] == ["-m", "0,1,2,3,18", "-n", "1"], args
    print("Timestamp, DeviceId, GPU Utilization (%), GPU Power (W), GPU Frequency (MHz), "
          "GPU Core Temperature (Celsius Degree), GPU Memory Used (MiB)")
    print("06:14:46.000,    0, 87.5, 412.3, 1600, 51, 40960")
    print("06:14:46.000,    1, N/A, 120.0, , 40, 0")
else:
    sys.exit(2)
"""


def fake_xpu_smi(directory: Path, *, fail: bool = False) -> Path:
    path = directory / "xpu-smi"
    path.write_text(FAKE_XPU_SMI.format(python=sys.executable, fail=fail))
    path.chmod(0o755)
    return path


@needs_root
def test_the_intel_collector_reads_xpu_smi(tmp_path: Path) -> None:
    dev = make_dev_tree(tmp_path, ("0000:29:00.0", "0000:9a:00.0"), kfd=False)
    collector = XpuSmiCollector(executable=str(fake_xpu_smi(tmp_path)), dev_root=dev, sysfs_root=tmp_path)
    inventory = collector.discover()
    assert inventory.vendor == "intel"
    assert (inventory.driver_version, inventory.level_zero_version) == (
        "I915_23.10.32_PSB_231129.32",
        "1.14.0",
    )
    first, second = inventory.gpus
    assert (first.index, first.uuid, first.pci_bus_id) == (
        0,
        "01000000-0000-0000-0000-000000180000",
        "0000:29:00.0",
    )
    assert (first.name, first.memory_mib, first.firmware_version) == (
        "Intel(R) Data Center GPU Max 1550",
        131072,
        "PVC2_1.23263",
    )
    assert (first.render_node, second.render_node) == (
        str(dev / "dri" / "renderD130"),
        str(dev / "dri" / "renderD129"),
    )
    a, b = collector.sample(5.0)
    assert (a.gpu_uuid, a.util_pct, a.power_w, a.sm_clock_mhz, a.temp_c, a.mem_used_mib) == (
        first.uuid,
        87.5,
        412.3,
        1600,
        51,
        40960,
    )
    assert (b.gpu_uuid, b.util_pct, b.sm_clock_mhz, b.mem_used_mib) == (second.uuid, None, None, 0)


def test_the_intel_collector_is_unavailable_without_a_working_xpu_smi(tmp_path: Path) -> None:
    with pytest.raises(CollectorUnavailable, match="not on the PATH"):
        XpuSmiCollector(executable=str(tmp_path / "missing"))
    with pytest.raises(CollectorUnavailable, match="exited 1: Level Zero initialization failed"):
        XpuSmiCollector(executable=str(fake_xpu_smi(tmp_path, fail=True)))


# --- the docker runtime --------------------------------------------------------------------------------


@pytest.fixture
def docker_runtime(tmp_path: Path, docker_engine: docker.DockerClient) -> Iterator[DockerRuntime]:
    runtime = DockerRuntime(tmp_path / "state", node_gpus=3)
    yield runtime
    for workload_id in list(runtime.store.records):
        name = runtime.container_name(workload_id)
        with contextlib.suppress(NotFound):
            docker_engine.api.remove_container(name, force=True)
    runtime.close()


def _probe(*paths: str) -> list[str]:
    """A command that prints each path's type, the groups and the GPU variables, then exits."""
    checks = "; ".join(f'test -c {p} && echo "chr {p}" || echo "missing {p}"' for p in paths)
    return [
        "sh",
        "-c",
        f"{checks}; ls /dev/dri; echo groups $(id -G); env | grep -E '^(ROCR|HIP|ZE|NVIDIA)_' | sort",
    ]


def _run_container(runtime: DockerRuntime, engine: docker.DockerClient, spec: WorkloadSpec) -> str:
    runtime.start(spec)
    status = wait_for(
        lambda: (s := runtime.get_status(spec.workload_id)) is not None and s.terminal and s,
        what=f"{spec.workload_id} to end",
    )
    assert (status.state, status.exit_code) == ("exited", 0), runtime.logs(spec.workload_id)
    return runtime.logs(spec.workload_id)


def _spec(*command: str, gpu_uuids: list[str], **fields: Any) -> WorkloadSpec:
    return WorkloadSpec(
        f"v{uuidlib.uuid4().hex[:10]}",
        image=TEST_IMAGE,
        command=list(command),
        gpu_uuids=gpu_uuids,
        cpu_millicores=200,
        ram_mib=32,
        **fields,
    )


@needs_root
def test_an_amd_container_gets_kfd_its_render_nodes_groups_and_variables(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker_runtime: DockerRuntime,
    docker_engine: docker.DockerClient,
) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi())
    collector = AmdSmiCollector(dev_root=make_dev_tree(tmp_path, AMD_BUS_IDS, kfd=True), sysfs_root=tmp_path)
    inventory = collector.discover()
    collector.close()
    docker_runtime.inventory = inventory  # as the agent sets it from its collector
    gpus = [inventory.gpus[1].uuid, inventory.gpus[2].uuid]  # renderD129 and renderD128
    spec = _spec(*_probe("/dev/kfd", "/dev/dri/renderD129", "/dev/dri/renderD128"), gpu_uuids=gpus)
    output = _run_container(docker_runtime, docker_engine, spec)
    lines = output.splitlines()
    assert {"chr /dev/kfd", "chr /dev/dri/renderD129", "chr /dev/dri/renderD128"} <= set(lines), output
    assert "renderD130" not in output  # the node's other GPU is not there
    assert str(DEVICE_GID) in next(line for line in lines if line.startswith("groups")).split()
    assert {"ROCR_VISIBLE_DEVICES=0,1", "HIP_VISIBLE_DEVICES=0,1", "NVIDIA_VISIBLE_DEVICES=void"} <= set(
        lines
    )
    host = docker_engine.api.inspect_container(docker_runtime.container_name(spec.workload_id))["HostConfig"]
    assert not host["DeviceRequests"] and host["Privileged"] is False and host["CapDrop"] == ["ALL"]
    assert sorted(d["PathInContainer"] for d in host["Devices"]) == [
        "/dev/dri/renderD128",
        "/dev/dri/renderD129",
        "/dev/kfd",
    ]


@needs_root
def test_an_intel_container_gets_its_render_node_and_affinity_mask(
    tmp_path: Path, docker_runtime: DockerRuntime, docker_engine: docker.DockerClient
) -> None:
    dev = make_dev_tree(tmp_path, ("0000:29:00.0", "0000:9a:00.0"), kfd=False)
    collector = XpuSmiCollector(executable=str(fake_xpu_smi(tmp_path)), dev_root=dev, sysfs_root=tmp_path)
    docker_runtime.inventory = collector.discover()
    second = docker_runtime.inventory.gpus[1]
    spec = _spec(*_probe("/dev/dri/renderD129", "/dev/kfd"), gpu_uuids=[second.uuid])
    lines = _run_container(docker_runtime, docker_engine, spec).splitlines()
    assert {"chr /dev/dri/renderD129", "missing /dev/kfd", "ZE_AFFINITY_MASK=0"} <= set(lines), lines
    assert "ZE_ENABLE_PCI_ID_DEVICE_ORDER=1" in lines and "renderD130" not in lines
    assert str(DEVICE_GID) in next(line for line in lines if line.startswith("groups")).split()


@needs_root
def test_device_paths_are_checked_where_they_are_used(tmp_path: Path, docker_runtime: DockerRuntime) -> None:
    (tmp_path / "plain").write_text("")
    cases = [
        ("", "has no render node"),
        (str(tmp_path / "renderD128"), "No such file"),
        (str(tmp_path / "plain"), "not a DRM render node"),
        ("/dev/null", "not a DRM render node"),
        (str(tmp_path / "x" / ".." / "renderD1"), "not an absolute, normalised"),
    ]
    (tmp_path / "dri").mkdir()
    (tmp_path / "dri" / "renderD5").write_text("")
    cases.append((str(tmp_path / "dri" / "renderD5"), "not a character device"))
    for path, reason in cases:
        docker_runtime.inventory = NodeInventory(
            gpus=[GpuInfo(index=0, uuid="GPU-x", name="AMD Instinct MI300X", memory_mib=1, render_node=path)],
            vendor="amd",
        )
        with pytest.raises(RuntimeFailure, match=reason):
            docker_runtime.start(_spec("true", gpu_uuids=["GPU-x"]))
    with pytest.raises(RuntimeFailure, match="GPU GPU-y is not on this node"):
        docker_runtime.start(_spec("true", gpu_uuids=["GPU-y"]))
    assert docker_runtime.store.records == {}  # nothing was made


# --- the process runtime -------------------------------------------------------------------------------


@needs_root
@pytest.mark.parametrize("vendor", ["amd", "intel"])
def test_the_process_gets_the_visibility_variables_and_groups(
    vendor: str, tmp_path: Path, process_options: dict[str, Any]
) -> None:
    dev = make_dev_tree(tmp_path, AMD_BUS_IDS, kfd=vendor == "amd")
    gpus = [
        GpuInfo(index=i, uuid=f"GPU-{i}", name="x", memory_mib=1, render_node=render_node(b, dev_root=dev))
        for i, b in enumerate(AMD_BUS_IDS)
    ]
    runtime = SubprocessRuntime(tmp_path / "state", **process_options)
    runtime.inventory = NodeInventory(
        gpus=gpus, vendor=vendor, node_devices=[str(dev / "kfd")] if vendor == "amd" else []
    )
    runtime.start(
        WorkloadSpec("p1", command=["/bin/sh", "-c", "id -G; exec env -0"], gpu_uuids=["GPU-2", "GPU-0"])
    )
    status = wait_for(
        lambda: (s := runtime.get_status("p1")) is not None and s.terminal and s, what="p1 to end"
    )
    assert (status.state, status.exit_code) == ("exited", 0), runtime.logs("p1")
    groups, rest = Path(runtime.store.records["p1"]["log"]).read_bytes().split(b"\n", 1)
    seen = dict(item.split(b"=", 1) for item in rest.split(b"\0") if item)
    if vendor == "amd":
        assert (seen[b"ROCR_VISIBLE_DEVICES"], seen[b"HIP_VISIBLE_DEVICES"]) == (b"2,0", b"0,1")
    else:
        assert (seen[b"ZE_AFFINITY_MASK"], seen[b"ZE_ENABLE_PCI_ID_DEVICE_ORDER"]) == (b"2,0", b"1")
    assert b"CUDA_VISIBLE_DEVICES" not in seen
    if runtime.user.switch:
        assert str(DEVICE_GID).encode() in groups.split() and b"0" not in groups.split()
