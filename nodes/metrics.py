"""Prometheus metrics for the fleet: ingest counters (per process) and a collector that reads the
database on each scrape (three cheap queries). Per-GPU gauges carry DCGM exporter names."""

from __future__ import annotations

import logging
from datetime import timedelta

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

HEARTBEATS = Counter("gpupool_heartbeats", "Heartbeat batches received, by result.", ["result"])
SAMPLES = Counter("gpupool_gpu_samples_ingested", "GPU telemetry samples stored.")
SAMPLES_IGNORED = Counter("gpupool_gpu_samples_ignored", "Samples for GPUs the node never registered.")
GAPS = Counter("gpupool_heartbeat_gaps", "Heartbeat sequence gaps detected.")
AGENT_REJECTED = Counter("gpupool_agent_requests_rejected", "Agent requests refused, by status.", ["status"])
COMMANDS = Counter("gpupool_node_commands", "Node command events, by kind and event.", ["kind", "event"])
NODES_MARKED_DOWN = Counter("gpupool_nodes_marked_down", "Nodes the health reconciler marked DOWN.")
GPUS_MARKED_UNHEALTHY = Counter("gpupool_gpus_marked_unhealthy", "GPUs isolated as unhealthy.")
ALERTS = Counter("gpupool_fleet_alerts", "Fleet alerts raised, by kind.", ["kind"])
MASS_SILENCE = Gauge("gpupool_fleet_mass_silence", "1 while the mass-silence guard holds back evictions.")

# Per-GPU gauges are exported for GPUs that reported within this window.
FRESH_FOR = timedelta(minutes=5)

DCGM_GAUGES = (
    # (metric name, help, column)
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "last_util_pct"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "last_mem_used_mib"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "last_power_w"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "last_temp_c"),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "last_sm_clock_mhz"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", "ecc_dbe_total"),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", "last_xid"),
)
GPU_LABELS = ["node", "gpu", "UUID", "model", "region"]


class FleetCollector(Collector):
    def describe(self):
        # Names only: registering must not query the database (the app registry may not be ready).
        yield GaugeMetricFamily("gpupool_nodes", "Nodes by state and region.", labels=["state", "region"])
        yield GaugeMetricFamily("gpupool_gpus", "GPUs by model and health.", labels=["model", "health"])
        yield GaugeMetricFamily("gpupool_gpus_isolated", "GPUs isolated from scheduling.")
        for name, help_, _ in DCGM_GAUGES:
            yield GaugeMetricFamily(name, help_, labels=GPU_LABELS)

    def collect(self):
        try:
            yield from self._collect()
        except Exception:  # a scrape must never fail because the database is away
            logger.warning("Fleet metrics unavailable", exc_info=True)

    def _collect(self):
        from django.db.models import Count, F
        from django.utils import timezone

        from nodes.models import Gpu, Node

        nodes = GaugeMetricFamily("gpupool_nodes", "Nodes by state and region.", labels=["state", "region"])
        for row in Node.objects.values("state", region_code=F("region__code")).annotate(n=Count("id")):
            nodes.add_metric([row["state"], row["region_code"]], row["n"])
        gpus = GaugeMetricFamily("gpupool_gpus", "GPUs by model and health.", labels=["model", "health"])
        present = Gpu.objects.filter(removed_at__isnull=True)
        for row in present.values("health", model_name=F("model__name"), name=F("reported_name")).annotate(
            n=Count("id")
        ):
            gpus.add_metric([row["model_name"] or f"unknown: {row['name']}", row["health"]], row["n"])
        isolated = GaugeMetricFamily("gpupool_gpus_isolated", "GPUs isolated from scheduling.")
        isolated.add_metric([], present.filter(isolated=True).count())
        families = {name: GaugeMetricFamily(name, help_, labels=GPU_LABELS) for name, help_, _ in DCGM_GAUGES}
        columns = [column for _, _, column in DCGM_GAUGES]
        rows = present.filter(last_sample_at__gte=timezone.now() - FRESH_FOR).values_list(
            "node__hostname", "index", "uuid", "model__name", "reported_name", "node__region__code", *columns
        )
        for hostname, index, uuid, model_name, reported, region, *values in rows:
            labels = [hostname, str(index), uuid, model_name or reported, region]
            for (name, _, _), value in zip(DCGM_GAUGES, values, strict=True):
                if value is not None:
                    families[name].add_metric(labels, float(value))
        yield nodes
        yield gpus
        yield isolated
        yield from families.values()


_registered = False


def register_collector() -> None:
    global _registered
    if not _registered:
        REGISTRY.register(FleetCollector())
        _registered = True
