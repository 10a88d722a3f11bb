"""Staff set a GPU's MIG mode and layout; the node's agent does it.

The rule: MIG mode changes only when staff ask, on an idle GPU. ``gpu_mig_configure`` checks the
layout against the GPU's profile table (``nodes.mig_profiles``: the layout's instances get their
starts there, the ones the agent will make), **refuses while work holds the GPU** (409 naming the
workloads: staff stop them or wait), and otherwise takes the GPU out of placement
(``Gpu.mig_configuring``: the scheduler places nothing on it) and sends ``configure_mig`` to the
agent, in one transaction, audited. When the command ends (``command_finished``), a success records
the mode and the layout the agent made and a failure or expiry leaves them as they were; either way
the GPU takes work again. A layout is the list of instances work takes (a workload of a profile gets
a free instance of it); an empty layout in MIG mode means an instance is made for each workload
where the hardware can make it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.db import transaction

from nodes.locks import lock_gpu
from nodes.mig_profiles import layout_placements, table_for
from nodes.models import CommandKind, Gpu, NodeCommand, NodeState
from nodes.services.commands import node_command_enqueue
from portal.errors import Conflict, ValidationFailed
from portal.services.audit import audit_record

logger = logging.getLogger(__name__)

# Workloads holding a GPU (by id), from the app that places work (scheduling registers it; it also
# waits for a running placement cycle, so that none places on the GPU after this check).
_HOLDERS: list[Callable[[int], list[str]]] = []


def gpu_holders_register(fn: Callable[[int], list[str]]) -> None:
    _HOLDERS[:] = [fn]


def _holders(gpu_id: int) -> list[str]:
    return _HOLDERS[0](gpu_id) if _HOLDERS else []


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


def gpu_mig_configure(*, gpu: Gpu, enable: Any, profiles: Any, actor: Any, reason: str = "") -> NodeCommand:
    """Staff: set ``gpu``'s MIG mode and layout (see the module docstring). Returns the command."""
    enable, placements = mig_layout_validate(gpu=gpu, enable=enable, profiles=profiles)
    with transaction.atomic():
        holders = _holders(gpu.pk)
        gpu = lock_gpu(gpu_id=gpu.pk)
        if gpu.removed_at is not None:
            raise Conflict("This GPU is no longer in its server.")
        if gpu.node.state == NodeState.DOWN:
            raise Conflict(f"{gpu.node.hostname} is {gpu.node.state}; it cannot change MIG now.")
        if gpu.mig_configuring:
            raise Conflict(f"GPU {gpu.index} is being reconfigured already; wait for its agent.")
        if holders:
            raise Conflict(
                f"GPU {gpu.index} of {gpu.node.hostname} runs workloads {', '.join(holders)}; MIG changes "
                "only on an idle GPU: stop them or wait for them to end."
            )
        layout = [{"profile": p, "start": s} for p, s in placements]
        command = node_command_enqueue(
            node=gpu.node,
            kind=CommandKind.CONFIGURE_MIG,
            payload={
                "gpu_uuid": gpu.uuid,
                "enable": enable,
                "profiles": [p for p, _ in placements],
                "placements": layout,
            },
        )
        gpu.mig_configuring = True
        gpu.save(update_fields=["mig_configuring"])
        audit_record(
            tenant=None,
            actor=actor,
            action="gpu.mig_configure",
            target=gpu,
            data={
                "before": {"mig_mode": gpu.mig_mode, "layout": gpu.mig_layout},
                "enable": enable,
                "layout": layout,
                "command": str(command.pk),
                "reason": reason,
            },
        )
    return command


def gpu_mig_on_command_finished(*, command: NodeCommand, state: str, result: dict[str, Any]) -> None:
    """Record what a ``configure_mig`` did: on success the mode and the instances the agent made;
    on failure or expiry nothing but the end of the change (the heartbeat reports the GPU's mode)."""
    uuid = command.payload.get("gpu_uuid") if isinstance(command.payload, dict) else None
    with transaction.atomic():
        gpu = Gpu.objects.select_for_update().filter(node_id=command.node_id, uuid=uuid).first()
        if gpu is None:
            return
        fields = ["mig_configuring"]
        gpu.mig_configuring = False
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
