"""How a tenant gets into a running workload: the ports its node published, and the share link that
opens its HTTP ports to people outside the tenant.

- **Ports**: the start command's result names each container port and the host port the node
  published it on (``nodes/PROTOCOL.md``); they are kept (``PublishedPort``) while the workload holds
  its GPUs and deleted when it stops holding them (``scheduling.services.states``). A port the node
  did not publish is kept with a null host port and the reason, so the API and the page say it
  rather than show an address where nothing listens.
- **Share link**: one per workload, a secret shown once (only its SHA-256 is stored); anyone holding
  it may use the workload's HTTP ports through the portal's proxy while it runs. Making a new one
  replaces the old; revoking deletes it. Both are audited.
"""

from __future__ import annotations

import secrets
from typing import Any

from django.db import transaction

from nodes.agent.workload_rules import WorkloadRuleError, check_ports
from portal.actors import Actor
from portal.models import hash_secret
from portal.services.audit import audit_record
from scheduling.locks import lock_workload
from scheduling.models import PublishedPort, Workload, WorkloadShareLink

NOT_PUBLISHED_SIMULATED = "A simulated node runs no process: nothing listens on this port."
NOT_PUBLISHED = "The node did not publish this port."


def requested_ports(workload: Workload) -> list[dict[str, Any]]:
    """The workload's ports as ``[{"port", "protocol"}]`` (rows stored before protocols were named
    hold plain numbers: HTTP ports)."""
    try:
        return check_ports(workload.ports or [])
    except WorkloadRuleError:
        return []  # validated at submission; a row that fails now has nothing reachable


def workload_ports_record(*, workload: Workload, node_id: int, result: dict[str, Any]) -> None:
    """Keep what the node published for ``workload`` (its start command's ``result``); the caller
    holds the workload's row lock."""
    wanted = requested_ports(workload)
    if not wanted:
        return
    reported = result.get("ports") if isinstance(result.get("ports"), dict) else {}
    note = NOT_PUBLISHED_SIMULATED if result.get("runtime") == "simulated" else NOT_PUBLISHED
    rows = []
    for item in wanted:
        host_port = reported.get(str(item["port"]))
        valid = isinstance(host_port, int) and not isinstance(host_port, bool) and 1 <= host_port <= 65535
        rows.append(
            PublishedPort(
                workload=workload,
                node_id=node_id,
                port=item["port"],
                protocol=item["protocol"],
                host_port=host_port if valid else None,
                note="" if valid else note,
            )
        )
    PublishedPort.objects.filter(workload=workload, node_id=node_id).delete()
    PublishedPort.objects.bulk_create(rows)


def share_link_create(*, workload: Workload, actor: Actor) -> str:
    """A new share link for the workload's HTTP ports (replacing any other); returns its secret,
    which is not stored and cannot be shown again."""
    plaintext = f"{WorkloadShareLink.PREFIX}_{secrets.token_urlsafe(32)}"
    with transaction.atomic():
        w = lock_workload(workload_id=workload.pk)
        replaced = WorkloadShareLink.objects.filter(workload=w).delete()[0] > 0
        WorkloadShareLink.objects.create(
            tenant_id=w.tenant_id, workload=w, token_hash=hash_secret(plaintext), created_by=actor.user
        )
        audit_record(
            tenant=w.tenant, actor=actor, action="workload.share_link.create", target=w,
            data={"replaced": replaced},
        )  # fmt: skip
    return plaintext


def share_link_revoke(*, workload: Workload, actor: Actor) -> bool:
    """Revoke the workload's share link; False when it had none. The proxy checks the link on every
    request and websocket, so it stops working at once."""
    with transaction.atomic():
        w = lock_workload(workload_id=workload.pk)
        deleted = WorkloadShareLink.objects.filter(workload=w).delete()[0] > 0
        if deleted:
            audit_record(tenant=w.tenant, actor=actor, action="workload.share_link.revoke", target=w)
    return deleted
