"""Bootstrap tokens, node registration (token -> per-node credential), credential checks, GPU matching.

Only a node is that node. A bootstrap token registers a hostname that has no node yet. Every node
that exists is live, whatever its state (DOWN and MAINTENANCE nodes come back with their
credential; there is no retired state: staff delete a node to free its name), so a registration
naming an existing node's hostname is refused (409) and that node's credential keeps working;
only a re-key token, made by staff for that node (``node_rekey_token_create``, audited), replaces
its credential. A GPU UUID present on another node is refused (409) and opens a fleet alert: GPU
rows never move between nodes on an agent's word. Tokens expire (``NODE_BOOTSTRAP_TOKEN_TTL_H``)
unless staff ask for "never".
"""

from __future__ import annotations

import functools
import hmac
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from nodes import metrics as node_metrics
from nodes.catalog import normalize_gpu_name
from nodes.locks import (
    lock_bootstrap_token,
    lock_fleet_alert,
    lock_gpus_by_uuid,
    lock_node_by_hostname,
    lock_node_if_exists,
)
from nodes.models import (
    FleetAlert,
    Gpu,
    GpuModel,
    Interconnect,
    Node,
    NodeBootstrapToken,
    NodeCredential,
    Region,
    UnknownGpuReport,
    hash_secret,
    new_secret,
)
from nodes.validation import fail
from portal.actors import Actor
from portal.errors import Conflict, DomainError
from portal.services.audit import audit_record


class NotAuthenticated(DomainError):
    status_code = 401
    code = "not_authenticated"


class NodeExists(Conflict):
    code = "node_exists"


class GpuConflict(Conflict):
    """GPUs a registration listed that are present on another node: ``conflicts`` holds each
    ``{"uuid", "node"}`` (the owner's hostname)."""

    code = "gpu_conflict"

    def __init__(self, message: str, *, conflicts: list[dict[str, str]]):
        super().__init__(message, fields={"gpus": [message]})
        self.conflicts = conflicts


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_mib: int = 0
    pci_bus_id: str = ""
    nvlink_island: int | None = None
    numa_node: int | None = None
    mig_mode: bool = False
    firmware_version: str = ""


@dataclass(frozen=True)
class NodeInfo:
    hostname: str
    address: str = ""
    region: str = ""
    labels: dict = field(default_factory=dict)
    cpu_cores: int = 0
    ram_mib: int = 0
    driver_version: str = ""
    cuda_version: str = ""
    rocm_version: str = ""
    level_zero_version: str = ""
    agent_version: str = ""
    interconnect: str = Interconnect.PCIE
    gpus: tuple[GpuInfo, ...] = ()
    simulated: bool = False


# --- bootstrap tokens ---------------------------------------------------------------------------------


@transaction.atomic
def bootstrap_token_create(
    *,
    region: Region | None,
    actor: Actor,
    expires_in: timedelta | None = None,
    never_expires: bool = False,
    note: str = "",
    intended_hostname: str = "",
    rekey_node: Node | None = None,
    now: datetime | None = None,
) -> tuple[NodeBootstrapToken, str]:
    """A one-use token for registering a node. Returns the row and the plaintext (shown once).

    It expires after ``expires_in``, by default ``NODE_BOOTSTRAP_TOKEN_TTL_H`` hours; never only
    with ``never_expires``. ``rekey_node``: see ``node_rekey_token_create``."""
    if never_expires and expires_in is not None:
        raise ValueError("expires_in and never_expires exclude each other")
    now = now or timezone.now()
    if expires_in is None and not never_expires:
        expires_in = timedelta(hours=settings.NODE_BOOTSTRAP_TOKEN_TTL_H)
    key_id, plaintext, token_hash = NodeBootstrapToken.generate()
    token = NodeBootstrapToken.objects.create(
        key_id=key_id,
        token_hash=token_hash,
        region=region,
        note=note[:200],
        intended_hostname=intended_hostname,
        rekey_node=rekey_node,
        created_by=actor.user,
        created_at=now,
        expires_at=None if never_expires else now + expires_in,
    )
    data = {"region": region.code if region else None, "expires_at": str(token.expires_at or "never")}
    if rekey_node is not None:
        data["rekey_node"] = rekey_node.hostname
    audit_record(tenant=None, actor=actor, action="node.bootstrap_token.create", target=token, data=data)
    return token, plaintext


@transaction.atomic
def node_rekey_token_create(
    *, node: Node, actor: Actor, expires_in: timedelta | None = None, now: datetime | None = None
) -> tuple[NodeBootstrapToken, str]:
    """Staff's "re-key node X" (a reinstalled server that lost its credential): a token that
    registers ``node``'s hostname only and replaces its credential. Earlier unused re-key tokens of
    the node stop working. Audited on the node."""
    now = now or timezone.now()
    NodeBootstrapToken.objects.filter(rekey_node=node, used_at__isnull=True).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=now)
    ).update(expires_at=now)
    token, plaintext = bootstrap_token_create(
        region=node.region,
        actor=actor,
        expires_in=expires_in,
        note=f"re-key {node.hostname}",
        rekey_node=node,
        now=now,
    )
    audit_record(
        tenant=None,
        actor=actor,
        action="node.rekey_token.create",
        target=node,
        data={"bootstrap_token": token.key_id, "expires_at": str(token.expires_at)},
    )
    return token, plaintext


def _split_token(plaintext: str, prefix: str) -> tuple[str, str] | None:
    parts = (plaintext or "").split("_", 2)
    if len(parts) != 3 or parts[0] != prefix or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


# --- GPU model matching -------------------------------------------------------------------------------


def gpu_model_index() -> dict[str, GpuModel]:
    index: dict[str, GpuModel] = {}
    for model in GpuModel.objects.all():
        for name in [model.name, *(model.aliases or [])]:
            index.setdefault(normalize_gpu_name(name), model)
    return index


def _flag_unknown(name: str, node: Node, count: int, now: datetime) -> None:
    report, created = UnknownGpuReport.objects.get_or_create(
        reported_name=name[:128],
        defaults={"first_seen_at": now, "last_seen_at": now, "gpu_count": count, "example_node": node},
    )
    if not created:
        UnknownGpuReport.objects.filter(pk=report.pk).update(
            last_seen_at=now, gpu_count=F("gpu_count") + count, example_node=node, resolved_at=None
        )


# --- registration -------------------------------------------------------------------------------------

# How long after a bootstrap token was spent the same machine may send the same registration again
# (its first answer lost to a timeout) and get the same node with a fresh credential.
REGISTER_RETRY_WINDOW = timedelta(minutes=10)


def node_register(*, bootstrap_token: str, info: NodeInfo, now: datetime | None = None) -> tuple[Node, str]:
    """Spend a bootstrap token; create the node (or, with a staff re-key token, re-key it) and its GPUs.

    Returns the node and its new credential ``gpn_<node_id>_<secret>`` (only the hash is stored).
    A wrong, used or expired token raises NotAuthenticated (401) and changes nothing; except that a
    spent token sent again by the machine it registered, shortly after, before that node sent a
    heartbeat (see ``_registration_retried``), answers the same node with a new credential.
    A hostname that has a node, without that node's re-key token, raises NodeExists (409); GPUs
    present on another node raise GpuConflict (409) and open a fleet alert. Neither spends the token.
    """
    now = now or timezone.now()
    try:
        return _node_register(bootstrap_token=bootstrap_token, info=info, now=now)
    except GpuConflict as exc:
        # After the registration's rollback, in a transaction of its own: the alert stays.
        _gpu_conflict_alert(info=info, conflicts=exc.conflicts, now=now)
        raise


@transaction.atomic
def _node_register(*, bootstrap_token: str, info: NodeInfo, now: datetime) -> tuple[Node, str]:
    parts = _split_token(bootstrap_token, NodeBootstrapToken.PREFIX)
    token = None
    if parts is not None:
        token = lock_bootstrap_token(key_id=parts[0])
    if token is None or not hmac.compare_digest(token.token_hash, hash_secret(bootstrap_token)):
        raise NotAuthenticated("Invalid bootstrap token.")
    retry_of = None
    if token.used_at is not None:
        retry_of = _registration_retried(token, info, now)
        if retry_of is None:
            raise NotAuthenticated("This bootstrap token has already been used.")
    elif token.expires_at is not None and token.expires_at <= now:
        raise NotAuthenticated("This bootstrap token has expired.")

    region = token.region
    if info.region:
        if region is not None and info.region != region.code:
            raise fail("region", f"The bootstrap token is for region {region.code!r}.")
        region = Region.objects.filter(code=info.region).first()
        if region is None:
            raise fail("region", f"Unknown region {info.region!r}.")
    if region is None:
        raise fail("region", "This field is required: the bootstrap token names no region.")

    node = retry_of or _node_to_register(token, info.hostname)
    fields = {
        "address": info.address,
        "region": region,
        "labels": info.labels,
        "cpu_cores": info.cpu_cores,
        "ram_mib": info.ram_mib,
        "driver_version": info.driver_version,
        "cuda_version": info.cuda_version,
        "rocm_version": info.rocm_version,
        "level_zero_version": info.level_zero_version,
        "versions_digest": "",  # the first heartbeat writes what it carries
        "agent_version": info.agent_version,
        "interconnect": info.interconnect,
        "registered_at": now,
        "last_seq": 0,
        "simulated": info.simulated or bool(token.intended_hostname),
    }
    rekey = node is not None and retry_of is None
    if node is None:
        try:
            with transaction.atomic():
                node = Node.objects.create(hostname=info.hostname, state_changed_at=now, **fields)
        except IntegrityError:  # registered at the same moment by another request
            raise NodeExists(
                f"A node named {info.hostname!r} is already registered.",
                fields={"hostname": ["A node with this hostname is already registered."]},
            ) from None
    else:
        if retry_of is not None:
            fields.pop("registered_at")  # the same registration, answered again
        for k, v in fields.items():
            setattr(node, k, v)
        if rekey:
            node.seq_epoch += 1  # a reinstalled server numbers its batches from 1 again
        node.save()

    secret_plain = f"{NodeCredential.PREFIX}_{node.pk}_{new_secret()}"
    NodeCredential.objects.update_or_create(
        node=node, defaults={"key_hash": hash_secret(secret_plain), "created_at": now}
    )
    if retry_of is None:
        token.used_at = now
        token.used_by_node = node
        token.save(update_fields=["used_at", "used_by_node"])

    moved = _sync_gpus(node, info.gpus, now)
    data = {"bootstrap_token": token.key_id, "gpus": len(info.gpus), "region": region.code}
    if moved:
        data["gpus_moved"] = moved  # retired from another node earlier: the hardware moved
    audit_record(
        tenant=None,
        actor=Actor.system(),
        action="node.register.retry" if retry_of else "node.rekey" if rekey else "node.register",
        target=node,
        data=data,
    )
    return node, secret_plain


def _node_to_register(token: NodeBootstrapToken, hostname: str) -> Node | None:
    """The existing node a (not yet spent) token may register: the node of a re-key token, when the
    hostname is that node's; None for a new hostname and a plain token. NodeExists otherwise."""
    node = lock_node_by_hostname(hostname=hostname)
    if token.rekey_node_id is not None:
        if node is None or node.pk != token.rekey_node_id:
            target = Node.objects.filter(pk=token.rekey_node_id).values_list("hostname", flat=True).first()
            raise NodeExists(
                f"This bootstrap token re-keys node {target!r} only, not {hostname!r}.",
                fields={"hostname": [f"This token is for node {target!r}."]},
            )
        return node
    if node is not None:
        message = (
            f"A node named {hostname!r} is already registered (node {node.pk}, {node.state}); its "
            "credential keeps working. To register a reinstalled server under this name, staff make "
            f"a re-key token for it: 'manage.py createnodetoken --rekey {hostname}', or Re-key on "
            "the node's fleet page."
        )
        raise NodeExists(message, fields={"hostname": ["A node with this hostname is already registered."]})
    return None


def _gpus_taken(taken: list[tuple[str, str]]) -> GpuConflict:
    """The 409 for GPUs (uuid, owner hostname) that are present on another node."""
    conflicts = [{"uuid": uuid, "node": owner} for uuid, owner in taken]
    listed = ", ".join(f"{c['uuid']} (node {c['node']!r})" for c in conflicts)
    return GpuConflict(
        f"GPUs already registered to another node: {listed}. A GPU belongs to one node; staff "
        "have been alerted.",
        conflicts=conflicts,
    )


@transaction.atomic
def _gpu_conflict_alert(*, info: NodeInfo, conflicts: list[dict[str, str]], now: datetime) -> None:
    """Open (or refresh) the fleet alert for ``info.hostname`` claiming other nodes' GPUs."""
    listed = ", ".join(f"{c['uuid']} (on {c['node']})" for c in conflicts)
    message = (
        f"A registration as {info.hostname!r} was refused: it listed GPUs of other nodes: {listed}. "
        "A cloned or forged agent, or hardware moved without re-registering the server it left."
    )
    data = {"hostname": info.hostname, "gpus": conflicts}
    subject = info.hostname[:253]
    kind = FleetAlert.Kind.GPU_UUID_CONFLICT
    updated = FleetAlert.objects.filter(kind=kind, subject=subject, resolved_at__isnull=True).update(
        message=message, data=data, last_seen_at=now
    )
    if not updated:
        FleetAlert.objects.create(
            kind=kind, subject=subject, message=message, data=data, opened_at=now, last_seen_at=now
        )
    node_metrics.ALERTS.labels(kind=kind).inc()
    audit_record(tenant=None, actor=Actor.system(), action="node.register.gpu_conflict", data=data)


def _registration_retried(token: NodeBootstrapToken, info: NodeInfo, now: datetime) -> Node | None:
    """The node a spent token registered, when this request is that registration sent again (the
    agent timed out before it read the answer): within REGISTER_RETRY_WINDOW of the first use, by
    the same machine, i.e. the same hostname and the same GPUs (UUIDs) as the node has now, and
    before that node sent anything with its credential. Otherwise None: the token stays spent."""
    node = token.used_by_node
    if node is None or token.used_at is None or now - token.used_at > REGISTER_RETRY_WINDOW:
        return None
    node = lock_node_if_exists(node_id=node.pk)
    if node is None or node.hostname != info.hostname or node.last_seq != 0:
        return None
    present = set(Gpu.objects.filter(node=node, removed_at__isnull=True).values_list("uuid", flat=True))
    if present != {gpu.uuid for gpu in info.gpus}:
        return None
    return node


def _sync_gpus(node: Node, gpus: tuple[GpuInfo, ...], now: datetime) -> list[str]:
    """Make the node's GPUs the listed ones. A listed UUID present (not removed) on another node is
    GpuConflict, whichever registration wrote it first; one retired there (removed_at) moves here:
    the hardware moved. Returns the UUIDs that moved."""
    index = gpu_model_index()
    # Locked: a registration running beside this one cannot take them between the check and the write.
    existing = lock_gpus_by_uuid(uuids=[g.uuid for g in gpus])
    taken = [gpu for gpu in existing.values() if gpu.node_id != node.pk and gpu.removed_at is None]
    if taken:
        raise _gpus_taken([(gpu.uuid, gpu.node.hostname) for gpu in sorted(taken, key=lambda g: g.uuid)])
    moved = sorted(uuid for uuid, gpu in existing.items() if gpu.node_id != node.pk)
    seen: set[str] = set()
    unknown: dict[str, int] = {}
    # Mark every GPU of the node removed first: the ones still listed come back below, and the
    # (node, index) uniqueness (over present GPUs) allows GPUs that swapped slots.
    Gpu.objects.filter(node=node, removed_at__isnull=True).update(removed_at=now)
    for info in gpus:
        model = index.get(normalize_gpu_name(info.name))
        if model is None:
            unknown[info.name] = unknown.get(info.name, 0) + 1
        values = {
            "node": node,
            "index": info.index,
            "model": model,
            "reported_name": info.name[:128],
            "memory_mib": info.memory_mib,
            "pci_bus_id": info.pci_bus_id,
            "nvlink_island": info.nvlink_island,
            "numa_node": info.numa_node,
            "mig_mode": info.mig_mode,
            "firmware_version": info.firmware_version,
            "removed_at": None,
        }
        gpu = existing.get(info.uuid)
        if gpu is None:
            try:
                with transaction.atomic():
                    Gpu.objects.create(uuid=info.uuid, **values)
            except IntegrityError:  # written at the same moment by another registration
                owner = Gpu.objects.filter(uuid=info.uuid).values_list("node__hostname", flat=True).first()
                raise _gpus_taken([(info.uuid, owner or "?")]) from None
        else:
            for k, v in values.items():
                setattr(gpu, k, v)
            gpu.save()
        seen.add(info.uuid)
    for name, count in unknown.items():
        _flag_unknown(name, node, count, now)
    return moved


@transaction.atomic
def gpu_conflict_alert_resolve(*, alert: FleetAlert, actor: Actor) -> FleetAlert:
    """Staff close a GPU UUID conflict alert (after looking at both machines). Other kinds of alert
    are resolved by the code that raised them. Audited."""
    alert = lock_fleet_alert(alert_id=alert.pk)
    if alert.kind != FleetAlert.Kind.GPU_UUID_CONFLICT:
        raise Conflict(f"A {alert.get_kind_display().lower()} alert resolves itself.")
    if alert.resolved_at is not None:
        raise Conflict("This alert is already resolved.")
    alert.resolved_at = timezone.now()
    alert.save(update_fields=["resolved_at"])
    audit_record(tenant=None, actor=actor, action="fleet_alert.resolve", target=alert, data=alert.data)
    return alert


# --- credentials --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuthenticatedNode:
    """What the agent endpoints need about the caller, from one query."""

    id: int
    seq_epoch: int
    hostname: str


def credential_node_id(credential: str) -> int | None:
    """The node id a ``gpn_<node_id>_<secret>`` credential names (not checked), or None."""
    parts = _split_token(credential, NodeCredential.PREFIX)
    if parts is None or not parts[0].isdigit():
        return None
    return int(parts[0])


def node_authenticate(*, credential: str) -> AuthenticatedNode:
    """Check a ``gpn_<node_id>_<secret>`` credential; raise NotAuthenticated (401) when wrong."""
    parts = _split_token(credential, NodeCredential.PREFIX)
    if parts is None or not parts[0].isdigit():
        raise NotAuthenticated("Invalid node credential.")
    # Every poll and report of every node makes it: a raw() statement (names from _meta), where
    # the ORM's values_list over the join spent its time compiling.
    found = next(iter(NodeCredential.objects.raw(_credential_statement(), [int(parts[0])])), None)
    if found is None or not hmac.compare_digest(found.key_hash, hash_secret(credential)):
        raise NotAuthenticated("Invalid node credential.")
    return AuthenticatedNode(id=int(parts[0]), seq_epoch=found.node_seq_epoch, hostname=found.node_hostname)


@functools.cache
def _credential_statement() -> str:
    q = connection.ops.quote_name
    cred, node = NodeCredential._meta, Node._meta
    cred_node = q(cred.get_field("node").column)
    return (
        f"SELECT c.{q(cred.pk.column)}, c.{q(cred.get_field('key_hash').column)},"
        f" n.{q(node.get_field('seq_epoch').column)} AS node_seq_epoch,"
        f" n.{q(node.get_field('hostname').column)} AS node_hostname"
        f" FROM {q(cred.db_table)} c JOIN {q(node.db_table)} n ON n.{q(node.pk.column)} = c.{cred_node}"
        f" WHERE c.{cred_node} = %s"
    )


@transaction.atomic
def gpu_models_rematch(*, actor: Actor) -> int:
    """After staff add an alias or a model: link GPUs whose reported name now matches. Returns
    how many GPUs were linked; resolves the matching unknown-GPU reports."""
    index = gpu_model_index()
    linked = 0
    now = timezone.now()
    for gpu in Gpu.objects.filter(model__isnull=True):
        model = index.get(normalize_gpu_name(gpu.reported_name))
        if model is not None:
            gpu.model = model
            gpu.save(update_fields=["model"])
            linked += 1
    for report in UnknownGpuReport.objects.filter(resolved_at__isnull=True):
        model = index.get(normalize_gpu_name(report.reported_name))
        if model is not None:
            report.resolved_at = now
            report.resolved_model = model
            report.save(update_fields=["resolved_at", "resolved_model"])
            audit_record(
                tenant=None,
                actor=actor,
                action="gpu_model.match_unknown",
                target=report,
                data={"model": model.name},
            )
    return linked
