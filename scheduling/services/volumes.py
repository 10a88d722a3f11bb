"""Tenant volumes: create, delete, attach to a workload at submission, and the agents' measurements.

The rules, once:

- A volume lives in one region, on the region's storage root (``VOLUME_STORAGE_ROOTS``: a shared
  filesystem every node of the region mounts at its agent's ``volumes_root``). A region without a
  root offers no volumes. Its name is unique among the tenant's live volumes of that region; its
  size is between ``VOLUME_MIN_SIZE_GIB`` and ``VOLUME_MAX_SIZE_GIB``.
- A workload names its volumes at submission (``"volumes": [{"volume", "mount_path", "shared"}]``).
  Its region follows them: all in one region, and it is placed only there (a request naming another
  region, or a reservation elsewhere, is a 400 naming ``region``).
- A volume is in use while a workload it is attached to is not terminal. Attaching happens under
  the volume's row lock (``scheduling.locks.lock_volumes``): it is refused (409 naming ``volumes``)
  when the volume is in use and either this workload or one that uses it did not ask to share.
- A volume grows at any time and shrinks only to a size above what it holds (its last measurement;
  one never measured holds nothing; one in use needs a measurement from the last 90 s): ``volume_resize``, under its row lock, with a
  ``VolumeResize`` row so storage billing charges each size for its own hours. The agent checks a
  start against the size current when the start command is delivered
  (``volume_sizes_for_payload``), so it refuses a start over the new size.
- A volume in use cannot be deleted (409). Deleting marks it deleted (billing stops there) and
  sends ``delete_volume`` to a node of its region that is up, whose agent removes the directory;
  the reconciler asks again where none was up or the command failed (``volumes_data_removal``).
- ``checkpoint_resume`` needs a volume: the job's checkpoints go to its first one.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import BigIntegerField, Q
from django.db.models.functions import Cast
from django.utils import timezone

from nodes.agent.workload_rules import WorkloadRuleError, check_mount_path
from nodes.models import CommandKind, CommandState, Node, NodeCommand, NodeState, Region
from nodes.services.commands import node_command_enqueue
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.events import publish
from portal.services.audit import audit_record
from scheduling.locks import lock_volume, lock_volumes
from scheduling.models import ACTIVE_STATES, Volume, VolumeResize, VolumeState, Workload, WorkloadVolume

logger = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
SPEC_KEYS = frozenset({"volume", "mount_path", "shared"})


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def storage_root(region: Region) -> str:
    """The region's storage root, or "" when it offers no volumes."""
    roots = settings.VOLUME_STORAGE_ROOTS or {}
    return str(roots.get(region.code) or roots.get("*") or "")


# --- create and delete -----------------------------------------------------------------------------


def volume_create(*, tenant, name: Any, region: Any, size_gib: Any, actor: Actor) -> Volume:
    """A new volume of ``size_gib`` GiB in the region with code ``region``."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise _fail(
            "name", "Lowercase letters, digits and . _ -, starting with a letter or digit, at most 63."
        )
    code = region if isinstance(region, str) else ""
    found = Region.objects.filter(code=code).first() if code else None
    if found is None:
        raise _fail("region", f"Unknown region {region!r}.")
    if not storage_root(found):
        raise _fail("region", f"Region {found.code} offers no volumes.")
    lo, hi = settings.VOLUME_MIN_SIZE_GIB, settings.VOLUME_MAX_SIZE_GIB
    if isinstance(size_gib, bool) or not isinstance(size_gib, int) or not lo <= size_gib <= hi:
        raise _fail("size_gib", f"An integer between {lo} and {hi}.")
    live = Volume.objects.for_tenant(tenant).exclude(state=VolumeState.DELETED)
    if live.count() >= settings.VOLUME_MAX_PER_TENANT:
        raise _fail("name", f"At most {settings.VOLUME_MAX_PER_TENANT} volumes per tenant.")
    try:
        with transaction.atomic():
            volume = Volume.objects.create(tenant=tenant, name=name, region=found, size_gib=size_gib)
            audit_record(
                tenant=tenant,
                actor=actor,
                action="volume.create",
                target=volume,
                data={"region": found.code, "size_gib": size_gib},
            )
    except IntegrityError:
        raise Conflict(
            f"name: you already have a volume {name!r} in {found.code}.",
            fields={"name": ["Already used in this region."]},
        ) from None
    return volume


GIB = 1024**3
# A volume in use shrinks only on a measurement at most this old (agents measure every 30 s).
SHRINK_MEASUREMENT_MAX_AGE = timedelta(seconds=90)


def volume_resize(*, volume: Volume, size_gib: Any, actor: Actor, now=None) -> Volume:
    """Make a volume ``size_gib`` GiB: larger at any time, smaller only above what it holds."""
    lo, hi = settings.VOLUME_MIN_SIZE_GIB, settings.VOLUME_MAX_SIZE_GIB
    if isinstance(size_gib, bool) or not isinstance(size_gib, int) or not lo <= size_gib <= hi:
        raise _fail("size_gib", f"An integer between {lo} and {hi}.")
    now = now or timezone.now()
    with transaction.atomic():
        volume = lock_volume(volume_id=volume.pk)
        if volume.state == VolumeState.DELETED:
            raise Conflict("This volume is deleted.", fields={"volume": ["Deleted."]}, code="volume_deleted")
        old = volume.size_gib
        if size_gib == old:
            return volume
        used = volume.used_bytes or 0
        if size_gib < old and volume_in_use_by(volume_ids=[volume.pk]).get(volume.pk):
            # In use, it may be growing: only a measurement from the last minute and a half (one
            # comes every 30 s while a workload uses it) tells what it holds now.
            measured = volume.used_measured_at
            if measured is None or now - measured > SHRINK_MEASUREMENT_MAX_AGE:
                raise Conflict(
                    "size_gib: the volume is in use and has not been measured in the last "
                    f"{int(SHRINK_MEASUREMENT_MAX_AGE.total_seconds())} s; try again after its next measurement.",
                    fields={"size_gib": ["In use: waiting for a recent measurement of what it holds."]},
                    code="volume_measurement_stale",
                )
        if size_gib < old and size_gib * GIB <= used:
            raise Conflict(
                f"size_gib: the volume holds {used / GIB:.2f} GiB; it shrinks only to a size above that.",
                fields={"size_gib": [f"Above {used / GIB:.2f} GiB, what it holds (measured)."]},
                code="volume_too_full",
            )
        VolumeResize.objects.create(
            tenant_id=volume.tenant_id, volume=volume, at=now, from_gib=old, to_gib=size_gib
        )
        volume.size_gib = size_gib
        volume.save(update_fields=["size_gib"])
        audit_record(
            tenant=volume.tenant,
            actor=actor,
            action="volume.resize",
            target=volume,
            data={"from_gib": old, "to_gib": size_gib, "used_bytes": volume.used_bytes},
        )
    return volume


def volume_sizes_for_payload(volumes: list) -> list:
    """A start payload's ``volumes`` with each size as it is now (a resize after placement, before
    delivery, counts): what the agent checks the volume's use against."""
    ids = [
        int(v["volume_id"]) for v in volumes if isinstance(v, dict) and str(v.get("volume_id", "")).isdigit()
    ]
    sizes = dict(Volume.objects.filter(pk__in=ids).values_list("pk", "size_gib"))
    out = []
    for v in volumes:
        vid = str(v.get("volume_id", "")) if isinstance(v, dict) else ""
        out.append({**v, "size_gib": sizes[int(vid)]} if vid.isdigit() and int(vid) in sizes else v)
    return out


def volume_in_use_by(*, volume_ids: Iterable[int]) -> dict[int, list[tuple[int, bool]]]:
    """For each volume, the (workload id, shared) of the non-terminal workloads it is attached to."""
    out: dict[int, list[tuple[int, bool]]] = {}
    for vid, wid, shared in WorkloadVolume.objects.filter(
        volume_id__in=list(volume_ids), workload__state__in=list(ACTIVE_STATES)
    ).values_list("volume_id", "workload_id", "shared"):
        out.setdefault(vid, []).append((wid, shared))
    return out


def volume_delete(*, volume: Volume, actor: Actor, now=None) -> Volume:
    """Delete a volume that no live workload uses: billing stops now, and a node of its region
    removes its data (``delete_volume``)."""
    now = now or timezone.now()
    with transaction.atomic():
        volume = lock_volume(volume_id=volume.pk)
        if volume.state == VolumeState.DELETED:
            return volume
        users = volume_in_use_by(volume_ids=[volume.pk]).get(volume.pk)
        if users:
            ids = ", ".join(str(w) for w, _ in users)
            raise Conflict(
                f"Volume {volume.pk} is in use by workload(s) {ids}; stop them first.",
                fields={"volume": [f"In use by workload(s) {ids}."]},
                code="volume_in_use",
            )
        volume.state = VolumeState.DELETED
        volume.deleted_at = now
        volume.save(update_fields=["state", "deleted_at"])
        node = (
            Node.objects.filter(region_id=volume.region_id, state=NodeState.READY)
            .order_by("-last_heartbeat_at", "pk")
            .first()
        )
        if node is not None:
            node_command_enqueue(
                node=node,
                kind=CommandKind.DELETE_VOLUME,
                payload={"volume_id": str(volume.pk)},
                idempotency_key=f"delete_volume:{volume.pk}",
                now=now,
            )
        else:
            logger.warning("Volume %s deleted with no ready node in its region to remove its data", volume.pk)
        audit_record(
            tenant=volume.tenant,
            actor=actor,
            action="volume.delete",
            target=volume,
            data={"data_removal_node": node.pk if node is not None else None},
        )
    return volume


# Deleted volumes whose data no node has removed yet are retried for this long, this many times.
DATA_REMOVAL_WINDOW = timedelta(days=7)
DATA_REMOVAL_TRIES = 5
IN_FLIGHT = (CommandState.PENDING, CommandState.DELIVERED, CommandState.ACCEPTED)


def volumes_data_removal(*, now=None) -> list[int]:
    """Ask again for the removal of deleted volumes' data where no node has done it: no ready node
    of the region when it was deleted, or the command failed or expired. A ready node of the region
    gets ``delete_volume`` (at most ``DATA_REMOVAL_TRIES`` per volume, within
    ``DATA_REMOVAL_WINDOW`` of the deletion; past that it is logged for staff). Run by the
    reconciler. Returns the volumes asked for."""
    now = now or timezone.now()
    deleted = list(
        Volume.objects.filter(state=VolumeState.DELETED, deleted_at__gte=now - DATA_REMOVAL_WINDOW).order_by(
            "pk"
        )
    )
    if not deleted:
        return []
    states: dict[str, list[str]] = {}
    for payload, state in NodeCommand.objects.filter(
        kind=CommandKind.DELETE_VOLUME, payload__volume_id__in=[str(v.pk) for v in deleted]
    ).values_list("payload", "state"):
        states.setdefault(str(payload.get("volume_id")), []).append(state)
    asked = []
    for v in deleted:
        tried = states.get(str(v.pk), [])
        if CommandState.SUCCEEDED in tried or any(s in IN_FLIGHT for s in tried):
            continue
        if len(tried) >= DATA_REMOVAL_TRIES:
            logger.error(
                "Volume %s: its data was not removed after %d tries; staff must remove it", v.pk, len(tried)
            )
            continue
        node = (
            Node.objects.filter(region_id=v.region_id, state=NodeState.READY)
            .order_by("-last_heartbeat_at", "pk")
            .first()
        )
        if node is None:
            continue
        node_command_enqueue(
            node=node,
            kind=CommandKind.DELETE_VOLUME,
            payload={"volume_id": str(v.pk)},
            idempotency_key=f"delete_volume:{v.pk}:{len(tried) + 1}",
            now=now,
        )
        asked.append(v.pk)
    return asked


# --- attaching at submission -----------------------------------------------------------------------


@dataclass
class VolumeRequest:
    volume: Volume
    mount_path: str
    shared: bool


def volumes_validate(*, tenant, spec: dict) -> list[VolumeRequest]:
    """The spec's ``volumes``, checked for shape, paths and ownership (not yet locked): a 400
    naming ``volumes`` for anything wrong. Another tenant's volume does not exist here."""
    raw = spec.get("volumes")
    if raw in (None, []):
        return []
    if not isinstance(raw, list):
        raise _fail("volumes", 'A list of {"volume": ID, "mount_path": "/workspace"}.')
    if len(raw) > settings.VOLUME_MAX_PER_WORKLOAD:
        raise _fail("volumes", f"At most {settings.VOLUME_MAX_PER_WORKLOAD} volumes.")
    wanted: list[tuple[int, str, bool]] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not set(item) <= SPEC_KEYS or "volume" not in item:
            raise _fail(
                "volumes", f'volumes[{i}]: an object {{"volume": ID, "mount_path": PATH, "shared": false}}.'
            )
        vid = item["volume"]
        if isinstance(vid, bool) or not isinstance(vid, int) or vid < 1:
            raise _fail("volumes", f"volumes[{i}].volume: a volume id.")
        try:
            path = check_mount_path(item.get("mount_path"))
        except WorkloadRuleError as exc:
            raise _fail("volumes", f"volumes[{i}].mount_path: {exc.message}") from None
        shared = item.get("shared", False)
        if not isinstance(shared, bool):
            raise _fail("volumes", f"volumes[{i}].shared: true or false.")
        for other_id, other_path, _ in wanted:
            if other_id == vid:
                raise _fail("volumes", f"Volume {vid} is attached twice.")
            if other_path == path or path.startswith(other_path + "/") or other_path.startswith(path + "/"):
                raise _fail("volumes", f"{path} and {other_path}: one volume per path, none inside another.")
        wanted.append((vid, path, shared))
    found = Volume.objects.for_tenant(tenant).select_related("region").in_bulk([w[0] for w in wanted])
    out = []
    for vid, path, shared in wanted:
        v = found.get(vid)
        if v is None or v.state == VolumeState.DELETED:
            raise _fail("volumes", f"You have no volume {vid}.")
        out.append(VolumeRequest(volume=v, mount_path=path, shared=shared))
    regions = {r.volume.region_id for r in out}
    if len(regions) > 1:
        raise _fail("volumes", "All of a workload's volumes must be in one region.")
    return out


def volumes_attach(*, tenant, workload: Workload, requests: list[VolumeRequest]) -> None:
    """Attach the volumes under their row locks (inside the submission's transaction, after the
    quota lock): refused (409 naming ``volumes``) when one is in use and a side did not ask to share."""
    if not requests:
        return
    locked = lock_volumes(ids=[r.volume.pk for r in requests])
    users = volume_in_use_by(volume_ids=list(locked))
    rows = []
    for position, r in enumerate(requests):
        v = locked.get(r.volume.pk)
        if v is None or v.state == VolumeState.DELETED:
            raise _fail("volumes", f"You have no volume {r.volume.pk}.")
        others = [(wid, shared) for wid, shared in users.get(v.pk, []) if wid != workload.pk]
        if others and (not r.shared or not all(shared for _, shared in others)):
            ids = ", ".join(str(wid) for wid, _ in others)
            why = (
                "it did not ask to share it"
                if r.shared
                else 'this request did not ask to share it ("shared": true)'
            )
            raise Conflict(
                f"volumes: volume {v.pk} is in use by workload(s) {ids}, and {why}.",
                fields={"volumes": [f"Volume {v.pk} is in use by workload(s) {ids}."]},
                code="volume_in_use",
            )
        rows.append(
            WorkloadVolume(
                tenant=tenant,
                workload=workload,
                volume=v,
                mount_path=r.mount_path,
                shared=r.shared,
                position=position,
            )
        )
    WorkloadVolume.objects.bulk_create(rows)


def workload_volume_payloads(*, workload_ids: Iterable[int]) -> dict[int, list[dict[str, Any]]]:
    """What each workload's start payload says of its volumes, in one query: ``volume_id`` (the
    agent derives the directory from it), ``mount_path`` and ``size_gib``, first volume first."""
    out: dict[int, list[dict[str, Any]]] = {}
    for wid, vid, path, size in (
        WorkloadVolume.objects.filter(workload_id__in=list(workload_ids))
        .order_by("workload_id", "position")
        .values_list("workload_id", "volume_id", "mount_path", "volume__size_gib")
    ):
        out.setdefault(wid, []).append({"volume_id": str(vid), "mount_path": path, "size_gib": size})
    return out


# --- measurements ----------------------------------------------------------------------------------


def volumes_on_measured(*, node_id: int, reports: list) -> int:
    """Store what a node measured: only volumes of the node's region, and only a measurement newer
    than the one stored. Returns how many volumes changed."""
    region_id = Node.objects.filter(pk=node_id).values_list("region_id", flat=True).first()
    if region_id is None or not reports:
        return 0
    newest: dict[int, Any] = {}
    for r in reports:
        if r.volume_id not in newest or r.measured_at > newest[r.volume_id].measured_at:
            newest[r.volume_id] = r
    changed = 0
    for vid, r in newest.items():
        newer = Volume.objects.filter(pk=vid, region_id=region_id).exclude(
            used_measured_at__gte=r.measured_at
        )
        # First the update that crosses into full (it was below its size, or unmeasured): the row's
        # lock makes exactly one measurement the crossing, which is announced (volume.full).
        with transaction.atomic():
            filled = (
                newer.filter(
                    Q(used_bytes__isnull=True)
                    | Q(used_bytes__lt=Cast("size_gib", BigIntegerField()) * 1024**3)
                )
                .filter(size_gib__lte=r.used_bytes // 1024**3)
                .update(used_bytes=r.used_bytes, used_measured_at=r.measured_at)
            )
            if filled:
                _volume_full_publish(volume_id=vid, used_bytes=r.used_bytes, measured_at=r.measured_at)
        changed += filled or newer.update(used_bytes=r.used_bytes, used_measured_at=r.measured_at)
    return changed


def _volume_full_publish(*, volume_id: int, used_bytes: int, measured_at) -> None:
    v = Volume.objects.filter(pk=volume_id).values("tenant_id", "name", "size_gib", "region__code").get()
    publish(
        tenant_id=v["tenant_id"],
        event={
            "type": "volume.full",
            "volume_id": volume_id,
            "name": v["name"],
            "region": v["region__code"],
            "size_gib": v["size_gib"],
            "used_bytes": used_bytes,
            "at": measured_at.isoformat(),
        },
    )
