"""Telemetry retention. Raw samples are kept TELEMETRY_RAW_RETENTION_DAYS, minute rollups
TELEMETRY_ROLLUP_RETENTION_DAYS (billing reads rollups). See nodes/TELEMETRY.md."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from nodes.models import Gpu, GpuMinuteRollup, GpuSample, HeartbeatBatch, SequenceGap


def telemetry_purge(*, now: datetime | None = None) -> dict[str, int]:
    """Delete what is past retention, one GPU at a time so that every DELETE walks the (gpu, ts)
        index and no statement holds locks for long. Safe to run twice. (Django deletes these rows with
    one DELETE each: nothing refers to them.)"""
    now = now or timezone.now()
    raw_cutoff = now - timedelta(days=settings.TELEMETRY_RAW_RETENTION_DAYS)
    rollup_cutoff = now - timedelta(days=settings.TELEMETRY_ROLLUP_RETENTION_DAYS)
    samples = rollups = 0
    for gpu_id in Gpu.objects.values_list("id", flat=True).iterator():
        samples += GpuSample.objects.filter(gpu_id=gpu_id, ts__lt=raw_cutoff).delete()[0]
        rollups += GpuMinuteRollup.objects.filter(gpu_id=gpu_id, minute__lt=rollup_cutoff).delete()[0]
    # Heartbeat markers only dedupe replays; keep them as long as the raw samples.
    heartbeats = HeartbeatBatch.objects.filter(received_at__lt=raw_cutoff).delete()[0]
    gaps = SequenceGap.objects.filter(detected_at__lt=raw_cutoff).delete()[0]
    return {"samples": samples, "rollups": rollups, "heartbeats": heartbeats, "gaps": gaps}
