"""Staff set a GPU's MIG mode and layout; the node's agent does it, once the GPU is idle.

The rule, in plain words:

- **Request** (``gpu_mig_configure``): the layout is checked against the GPU's profile table
  (``nodes.mig_profiles``: the layout's instances get their starts there, the ones the agent will
  make). The GPU leaves placement at once (``Gpu.mig_configuring``: the scheduler places nothing on
  it, neither new work nor an elastic job's growth) and the change is recorded on it
  (``mig_pending``, ``mig_requested_at``), audited (``gpu.mig_configure``). A change already
  pending on the GPU is a 409: staff cancel it first.
- **Drain**: work that holds the GPU runs on; nothing is stopped. If none holds it, the command goes
  in the same transaction; otherwise the GPU is *draining* and the command goes when the last of
  that work has ended (``gpu_mig_drained_send``: scheduling calls it for the node when a workload
  leaves it, and the beat runs it for all as the reconciler), audited (``gpu.mig_send``). A node
  that is DOWN keeps the change until it is back.
- **Cancel** (``gpu_mig_cancel``): a change not yet sent is dropped and the GPU takes work again,
  audited (``gpu.mig_cancel``); once sent it is the agent's (409).
- **Answer**: when ``configure_mig`` ends (``command_finished``), a success records the mode and the
  layout the agent made and a failure or expiry leaves them as they were; either way the change is
  over and the GPU takes work again.

A layout is the list of instances work takes (a workload of a profile gets a free instance of it);
an empty layout in MIG mode means an instance is made for each workload where the hardware can make
it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from nodes.locks import lock_gpu_and_node
from nodes.mig_profiles import layout_placements, table_for
from nodes.models import CommandKind, Gpu, NodeCommand, NodeState, RegionBackend
from nodes.services.commands import node_command_enqueue
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.services.audit import audit_record

logger = logging.getLogger(__name__)

# Workloads holding a GPU (by id), from the app that places work (scheduling registers it). With
# ``wait=True`` it first waits for a running placement cycle and holds the cycle's lock until the
# transaction ends, so that no cycle that read the GPU before it left placement can still place
# there; once ``mig_configuring`` is committed, no later cycle does, and ``wait=False`` will do.
_HOLDERS: list[Callable[..., list[str]]] = []


def gpu_holders_register(fn: Callable[..., list[str]]) -> None:
    _HOLDERS[:] = [fn]


def _holders(gpu_id: int, *, wait: bool) -> list[str]:
    return _HOLDERS[0](gpu_id, wait=wait) if _HOLDERS else []


def gpu_mig_waiting_for(*, gpu: Gpu) -> list[str]:
    """The workloads a draining GPU's MIG change waits for (none once it is sent or without one)."""
    if gpu.mig_pending is None or gpu.mig_sent_at is not None:
        return []
    return _holders(gpu.pk, wait=False)


def mig_layout_validate(*, gpu: Gpu, enable: Any, profiles: Any) -> tuple[bool, list[tuple[str, int]]]:
    """(enable, the layout's (profile, start) instances) for ``gpu``; ValidationFailed names the field."""
    if not isinstance(enable, bool):
        raise ValidationFailed("enable must be true or false.", fields={"enable": ["Must be a boolean."]})
    if profiles is None:
        profiles = []
    if not isinstance(profiles, list) or not all(isinstance(p, str) and len(p) <= 16 for p in profiles):
        raise ValidationFailed(
            "profiles must be a list of MIG profile names.", fields={"profiles": ["A list of names."]}
        )
    name = gpu.model.name if gpu.model_id else gpu.reported_name
    table = table_for(name)
    if table is None:
        raise ValidationFailed(f"{name} has no MIG.", fields={"enable": [f"{name} has no MIG."]})
    if not enable:
        if profiles:
            raise ValidationFailed(
                "A GPU leaving MIG mode keeps no layout.", fields={"profiles": ["Must be empty."]}
            )
        return False, []
    if len(profiles) > table.memory_slices:
        raise ValidationFailed(
            f"At most {table.memory_slices} instances fit one GPU.",
            fields={"profiles": [f"At most {table.memory_slices}."]},
        )
    try:
        return True, layout_placements(table, profiles)
    except ValueError as exc:
        raise ValidationFailed(str(exc), fields={"profiles": [str(exc)]}) from exc


def gpu_mig_configure(
    *, gpu: Gpu, enable: Any, profiles: Any, actor: Actor, reason: str = ""
) -> NodeCommand | None:
    """Staff: set ``gpu``'s MIG mode and layout (see the module docstring). Returns the command sent,
    or None when the GPU drains first (its work runs on; the command goes when it has ended)."""
    enable, placements = mig_layout_validate(gpu=gpu, enable=enable, profiles=profiles)
    with transaction.atomic():
        holders = _holders(gpu.pk, wait=True)
        gpu = lock_gpu_and_node(gpu_id=gpu.pk)
        if gpu.removed_at is not None:
            raise Conflict("This GPU is no longer in its server.")
        if gpu.node.state == NodeState.DOWN:
            raise Conflict(f"{gpu.node.hostname} is {gpu.node.state}; it cannot change MIG now.")
        if gpu.node.region.backend == RegionBackend.SLURM:
            # No agent runs there to make the change, and Slurm, not the portal, places its work.
            raise Conflict(
                f"{gpu.node.hostname} is a Slurm node: its cluster's administrators set MIG there."
            )
        if gpu.mig_configuring:
            if gpu.mig_pending is not None and gpu.mig_sent_at is None:
                raise Conflict(
                    f"GPU {gpu.index} has a MIG change pending already (it waits for its work to end): "
                    "cancel it first."
                )
            raise Conflict(f"GPU {gpu.index} is being reconfigured already; wait for its agent.")
        layout = [{"profile": p, "start": s} for p, s in placements]
        now = timezone.now()
        gpu.mig_configuring = True
        gpu.mig_pending = {
            "enable": enable,
            "layout": layout,
            "reason": reason,
            "requested_by": str(actor)[:200],
            "command": None,
        }
        gpu.mig_requested_at = now
        gpu.mig_sent_at = None
        audit_record(
            tenant=None,
            actor=actor,
            action="gpu.mig_configure",
            target=gpu,
            data={
                "before": {"mig_mode": gpu.mig_mode, "layout": gpu.mig_layout},
                "enable": enable,
                "layout": layout,
                "reason": reason,
                "waiting_for": holders,
            },
        )
        if holders:
            gpu.save(update_fields=["mig_configuring", "mig_pending", "mig_requested_at", "mig_sent_at"])
            return None
        return _send(gpu, actor=actor, now=now)


def _send(gpu: Gpu, *, actor: Actor, now: datetime) -> NodeCommand:
    """The pending change of a locked, idle ``gpu`` to its agent (in the caller's transaction)."""
    pending = gpu.mig_pending or {}
    layout = pending.get("layout") or []
    command = node_command_enqueue(
        node=gpu.node,
        kind=CommandKind.CONFIGURE_MIG,
        payload={
            "gpu_uuid": gpu.uuid,
            "enable": bool(pending.get("enable")),
            "profiles": [row["profile"] for row in layout],
            "placements": layout,
        },
        now=now,
    )
    gpu.mig_pending = {**pending, "command": str(command.pk)}
    gpu.mig_sent_at = now
    gpu.save(update_fields=["mig_configuring", "mig_pending", "mig_requested_at", "mig_sent_at"])
    audit_record(
        tenant=None,
        actor=actor,
        action="gpu.mig_send",
        target=gpu,
        data={"enable": bool(pending.get("enable")), "layout": layout, "command": str(command.pk)},
    )
    return command


def gpu_mig_drained_send(*, node_id: int | None = None, now: datetime | None = None) -> int:
    """Send each draining GPU's change (of ``node_id``'s GPUs, or all) whose work has all ended.
    Safe to run twice and beside itself: each GPU is rechecked under its node's and its own row lock
    (node first). Returns how many were sent."""
    rows = Gpu.objects.filter(mig_pending__isnull=False, mig_sent_at__isnull=True, removed_at__isnull=True)
    if node_id is not None:
        rows = rows.filter(node_id=node_id)
    sent = 0
    for gpu_id in rows.exclude(node__state=NodeState.DOWN).values_list("pk", flat=True):
        with transaction.atomic():
            gpu = lock_gpu_and_node(gpu_id=gpu_id)
            if gpu.mig_pending is None or gpu.mig_sent_at is not None or gpu.removed_at is not None:
                continue
            if gpu.node.state == NodeState.DOWN or _holders(gpu.pk, wait=False):
                continue
            _send(gpu, actor=Actor.system(), now=now or timezone.now())
            sent += 1
    return sent


def gpu_mig_cancel(*, gpu: Gpu, actor: Actor, reason: str = "") -> Gpu:
    """Staff: drop a change that still waits for the GPU to drain; the GPU takes work again."""
    with transaction.atomic():
        gpu = lock_gpu_and_node(gpu_id=gpu.pk)
        if gpu.mig_pending is None:
            raise Conflict(f"GPU {gpu.index} has no MIG change pending.")
        if gpu.mig_sent_at is not None:
            raise Conflict(f"GPU {gpu.index}'s MIG change was sent to its agent; wait for its answer.")
        pending = gpu.mig_pending
        waited = _holders(gpu.pk, wait=False)
        gpu.mig_configuring = False
        gpu.mig_pending = None
        gpu.mig_requested_at = None
        gpu.save(update_fields=["mig_configuring", "mig_pending", "mig_requested_at"])
        audit_record(
            tenant=None,
            actor=actor,
            action="gpu.mig_cancel",
            target=gpu,
            data={
                "enable": pending.get("enable"),
                "layout": pending.get("layout"),
                "reason": reason,
                "waiting_for": waited,
            },
        )
    return gpu


def gpu_mig_on_command_finished(*, command: NodeCommand, state: str, result: dict[str, Any]) -> None:
    """Record what a ``configure_mig`` did: on success the mode and the instances the agent made;
    on failure or expiry nothing but the end of the change (the heartbeat reports the GPU's mode)."""
    uuid = command.payload.get("gpu_uuid") if isinstance(command.payload, dict) else None
    with transaction.atomic():
        gpu = Gpu.objects.select_for_update().filter(node_id=command.node_id, uuid=uuid).first()
        if gpu is None:
            return
        if gpu.mig_pending is not None and gpu.mig_pending.get("command") != str(command.pk):
            return  # an older change's late answer: the pending one is not this command's
        fields = ["mig_configuring", "mig_pending", "mig_requested_at", "mig_sent_at"]
        gpu.mig_configuring = False
        gpu.mig_pending = gpu.mig_requested_at = gpu.mig_sent_at = None
        if state == "succeeded":
            gpu.mig_mode = bool(result.get("mig_mode"))
            created = result.get("created") if isinstance(result.get("created"), list) else []
            gpu.mig_layout = [
                {"profile": str(row["profile"]), "start": int(row["start"])}
                for row in created
                if isinstance(row, dict) and "profile" in row and type(row.get("start")) is int
            ]
            fields += ["mig_mode", "mig_layout"]
        else:
            logger.warning("MIG change of GPU %s %s: %s", uuid, state, result)
        gpu.save(update_fields=fields)
