from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal
from io import StringIO

from django.core.management import call_command
from django.utils import timezone

from nodes.catalog import CATALOG, catalog_seed, compute_weight
from nodes.demo import fleet_demo_seed
from nodes.models import (
    Gpu,
    GpuMinuteRollup,
    GpuModel,
    GpuSample,
    HeartbeatBatch,
    Node,
    NodeBootstrapToken,
    Region,
)
from nodes.selectors import fleet_inventory, gpu_models_supporting, gpu_rollups_between
from nodes.services.telemetry import telemetry_purge
from tests.nodes.conftest import registration_body


def test_catalog_is_seeded_by_migrate_and_seeding_is_idempotent(db):
    names = set(GpuModel.objects.values_list("name", flat=True))
    assert {s.name for s in CATALOG} == names
    for required in ("H200", "H100", "H100-PCIe", "A100-40", "A100-80", "L40S", "L4", "A10", "T4", "V100-16",
                     "V100-32", "P100", "MI300X", "MI250", "Max-1550", "Max-1100"):  # fmt: skip
        assert GpuModel.objects.filter(short_name=required).exists(), required
    assert catalog_seed() == (0, 0)
    out = StringIO()
    call_command("seed_catalog", stdout=out)
    assert "0 created, 0 updated" in out.getvalue()
    assert GpuModel.objects.count() == len(CATALOG)


def test_compute_weights_follow_the_documented_formula(db):
    weight = dict(GpuModel.objects.values_list("short_name", "compute_weight"))
    assert weight["H100"] == Decimal("1.00")
    assert Decimal("0.25") <= weight["T4"] <= Decimal("0.35")
    assert weight["H200"] > weight["H100"] > weight["A100-80"] > weight["A100-40"] > weight["T4"]
    assert compute_weight(989.4, 3350) == Decimal("1.00")


def test_staff_edited_weight_survives_reseeding(db):
    GpuModel.objects.filter(short_name="T4").update(compute_weight=Decimal("0.40"), memory_gib=1)
    assert catalog_seed() == (0, 1)
    t4 = GpuModel.objects.get(short_name="T4")
    assert t4.compute_weight == Decimal("0.40") and t4.memory_gib == 16


def test_software_matching(db):
    ampere_plus = {m.short_name for m in gpu_models_supporting(stack="cuda", min_cuda_cc=(8, 0))}
    assert {"H100", "A100-80", "L4", "A10"} <= ampere_plus and not {"T4", "V100-16", "MI300X"} & ampere_plus
    assert {m.short_name for m in gpu_models_supporting(stack="rocm")} == {"MI300X", "MI250"}
    assert [m.short_name for m in gpu_models_supporting(gfx_target="gfx942")] == ["MI300X"]


def test_demo_fleet_file_and_second_run(db, tmp_path, client, django_capture_on_commit_callbacks, settings):
    path = tmp_path / "fleet.json"
    with django_capture_on_commit_callbacks(execute=True):
        fleet_demo_seed(path=path, portal_url="http://127.0.0.1:8123")
    data = json.loads(path.read_text())
    assert data["portal_url"] == "http://127.0.0.1:8123" and len(data["nodes"]) == 24
    assert Region.objects.count() == 3
    assert {n["region"] for n in data["nodes"]} == {"us-east-1", "eu-west-1", "ap-northeast-1"}
    counts = [g["count"] for n in data["nodes"] for g in n["gpus"]]
    assert min(counts) >= 1 and max(counts) <= 8
    models = {g["model"] for n in data["nodes"] for g in n["gpus"]}
    assert {"NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S", "NVIDIA L4", "Tesla T4",
            "AMD Instinct MI300X"} <= models  # fmt: skip
    assert NodeBootstrapToken.objects.count() == 24

    # One node registers with its token (as the simulated launcher would).
    first = data["nodes"][0]
    body = registration_body(first["bootstrap_token"], first["hostname"], gpus=first["gpus"][0]["count"],
                             name=first["gpus"][0]["model"])  # fmt: skip
    body["labels"] = first["labels"]
    assert (
        client.post("/agent/v1/register", data=json.dumps(body), content_type="application/json").status_code
        == 201
    )
    node = Node.objects.get(hostname=first["hostname"])
    assert node.simulated and all(g.model is not None for g in node.gpus.all())

    # An unused token expires; the second run keeps the 22 good ones, re-mints that one, none for the node.
    expired = data["nodes"][1]
    key_id = expired["bootstrap_token"].split("_")[1]
    NodeBootstrapToken.objects.filter(key_id=key_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        fleet_demo_seed(path=path, portal_url="http://127.0.0.1:8123")
    again = {n["hostname"]: n for n in json.loads(path.read_text())["nodes"]}
    assert again[first["hostname"]]["bootstrap_token"] is None and again[first["hostname"]]["registered"]
    assert again[expired["hostname"]]["bootstrap_token"] != expired["bootstrap_token"]
    kept = [n for n in data["nodes"][2:] if again[n["hostname"]]["bootstrap_token"] == n["bootstrap_token"]]
    assert len(kept) == 22
    assert NodeBootstrapToken.objects.count() == 25


def test_seed_demo_command_seeds_the_fleet(db, tmp_path, settings, django_capture_on_commit_callbacks):
    settings.FLEET_FILE = tmp_path / "fleet.json"
    out = StringIO()
    with django_capture_on_commit_callbacks(execute=True):
        call_command("seed_demo", stdout=out)
    assert "Simulated fleet: 24 nodes" in out.getvalue()
    assert len(json.loads(settings.FLEET_FILE.read_text())["nodes"]) == 24
    # A volume or two of the demo tenant in the simulated regions; a second run makes no more.
    from scheduling.models import Volume

    demo = {(v.name, v.region.code, v.size_gib) for v in Volume.objects.filter(tenant__slug="demo")}
    assert demo == {
        ("datasets", "us-east-1", 200),
        ("checkpoints", "us-east-1", 50),
        ("scratch", "eu-west-1", 100),
    }
    with django_capture_on_commit_callbacks(execute=True):
        call_command("seed_demo", stdout=StringIO())
    assert Volume.objects.filter(tenant__slug="demo").count() == 3


def test_metrics_expose_dcgm_gauges_and_fleet_counts(agent, client):
    now = timezone.now()
    samples = [
        agent.sample(agent.uuids[0], now, util_pct=77.0, xid_errors=[13]),
        agent.sample(agent.uuids[1], now),
    ]
    agent.heartbeat(agent.batch(samples=samples))
    text = client.get("/metrics").content.decode()
    hostname = agent.node.hostname
    labels = (
        f'UUID="{agent.uuids[0]}",gpu="0",model="NVIDIA H100 SXM 80GB",node="{hostname}",region="us-east-1"'
    )
    assert f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} 77.0" in text
    for name in ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_SM_CLOCK",
                 "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"):  # fmt: skip
        assert f"{name}{{{labels}}}" in text, name
    assert f"DCGM_FI_DEV_XID_ERRORS{{{labels}}} 13.0" in text
    assert 'gpupool_nodes{region="us-east-1",state="ready"} 1.0' in text
    assert 'gpupool_gpus{health="healthy",model="NVIDIA H100 SXM 80GB"} 2.0' in text
    assert 'gpupool_heartbeats_total{result="accepted"}' in text
    assert "gpupool_gpu_samples_ingested_total" in text


def test_purge_keeps_what_is_within_retention(agent, settings):
    settings.TELEMETRY_RAW_RETENTION_DAYS = 7
    now = timezone.now()
    old = now - timedelta(days=8)
    agent.heartbeat(agent.batch(samples=[agent.sample(u, old) for u in agent.uuids]))
    agent.heartbeat(agent.batch(samples=[agent.sample(u, now) for u in agent.uuids]))
    HeartbeatBatch.objects.filter(seq=1).update(received_at=old)
    result = telemetry_purge(now=now)
    assert result["samples"] == 2 and result["heartbeats"] == 1
    assert GpuSample.objects.count() == 2 and GpuMinuteRollup.objects.count() == 4  # rollups kept longer
    assert telemetry_purge(now=now)["samples"] == 0
    gpu_ids = [g.id for n in fleet_inventory() for g in n.gpus]
    assert (
        gpu_rollups_between(
            gpu_ids=gpu_ids, start=now - timedelta(minutes=5), end=now + timedelta(minutes=1)
        ).count()
        == 2
    )


def test_purge_deletes_the_samples_of_gpus_that_are_gone(agent):
    """Raw samples have no database constraint on their GPU: the samples a GPU deleted during an
    ingest leaves behind (made here directly) go at the next purge, whatever their age; the
    samples of the GPUs that are there, within retention, stay."""
    now = timezone.now()
    assert (
        agent.heartbeat(agent.batch(samples=[agent.sample(u, now) for u in agent.uuids])).status_code == 200
    )
    gone = Gpu.objects.order_by("-id").values_list("id", flat=True)[0] + 1000
    GpuSample.objects.create(gpu_id=gone, ts=now)
    GpuSample.objects.create(gpu_id=gone + 7, ts=now - timedelta(minutes=1))
    result = telemetry_purge(now=now)
    assert result["orphan_samples"] == 2 and result["samples"] == 0
    assert not GpuSample.objects.filter(gpu_id__in=[gone, gone + 7]).exists()
    assert GpuSample.objects.count() == len(agent.uuids)
    assert telemetry_purge(now=now)["orphan_samples"] == 0
