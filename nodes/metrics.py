"""Prometheus metrics for the fleet: ingest counters (per process) and a collector that reads the
database on each scrape: nodes by state and region (one query) and GPUs by model, region and health
with their latest telemetry aggregated per model and region (one query), whatever the fleet's size.

Per-GPU gauges under DCGM exporter names (one series per GPU and field: ~20,000 series at 3,300
GPUs) are added only with ``METRICS_PER_GPU`` (default: on with DEBUG, off in production); the
dashboards and alert rules in deploy/ use only the aggregates.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
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

# Telemetry counts (aggregates and per-GPU gauges) for GPUs that reported within this window.
FRESH_FOR = timedelta(minutes=5)

AGG_LABELS = ["model", "region"]
AGGREGATES = (
    # (metric name, help, the aggregate's key in the query below)
    ("gpupool_gpus_reporting", "GPUs that reported telemetry in the last 5 minutes.", "reporting"),
    (
        "gpupool_gpu_util_percent_sum",
        "Sum of the reporting GPUs' utilisation (in %); / reporting = mean.",
        "util",
    ),
    ("gpupool_gpu_memory_used_mib", "Framebuffer memory used by the reporting GPUs (in MiB).", "mem"),
    ("gpupool_gpu_power_watts", "Power drawn by the reporting GPUs (in W).", "power"),
    ("gpupool_gpu_temp_max_celsius", "Temperature of the hottest reporting GPU (in C).", "temp"),
    (
        "gpupool_gpu_sm_clock_mhz_sum",
        "Sum of the reporting GPUs' SM clocks (in MHz); / reporting = mean.",
        "clock",
    ),
    ("gpupool_gpus_ecc_dbe", "Reporting GPUs with double-bit ECC errors.", "dbe"),
    ("gpupool_gpus_xid", "Reporting GPUs whose last XID error is non-zero.", "xid"),
)

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


def _gpu_aggregates(cutoff):
    """One query: present GPUs by (model, region, health) with counts and telemetry aggregates."""
    from django.db.models import Count, Max, Q, Sum, Value
    from django.db.models.functions import Coalesce, Concat

    from nodes.models import Gpu

    fresh = Q(last_sample_at__gte=cutoff)
    return (
        Gpu.objects.filter(removed_at__isnull=True)
        .values(
            "health",
            label=Coalesce("model__name", Concat(Value("unknown: "), "reported_name")),
            region_code=Coalesce("node__region__code", Value("")),
        )
        .annotate(
            n=Count("id"),
            isolated_n=Count("id", filter=Q(isolated=True)),
            reporting=Count("id", filter=fresh),
            util=Sum("last_util_pct", filter=fresh),
            mem=Sum("last_mem_used_mib", filter=fresh),
            power=Sum("last_power_w", filter=fresh),
            temp=Max("last_temp_c", filter=fresh),
            clock=Sum("last_sm_clock_mhz", filter=fresh),
            dbe=Count("id", filter=fresh & Q(ecc_dbe_total__gt=0)),
            xid=Count("id", filter=fresh & Q(last_xid__gt=0)),
        )
        .order_by()
    )


class FleetCollector(Collector):
    def describe(self):
        # Names only: registering must not query the database (the app registry may not be ready).
        yield GaugeMetricFamily("gpupool_nodes", "Nodes by state and region.", labels=["state", "region"])
        yield GaugeMetricFamily("gpupool_gpus", "GPUs by model and health.", labels=["model", "health"])
        yield GaugeMetricFamily("gpupool_gpus_isolated", "GPUs isolated from scheduling.")
        for name, help_, _ in AGGREGATES:
            yield GaugeMetricFamily(name, help_, labels=AGG_LABELS)
        if settings.METRICS_PER_GPU:
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

        from nodes.models import Node

        nodes = GaugeMetricFamily("gpupool_nodes", "Nodes by state and region.", labels=["state", "region"])
        for row in (
            Node.objects.values("state", region_code=F("region__code")).annotate(n=Count("id")).order_by()
        ):
            nodes.add_metric([row["state"], row["region_code"]], row["n"])

        cutoff = timezone.now() - FRESH_FOR
        by_health: dict[tuple[str, str], int] = {}
        isolated_n = 0
        # (model, region) -> aggregate key -> value; None where no GPU reported.
        agg: dict[tuple[str, str], dict[str, float | None]] = {}
        for row in _gpu_aggregates(cutoff):
            key = (row["label"], row["health"])
            by_health[key] = by_health.get(key, 0) + row["n"]
            isolated_n += row["isolated_n"]
            into = agg.setdefault((row["label"], row["region_code"]), {})
            for _, _, field in AGGREGATES:
                value = row[field]
                if value is None:
                    into.setdefault(field, None)
                    continue
                old = into.get(field)
                into[field] = value if old is None else max(old, value) if field == "temp" else old + value
        gpus = GaugeMetricFamily("gpupool_gpus", "GPUs by model and health.", labels=["model", "health"])
        for (label, health), n in sorted(by_health.items()):
            gpus.add_metric([label, health], n)
        isolated = GaugeMetricFamily("gpupool_gpus_isolated", "GPUs isolated from scheduling.")
        isolated.add_metric([], isolated_n)
        yield nodes
        yield gpus
        yield isolated
        for name, help_, field in AGGREGATES:
            family = GaugeMetricFamily(name, help_, labels=AGG_LABELS)
            for labels, values in sorted(agg.items()):
                value = values.get(field)
                if value is not None or field == "reporting":
                    family.add_metric(list(labels), float(value or 0))
            yield family
        if settings.METRICS_PER_GPU:
            yield from self._per_gpu(cutoff)

    @staticmethod
    def _per_gpu(cutoff):
        from nodes.models import Gpu

        families = {name: GaugeMetricFamily(name, help_, labels=GPU_LABELS) for name, help_, _ in DCGM_GAUGES}
        columns = [column for _, _, column in DCGM_GAUGES]
        rows = Gpu.objects.filter(removed_at__isnull=True, last_sample_at__gte=cutoff).values_list(
            "node__hostname", "index", "uuid", "model__name", "reported_name", "node__region__code", *columns
        )
        for hostname, index, uuid, model_name, reported, region, *values in rows.order_by().iterator(2000):
            labels = [hostname, str(index), uuid, model_name or reported, region]
            for (name, _, _), value in zip(DCGM_GAUGES, values, strict=True):
                if value is not None:
                    families[name].add_metric(labels, float(value))
        yield from families.values()


_registered = False


def register_collector() -> None:
    global _registered
    if not _registered:
        REGISTRY.register(FleetCollector())
        _registered = True
