"""MIG instances the agent takes for workloads, and the staff MIG configuration.

A ``start_workload`` with a ``mig_profile`` runs on a MIG instance of that profile on the GPU named
in ``gpu_uuids``, at the memory slice the portal chose (``mig_start``): the instance of the staff
layout there, or one the agent makes there now (a GPU instance with one compute instance), leaving
the instances of other workloads alone. The GPU must be in MIG mode: only staff change that
(``configure_mig``), never a workload's start or end. The workload then sees only its instance
(``--gpus device=MIG-...`` or ``CUDA_VISIBLE_DEVICES=MIG-...``). When the workload ends (stop,
preemption, or exit, noticed at the next heartbeat before it is reported) an instance the agent made
for it is destroyed; a layout instance stays for the next workload. The instances are recorded in
the agent's buffer (``mig_instances``), so a restarted agent still knows them and a repeated start
reuses its instance.
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
from nodes.agent.types import NodeInventory, WorkloadSpec, WorkloadStatus
from nodes.mig_profiles import check_placements, layout_placements, table_for

RECORDS = "mig_instances"  # buffer key: {workload_id: {"gpu_uuid", "mig_uuid", "profile", "start", "made"}}


class MigSlices:
    def __init__(self, buffer: Buffer, collector: Collector, log: logging.LoggerAdapter[Any]) -> None:
        self.buffer = buffer
        self.collector = collector
        self.log = log
        self.starting: set[str] = set()
        """Workloads between their slice and their start (a heartbeat must not take the slice)."""

    def records(self) -> dict[str, dict[str, Any]]:
        return json.loads(self.buffer.get(RECORDS, "{}") or "{}")

    def holding(self, gpu_uuids: list[str]) -> list[str]:
        """Workloads whose slices are on any of these GPUs."""
        return [wid for wid, record in self.records().items() if record["gpu_uuid"] in gpu_uuids]

    def _save(self, records: dict[str, dict[str, Any]]) -> None:
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
            made = await asyncio.to_thread(
                self.collector.create_mig_instance, parent, spec.mig_profile, spec.mig_start
            )
            holder = next(
                (wid for wid, r in self.records().items() if r["mig_uuid"] == str(made["mig_uuid"])), None
            )
            if holder is not None:
                raise RuntimeFailure(
                    f"the {spec.mig_profile} instance at memory slice {made['start']} of GPU {parent} "
                    f"is workload {holder}'s"
                )
            record = {
                "gpu_uuid": parent,
                "mig_uuid": str(made["mig_uuid"]),
                "profile": spec.mig_profile,
                "start": made["start"],
                "made": bool(made["made"]),
            }
            records = self.records()
            records[spec.workload_id] = record
            self._save(records)
            self.log.info(
                "%s MIG instance %s (%s at %s) for workload %s",
                "made" if record["made"] else "took the layout's",
                record["mig_uuid"],
                spec.mig_profile,
                record["start"],
                spec.workload_id,
            )
        return dataclasses.replace(spec, gpu_uuids=[record["mig_uuid"]])

    async def release(self, workload_id: str) -> bool:
        """Give back the workload's instance, if it has one (True then): destroyed if the agent made
        it, kept if it is the staff layout's. A failure is logged and the record kept: the next
        heartbeat tries again."""
        record = self.records().get(workload_id)
        if record is None:
            return False
        if record.get("made", True) is False:
            records = self.records()
            records.pop(workload_id, None)
            self._save(records)
            self.log.info(
                "gave back the layout's MIG instance %s of workload %s", record["mig_uuid"], workload_id
            )
            return True
        try:
            await asyncio.to_thread(
                self.collector.destroy_mig_instance, record["gpu_uuid"], record["mig_uuid"]
            )
        except CollectorError as exc:
            self.log.error(
                "the MIG instance %s of workload %s cannot be destroyed: %s",
                record["mig_uuid"],
                workload_id,
                exc,
            )
            return False
        records = self.records()
        records.pop(workload_id, None)
        self._save(records)
        self.log.info("destroyed MIG instance %s of workload %s", record["mig_uuid"], workload_id)
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


def mig_layout_from_payload(
    payload: dict[str, Any], inventory: NodeInventory | None, gpu_uuid: str
) -> list[tuple[str, int]]:
    """The instances ((profile, start)) a ``configure_mig`` asks for, checked against the GPU's
    profile table: ``placements`` (``[{"profile", "start"}]``, as the portal sends them) or, from
    an older portal, ``profiles`` (names; the starts are found here). Raises RuntimeFailure."""
    gpu = inventory.gpu(gpu_uuid) if inventory is not None else None
    if gpu is None:
        raise RuntimeFailure(f"GPU {gpu_uuid} is not on this node")
    table = table_for(gpu.name)
    if table is None:
        raise RuntimeFailure(f"{gpu.name} has no MIG")
    raw = payload.get("placements")
    try:
        if raw is not None:
            if not isinstance(raw, list) or len(raw) > table.memory_slices:
                raise ValueError(f"placements must be a list of at most {table.memory_slices} instances")
            placements = []
            for row in raw:
                if (
                    not isinstance(row, dict)
                    or not isinstance(row.get("profile"), str)
                    or type(row.get("start")) is not int
                ):
                    raise ValueError('each placement is {"profile": "1g.10gb", "start": 0}')
                placements.append((row["profile"], row["start"]))
            check_placements(table, placements)
            return placements
        profiles = payload.get("profiles") or []
        if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
            raise ValueError("profiles must be a list of MIG profile names")
        if len(profiles) > table.memory_slices:
            raise ValueError(f"at most {table.memory_slices} instances fit one GPU")
        return layout_placements(table, profiles)
    except ValueError as exc:
        raise RuntimeFailure(f"MIG layout refused: {exc}") from exc
