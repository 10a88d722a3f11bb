"""Receivers of the fleet's signals (``nodes.signals``), connected in ``SchedulingConfig.ready()``.

Thin: each calls one service. nodes sends them after its transaction commits, with
``send_robust``, so a failure here is logged there and never undoes the fleet's change; the
reconciler (``scheduling.services.lifecycle.scheduling_reconcile``) finishes whatever a failed
receiver left.
"""

from __future__ import annotations

from nodes import signals
from nodes.models import CommandKind
from nodes.services.mig import gpu_mig_drained_send
from scheduling.locks import cycle_lock_wait
from scheduling.selectors.shared import workloads_holding_gpu
from scheduling.services import elastic, lifecycle, orphans, warm_pools
from scheduling.services import volumes as volume_services
from scheduling.services.triggers import cycle_request

WORKLOAD_COMMANDS = (CommandKind.START_WORKLOAD, CommandKind.STOP_WORKLOAD, CommandKind.PREEMPT_WORKLOAD)


def on_command_finished(sender, command, state, result, **kwargs) -> None:
    if command.kind in WORKLOAD_COMMANDS:
        lifecycle.workload_on_command_finished(
            kind=command.kind,
            payload=command.payload,
            node_id=command.node_id,
            state=state,
            result=result or {},
        )
        _mig_drained_send(command.node_id)
    elif command.kind == CommandKind.RESIZE_WORKLOAD:
        elastic.resize_on_command_finished(payload=command.payload, node_id=command.node_id, state=state)
        _mig_drained_send(command.node_id)
    elif command.kind == CommandKind.PREWARM:
        warm_pools.warm_slots_on_prewarm_finished(command_id=command.pk, state=state)
    elif command.kind == CommandKind.CONFIGURE_MIG:
        cycle_request(reason="mig_configured")  # the GPU takes work again, in its new shape


def gpu_holders(gpu_id: int, *, wait: bool = True) -> list[str]:
    """Workloads holding a GPU now (``nodes.services.mig``); with ``wait``, checked after any running
    cycle ends, holding the cycle's lock to the end of the caller's transaction."""
    if wait:
        cycle_lock_wait()
    return workloads_holding_gpu(gpu_id=gpu_id)


def _mig_drained_send(node_id: int) -> None:
    """Work left the node (or it is back): a GPU of it that drains for a staff MIG change may now be
    idle. One indexed query when none drains; the beat (``nodes.tasks.send_drained_mig``) finishes
    what this misses."""
    gpu_mig_drained_send(node_id=node_id)


def on_workload_exited(
    sender, node, workload_id, state, exit_code, finished_at=None, message="", **kwargs
) -> None:
    lifecycle.workload_on_exited(
        node_id=node.pk, workload_id=workload_id, state=state, exit_code=exit_code, message=message or ""
    )
    _mig_drained_send(node.pk)


def on_workload_running(sender, node, workload_id, started_at=None, **kwargs) -> None:
    lifecycle.workload_on_running(node_id=node.pk, workload_id=workload_id)


def on_node_ready(sender, node, **kwargs) -> None:
    _mig_drained_send(node.pk)
    cycle_request(reason="node_ready")


def on_node_down(sender, node, last_heartbeat_at=None, **kwargs) -> None:
    lifecycle.workloads_on_node_down(
        node_id=node.pk, reason=node.state_reason, last_heartbeat_at=last_heartbeat_at
    )
    cycle_request(reason="node_down")


def on_workloads_reported(sender, node_id, workload_ids, **kwargs) -> None:
    orphans.workloads_reap(node_id=node_id, workload_ids=workload_ids)


def on_volumes_measured(sender, node_id, volumes, **kwargs) -> None:
    volume_services.volumes_on_measured(node_id=node_id, reports=volumes)


def on_gpu_unhealthy(sender, gpu, node, reason, **kwargs) -> None:
    lifecycle.workloads_on_gpu_unhealthy(gpu_id=gpu.pk, node_id=node.pk, reason=reason)
    cycle_request(reason="gpu_unhealthy")


def connect() -> None:
    from nodes.services.commands import wire_payload_register
    from nodes.services.mig import gpu_holders_register
    from scheduling.services.env import start_payload_for_node

    wire_payload_register(CommandKind.START_WORKLOAD, start_payload_for_node)
    gpu_holders_register(gpu_holders)
    signals.command_finished.connect(on_command_finished, dispatch_uid="scheduling.command_finished")
    signals.workload_exited.connect(on_workload_exited, dispatch_uid="scheduling.workload_exited")
    signals.node_down.connect(on_node_down, dispatch_uid="scheduling.node_down")
    signals.gpu_unhealthy.connect(on_gpu_unhealthy, dispatch_uid="scheduling.gpu_unhealthy")
    signals.workload_running.connect(on_workload_running, dispatch_uid="scheduling.workload_running")
    signals.node_ready.connect(on_node_ready, dispatch_uid="scheduling.node_ready")
    signals.workloads_reported.connect(on_workloads_reported, dispatch_uid="scheduling.workloads_reported")
    signals.volumes_measured.connect(on_volumes_measured, dispatch_uid="scheduling.volumes_measured")
