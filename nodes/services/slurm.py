"""Slurm regions in the fleet: a region whose ``backend`` is ``slurm`` has no agents; its nodes and
GPUs are read from Slurm (``sinfo --json``) into Node and Gpu rows, read-only, at every sync.

Such a node is in state ``slurm`` (``NodeState.SLURM``): the engine never places on it and the
heartbeat watch leaves it alone; Slurm's own state (idle, mixed, drained, down, ...) and reason are
in its ``state_reason`` and ``labels`` for the staff fleet pages. Its GPUs are one row per GRES
unit, their catalog model from the region's ``gres_types`` (a type it does not map is shown by its
name, with no model). A node Slurm no longer lists keeps its row (allocations point at it) with
its GPUs marked removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from nodes.models import Gpu, GpuModel, Node, NodeState, Region, RegionBackend
from nodes.slurm.cli import SlurmError, SlurmNode
from nodes.slurm.config import SlurmConfig, slurm_config_parse
from nodes.slurm.rest import SlurmConnector, slurm_connector_for
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.services.audit import audit_record


@dataclass
class InventoryResult:
    nodes: int = 0
    gpus: int = 0
    gone: list[str] = field(default_factory=list)


def slurm_config(region: Region) -> SlurmConfig:
    """The region's checked Slurm configuration; ValidationFailed where it is not a Slurm region."""
    if region.backend != RegionBackend.SLURM:
        raise ValidationFailed(
            f"Region {region.code} is not a Slurm region.", fields={"region": ["Not Slurm."]}
        )
    return slurm_config_parse(region.slurm)


def slurm_connector(region: Region) -> SlurmConnector:
    return slurm_connector_for(slurm_config(region))


def slurm_hostname(region: Region, name: str) -> str:
    """The fleet's name of a Slurm node (hostnames are unique across regions)."""
    return f"{name}.{region.code}.slurm"


def _gpu_uuid(region: Region, node: str, gres_type: str, i: int) -> str:
    return f"slurm:{region.code}:{node}:{gres_type or 'gpu'}:{i}"


def _state_text(n: SlurmNode) -> str:
    flags = f" ({', '.join(n.flags)})" if n.flags else ""
    reason = f": {n.reason}" if n.reason else ""
    return f"Slurm: {n.state}{flags}{reason}"[:255]


def slurm_inventory_store(
    *, region: Region, nodes: list[SlurmNode], config: SlurmConfig, now: datetime | None = None
) -> InventoryResult:
    """Write what Slurm reported as the region's Node and Gpu rows (idempotent)."""
    now = now or timezone.now()
    result = InventoryResult()
    models = {m.name: m for m in GpuModel.objects.filter(name__in=list(config.gres_types))}
    with transaction.atomic():
        existing = {n.hostname: n for n in Node.objects.select_for_update().filter(region=region)}
        seen = set()
        for sn in nodes:
            hostname = slurm_hostname(region, sn.name)
            seen.add(hostname)
            labels = {
                "slurm_node": sn.name,
                "slurm_state": sn.state,
                "partitions": list(sn.partitions),
                "slurm_gpus_used": dict(sn.gpus_used),  # every job's, gpupool's or not
            }
            node = existing.get(hostname)
            if node is None:
                node = Node.objects.create(
                    hostname=hostname,
                    address=sn.address,
                    region=region,
                    labels=labels,
                    cpu_cores=sn.cpus,
                    ram_mib=sn.memory_mib,
                    state=NodeState.SLURM,
                    state_reason=_state_text(sn),
                    state_changed_at=now,
                    registered_at=now,
                )
            else:
                node.address, node.labels, node.cpu_cores, node.ram_mib = (
                    sn.address,
                    labels,
                    sn.cpus,
                    sn.memory_mib,
                )
                if node.state_reason != _state_text(sn):
                    node.state_reason, node.state_changed_at = _state_text(sn), now
                node.state = NodeState.SLURM
                node.save(
                    update_fields=[
                        "address",
                        "labels",
                        "cpu_cores",
                        "ram_mib",
                        "state",
                        "state_reason",
                        "state_changed_at",
                    ]
                )
            result.nodes += 1
            _gpus_store(region=region, node=node, sn=sn, config=config, models=models, now=now)
            result.gpus += sum(sn.gpus.values())
        for hostname, node in existing.items():
            if hostname in seen:
                continue
            result.gone.append(hostname)
            if node.state_reason != "Slurm no longer lists this node.":
                node.state_reason, node.state_changed_at = "Slurm no longer lists this node.", now
                node.save(update_fields=["state_reason", "state_changed_at"])
            Gpu.objects.filter(node=node, removed_at__isnull=True).update(removed_at=now)
    return result


def _gpus_store(
    *,
    region: Region,
    node: Node,
    sn: SlurmNode,
    config: SlurmConfig,
    models: dict[str, GpuModel],
    now: datetime,
) -> None:
    want = []
    for gres_type in sorted(sn.gpus):
        model_name = config.model_of_type(gres_type)
        model = models.get(model_name) if model_name else None
        for i in range(sn.gpus[gres_type]):
            want.append((_gpu_uuid(region, sn.name, gres_type, i), gres_type, model))
    current = {g.uuid: g for g in Gpu.objects.filter(node=node, removed_at__isnull=True)}
    wanted = {u for u, _, _ in want}
    Gpu.objects.filter(pk__in=[g.pk for u, g in current.items() if u not in wanted]).update(removed_at=now)
    for index, (uuid, gres_type, model) in enumerate(want):
        g = current.get(uuid)
        name = f"gres gpu:{gres_type}" if gres_type else "gres gpu"
        memory = model.memory_gib * 1024 if model else 0
        if g is None:
            Gpu.objects.update_or_create(
                uuid=uuid,
                defaults={
                    "node": node,
                    "index": index,
                    "model": model,
                    "reported_name": name,
                    "memory_mib": memory,
                    "removed_at": None,
                },
            )
        elif (g.index, g.model_id, g.reported_name) != (index, model.pk if model else None, name):
            g.index, g.model, g.reported_name, g.memory_mib = index, model, name, memory
            g.save(update_fields=["index", "model", "reported_name", "memory_mib"])


def slurm_inventory_refresh(*, region: Region, now: datetime | None = None) -> InventoryResult:
    """Read the region's nodes from Slurm and store them (``SlurmError`` when Slurm does not answer)."""
    config = slurm_config(region)
    return slurm_inventory_store(
        region=region, nodes=slurm_connector_for(config).nodes(), config=config, now=now
    )


def region_slurm_set(
    *, code: str, name: str, slurm: dict, actor: Actor, check: bool = True, now: datetime | None = None
) -> tuple[Region, InventoryResult | None]:
    """Make region ``code`` a Slurm region with this configuration (or change it): validate the
    configuration against the catalog, refuse a region that has agent nodes, save, audit, and, with
    ``check``, read the inventory once (a cluster that does not answer is refused: nothing saved)."""
    config = slurm_config_parse(slurm, model_names=set(GpuModel.objects.values_list("name", flat=True)))
    if not name or len(name) > 100:
        raise ValidationFailed(
            "name is required (at most 100 characters).", fields={"name": ["1 to 100 characters."]}
        )
    with transaction.atomic():
        region = Region.objects.select_for_update().filter(code=code).first()
        created = region is None
        if created:
            region = Region(code=code)
            region.full_clean(exclude=["name", "backend", "slurm"])
        elif Node.objects.filter(region=region).exclude(state=NodeState.SLURM).exists():
            raise Conflict(
                f"Region {code} has agent nodes; a Slurm region has only Slurm's.", code="invalid_state"
            )
        old = {"backend": region.backend, "slurm": region.slurm}
        region.name, region.backend, region.slurm = name, RegionBackend.SLURM, slurm
        region.save()
        inventory = None
        if check:
            try:
                inventory = slurm_inventory_store(
                    region=region, nodes=slurm_connector_for(config).nodes(), config=config, now=now
                )
            except SlurmError as exc:
                raise ValidationFailed(f"Slurm does not answer: {exc}", fields={"slurm": [str(exc)]}) from exc
        audit_record(
            tenant=None,
            actor=actor,
            action="region.slurm_created" if created else "region.slurm_changed",
            target=region,
            data={"from": old, "to": {"backend": region.backend, "slurm": slurm}},
        )
    return region, inventory
