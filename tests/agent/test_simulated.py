"""The simulated collector's numbers follow the simulated runtime's workloads; faults can be injected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodes.agent.collectors import CollectorError
from nodes.agent.collectors.simulated import MODELS, SimulatedCollector
from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.runtimes.simulated import SimulatedRuntime
from nodes.agent.types import WorkloadSpec

H100 = "NVIDIA H100 80GB HBM3"
SPEC = MODELS[H100]


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def runtime(tmp_path: Path, clock: Clock) -> SimulatedRuntime:
    return SimulatedRuntime(tmp_path / "state", clock=clock)


def make_node(runtime: SimulatedRuntime, tmp_path: Path, seed: int = 7) -> SimulatedCollector:
    collector = SimulatedCollector(
        gpus=[{"model": H100, "count": 4}, {"model": "NVIDIA L4", "count": 1}],
        hostname="sim-a-001",
        seed=seed,
        control_file=tmp_path / "faults.json",
    )
    collector.attach(runtime.gpu_load)
    return collector


def test_inventory_from_the_fleet_declaration(runtime: SimulatedRuntime, tmp_path: Path) -> None:
    inventory = make_node(runtime, tmp_path).discover()
    assert [g.name for g in inventory.gpus] == [H100] * 4 + ["NVIDIA L4"]
    assert [g.memory_mib for g in inventory.gpus][:1] == [81559]
    assert len({g.uuid for g in inventory.gpus}) == 5
    assert all(g.uuid.startswith("GPU-") for g in inventory.gpus)
    assert [g.numa_node for g in inventory.gpus] == [0, 0, 1, 1, 1]
    assert (inventory.interconnect, inventory.cuda_version) == ("nvswitch", "12.6")
    # The same host gets the same UUIDs every time (a restarted simulated agent is the same node).
    again = make_node(runtime, tmp_path).discover()
    assert [g.uuid for g in again.gpus] == [g.uuid for g in inventory.gpus]


def test_fleet_file_memory_overrides_the_builtin_table(tmp_path: Path) -> None:
    collector = SimulatedCollector(
        gpus=[{"model": H100, "count": 1, "memory_mib": 81920}, {"model": "Mystery GPU"}]
    )
    assert [g.memory_mib for g in collector.discover().gpus] == [81920, 81920]
    assert [g.name for g in collector.discover().gpus] == [H100, "Mystery GPU"]


def test_numbers_follow_the_workloads(runtime: SimulatedRuntime, clock: Clock, tmp_path: Path) -> None:
    collector = make_node(runtime, tmp_path)
    gpus = collector.discover().gpus
    idle = collector.sample(clock.now)
    assert all(s.util_pct < 3 and s.mem_used_mib == 0 and s.processes == [] for s in idle)
    assert all(SPEC.idle_w <= s.power_w < SPEC.idle_w + 15 for s in idle[:4])

    runtime.start(WorkloadSpec("full", gpu_uuids=[gpus[0].uuid, gpus[1].uuid]))
    runtime.start(WorkloadSpec("half", gpu_uuids=[gpus[2].uuid], gpu_fraction_milli=500))
    temps = []
    for _ in range(8):
        clock.now += 5
        samples = collector.sample(clock.now)
        temps.append(samples[0].temp_c)
    full, _, half, idle_gpu, _ = samples
    assert full.util_pct > 85 and full.power_w > 0.85 * SPEC.tdp_w and full.power_w <= SPEC.tdp_w
    assert 0.6 * SPEC.memory_mib <= full.mem_used_mib <= 0.9 * SPEC.memory_mib
    assert [(p.workload_id, p.used_mib) for p in full.processes] == [("full", full.mem_used_mib)]
    assert 40 < half.util_pct < 50
    assert 0.3 * SPEC.memory_mib <= half.mem_used_mib <= 0.45 * SPEC.memory_mib
    assert SPEC.idle_w < half.power_w < full.power_w
    assert idle_gpu.util_pct < 3 and idle_gpu.mem_used_mib == 0
    # Temperature follows power with a lag: it climbs towards its target.
    assert temps == sorted(temps) and temps[-1] > temps[0] + 10
    assert full.sm_clock_mhz > 1800 and idle_gpu.sm_clock_mhz == 345

    runtime.stop("full", grace_s=1)
    clock.now += 5
    assert collector.sample(clock.now)[0].util_pct < 3


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    def series(seed: int, name: str) -> list[tuple]:
        clock = Clock()
        runtime = SimulatedRuntime(tmp_path / name, clock=clock)
        collector = make_node(runtime, tmp_path, seed=seed)
        runtime.start(WorkloadSpec("w", gpu_uuids=[collector.discover().gpus[0].uuid]))
        out = []
        for _ in range(5):
            clock.now += 2
            out.append(tuple((s.util_pct, s.power_w, s.temp_c) for s in collector.sample(clock.now)))
        return out

    assert series(1, "a") == series(1, "b")
    assert series(1, "c") != series(2, "d")


def test_injected_faults(runtime: SimulatedRuntime, tmp_path: Path) -> None:
    collector = make_node(runtime, tmp_path)
    uuid0 = collector.discover().gpus[0].uuid
    collector.inject_fault(uuid0, "xid", 79)
    collector.inject_fault(1, "dbe")
    collector.inject_fault("2", "row_remap_failure")

    first = collector.sample(1.0)
    assert first[0].xid_errors == [79]
    assert first[1].ecc_dbe == 1 and first[1].ecc_sbe == 0
    assert first[2].row_remap_failure is True
    second = collector.sample(2.0)
    assert second[0].xid_errors == []  # an XID is an event: reported once
    assert second[1].ecc_dbe == 1  # ECC counters and remap failures stay
    assert second[2].row_remap_failure is True

    # The control file: read by the next sample, then removed.
    control = tmp_path / "faults.json"
    control.write_text(json.dumps([{"gpu": 3, "kind": "fell_off_bus"}, {"gpu": 4, "kind": "xid", "xid": 48}]))
    third = collector.sample(3.0)
    assert not control.exists()
    assert third[3].fell_off_bus is True and third[3].util_pct is None
    assert third[4].xid_errors == [48]
    collector.inject_fault(3, "clear")
    assert collector.sample(4.0)[3].fell_off_bus is False
    with pytest.raises(ValueError, match="unknown fault"):
        collector.inject_fault(0, "meltdown")


def test_mig_reconfiguration(runtime: SimulatedRuntime, tmp_path: Path) -> None:
    collector = make_node(runtime, tmp_path)
    gpus = collector.discover().gpus
    result = collector.configure_mig(gpus[0].uuid, True, [("3g.40gb", 0), ("3g.40gb", 4)])
    assert result["mig_mode"] is True and [c["start"] for c in result["created"]] == [0, 4]
    assert collector.discover().gpus[0].mig_mode is True
    # The simulated GPU keeps the hardware's rules: no third instance on the eight memory slices.
    with pytest.raises(CollectorError, match="Insufficient Resources"):
        collector.create_mig_instance(gpus[0].uuid, "1g.10gb")
    sample = collector.sample(1.0)
    assert sample[0].util_pct is None and sample[0].to_json()["util_pct"] is None  # as NVML: no counter
    assert sample[1].util_pct is not None
    with pytest.raises(CollectorError, match="does not support MIG"):
        collector.configure_mig(gpus[4].uuid, True, [("1g.5gb", 0)])


def test_runtime_timers(runtime: SimulatedRuntime, clock: Clock) -> None:
    runtime.start(WorkloadSpec("job", sim_duration_s=30))
    runtime.start(WorkloadSpec("bad", env={"GPUPOOL_SIM_DURATION_S": "10", "GPUPOOL_SIM_EXIT_CODE": "3"}))
    runtime.start(WorkloadSpec("capped", max_runtime_s=20))
    runtime.start(WorkloadSpec("forever"))
    handle = runtime.start(WorkloadSpec("job", sim_duration_s=999))  # the same id: nothing new
    assert handle.workload_id == "job"

    clock.now += 15
    states = {s.workload_id: (s.state, s.exit_code) for s in runtime.status()}
    assert states == {
        "job": ("running", None),
        "bad": ("failed", 3),
        "capped": ("running", None),
        "forever": ("running", None),
    }
    clock.now += 20
    states = {s.workload_id: (s.state, s.exit_code) for s in runtime.status()}
    assert states["job"] == ("exited", 0) and states["capped"] == ("exited", 0)
    assert runtime.get_status("job").finished_at == 1030.0

    assert runtime.stop("forever", grace_s=5).state == "stopped"
    assert runtime.stop("job", grace_s=5).state == "exited"  # already over: unchanged
    assert runtime.stop("nobody", grace_s=5).message == "not known on this node"
    runtime.start(WorkloadSpec("spot"))
    assert runtime.stop("spot", grace_s=0, final_state="preempted").state == "preempted"
    assert "running" not in runtime.logs("forever")
    runtime.forget("forever")
    assert runtime.get_status("forever") is None
    with pytest.raises(RuntimeFailure):
        runtime.logs("forever")


def test_runtime_records_survive_a_restart(tmp_path: Path, clock: Clock) -> None:
    first = SimulatedRuntime(tmp_path / "state", clock=clock)
    first.start(WorkloadSpec("job", sim_duration_s=30, gpu_uuids=["GPU-x"]))
    clock.now += 10
    second = SimulatedRuntime(tmp_path / "state", clock=clock)
    assert second.gpu_load(clock.now) == {"GPU-x": [("job", 1000)]}
    clock.now += 30
    assert second.get_status("job").state == "exited"


class SleepingClock(Clock):
    """A clock whose ``sleep`` moves it forward (and records how long each sleep was)."""

    def __init__(self, now: float = 1000.0) -> None:
        super().__init__(now)
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_cold_start_pulls_each_image_once(tmp_path: Path) -> None:
    clock = SleepingClock()
    runtime = SimulatedRuntime(
        tmp_path / "state", clock=clock, sleep=clock.sleep, cold_start_s={"big:1": 30, "": 5}
    )
    runtime.start(WorkloadSpec("a", image="big:1", sim_duration_s=100))
    assert clock.slept == [30] and clock.now == 1030  # start returns once it runs
    assert runtime.get_status("a").state == "running" and runtime.get_status("a").started_at == 1030
    runtime.start(WorkloadSpec("b", image="big:1"))  # the image is here now
    runtime.start(WorkloadSpec("c", image="small:1"))  # other images: the default
    assert clock.slept == [30, 5]
    assert clock.now == 1035
    clock.now += 90  # "a" runs its 100 s from when it started running (1030), not from the request
    assert runtime.get_status("a").state == "running"
    clock.now += 5
    assert runtime.get_status("a").state == "exited"


def test_a_workload_is_starting_while_its_image_is_pulled(tmp_path: Path, clock: Clock) -> None:
    waits: list[float] = []
    runtime = SimulatedRuntime(tmp_path / "state", clock=clock, sleep=waits.append, cold_start_s=20)
    runtime.start(WorkloadSpec("a", image="img", gpu_uuids=["GPU-x"]))
    assert waits == [20]
    assert runtime.get_status("a").state == "starting" and runtime.gpu_load(clock.now) == {}
    clock.now += 20
    assert runtime.get_status("a").state == "running"
    assert runtime.gpu_load(clock.now) == {"GPU-x": [("a", 1000)]}
    # A restarted agent starting it again waits only for what is left of the pull.
    clock.now -= 5
    again = SimulatedRuntime(tmp_path / "state", clock=clock, sleep=waits.append, cold_start_s=20)
    again.start(WorkloadSpec("a", image="img"))
    assert waits == [20, 5]


def test_prewarm_removes_the_cold_start(tmp_path: Path) -> None:
    clock = SleepingClock()
    runtime = SimulatedRuntime(tmp_path / "state", clock=clock, sleep=clock.sleep, cold_start_s=12)
    assert runtime.prewarm("img:2") == {"image": "img:2", "pulled": True, "pull_s": 12.0}
    assert runtime.prewarm("img:2")["pull_s"] == 0.0
    runtime.start(WorkloadSpec("w", image="img:2"))
    assert clock.slept == [12] and runtime.get_status("w").state == "running"
    # The node remembers its images across an agent restart.
    restarted = SimulatedRuntime(tmp_path / "state", clock=clock, sleep=clock.sleep, cold_start_s=12)
    restarted.start(WorkloadSpec("w2", image="img:2"))
    assert clock.slept == [12]


def test_cold_start_setting_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_SIM_COLD_START_S", "ghcr.io/acme/train:1=40, 7")
    runtime = SimulatedRuntime(tmp_path / "state")
    assert runtime.cold_start_s == {"ghcr.io/acme/train:1": 40.0, "": 7.0}
    monkeypatch.setenv("GPUPOOL_SIM_COLD_START_S", "img=soon")
    with pytest.raises(ValueError, match="GPUPOOL_SIM_COLD_START_S"):
        SimulatedRuntime(tmp_path / "other")
    monkeypatch.delenv("GPUPOOL_SIM_COLD_START_S")
    assert SimulatedRuntime(tmp_path / "third").cold_start_s == {}


def test_a_sample_s_wire_form_has_every_field_of_the_sample():
    """``GpuSample.to_json`` is written out by hand (for speed): it must not drop or rename a field."""
    import dataclasses

    from nodes.agent.types import GpuSample, ProcessSample

    sample = GpuSample(
        gpu_uuid="GPU-1", ts=1_700_000_000.25, util_pct=50.0, mem_used_mib=1024, xid_errors=[13],
        processes=[ProcessSample(pid=7, used_mib=None, workload_id="42")],
    )  # fmt: skip
    wire = sample.to_json()
    assert wire["ts"] == "2023-11-14T22:13:20.250Z"
    assert {k: v for k, v in wire.items() if k != "ts"} == {
        k: v for k, v in dataclasses.asdict(sample).items() if k != "ts"
    }


def test_protocol_times_are_rfc3339_utc_with_milliseconds():
    """Epoch seconds (the readings', cached per tick) and aware datetimes in any zone format alike."""
    from datetime import UTC, datetime, timedelta, timezone

    from nodes.agent.types import rfc3339

    moment = datetime(2026, 12, 2, 12, 0, 0, 123456, tzinfo=UTC)
    for _ in range(2):  # the second time from the cache
        assert rfc3339(moment.timestamp()) == "2026-12-02T12:00:00.123Z"
    assert rfc3339(moment.astimezone(timezone(timedelta(hours=-5)))) == "2026-12-02T12:00:00.123Z"
    assert rfc3339(0.0) == "1970-01-01T00:00:00.000Z"
    assert rfc3339(moment.timestamp() + 0.5) == "2026-12-02T12:00:00.623Z"


def test_an_elastic_job_resizes_in_place_and_its_gpus_load_follows(
    runtime: SimulatedRuntime, clock: Clock, tmp_path: Path
) -> None:
    collector = make_node(runtime, tmp_path)
    uuids = [g.uuid for g in collector.discover().gpus][:4]  # the four H100s
    runtime.start(WorkloadSpec("e", gpu_uuids=uuids[:1], sim_duration_s=100))
    clock.now += 10
    info = {"gpu_uuids": uuids[:3], "gpu_count": 3, "world_size": 3, "local_world_size": 3}
    runtime.resize("e", info, restart=True, grace_s=5)
    status = runtime.get_status("e")
    assert status.state == "running" and status.gpu_uuids == uuids[:3]
    assert sorted(runtime.gpu_load(clock.now)) == sorted(uuids[:3])
    runtime.resize("e", {**info, "gpu_uuids": uuids[:2], "gpu_count": 2}, restart=False, grace_s=5)
    assert sorted(runtime.gpu_load(clock.now)) == sorted(uuids[:2])
    assert json.loads((runtime.workload_dir("e") / "resize").read_text())["gpu_count"] == 2
    clock.now += 90
    assert runtime.get_status("e").finished_at == 1100.0  # the same run: its end unchanged
    with pytest.raises(RuntimeFailure, match="not running"):
        runtime.resize("e", info, restart=False, grace_s=5)
