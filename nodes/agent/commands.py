"""The agent's commands: each command id runs once (a repeat is answered from the buffer), by kind
(start, stop, preempt, prewarm, configure MIG, drain), and its result goes back through the outbox.

``CommandHandlers`` is a mixin of ``nodes.agent.agent.Agent``: it uses the agent's buffer, runtime,
collector, MIG slices and sender.
"""

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nodes.agent.collectors import CollectorError
from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.types import (
    PREEMPTED,
    RUNNING,
    NodeInventory,
    WorkloadSpec,
    rfc3339,
)
from nodes.agent.workload_rules import WorkloadRuleError, check_image, check_volume_id


def start_failed(payload: dict[str, Any], reason: str, *, rejected: bool = False) -> dict[str, Any]:
    """The result of a start that failed: the portal shows ``reason`` on the workload. ``rejected``:
    the payload broke the workload rules, so no node would start it and the portal fails it at once
    instead of trying again elsewhere."""
    workload_id = payload.get("workload_id") if isinstance(payload, dict) else None
    return {
        "workload_id": str(workload_id or ""),
        "error": "start_failed",
        "reason": reason,
        "rejected": rejected,
    }


class CommandHandlers:
    def receive_command(self, command: dict[str, Any]) -> None:
        """Run a command once per id; a repeat is answered with the result already stored."""
        command_id = str(command["id"])
        kind = str(command.get("kind", ""))
        payload = command.get("payload") or {}
        record = self.buffer.command(command_id)
        if record is not None and record.finished:
            if not self.buffer.has_pending_report(command_id):
                self.log.info("command %s delivered again; reporting its stored result", command_id)
                self.buffer.add_report(
                    command_id, self._report_body(record.state, record.result or {}, record.message)
                )
                self._wake_sender()
            return
        if command_id in self._command_tasks and not self._command_tasks[command_id].done():
            return  # running now; it reports when it finishes
        if record is None:
            self.buffer.command_accepted(command_id, kind, payload, self._report_body("accepted", {}, ""))
            self._wake_sender()
        # else: accepted by an earlier run of the agent that stopped before finishing it; the
        # runtimes are idempotent by workload id, so running it again is safe.
        self.log.info("command %s: %s", command_id, kind)
        task = asyncio.ensure_future(self._execute(command_id, kind, payload))
        self._command_tasks[command_id] = task
        task.add_done_callback(lambda _: self._command_tasks.pop(command_id, None))

    @staticmethod
    def _report_body(status: str, result: dict[str, Any], message: str) -> dict[str, Any]:
        return {"status": status, "result": result, "message": message, "at": rfc3339(time.time())}

    async def _execute(self, command_id: str, kind: str, payload: dict[str, Any]) -> None:
        handlers: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "start_workload": self._start_workload,
            "stop_workload": self._stop_workload,
            "preempt_workload": self._preempt_workload,
            "prewarm": self._prewarm,
            "configure_mig": self._configure_mig,
            "drain": self._drain,
            "delete_volume": self._delete_volume,
        }
        handler = handlers.get(kind)
        try:
            if handler is None:
                raise ValueError(f"unknown command kind {kind!r}")
            result = await handler(payload)
            state, message = "succeeded", ""
        except WorkloadRuleError as exc:
            state, result, message = "failed", {"rejected": True}, str(exc)
        except (RuntimeFailure, CollectorError, ValueError, KeyError, TypeError) as exc:
            state, result, message = "failed", {}, str(exc) or type(exc).__name__
        except Exception as exc:
            self.log.exception("command %s (%s) failed unexpectedly", command_id, kind)
            state, result, message = "failed", {}, f"agent error: {exc!r}"
        if state == "failed" and kind == "start_workload":
            result = start_failed(payload, message, rejected=result.get("rejected") is True)
        self.log.info("command %s %s %s", command_id, state, message)
        self.buffer.command_finished(
            command_id, state, result, message, self._report_body(state, result, message)
        )
        self._wake_sender()

    async def _start_workload(self, payload: dict[str, Any]) -> dict[str, Any]:
        spec = WorkloadSpec.from_payload(payload)
        known = await asyncio.to_thread(self.runtime.get_status, spec.workload_id)
        if known is not None and known.terminal and self.runtime.attempt_of(spec.workload_id) != spec.attempt:
            # Another placement of a workload whose earlier run here has ended (a retry, a requeue):
            # it starts afresh, never with the ended run's handle. Its last lines go first.
            await self.forget_ended(spec.workload_id)
            known = None
        if known is None:
            if self.draining:
                raise RuntimeFailure("this node is draining and accepts no new work")
            inventory = self.inventory or NodeInventory(gpus=[])
            for uuid in spec.gpu_uuids:
                if inventory.gpu(uuid) is None and not any(
                    mig.uuid == uuid for gpu in inventory.gpus for mig in gpu.mig_devices
                ):
                    raise RuntimeFailure(f"GPU {uuid} is not on this node")
            sliced = [] if spec.mig_profile else self.mig.holding(spec.gpu_uuids)
            if sliced:
                raise RuntimeFailure(
                    f"MIG slices of workloads {', '.join(sliced)} are on its GPU; other work waits for them"
                )
        mig = bool(spec.mig_profile) and (known is None or spec.workload_id in self.mig.records())
        self.mig.starting.add(spec.workload_id)
        try:
            if mig:
                made = spec.workload_id not in self.mig.records()
                spec = await self.mig.slice_for(spec, await self._runtime_status())
                self.inventory = await asyncio.to_thread(self.collector.discover)
            try:
                handle = await asyncio.to_thread(self.runtime.start, spec)
            except Exception:
                if mig and made:
                    await self._release_mig(spec.workload_id)
                raise
        finally:
            self.mig.starting.discard(spec.workload_id)
        await asyncio.to_thread(self.runtime.attempt_record, spec.workload_id, spec.attempt or 0)
        if spec.max_runtime_s and known is None:
            deadlines = self._deadlines()
            deadlines[spec.workload_id] = time.time() + spec.max_runtime_s
            self.buffer.set("deadlines", json.dumps(deadlines))
        result: dict[str, Any] = {"workload_id": spec.workload_id, "ref": handle.ref}
        if spec.ports:
            # Container port -> host port; a port missing here was not published (the simulated
            # runtime publishes none), and the portal says so rather than show an address.
            result["ports"] = handle.ports
            result["runtime"] = self.runtime.name
        if mig:
            result["mig_uuid"] = spec.gpu_uuids[0]
        return result

    def _close_ssh(self, workload_id: str) -> None:
        """A workload that stops takes its SSH sessions with it, at once."""
        ssh = getattr(self, "ssh", None)
        if ssh is not None:
            ssh.close_workload(workload_id)

    async def _release_mig(self, workload_id: str) -> None:
        if await self.mig.release(workload_id):
            self.inventory = await asyncio.to_thread(self.collector.discover)

    async def _stop_workload(self, payload: dict[str, Any]) -> dict[str, Any]:
        workload_id = str(payload["workload_id"])
        grace = float(payload.get("grace_s", self.config.stop_grace_s))
        self._close_ssh(workload_id)
        status = await asyncio.to_thread(self.runtime.stop, workload_id, grace)
        await self._release_mig(workload_id)
        return {"workload_id": workload_id, "state": status.state, "exit_code": status.exit_code}

    async def _preempt_workload(self, payload: dict[str, Any]) -> dict[str, Any]:
        workload_id = str(payload["workload_id"])
        notice = float(payload.get("notice_s", 0))
        grace = float(payload.get("grace_s", min(self.config.stop_grace_s, 10.0)))
        status = await asyncio.to_thread(self.runtime.get_status, workload_id)
        if status is not None and status.state == RUNNING:
            await asyncio.to_thread(self.runtime.notify_preempt, workload_id, notice)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + notice
            while loop.time() < deadline:
                await asyncio.sleep(min(1.0, max(0.0, deadline - loop.time())))
                status = await asyncio.to_thread(self.runtime.get_status, workload_id)
                if status is None or status.terminal:
                    break  # it finished within its notice
        self._close_ssh(workload_id)
        status = await asyncio.to_thread(self.runtime.stop, workload_id, grace, final_state=PREEMPTED)
        await self._release_mig(workload_id)
        return {"workload_id": workload_id, "state": status.state, "exit_code": status.exit_code}

    async def _prewarm(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self.runtime.prewarm, check_image(payload.get("image")))

    async def _configure_mig(self, payload: dict[str, Any]) -> dict[str, Any]:
        uuid = str(payload["gpu_uuid"])
        statuses = await self._runtime_status()
        busy = [s.workload_id for s in statuses if not s.terminal and uuid in s.gpu_uuids]
        busy += self.mig.holding([uuid])
        if busy:
            raise RuntimeFailure(
                f"GPU {uuid} runs workloads {', '.join(busy)}; MIG can change only on an idle GPU"
            )
        result = await asyncio.to_thread(
            self.collector.configure_mig,
            uuid,
            bool(payload.get("enable", True)),
            list(payload.get("profiles") or []),
        )
        self.inventory = await asyncio.to_thread(self.collector.discover)
        return result

    async def _delete_volume(self, payload: dict[str, Any]) -> dict[str, Any]:
        volume_id = check_volume_id(payload.get("volume_id"))
        return await asyncio.to_thread(self.runtime.volumes.delete, volume_id)

    async def _drain(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.buffer.set("draining", "1")
        statuses = await self._runtime_status()
        return {"draining": True, "running": [s.workload_id for s in statuses if not s.terminal]}
