"""The agent's commands: each command id runs once (a repeat is answered from the buffer), by kind
(start, stop, preempt, prewarm, configure MIG, drain, undrain, upgrade, GPU check), and its result
goes back through the outbox.

``CommandHandlers`` is a mixin of ``nodes.agent.agent.Agent``: it uses the agent's buffer, runtime,
collector, MIG slices and sender.
"""

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nodes.agent.collectors import CollectorError
from nodes.agent.mig import mig_layout_from_payload
from nodes.agent.runtimes import RuntimeFailure
from nodes.agent.types import (
    PREEMPTED,
    RUNNING,
    NodeInventory,
    WorkloadSpec,
    rfc3339,
)
from nodes.agent.workload_rules import WorkloadRuleError, check_gpu_uuids, check_image, check_volume_id

# XIDs that mean the GPU needs attention (the portal isolates a GPU on them too: nodes/PROTOCOL.md).
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
UPGRADE_OUTPUT_CHARS = 2000
MAX_UPGRADE_TIMEOUT_S = 86400


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
            "undrain": self._undrain,
            "upgrade": self._upgrade,
            "gpu_check": self._gpu_check,
            "resize_workload": self._resize_workload,
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

    async def _resize_workload(self, payload: dict[str, Any]) -> dict[str, Any]:
        """An elastic job's new GPUs on this node: written to its resize file, then SIGUSR1, or a
        restart from its checkpoint (``on_resize`` "restart"). Every field is checked again here."""
        workload_id = str(payload["workload_id"])
        uuids = check_gpu_uuids(payload["gpu_uuids"])
        world = payload["world_size"]
        mode = payload.get("on_resize", "signal")
        if isinstance(world, bool) or not isinstance(world, int) or not len(uuids) <= world <= 4096:
            raise WorkloadRuleError("world_size", "A whole number, at least the GPUs given here.")
        if mode not in ("signal", "restart"):
            raise WorkloadRuleError("on_resize", 'Either "signal" or "restart".')
        if not uuids:
            raise WorkloadRuleError("gpu_uuids", "An elastic job keeps at least one GPU.")
        inventory = self.inventory or NodeInventory(gpus=[])
        for uuid in uuids:
            if inventory.gpu(uuid) is None:
                raise RuntimeFailure(f"GPU {uuid} is not on this node")
        status = await asyncio.to_thread(self.runtime.get_status, workload_id)
        if status is None or status.state != RUNNING:
            raise RuntimeFailure(f"workload {workload_id} is not running on this node")
        info = {
            "gpu_uuids": uuids,
            "gpu_count": len(uuids),
            "world_size": world,
            "local_world_size": len(uuids),
            "at": rfc3339(time.time()),
        }
        grace = float(payload.get("grace_s", min(self.config.stop_grace_s, 30.0)))
        await asyncio.to_thread(
            self.runtime.resize, workload_id, info, restart=mode == "restart", grace_s=grace
        )
        return {"workload_id": workload_id, "gpu_count": len(uuids), "on_resize": mode}

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
        enable = payload.get("enable", True)
        if not isinstance(enable, bool):
            raise RuntimeFailure("enable must be true or false")
        placements = mig_layout_from_payload(payload, self.inventory, uuid) if enable else []
        result = await asyncio.to_thread(self.collector.configure_mig, uuid, enable, placements)
        self.inventory = await asyncio.to_thread(self.collector.discover)
        return result

    async def _delete_volume(self, payload: dict[str, Any]) -> dict[str, Any]:
        volume_id = check_volume_id(payload.get("volume_id"))
        return await asyncio.to_thread(self.runtime.volumes.delete, volume_id)

    async def _drain(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.buffer.set("draining", "1")
        statuses = await self._runtime_status()
        return {"draining": True, "running": [s.workload_id for s in statuses if not s.terminal]}

    async def _undrain(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Staff returned the node to service (or a rolling upgrade finished here): take work again."""
        self.buffer.set("draining", "0")
        return {"draining": False}

    async def _upgrade(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Run the upgrade this node's configuration names (``upgrades``: name -> argv); the portal
        sends only the name, so it can run nothing the node's owner did not configure. Refused while
        workloads run here; the process is killed at ``timeout_s``; exit 0 is success."""
        name = payload.get("upgrade")
        argv = self.config.upgrades.get(name) if isinstance(name, str) else None
        if argv is None:
            raise RuntimeFailure(f"no upgrade {str(name)[:64]!r} is configured on this node")
        timeout = payload.get("timeout_s")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int)
            or not 1 <= timeout <= MAX_UPGRADE_TIMEOUT_S
        ):
            raise ValueError(f"timeout_s: whole seconds from 1 to {MAX_UPGRADE_TIMEOUT_S}")
        running = [s.workload_id for s in await self._runtime_status() if not s.terminal]
        if running:
            raise RuntimeFailure(f"workloads {', '.join(running)} still run here; drain the node first")
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "GPUPOOL_UPGRADE": name},
            start_new_session=True,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            await process.wait()
            raise RuntimeFailure(f"upgrade {name} did not finish within {timeout} s; killed") from None
        tail = output.decode(errors="replace")[-UPGRADE_OUTPUT_CHARS:]
        if process.returncode != 0:
            raise RuntimeFailure(f"upgrade {name} exited with {process.returncode}: {tail.strip()}")
        self.inventory = await asyncio.to_thread(self.collector.discover)
        return {
            "upgrade": name,
            "exit_code": 0,
            "output": tail,
            "driver_version": self.inventory.driver_version,
        }

    async def _gpu_check(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Every GPU the node had is still there and reads healthy: found again by the collector, and
        one reading each without a fall off the bus, a critical XID, pending page retirement or a
        row remap failure. The readings go on to the portal in the next heartbeat."""
        before = {gpu.uuid for gpu in (self.inventory.gpus if self.inventory else [])}
        inventory = await asyncio.to_thread(self.collector.discover)
        self.inventory = inventory
        problems = [f"GPU {uuid} is missing" for uuid in sorted(before - {g.uuid for g in inventory.gpus})]
        samples = await asyncio.to_thread(self.collector.sample, time.time())
        self._readings.extend(samples)
        for sample in samples:
            if sample.fell_off_bus:
                problems.append(f"GPU {sample.gpu_uuid} fell off the bus")
            bad = sorted(CRITICAL_XIDS.intersection(sample.xid_errors))
            if bad:
                problems.append(f"GPU {sample.gpu_uuid} reported XID {', '.join(map(str, bad))}")
            if sample.retired_pages_pending:
                problems.append(f"GPU {sample.gpu_uuid} has page retirement pending")
            if sample.row_remap_failure:
                problems.append(f"GPU {sample.gpu_uuid} has a row remap failure")
        if problems:
            raise RuntimeFailure("; ".join(problems))
        return {"gpus": len(inventory.gpus), "driver_version": inventory.driver_version}
