"""Events nodes announces to the apps above it. All are sent after the transaction commits.

nodes knows nothing about scheduling: receivers connect in their own ``AppConfig.ready()``.

- ``command_finished(sender=NodeCommand, command, state, result)``: a command reached a final
  state: ``succeeded``, ``failed`` or ``expired`` (``result`` is the agent's result dict, or
  ``{"reason": ...}`` for an expiry).
- ``workload_exited(sender=Node, node, workload_id, state, exit_code, finished_at, message)``: a
  node reported a workload in a terminal state (``exited``, ``failed``, ``stopped``, ``preempted``)
  for the first time. ``exit_code`` is an int or None.
- ``node_down(sender=Node, node, last_heartbeat_at)``: the health reconciler marked a node DOWN.
- ``gpu_unhealthy(sender=Gpu, gpu, node, reason)``: a GPU became UNHEALTHY and was isolated.
- ``workload_running(sender=Node, node, workload_id, started_at)``: a node reported a workload
  ``running`` where it had not before (a workload that was starting, e.g. pulling its image, now
  runs). ``started_at`` is the agent's time, or the report's when the agent gave none.
- ``node_ready(sender=Node, node)``: a node became READY (schedulable) again: staff uncordoned it
  or took it out of maintenance, or its heartbeats resumed after SUSPECT or DOWN.
- ``workloads_reported(sender=Node, node_id, workload_ids)``: the node's newest heartbeat lists
  these workloads (ids as the node reports them) ``starting`` or ``running``. Sent for every such
  heartbeat, changed or not, so that a receiver can check the node runs only what it was given
  (scheduling's reaper); keep receivers to one set-based query.
- ``volumes_measured(sender=Node, node_id, volumes)``: a heartbeat carried measurements of tenant
  volumes (``VolumeReport``: ``volume_id``, ``used_bytes``, ``measured_at``).
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.dispatch import Signal

logger = logging.getLogger(__name__)

command_finished = Signal()
workload_exited = Signal()
node_down = Signal()
gpu_unhealthy = Signal()
workload_running = Signal()
node_ready = Signal()
workloads_reported = Signal()
volumes_measured = Signal()


def send_on_commit(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal`` once the current transaction commits (at once outside a transaction).

    Receivers run with ``send_robust``: one failing receiver is logged and never undoes the
    change that caused the event, nor stops the other receivers.
    """

    def send() -> None:
        for receiver, result in signal.send_robust(sender=sender, **kwargs):
            if isinstance(result, Exception):
                logger.error(
                    "Receiver %r of a nodes signal failed", receiver, exc_info=(type(result), result, None)
                )

    transaction.on_commit(send)
