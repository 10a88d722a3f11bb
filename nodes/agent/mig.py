"""MIG slices the agent makes for workloads.

A ``start_workload`` with a ``mig_profile`` runs on a MIG slice of that profile made for it on the
GPU named in ``gpu_uuids``: the collector turns MIG mode on if it is off (the portal sends MIG work
only to GPUs that are empty or already hold slices) and makes one GPU instance with one compute
instance, leaving the slices of other workloads alone; the workload then sees only the slice
(``--gpus device=MIG-...`` or ``CUDA_VISIBLE_DEVICES=MIG-...``). When the workload ends (stop,
preemption, or exit, noticed at the next heartbeat before it is reported) the slice is destroyed,
and the last slice of a GPU turns MIG mode off again. The slices are recorded in the agent's buffer
(``mig_instances``), so a restarted agent still knows them and a repeated start reuses its slice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

from nodes.agent.buffer import Buffer
from nodes.agent.collectors import Collector, CollectorError
from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.types import WorkloadSpec, WorkloadStatus

RECORDS = "mig_instances"  # buffer key: {workload_id: {"gpu_uuid", "mig_uuid", "profile"}}


class MigSlices:
    def __init__(self, buffer: Buffer, collector: Collector, log: logging.LoggerAdapter[Any]) -> None:
        self.buffer = buffer
        self.collector = collector
        self.log = log
        self.starting: set[str] = set()
        """Workloads between their slice and their start (a heartbeat must not take the slice)."""

    def records(self) -> dict[str, dict[str, str]]:
        return json.loads(self.buffer.get(RECORDS, "{}") or "{}")

    def holding(self, gpu_uuids: list[str]) -> list[str]:
        """Workloads whose slices are on any of these GPUs."""
        return [wid for wid, record in self.records().items() if record["gpu_uuid"] in gpu_uuids]

    def _save(self, records: dict[str, dict[str, str]]) -> None:
        self.buffer.set(RECORDS, json.dumps(records))

    async def slice_for(self, spec: WorkloadSpec, statuses: list[WorkloadStatus]) -> WorkloadSpec:
        """The spec that runs on the workload's slice: made now, or the one an earlier try made."""
        record = self.records().get(spec.workload_id)
        if record is None:
            if len(spec.gpu_uuids) != 1:
                raise ValueError("a MIG slice is made on exactly one GPU (gpu_uuids)")
            parent = spec.gpu_uuids[0]
            busy = [s.workload_id for s in statuses if not s.terminal and parent in s.gpu_uuids]
            if busy:
                raise RuntimeFailure(
                    f"GPU {parent} runs workloads {', '.join(busy)} that are not on MIG slices; "
                    "MIG slices and other work do not share a GPU"
                )
            made = await asyncio.to_thread(self.collector.create_mig_instance, parent, spec.mig_profile)
            record = {"gpu_uuid": parent, "mig_uuid": str(made["mig_uuid"]), "profile": spec.mig_profile}
            records = self.records()
            records[spec.workload_id] = record
            self._save(records)
            self.log.info(
                "made MIG slice %s (%s) for workload %s",
                record["mig_uuid"],
                spec.mig_profile,
                spec.workload_id,
            )
        return dataclasses.replace(spec, gpu_uuids=[record["mig_uuid"]])

    async def release(self, workload_id: str) -> bool:
        """Destroy the workload's slice, if it has one (True then). A failure is logged and the
        record kept: the next heartbeat tries again."""
        record = self.records().get(workload_id)
        if record is None:
            return False
        try:
            result = await asyncio.to_thread(
                self.collector.destroy_mig_instance, record["gpu_uuid"], record["mig_uuid"]
            )
        except CollectorError as exc:
            self.log.error(
                "the MIG slice %s of workload %s cannot be destroyed: %s",
                record["mig_uuid"],
                workload_id,
                exc,
            )
            return False
        records = self.records()
        records.pop(workload_id, None)
        self._save(records)
        self.log.info(
            "destroyed MIG slice %s of workload %s (MIG mode %s)",
            record["mig_uuid"],
            workload_id,
            "on" if result.get("mig_mode") else "off",
        )
        return True

    async def release_finished(self, statuses: list[WorkloadStatus]) -> bool:
        """Destroy the slices of workloads that ended (or that the runtime no longer knows)."""
        records = self.records()
        if not records:
            return False
        live = {s.workload_id for s in statuses if not s.terminal} | self.starting
        released = False
        for workload_id in records:
            if workload_id not in live:
                released = await self.release(workload_id) or released
        return released
