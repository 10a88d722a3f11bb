"""The demo fleet: the catalog, three regions, and a simulated fleet file (``var/fleet.json``) that
the simulated fleet launcher reads to start one ``gpupool-agent`` per node (format in PROTOCOL.md).

Idempotent: nodes that already registered get no new token; a token from the previous file that is
still unused and unexpired is kept; only missing, used-by-nobody-but-expired ones are minted anew.
"""

from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from nodes.catalog import CATALOG, catalog_seed
from nodes.models import Node, NodeBootstrapToken, Region, hash_secret
from nodes.services.registration import bootstrap_token_create
from portal.actors import Actor

FLEET_FILE_VERSION = 1
DEMO_TOKEN_TTL = timedelta(days=30)

DEMO_REGIONS = (
    ("us-east-1", "US East", "Ashburn, Virginia, US"),
    ("eu-west-1", "EU West", "Dublin, Ireland"),
    ("ap-northeast-1", "Asia Pacific (Tokyo)", "Tokyo, Japan"),
)


@dataclass(frozen=True)
class SimNode:
    hostname: str
    region: str
    model: str  # catalog name
    count: int
    interconnect: str
    cpu_cores: int
    ram_gib: int


def _plan() -> list[SimNode]:
    plan = []

    def add(prefix, region, model, count, n, interconnect, cpu, ram):
        for i in range(1, n + 1):
            plan.append(SimNode(f"sim-{prefix}-{i:02d}", region, model, count, interconnect, cpu, ram))

    add("use1-h100", "us-east-1", "NVIDIA H100 SXM 80GB", 8, 3, "nvswitch", 192, 2048)
    add("use1-a100", "us-east-1", "NVIDIA A100 SXM 80GB", 8, 2, "nvswitch", 128, 1024)
    add("use1-l40s", "us-east-1", "NVIDIA L40S", 4, 2, "pcie", 64, 512)
    add("use1-mi300x", "us-east-1", "AMD Instinct MI300X", 8, 1, "xgmi", 192, 2048)
    add("euw1-h200", "eu-west-1", "NVIDIA H200 SXM 141GB", 8, 2, "nvswitch", 192, 2048)
    add("euw1-a100", "eu-west-1", "NVIDIA A100 SXM 40GB", 4, 2, "nvlink", 64, 512)
    add("euw1-l4", "eu-west-1", "NVIDIA L4", 2, 2, "pcie", 32, 128)
    add("euw1-t4", "eu-west-1", "NVIDIA T4", 1, 2, "pcie", 16, 64)
    add("apne1-h100p", "ap-northeast-1", "NVIDIA H100 PCIe 80GB", 2, 2, "pcie", 64, 512)
    add("apne1-a10", "ap-northeast-1", "NVIDIA A10", 1, 2, "pcie", 16, 128)
    add("apne1-v100", "ap-northeast-1", "NVIDIA V100 SXM2 32GB", 4, 2, "nvlink", 48, 384)
    add("apne1-mi250", "ap-northeast-1", "AMD Instinct MI250", 4, 1, "xgmi", 64, 512)
    add("apne1-t4", "ap-northeast-1", "NVIDIA T4", 4, 1, "pcie", 32, 256)
    return plan


# What the driver (NVML, amdsmi) reports for each catalog model the demo fleet uses.
DRIVER_NAMES = {
    "NVIDIA H200 SXM 141GB": "NVIDIA H200",
    "NVIDIA H100 SXM 80GB": "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 PCIe 80GB": "NVIDIA H100 PCIe",
    "NVIDIA A100 SXM 80GB": "NVIDIA A100-SXM4-80GB",
    "NVIDIA A100 SXM 40GB": "NVIDIA A100-SXM4-40GB",
    "NVIDIA L40S": "NVIDIA L40S",
    "NVIDIA L4": "NVIDIA L4",
    "NVIDIA A10": "NVIDIA A10",
    "NVIDIA T4": "Tesla T4",
    "NVIDIA V100 SXM2 32GB": "Tesla V100-SXM2-32GB",
    "AMD Instinct MI300X": "AMD Instinct MI300X",
    "AMD Instinct MI250": "AMD Instinct MI250",
}


def _previous_tokens(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
        return {
            n["hostname"]: n["bootstrap_token"] for n in data.get("nodes", []) if n.get("bootstrap_token")
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _still_usable(plaintext: str, hostname: str, now) -> bool:
    parts = plaintext.split("_", 2)
    if len(parts) != 3:
        return False
    token = NodeBootstrapToken.objects.filter(key_id=parts[1], intended_hostname=hostname).first()
    return (
        token is not None
        and hmac.compare_digest(token.token_hash, hash_secret(plaintext))
        and token.is_usable(now)
    )


@transaction.atomic
def fleet_demo_seed(*, path: Path | None = None, portal_url: str | None = None) -> dict:
    """Seed the catalog and regions and write the simulated fleet file. Returns what it wrote."""
    path = Path(path or settings.FLEET_FILE)
    now = timezone.now()
    catalog_seed()
    regions = {}
    for code, name, location in DEMO_REGIONS:
        regions[code], _ = Region.objects.update_or_create(
            code=code, defaults={"name": name, "location": location}
        )
    previous = _previous_tokens(path)
    registered = set(
        Node.objects.filter(hostname__in=[n.hostname for n in _plan()]).values_list("hostname", flat=True)
    )
    system = Actor.system()
    nodes = []
    for sim in _plan():
        token: str | None = None
        if sim.hostname not in registered:
            token = previous.get(sim.hostname)
            if token is None or not _still_usable(token, sim.hostname, now):
                # Unused tokens minted for this hostname earlier are dead now: expire them.
                NodeBootstrapToken.objects.filter(
                    intended_hostname=sim.hostname, used_at__isnull=True, expires_at__gt=now
                ).update(expires_at=now)
                _, token = bootstrap_token_create(
                    region=regions[sim.region],
                    actor=system,
                    expires_in=DEMO_TOKEN_TTL,
                    note=f"simulated fleet: {sim.hostname}",
                    intended_hostname=sim.hostname,
                    now=now,
                )
        spec = next(s for s in CATALOG if s.name == sim.model)
        nodes.append(
            {
                "hostname": sim.hostname,
                "region": sim.region,
                "bootstrap_token": token,
                "registered": sim.hostname in registered,
                "cpu_cores": sim.cpu_cores,
                "ram_mib": sim.ram_gib * 1024,
                "interconnect": sim.interconnect,
                "labels": {"simulated": "true", "pool": sim.hostname.rsplit("-", 1)[0]},
                "gpus": [
                    {
                        "model": DRIVER_NAMES[sim.model],
                        "count": sim.count,
                        "memory_mib": spec.memory_gib * 1024,
                        "vendor": spec.vendor,
                    }
                ],
            }
        )
    data = {
        "version": FLEET_FILE_VERSION,
        "portal_url": portal_url or settings.SITE_URL,
        "generated_at": now.isoformat().replace("+00:00", "Z"),
        "nodes": nodes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    transaction.on_commit(lambda: os.replace(tmp, path))
    return data


def on_seed_demo_requested(sender, tenant=None, stdout=None, **kwargs) -> None:
    data = fleet_demo_seed()
    if stdout is not None:
        gpus = sum(g["count"] for n in data["nodes"] for g in n["gpus"])
        stdout.write(
            f"Simulated fleet: {len(data['nodes'])} nodes, {gpus} GPUs in {len(DEMO_REGIONS)} regions "
            f"(fleet file {settings.FLEET_FILE})."
        )
