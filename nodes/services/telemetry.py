"""Telemetry retention. Raw samples are kept TELEMETRY_RAW_RETENTION_DAYS, minute rollups
TELEMETRY_ROLLUP_RETENTION_DAYS (billing reads rollups). Raw samples of a GPU that is gone are
deleted whatever their age: their GPU is a foreign key without a database constraint (see
``GpuSample``), so a GPU deleted while a batch of its node was being written can leave some behind.
See nodes/TELEMETRY.md."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection
from django.utils import timezone

from nodes.models import Gpu, GpuMinuteRollup, GpuSample, HeartbeatBatch, SequenceGap


def telemetry_purge(*, now: datetime | None = None) -> dict[str, int]:
    """Delete what is past retention, one GPU at a time so that every DELETE walks the (gpu, ts)
    index and no statement holds locks for long; and the raw samples of GPUs that are gone. Safe to run twice. (Django deletes these rows with
    one DELETE each: nothing refers to them.)"""
    now = now or timezone.now()
    raw_cutoff = now - timedelta(days=settings.TELEMETRY_RAW_RETENTION_DAYS)
    rollup_cutoff = now - timedelta(days=settings.TELEMETRY_ROLLUP_RETENTION_DAYS)
    samples = rollups = 0
    for gpu_id in Gpu.objects.values_list("id", flat=True).iterator():
        samples += GpuSample.objects.filter(gpu_id=gpu_id, ts__lt=raw_cutoff).delete()[0]
        rollups += GpuMinuteRollup.objects.filter(gpu_id=gpu_id, minute__lt=rollup_cutoff).delete()[0]
    orphans = 0
    for gpu_id in _sampled_gpus_gone():
        orphans += GpuSample.objects.filter(gpu_id=gpu_id).delete()[0]
    # Heartbeat markers only dedupe replays; keep them as long as the raw samples.
    heartbeats = HeartbeatBatch.objects.filter(received_at__lt=raw_cutoff).delete()[0]
    gaps = SequenceGap.objects.filter(detected_at__lt=raw_cutoff).delete()[0]
    return {
        "samples": samples,
        "orphan_samples": orphans,
        "rollups": rollups,
        "heartbeats": heartbeats,
        "gaps": gaps,
    }


def _sampled_gpus_gone() -> list[int]:
    """The GPU ids that raw samples refer to and the GPU table no longer has. The distinct ids are
    read from the ``(gpu_id, ts)`` index one look-up each (a recursive "loose index scan"), not by
    reading every sample; raw SQL because the ORM has no recursive query."""
    samples, gpus = GpuSample._meta, Gpu._meta
    gpu_id = samples.get_field("gpu").column
    with connection.cursor() as cur:
        cur.execute(
            f"""
WITH RECURSIVE ids (gpu_id) AS (
    SELECT MIN({gpu_id}) FROM {samples.db_table}
    UNION ALL
    SELECT (SELECT MIN({gpu_id}) FROM {samples.db_table} WHERE {gpu_id} > ids.gpu_id)
    FROM ids WHERE ids.gpu_id IS NOT NULL
)
SELECT ids.gpu_id FROM ids WHERE ids.gpu_id IS NOT NULL
AND NOT EXISTS (SELECT 1 FROM {gpus.db_table} g WHERE g.{gpus.pk.column} = ids.gpu_id)
"""
        )
        return [row[0] for row in cur.fetchall()]
