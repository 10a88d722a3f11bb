"""/metrics for a fleet of 3,300 GPUs: per-model/region aggregates always, per-GPU DCGM series only
with METRICS_PER_GPU, and a scrape that stays cheap."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from nodes.models import Gpu, GpuHealth, GpuModel, Node, Region

MODELS = (("NVIDIA H100 SXM 80GB", 8), ("NVIDIA A100 SXM 80GB", 8), ("NVIDIA L40S", 4), ("NVIDIA L4", 2))
REGIONS = ("us-east-1", "eu-west-1", "ap-northeast-1")


@pytest.fixture
def fleet(db):
    """~3,300 GPUs on 550 nodes in three regions; all reported a minute ago except a few."""
    now = timezone.now()
    regions = [
        Region.objects.get_or_create(code=code, defaults={"name": code, "location": code})[0]
        for code in REGIONS
    ]
    models = {m.name: m for m in GpuModel.objects.filter(name__in=[name for name, _ in MODELS])}
    assert len(models) == len(MODELS)
    nodes = Node.objects.bulk_create(
        Node(hostname=f"scale-{i:04d}", region=regions[i % 3], registered_at=now) for i in range(550)
    )
    gpus = []
    for i, node in enumerate(nodes):
        name, per_node = MODELS[(0, 0, 0, 1, 1, 1, 2, 2, 3, 3)[i % 10]]
        for index in range(per_node):
            stale = i % 50 == 0
            gpus.append(
                Gpu(
                    node=node,
                    index=index,
                    uuid=f"GPU-{node.hostname}-{index}",
                    model=models[name],
                    reported_name=name,
                    health=GpuHealth.UNHEALTHY if (i, index) == (5, 1) else GpuHealth.HEALTHY,
                    isolated=(i, index) == (5, 1),
                    last_sample_at=now - (timedelta(hours=1) if stale else timedelta(minutes=1)),
                    last_util_pct=float((i + index) % 100),
                    last_mem_used_mib=1000 + index,
                    last_power_w=300.0 + index,
                    last_temp_c=60 + (i % 30),
                    last_sm_clock_mhz=1800,
                    ecc_dbe_total=1 if (i, index) == (7, 0) else 0,
                    last_xid=79 if (i, index) == (9, 0) else None,
                )
            )
    Gpu.objects.bulk_create(gpus, batch_size=1000)
    return gpus


def scrape(client) -> tuple[float, dict]:
    started = time.perf_counter()
    response = client.get("/metrics")
    elapsed = time.perf_counter() - started
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.content.decode())}
    return elapsed, families


def series(families, name) -> list:
    family = families.get(name)
    return family.samples if family is not None else []


def test_aggregates_are_always_there_and_per_gpu_series_only_when_asked(client, fleet, settings):
    assert len(fleet) == 3300
    settings.METRICS_PER_GPU = False
    client.get("/metrics")  # warm up (imports, first connection)
    elapsed_off, families = min((scrape(client) for _ in range(3)), key=lambda r: r[0])
    fresh = [g for g in fleet if g.last_sample_at > timezone.now() - timedelta(minutes=5)]

    assert series(families, "DCGM_FI_DEV_GPU_UTIL") == []
    total = sum(1 for s in families.values() for _ in s.samples)
    assert total < 400, total  # the fleet's size does not multiply the series
    power = {
        (s.labels["model"], s.labels["region"]): s.value for s in series(families, "gpupool_gpu_power_watts")
    }
    assert sum(power.values()) == pytest.approx(sum(g.last_power_w for g in fresh))
    assert len(power) == 12  # 4 models x 3 regions
    reporting = series(families, "gpupool_gpus_reporting")
    assert sum(s.value for s in reporting) == len(fresh)
    util = {
        (s.labels["model"], s.labels["region"]): s.value
        for s in series(families, "gpupool_gpu_util_percent_sum")
    }
    h100_use1 = [
        g.last_util_pct
        for g in fresh
        if g.reported_name == "NVIDIA H100 SXM 80GB" and g.node.region.code == "us-east-1"
    ]
    assert util[("NVIDIA H100 SXM 80GB", "us-east-1")] == pytest.approx(sum(h100_use1))
    assert max(s.value for s in series(families, "gpupool_gpu_temp_max_celsius")) == max(
        g.last_temp_c for g in fresh
    )
    assert sum(s.value for s in series(families, "gpupool_gpus_ecc_dbe")) == 1
    assert sum(s.value for s in series(families, "gpupool_gpus_xid")) == 1
    by_health = {(s.labels["model"], s.labels["health"]): s.value for s in series(families, "gpupool_gpus")}
    assert sum(by_health.values()) == len(fleet)
    assert by_health[("NVIDIA A100 SXM 80GB", "unhealthy")] == 1
    assert series(families, "gpupool_gpus_isolated")[0].value == 1

    settings.METRICS_PER_GPU = True
    elapsed_on, families = scrape(client)
    assert len(series(families, "DCGM_FI_DEV_GPU_UTIL")) == len(fresh)
    assert len(series(families, "gpupool_gpu_power_watts")) == 12  # the aggregates stay
    print(
        f"\n/metrics ({total} series without per-GPU) with {len(fleet)} GPUs: {elapsed_off * 1000:.0f} ms per-GPU off, {elapsed_on * 1000:.0f} ms on"
    )


def test_the_collector_makes_two_queries_whatever_the_fleet_size(fleet, settings, django_assert_num_queries):
    from nodes.metrics import FleetCollector

    settings.METRICS_PER_GPU = False
    with django_assert_num_queries(2):
        families = list(FleetCollector().collect())
    assert {f.name for f in families} >= {"gpupool_nodes", "gpupool_gpus", "gpupool_gpu_power_watts"}
    settings.METRICS_PER_GPU = True
    with django_assert_num_queries(3):
        families = list(FleetCollector().collect())
    assert "DCGM_FI_DEV_GPU_UTIL" in {f.name for f in families}
