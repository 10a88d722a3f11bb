"""How a tenant gets into a running workload: ``access`` of the workload detail (the API and the
workload page), who may log in over SSH, and where the portal's proxy sends a port's requests.
Each kind of access is one key, built from what the node reported, so nothing is shown that does
not work.

- ``ssh``: ``{host, port, user, command, known_hosts}`` or null, with ``ssh_unavailable_reason``.
- ``ports``: one entry per requested port, ``{port, protocol, host_port, host, url, note}``. An HTTP
  port of a RUNNING workload has a ``url`` on the portal's proxy (``/proxy/<id>/<port>/``, on
  ``PROXY_ORIGIN`` when set); a TCP port has the node's ``host`` and ``host_port``; anything else
  has nulls and a ``note`` that says why.
- ``share_link``: whether the HTTP ports have a share link (its secret is shown only when made).

The rule for SSH, once (docs/security.md, "SSH into a workload"): a running workload (an instance,
or a job one wants to look into) opens to

- its own key (``Workload.ssh_public_key``, an instance's, given at launch), and
- the saved keys (``SshKey``) of the people whose membership in the instance's tenant may operate
  workloads, now: owner, admin and member (not billing, not viewer), with an active account.

Nothing else: no password, no other tenant's people, no key of a person who left or was demoted.
It is checked at every login: the node's agent asks the portal for the keys of the workload being
logged into (``ssh_authorized_keys``, through ``/agent/v1/nodes/<id>/workloads/<id>/ssh-keys``), so
a removed member or a deleted key is refused from the next login on. The portal answers only the
node that holds the workload now, and only while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.urls import reverse

from nodes.agent.workload_rules import WorkloadRuleError, parse_ssh_public_key
from portal.errors import NotFound
from portal.models import Membership, Role, Tenant
from scheduling.models import PublishedPort, SshKey, Workload, WorkloadShareLink, WorkloadState
from scheduling.selectors.shared import workload_placement
from scheduling.services.access import requested_ports

# Roles whose people may get into a tenant's instances: those that may start and stop them.
SSH_ROLES = (Role.OWNER, Role.ADMIN, Role.MEMBER)


def ssh_user(workload: Workload) -> str:
    """The SSH user name of a workload: its id as the agent knows it (the start command's)."""
    return str(workload.pk)


def known_hosts_line(host: str, port: int, host_key: str) -> str:
    """A ``known_hosts`` line: ``[host]:port type base64`` (plain ``host`` on port 22)."""
    where = host if port == 22 else f"[{host}]:{port}"
    return f"{where} {host_key}"


def workload_ssh_access(
    *, workload: Workload, placement: list[dict[str, Any]] | None = None
) -> tuple[dict[str, Any] | None, str]:
    """``(ssh, "")`` with ``host``, ``port``, ``user``, ``command`` and ``known_hosts`` when SSH
    works now, or ``(None, reason)`` saying why not. ``placement``: the workload's rows of
    ``workload_placement`` when the caller has them (no query then)."""
    if workload.state != WorkloadState.RUNNING:
        return None, f"SSH opens while it runs; it is {workload.get_state_display().lower()}."
    rows = workload_placement(workload=workload) if placement is None else placement
    node = rows[0] if rows else None
    if node is None:
        return None, "It holds no node at the moment."
    if node["node__simulated"]:
        return None, "SSH is not available on the simulated fleet: its workloads are timers, not shells."
    port, host_key = node["node__ssh_port"], node["node__ssh_host_key"]
    if not port or not host_key:
        hostname = node["node__hostname"]
        return None, f"The agent on {hostname} serves no SSH endpoint (its ssh_listen setting is off)."
    host, user = node["node__address"] or node["node__hostname"], ssh_user(workload)
    command = f"ssh -p {port} {user}@{host}" if port != 22 else f"ssh {user}@{host}"
    return {
        "host": host,
        "port": port,
        "user": user,
        "command": command,
        "known_hosts": known_hosts_line(host, port, host_key),
    }, ""


def ssh_authorized_keys(*, node_id: int, workload_id: str) -> list[dict[str, str]]:
    """The keys that may log in to ``workload_id`` on node ``node_id`` now, each
    ``{"key", "fingerprint", "source"}``; :class:`NotFound` unless that node holds the workload
    and it runs."""
    missing = NotFound("No such running workload on this node.")
    if not workload_id.isdigit() or len(workload_id) > 18:
        raise missing
    workload = (
        Workload.objects.filter(
            pk=int(workload_id),
            state=WorkloadState.RUNNING,
            allocations__node_id=node_id,
            allocations__ended_at__isnull=True,
        )
        .only("id", "tenant_id", "ssh_public_key")
        .first()
    )
    if workload is None:
        raise missing
    keys: list[dict[str, str]] = []
    if workload.ssh_public_key:
        try:  # stored normalised at submission; parsed again where it is used
            parsed = parse_ssh_public_key(workload.ssh_public_key)
        except WorkloadRuleError:
            parsed = None
        if parsed is not None:
            keys.append({"key": parsed.line, "fingerprint": parsed.fingerprint, "source": "workload"})
    people = Membership.objects.filter(
        tenant_id=workload.tenant_id, role__in=SSH_ROLES, user__is_active=True
    ).values("user_id")
    for saved in SshKey.objects.filter(user_id__in=people).select_related("user").order_by("id"):
        keys.append(
            {
                "key": saved.public_key,
                "fingerprint": saved.fingerprint,
                "source": f"{saved.user.email}: {saved.name}",
            }
        )
    return keys


PROXY_PREFIX = "/proxy/"
SHARE_PARAM = "gpupool_share"  # the query parameter that carries a share link's secret
TICKET_PARAM = "gpupool_ticket"  # a member's one-minute pass from the portal to PROXY_ORIGIN
TICKET_SALT = "gpupool.proxy.ticket"
MEMBER_SALT = "gpupool.proxy.member"
TCP_NOTE = (
    "Raw TCP on the node: the portal does not check who connects (the service must authenticate "
    "its clients); reachable from the network the node publishes TCP ports on."
)


def proxy_path(workload_id: int, port: int) -> str:
    return f"{PROXY_PREFIX}{workload_id}/{port}/"


def proxy_url(workload_id: int, port: int, *, request: Any = None) -> str:
    """The URL of a workload's HTTP port: on ``PROXY_ORIGIN`` when set, else on the portal's own
    origin (a path, without a request)."""
    path = proxy_path(workload_id, port)
    if settings.PROXY_ORIGIN:
        return f"{settings.PROXY_ORIGIN}{path}"
    return request.build_absolute_uri(path) if request is not None else path


def workload_ports(*, workload: Workload, request: Any = None) -> list[dict[str, Any]]:
    wanted = requested_ports(workload)
    if not wanted:
        return []
    running = workload.state == WorkloadState.RUNNING
    rows: dict[int, PublishedPort] = {}
    if running:
        # A gang's ports are on each of its nodes; the first node's are shown.
        for row in PublishedPort.objects.filter(workload=workload).select_related("node").order_by("node_id"):
            rows.setdefault(row.port, row)
    entries = []
    for item in wanted:
        entry: dict[str, Any] = {**item, "host_port": None, "host": None, "url": None, "note": ""}
        row = rows.get(item["port"])
        if not running:
            entry["note"] = "Reachable while it runs."
        elif row is None:
            entry["note"] = "Waiting for the node to report where it published this port."
        elif row.host_port is None:
            entry["note"] = row.note
        else:
            entry["host_port"] = row.host_port
            if item["protocol"] == "http":
                entry["url"] = proxy_url(workload.pk, item["port"], request=request)
                # The page's link: on a proxy origin of its own, a member's browser goes through the
                # portal first for its ticket (the portal's session does not reach that origin).
                entry["page_url"] = (
                    reverse("scheduling:workload-open", kwargs={"pk": workload.pk, "port": item["port"]})
                    if settings.PROXY_ORIGIN
                    else entry["url"]
                )
            else:
                entry["host"] = row.node.reach_address
                entry["note"] = TCP_NOTE
        entries.append(entry)
    return entries


def workload_access(
    *, workload: Workload, placement: list[dict[str, Any]] | None = None, request: Any = None
) -> dict[str, Any]:
    """The ``access`` object of a workload's detail (the API and the workload page). ``placement``:
    the workload's rows of ``workload_placement`` when the caller has them (no query then)."""
    ssh, reason = workload_ssh_access(workload=workload, placement=placement)
    ports = workload_ports(workload=workload, request=request)
    http = any(p["protocol"] == "http" for p in ports)
    link = WorkloadShareLink.objects.filter(workload=workload).only("created_at").first() if http else None
    return {
        "ssh": ssh,
        "ssh_unavailable_reason": reason,
        "ports": ports,
        # Whether a share link could open anything: the workload asked for an HTTP port.
        "http": http,
        # Whether one is reachable now (the page offers a share link only then: a simulated node,
        # or one that did not publish the port, opens nothing).
        "http_open": any(p["url"] for p in ports if p["protocol"] == "http"),
        "share_link": {"created_at": link.created_at} if link is not None else None,
    }


@dataclass(frozen=True)
class ProxyTarget:
    tenant_id: int
    host: str
    host_port: int


def proxy_target(*, workload_id: int, port: int) -> ProxyTarget | None:
    """Where the proxy sends a request for ``workload_id``'s ``port``: a RUNNING workload's HTTP port
    that its node published; None for anything else (the proxy answers 404)."""
    row = (
        PublishedPort.objects.filter(
            workload_id=workload_id,
            port=port,
            protocol="http",
            host_port__isnull=False,
            workload__state=WorkloadState.RUNNING,
        )
        .exclude(workload__tenant__status=Tenant.Status.SUSPENDED)
        .order_by("node_id")
        .values_list("workload__tenant_id", "node__address", "node__hostname", "host_port")
        .first()
    )
    if row is None:
        return None
    tenant_id, address, hostname, host_port = row
    return ProxyTarget(tenant_id=tenant_id, host=address or hostname, host_port=host_port)
