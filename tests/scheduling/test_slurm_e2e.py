"""A Slurm region end to end on a real single-host Slurm (tests/slurm_cluster.py): jobs submitted
through gpupool's API become Slurm jobs (checked in ``scontrol show job``), their states and pending
reasons come back, stop is scancel, and sacct's accounting becomes usage records and invoice lines.
"""

from __future__ import annotations

import getpass
import json
import time
from decimal import Decimal

import pytest
from django.utils import timezone

from metering.models import Budget, BudgetLimitAction, RateCard, UsageRecord
from metering.periods import period_of
from metering.selectors.shared import month_cost_to_date
from metering.services.invoices import invoice_build
from metering.services.rates import rate_card_version_create
from metering.services.usage import usage_build
from nodes.models import Gpu, GpuModel, Node, NodeCommand, NodeState, Region, RegionBackend
from scheduling.models import Allocation, Plan, Quota, QuotaModelLimit, SlurmJob, Workload, WorkloadLogLine
from scheduling.models import WorkloadState as S
from scheduling.selectors.shared import quota_usage
from scheduling.services.slurm import slurm_region_sync
from tests.scheduling.conftest import A100, H100
from tests.slurm_cluster import NODE, NODE2, OUTPUT_DIR, SLURM_CONF, slurm

pytestmark = pytest.mark.django_db


# sacct's records of this run only: slurmdbd keeps older ones, and a test cluster made again (its
# state removed) gives the same job ids again.
RECENT = ("-S", "now-10minutes")


def slurm_clear() -> None:
    """Cancel every job left on the test cluster (a failed test's, or a crashed run's), and wait
    until Slurm has ended them: each test starts on idle nodes."""
    slurm("scancel", "--user", getpass.getuser())
    deadline = time.monotonic() + 20
    while slurm("squeue", "-h", "-t", "PD,R,CG,CF", "-o", "%i").strip() and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture
def region(slurm_cluster, db):
    slurm_clear()
    yield Region.objects.create(
        code="hpc-1",
        name="HPC cluster",
        backend=RegionBackend.SLURM,
        slurm={
            "connector": "cli",
            "slurm_conf": str(SLURM_CONF),
            "partitions": {"default": "gpu", "spot": "batch"},
            "gres_types": {H100: "h100", A100: "a100"},
            "output_dir": str(OUTPUT_DIR),
            "account_prefix": "gpt-",
        },
    )
    slurm_clear()


@pytest.fixture
def client(tenant, make_token, api):
    return api(make_token(tenant))


def job(**spec):
    return {"image": "ghcr.io/acme/train:1", "region": "hpc-1", "gpu_models": ["H100"], **spec}


def submit(client, **spec):
    r = client.post("/api/v1/jobs/", job(**spec), content_type="application/json")
    assert r.status_code == 201, r.content
    return r.json()["id"]


def sync_until(region, cycle, check, timeout=30.0):
    """Run the cycle and the region's sync until ``check()`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        cycle()
        result = slurm_region_sync(region=region)
        assert not result.error, result.error
        if check():
            return
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def scontrol_job(job_id: int) -> dict[str, str]:
    out = slurm("scontrol", "show", "job", "-o", str(job_id))
    return dict(part.split("=", 1) for part in out.split() if "=" in part)


def test_inventory_the_fleet_and_a_job_from_submission_to_invoice(region, client, tenant, cycle):
    # Inventory: the node and its GRES GPUs, by catalog model, in Slurm's own state.
    assert slurm_region_sync(region=region).error == ""
    node = Node.objects.get(region=region, labels__slurm_node=NODE)
    assert node.state == NodeState.SLURM and node.state_reason.startswith("Slurm: ")
    assert sorted(node.labels["partitions"]) == ["batch", "gpu", "multi"] and node.cpu_cores == 8
    second = Node.objects.get(region=region, labels__slurm_node=NODE2)
    assert second.labels["partitions"] == ["multi"] and second.cpu_cores == 4
    gpus = Gpu.objects.filter(node=node, removed_at__isnull=True)
    assert sorted((g.model.name, g.reported_name) for g in gpus) == sorted(
        [(A100, "gres gpu:a100")] * 2 + [(H100, "gres gpu:h100")] * 2
    )
    r = client.get("/api/v1/gpu-types/")
    assert r.status_code == 200

    h100 = GpuModel.objects.get(name=H100)
    card = RateCard.objects.create(name="Standard", currency="USD", is_default=True)
    rate_card_version_create(
        rate_card=card,
        effective_from=timezone.now() - timezone.timedelta(days=1),
        gpu_prices={(h100.pk, Plan.ON_DEMAND): "3.60"},
        allow_past=True,
    )

    wid = submit(
        client,
        gpu_count=1,
        cpu_millicores=1500,
        ram_mib=256,
        max_runtime_s=120,
        env={"GREETING": "hello 'there'"},
        command=["sh", "-c", 'echo "$GREETING from $GPUPOOL_WORKLOAD_ID"; sleep 1'],
    )
    sync_until(region, cycle, lambda: SlurmJob.objects.filter(workload_id=wid).exists())
    sj = SlurmJob.objects.get(workload_id=wid)
    seen = scontrol_job(sj.job_id)  # Slurm's own view
    assert (
        seen["JobName"] == f"gpupool-{wid}" and seen["Account"] == "gpt-acme" and seen["Partition"] == "gpu"
    )
    assert "gres/gpu:h100=1" in seen["TRES"] and seen["TimeLimit"] == "00:02:00"
    assert seen["NumCPUs"] == "2" and "mem=256M" in seen["TRES"]

    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "succeeded")
    body = client.get(f"/api/v1/jobs/{wid}/").json()
    assert body["exit_code"] == 0
    lines = list(WorkloadLogLine.objects.filter(workload_id=wid).values_list("text", flat=True))
    assert lines == [f"hello 'there' from {wid}"]
    events = [e["to_state"] for e in client.get(f"/api/v1/jobs/{wid}/events/").json()]
    assert events[-3:] == ["scheduled", "running", "succeeded"]

    # Accounting: sacct's interval, billed at the minimum of 60 s, on the invoice.
    usage_build(tenant=tenant)
    (rec,) = UsageRecord.objects.filter(workload_id=wid)
    assert rec.region_id == region.pk and rec.gpu_model_id == h100.pk and rec.plan == Plan.ON_DEMAND
    assert rec.seconds + rec.minimum_topup_s == 60
    assert rec.amount == Decimal("0.06")
    invoice = invoice_build(tenant=tenant, period_start=period_of(timezone.now()))
    assert [(line.gpu_model_id, line.amount) for line in invoice.lines.all()] == [(h100.pk, Decimal("0.06"))]


def test_hostile_env_and_arguments_reach_the_job_as_text(region, client, cycle, tmp_path):
    marker = tmp_path / "pwned"
    hostile = f"$(touch {marker}); `touch {marker}` ' \" \\n"
    wid = submit(
        client,
        env={"X": hostile},
        command=["sh", "-c", 'printf "%s|%s\\n" "$X" "$1"', "sh", f"; touch {marker}"],
    )
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "succeeded")
    lines = list(WorkloadLogLine.objects.filter(workload_id=wid).values_list("text", flat=True))
    assert lines == [f"{hostile}|; touch {marker}"]
    assert not marker.exists()


def test_a_job_sbatch_made_before_a_crash_is_adopted_not_submitted_again(region, client, cycle):
    wid = submit(client, command=["true"])
    cycle()
    # The sync that ran sbatch died before its row was saved: Slurm has the job, gpupool does not.
    made = int(
        slurm(
            "sbatch",
            "--parsable",
            f"--job-name=gpupool-{wid}",
            "--account=gpt-acme",
            "--output=/dev/null",
            "--wrap=true",
        ).strip()
    )
    result = slurm_region_sync(region=region)
    assert result.submitted == [wid] and not result.error
    assert SlurmJob.objects.get(workload_id=wid).job_id == made
    names = slurm("squeue", "-h", "-o", "%j", "--name", f"gpupool-{wid}").split()
    assert len(names) <= 1  # the one job (it may have ended already)
    # The beat task runs the same sync for every Slurm region.
    from scheduling.tasks import slurm_sync

    assert [r["region"] for r in slurm_sync()] == ["hpc-1"]


def test_pending_reasons_stop_and_refusals(region, client, cycle):
    hog = submit(client, gpu_count=2, command=["sleep", "60"])
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{hog}/").json()["state"] == "running")
    waiting = submit(client, gpu_count=1, command=["true"])

    def capacity():
        body = client.get(f"/api/v1/jobs/{waiting}/").json()
        return body["state"] == "queued" and body["pending"]["reason"] == "capacity"

    sync_until(region, cycle, capacity)
    body = client.get(f"/api/v1/jobs/{waiting}/").json()
    assert "Resources" in body["pending"]["message"]
    assert scontrol_job(SlurmJob.objects.get(workload_id=waiting).job_id)["JobState"] == "PENDING"

    # Stop is scancel; the freed GPUs go to the waiting job.
    assert client.post(f"/api/v1/jobs/{hog}/stop/").status_code in (200, 202)
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{hog}/").json()["state"] == "stopped")
    assert scontrol_job(SlurmJob.objects.get(workload_id=hog).job_id)["JobState"] == "CANCELLED"
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{waiting}/").json()["state"] == "succeeded")
    # Both billed for what sacct says, though Slurm gave the hog's GPUs to the waiting job before
    # sacct had the hog's end (its open rows are released to it, then end at sacct's end).
    hog_end = json.loads(
        slurm("sacct", "--json", *RECENT, "-j", str(SlurmJob.objects.get(workload_id=hog).job_id))
    )
    rows = Allocation.objects.filter(workload_id=hog)
    # (at sacct's end; Slurm counts whole seconds, so at the stop where that came later within it)
    end = max(r["time"]["end"] for r in hog_end["jobs"])
    assert rows.count() == 2 and all(0 <= a.ended_at.timestamp() - end < 1 for a in rows)
    assert {a.end_reason for a in rows} == {"slurm_cancelled"}
    assert Allocation.objects.filter(workload_id=waiting, end_reason="slurm_completed").count() == 1

    # What Slurm cannot hold is refused by Slurm, and the job fails with its words.
    big = submit(client, gpu_count=3, command=["true"])
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{big}/").json()["state"] == "failed")
    assert "Slurm refused the job" in client.get(f"/api/v1/jobs/{big}/").json()["state_reason"]

    # What gpupool cannot tell Slurm is refused at the API, naming the field.
    for spec, field in (
        ({"gpu_fraction_milli": 500}, "gpu_fraction_milli"),
        ({"gang": True, "gpu_count": 3}, "gang"),  # no node shape divides 3 (h100:2 per node)
        ({"gpus_per_node": [4], "gpu_count": 8}, "gpus_per_node"),  # no node has 4
        ({"env": {"K": {"secret": "nope"}}}, "env"),
    ):
        r = client.post("/api/v1/jobs/", job(command=["true"], **spec), content_type="application/json")
        assert r.status_code == 400 and field in r.json()["error"]["fields"], r.content
    r = client.post("/api/v1/instances/", job(), content_type="application/json")
    assert r.status_code == 400 and "region" in r.json()["error"]["fields"]


def test_a_dependency_and_an_array(region, client, cycle):
    first = submit(client, command=["sleep", "3"])
    after = submit(client, command=["true"], depends_on=[{"job": first, "condition": "succeeded"}])
    doomed = submit(client, command=["false"])
    never = submit(client, command=["true"], depends_on=[{"job": doomed, "condition": "succeeded"}])
    # Once its dependency is Slurm's, the wait is Slurm's: afterok on the first job's Slurm id.
    sync_until(region, cycle, lambda: SlurmJob.objects.filter(workload_id=after).exists())
    seen = scontrol_job(SlurmJob.objects.get(workload_id=after).job_id)
    first_id = SlurmJob.objects.get(workload_id=first).job_id
    assert seen["Dependency"].startswith(f"afterok:{first_id}") and seen["JobState"] == "PENDING"

    def waits_in_slurm():
        body = client.get(f"/api/v1/jobs/{after}/").json()
        return body["state"] == "queued" and body["pending"]["reason"] == "dependency"

    sync_until(region, cycle, waits_in_slurm)
    assert "Dependency" in client.get(f"/api/v1/jobs/{after}/").json()["pending"]["message"]
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{after}/").json()["state"] == "succeeded")
    # A dependency that fails: Slurm drops the dependent (--kill-on-invalid-dep), and it fails.
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{never}/").json()["state"] == "failed")
    assert client.get(f"/api/v1/jobs/{doomed}/").json()["exit_code"] == 1
    events = [e["to_state"] for e in client.get(f"/api/v1/jobs/{never}/events/").json()]
    assert events[-1] == "failed" and "running" not in events  # it never ran: nothing billed

    arr = client.post(
        "/api/v1/jobs/",
        job(
            command=["sh", "-c", "echo task $GPUPOOL_ARRAY_INDEX of $GPUPOOL_ARRAY_COUNT"], array={"count": 2}
        ),
        content_type="application/json",
    )
    assert arr.status_code == 201, arr.content
    aid = arr.json()["id"]
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{aid}/").json()["state"] == "succeeded")
    tasks = SlurmJob.objects.filter(workload__array_parent_id=aid).order_by("workload__array_index")
    texts = [
        list(WorkloadLogLine.objects.filter(workload_id=t.workload_id).values_list("text", flat=True))
        for t in tasks
    ]
    assert texts == [["task 0 of 2"], ["task 1 of 2"]]
    assert client.get(f"/api/v1/jobs/{aid}/").json()["state"] == S.SUCCEEDED


def price_h100(per_hour: str) -> GpuModel:
    h100 = GpuModel.objects.get(name=H100)
    card = RateCard.objects.create(name="Standard", currency="USD", is_default=True)
    rate_card_version_create(
        rate_card=card,
        effective_from=timezone.now() - timezone.timedelta(days=1),
        gpu_prices={(h100.pk, Plan.ON_DEMAND): per_hour},
        allow_past=True,
    )
    return h100


def scontrol_jobs(job_id: int) -> list[dict[str, str]]:
    """``scontrol show job`` of a job, one dict per record (an array job: a record per task)."""
    out = slurm("scontrol", "show", "job", "-o", str(job_id))
    return [dict(p.split("=", 1) for p in line.split() if "=" in p) for line in out.splitlines() if line]


def test_an_array_is_one_slurm_array_job_with_a_task_row_per_slurm_task(region, client, tenant, cycle):
    price_h100("3.60")
    r = client.post(
        "/api/v1/jobs/",
        job(
            command=[
                "sh",
                "-c",
                'echo "task $GPUPOOL_ARRAY_INDEX of $GPUPOOL_ARRAY_COUNT (slurm $SLURM_ARRAY_TASK_ID)'
                ' id $GPUPOOL_WORKLOAD_ID"; sleep 1',
            ],
            array={"count": 3, "parallelism": 2},
        ),
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    aid = r.json()["id"]
    sync_until(region, cycle, lambda: SlurmJob.objects.filter(workload_id=aid).exists())
    array_id = SlurmJob.objects.get(workload_id=aid).job_id
    # Slurm's own view: one array job of three tasks, at most two at a time.
    records = scontrol_jobs(array_id)
    assert {rec["ArrayJobId"] for rec in records} == {str(array_id)}
    assert all(rec["JobName"] == f"gpupool-{aid}" for rec in records)
    assert {rec.get("ArrayTaskThrottle") for rec in records} == {"2"}
    tasks_seen = ",".join(rec["ArrayTaskId"] for rec in records)
    assert tasks_seen in ("0-2%2", "0,1-2%2") or {"0", "1"} <= set(tasks_seen.replace("%2", "").split(","))
    names = slurm("squeue", "-h", "-o", "%F", "--name", f"gpupool-{aid}").split()
    assert set(names) <= {str(array_id)}  # no other Slurm job for it
    # Its batch script (Slurm's copy) names each task's own workload id, reserved before sbatch:
    # the tasks made so far have theirs, the others are made later with the rest.
    reserved = Workload.objects.get(pk=aid).array_task_ids
    assert len(set(reserved)) == 3 and aid not in reserved
    made = dict(Workload.objects.filter(array_parent_id=aid).values_list("array_index", "pk"))
    assert made and all(reserved[i] == pk for i, pk in made.items())
    script = slurm("scontrol", "write", "batch_script", str(array_id), "-")
    assert f"GPUPOOL_TASK_IDS=({' '.join(map(str, reserved))})" in script

    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{aid}/").json()["state"] == "succeeded")
    listed = client.get(f"/api/v1/jobs/{aid}/tasks/").json()["results"]
    assert sorted((t["array_index"], t["state"]) for t in listed) == [(i, "succeeded") for i in range(3)]
    rows = SlurmJob.objects.filter(workload__array_parent_id=aid).order_by("array_task_id")
    assert [(sj.job_id, sj.array_task_id) for sj in rows] == [(array_id, i) for i in range(3)]
    for sj in rows:
        lines = list(
            WorkloadLogLine.objects.filter(workload_id=sj.workload_id).values_list("text", flat=True)
        )
        i = sj.array_task_id
        # Each task is told its own workload id, as the agent tells a task (not the array's).
        assert lines == [f"task {i} of 3 (slurm {i}) id {sj.workload_id}"] and sj.workload_id == reserved[i]
        assert sj.output_path.endswith(f"gpupool-{aid}-{array_id}_{i}.out")
        # Each task's usage from sacct's record of that task: one GPU, ended, from its RUNNING.
        (alloc,) = Allocation.objects.filter(workload_id=sj.workload_id)
        task = sj.workload
        assert alloc.ended_at is not None and alloc.started_at == task.started_at
        assert alloc.gpu_model.name == H100 and alloc.end_reason == "slurm_completed"
    sacct = slurm("sacct", "-n", "-P", "-X", *RECENT, "-o", "JobID,State", "-j", str(array_id)).split()
    assert sorted(sacct) == [f"{array_id}_{i}|COMPLETED" for i in range(3)]
    # Each task is billed from Slurm's start of it, also one whose row the cycle made after Slurm
    # had started it (task 2 starts as soon as 0 or 1 ends; its row comes a sync and a cycle later).
    records = json.loads(slurm("sacct", "--json", *RECENT, "-j", str(array_id)))["jobs"]
    starts = {r["array"]["task_id"]: r["time"]["start"] for r in records if r["array"]["task_id"] is not None}
    for sj in rows:
        started = Workload.objects.get(pk=sj.workload_id).started_at
        assert started.timestamp() == starts[sj.array_task_id]
    usage_build(tenant=tenant)
    assert UsageRecord.objects.filter(workload__array_parent_id=aid).count() == 3
    assert all(rec.seconds + rec.minimum_topup_s == 60 for rec in UsageRecord.objects.filter(tenant=tenant))


def test_stopping_an_array_is_one_scancel_of_the_slurm_array(region, client, cycle):
    r = client.post(
        "/api/v1/jobs/",
        job(command=["sleep", "60"], array={"count": 4, "parallelism": 1}),
        content_type="application/json",
    )
    aid = r.json()["id"]

    def running(index):
        def check():
            listed = client.get(f"/api/v1/jobs/{aid}/tasks/").json()["results"]
            return any(t["state"] == "running" and t["array_index"] == index for t in listed)

        return check

    sync_until(region, cycle, running(0))
    array_id = SlurmJob.objects.get(workload_id=aid).job_id
    pending = [rec for rec in scontrol_jobs(array_id) if rec["JobState"] == "PENDING"]
    assert pending and pending[0]["Reason"] == "JobArrayTaskLimit"  # Slurm holds the rest back
    # One task stopped alone: scancel <id>_0; Slurm then runs the next.
    first = SlurmJob.objects.get(workload__array_parent_id=aid, array_task_id=0).workload_id
    assert client.post(f"/api/v1/jobs/{first}/stop/").status_code in (200, 202)
    result = slurm_region_sync(region=region)
    assert result.cancelled == [first] and not result.error
    sync_until(region, cycle, running(1))
    assert slurm("sacct", "-n", "-P", "-X", *RECENT, "-o", "State", "-j", f"{array_id}_0").startswith(
        "CANCELLED"
    )

    # The array stopped: one scancel, of the array job.
    assert client.post(f"/api/v1/jobs/{aid}/stop/").status_code in (200, 202)
    cycle()
    result = slurm_region_sync(region=region)
    assert result.cancelled == [aid] and not result.error
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{aid}/").json()["state"] == "stopped")
    sync_until(
        region,
        cycle,
        lambda: (
            not SlurmJob.objects.filter(workload__array_parent_id=aid, accounted_at__isnull=True).exists()
        ),
    )
    listed = client.get(f"/api/v1/jobs/{aid}/tasks/").json()["results"]
    assert sorted((t["array_index"], t["state"]) for t in listed) == [(0, "stopped"), (1, "stopped")]
    states = set(slurm("sacct", "-n", "-P", "-X", *RECENT, "-o", "State", "-j", str(array_id)).splitlines())
    assert states and all(s.startswith("CANCELLED") for s in states)
    assert not slurm("squeue", "-h", "-j", str(array_id)).strip() or all(
        rec["JobState"] in ("CANCELLED", "COMPLETING") for rec in scontrol_jobs(array_id)
    )
    # The tasks that ran are billed to their cancel; those Slurm never ran hold nothing.
    allocs = Allocation.objects.filter(workload__array_parent_id=aid)
    assert sorted(allocs.values_list("workload__array_index", "end_reason")) == [
        (0, "slurm_cancelled"),
        (1, "slurm_cancelled"),
    ]
    assert not allocs.filter(ended_at__isnull=True).exists()


def test_a_gang_is_one_multi_node_slurm_job_with_the_rendezvous_of_every_gang(region, client, tenant, cycle):
    region.slurm = {**region.slurm, "partitions": {"default": "multi"}}
    region.save(update_fields=["slurm"])
    assert slurm_region_sync(region=region).nodes == 2  # the shapes come from the inventory
    show = (
        'echo "$NODE_RANK $WORLD_SIZE $NNODES $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT '
        '$GPUPOOL_PEERS $SLURMD_NODENAME $X"; sleep 2'
    )
    wid = submit(client, gang=True, gpu_count=4, env={"X": "a b"}, command=["sh", "-c", show])
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "running")
    sj = SlurmJob.objects.get(workload_id=wid)
    seen = scontrol_job(sj.job_id)  # Slurm's own view: two nodes, two H100 on each
    assert seen["NumNodes"] == "2" and seen["NodeList"] in (f"{NODE},{NODE2}", f"{NODE},{NODE}-2")
    assert "gres/gpu:h100=4" in seen["TRES"] and seen["Partition"] == "multi"
    # While it runs it holds its four GPUs, two per node, as a gang on agent nodes does.
    held = Allocation.objects.filter(workload_id=wid, ended_at__isnull=True)
    assert sorted(held.values_list("node__labels__slurm_node", flat=True)) == [NODE, NODE, NODE2, NODE2]

    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "succeeded")
    port = Workload.objects.get(pk=wid).gang_port
    lines = sorted(WorkloadLogLine.objects.filter(workload_id=wid).values_list("text", flat=True))
    assert lines == [
        f"0 4 2 2 {NODE} {port} {NODE},{NODE2} {NODE} a b",
        f"1 4 2 2 {NODE} {port} {NODE},{NODE2} {NODE2} a b",
    ]
    assert Allocation.objects.filter(workload_id=wid, ended_at__isnull=False).count() == 4
    assert not Allocation.objects.filter(workload_id=wid, ended_at__isnull=True).exists()

    # gpus_per_node: split over nodes as asked, not whole nodes.
    split = submit(client, gpu_count=2, gpus_per_node=[1], command=["sh", "-c", 'echo "$NODE_RANK/$NNODES"'])
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{split}/").json()["state"] == "succeeded")
    seen = scontrol_job(SlurmJob.objects.get(workload_id=split).job_id)
    assert seen["NumNodes"] == "2" and "gres/gpu:h100=2" in seen["TRES"]
    assert sorted(WorkloadLogLine.objects.filter(workload_id=split).values_list("text", flat=True)) == [
        "0/2",
        "1/2",
    ]


def test_running_slurm_jobs_count_toward_model_quota_and_budget(region, client, tenant, cycle):
    h100 = price_h100("360.00")  # 0.10 per GPU-second
    quota = Quota.objects.create(tenant=tenant)
    QuotaModelLimit.objects.create(quota=quota, gpu_model=h100, max_gpus=2)
    # Dispatch too: a job that accepts A100 or H100 goes to Slurm as the model with room, as the
    # cycle places it in agent regions (A100, its first, is at a quota of 0).
    a100_limit = QuotaModelLimit.objects.create(
        quota=quota, gpu_model=GpuModel.objects.get(name=A100), max_gpus=0
    )
    either = submit(client, gpu_models=[A100, H100], command=["true"])
    sync_until(region, cycle, lambda: SlurmJob.objects.filter(workload_id=either).exists())
    assert "gres/gpu:h100=1" in scontrol_job(SlurmJob.objects.get(workload_id=either).job_id)["TRES"]
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{either}/").json()["state"] == "succeeded")
    a100_limit.delete()

    hog = submit(client, gpu_count=2, command=["sleep", "20"], max_runtime_s=120)
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{hog}/").json()["state"] == "running")
    assert quota_usage(tenant=tenant).model_milli == {h100.pk: 2000}  # its open allocations

    # At the per-model quota: no more H100 into the Slurm region; another model still fits.
    r = client.post("/api/v1/jobs/", job(command=["true"]), content_type="application/json")
    assert r.status_code == 403 and r.json()["error"]["fields"]["quota"] == f"max_gpus[{H100}]", r.content
    other = client.post(
        "/api/v1/jobs/", job(command=["true"], gpu_models=[A100]), content_type="application/json"
    )
    assert other.status_code == 201, other.content

    # Budget: what the running job accrued counts, as for agent-run work. A job estimated at 6.00
    # (60 s of one H100) fits a 6.05 budget alone, not with the running job's seconds.
    time.sleep(1)
    spent = month_cost_to_date(tenant=tenant)
    assert spent > Decimal("0.1")
    QuotaModelLimit.objects.filter(quota=quota).delete()
    Budget.objects.create(tenant=tenant, monthly_limit=Decimal("6.05"), limit_action=BudgetLimitAction.REFUSE)
    sync_until(
        region,
        cycle,
        lambda: client.get(f"/api/v1/jobs/{other.json()['id']}/").json()["state"] == "succeeded",
    )
    r = client.post("/api/v1/jobs/", job(command=["true"], max_runtime_s=60), content_type="application/json")
    assert r.status_code == 403 and "spent this month" in r.json()["error"]["message"], r.content

    assert client.post(f"/api/v1/jobs/{hog}/stop/").status_code in (200, 202)
    assert not NodeCommand.objects.filter(node__region=region).exists()  # Slurm's: scancel, not agents
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{hog}/").json()["state"] == "stopped")
    assert quota_usage(tenant=tenant).model_milli.get(h100.pk, 0) == 0
    ended = Allocation.objects.filter(workload_id=hog)
    assert ended.count() == 2 and not ended.filter(ended_at__isnull=True).exists()


def test_max_retries_resubmits_a_failed_job_as_a_new_slurm_job(region, client, tenant, cycle, tmp_path):
    h100 = price_h100("3.60")
    marker = tmp_path / "ran-once"
    flaky = submit(
        client,
        max_retries=2,
        command=[
            "sh",
            "-c",
            # (a second each: Slurm counts whole seconds, and a run of none bills none)
            f"sleep 1; if [ -e {marker} ]; then echo again $GPUPOOL_WORKLOAD_ID;"
            f" else touch {marker}; echo first; exit 3; fi",
        ],
    )
    doomed = submit(client, max_retries=1, command=["sh", "-c", "exit 4"])
    sync_until(
        region,
        cycle,
        lambda: (
            {client.get(f"/api/v1/jobs/{w}/").json()["state"] for w in (flaky, doomed)}
            == {"succeeded", "failed"}
        ),
        timeout=60,
    )
    body = client.get(f"/api/v1/jobs/{flaky}/").json()
    assert (body["state"], body["retries"], body["attempt"], body["exit_code"]) == ("succeeded", 1, 2, 0)
    sj = SlurmJob.objects.get(workload_id=flaky)
    (earlier,) = sj.earlier_job_ids
    # Slurm's own view: two jobs of that name, the first failed with its exit code, the second not.
    # (slurmdbd may name a record "allocation" for a moment after its end: asked again until then.)
    deadline = time.monotonic() + 15
    while True:
        sacct = slurm(
            "sacct", "-n", "-P", "-X", *RECENT, "-o", "JobIDRaw,State,ExitCode", "--name", f"gpupool-{flaky}"
        )
        if len(sacct.split()) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(sacct.split()) == sorted([f"{earlier}|FAILED|3:0", f"{sj.job_id}|COMPLETED|0:0"])
    assert scontrol_job(sj.job_id)["Requeue"] == "0"  # Slurm leaves the retrying to gpupool
    events = client.get(f"/api/v1/jobs/{flaky}/events/").json()
    assert [e["to_state"] for e in events][-6:] == [
        "scheduled",
        "running",
        "queued",
        "scheduled",
        "running",
        "succeeded",
    ]
    assert "Retry 1 of 2" in events[-4]["message"]
    lines = list(WorkloadLogLine.objects.filter(workload_id=flaky).values_list("text", flat=True))
    assert lines == ["first", f"again {flaky}"]
    # Each attempt is billed for its own run, from sacct: two ended allocations, one per Slurm job.
    records = {
        r["job_id"]: r["time"]
        for r in json.loads(slurm("sacct", "--json", *RECENT, "-j", f"{earlier},{sj.job_id}"))["jobs"]
    }
    allocs = list(Allocation.objects.filter(workload_id=flaky).order_by("started_at"))
    assert [a.end_reason for a in allocs] == ["slurm_failed", "slurm_completed"]
    for a, jid in zip(allocs, (earlier, sj.job_id), strict=True):
        assert 0 <= a.ended_at.timestamp() - records[jid]["end"] < 1
    assert allocs[0].ended_at <= allocs[1].started_at
    usage_build(tenant=tenant)
    assert UsageRecord.objects.filter(workload_id=flaky, gpu_model=h100).count() == 2

    # Out of retries: failed, after 1 + max_retries Slurm jobs.
    body = client.get(f"/api/v1/jobs/{doomed}/").json()
    assert (body["retries"], body["attempt"], body["exit_code"]) == (1, 2, 4)
    assert "No retries left (1)" in body["state_reason"]
    assert len(SlurmJob.objects.get(workload_id=doomed).earlier_job_ids) == 1

    # An array's tasks are not retried one by one in Slurm: refused, naming the field.
    r = client.post(
        "/api/v1/jobs/",
        job(command=["true"], array={"count": 2}, max_retries=1),
        content_type="application/json",
    )
    assert r.status_code == 400 and "max_retries" in r.json()["error"]["fields"], r.content


def test_a_node_failure_queues_the_job_again_without_using_a_retry(region, client, cycle):
    region.slurm = {**region.slurm, "partitions": {"default": "multi"}}
    region.save(update_fields=["slurm"])
    assert slurm_region_sync(region=region).nodes == 2
    wid = submit(client, gpu_count=2, gpus_per_node=[1], command=["sh", "-c", "sleep 4; echo done"])
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "running")
    first = SlurmJob.objects.get(workload_id=wid).job_id
    try:
        slurm("scontrol", "update", f"nodename={NODE2}", "state=down", "reason=gpupool-test")
        sync_until(
            region,
            cycle,
            lambda: SlurmJob.objects.get(workload_id=wid).earlier_job_ids == [first],
            timeout=60,
        )
    finally:
        # (ReturnToService=2 may have brought it back already as slurmd registers again.)
        if "down" in slurm("sinfo", "-h", "-N", "-n", NODE2, "-o", "%T"):
            slurm("scontrol", "update", f"nodename={NODE2}", "state=resume")
    states = slurm("sacct", "-n", "-P", "-X", *RECENT, "-o", "State", "-j", str(first)).split()
    assert states == ["NODE_FAIL"]
    sync_until(
        region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "succeeded", timeout=60
    )
    body = client.get(f"/api/v1/jobs/{wid}/").json()
    assert (body["retries"], body["attempt"]) == (0, 2)  # max_retries 0: a node failure is not one
    events = client.get(f"/api/v1/jobs/{wid}/events/").json()
    (requeue,) = [e for e in events if e["reason"] == "node_down"]
    assert requeue["to_state"] == "queued" and f"Slurm job {first}: NODE_FAIL" in requeue["message"]
    # Its log: the second attempt's run on both nodes (the first was killed before its echo).
    lines = list(WorkloadLogLine.objects.filter(workload_id=wid).values_list("text", flat=True))
    assert lines.count("done") == 2


def test_a_job_naming_no_region_goes_to_a_slurm_region_with_free_gpus(region, client, cycle, make_node):
    # A second Slurm region on the same cluster, over both nodes (partition multi): four H100.
    wide = Region.objects.create(
        code="hpc-2",
        name="HPC wide",
        backend=RegionBackend.SLURM,
        slurm={**region.slurm, "partitions": {"default": "multi"}, "gres_types": {H100: "h100"}},
    )
    agent_node = make_node(model=A100, gpus=1, region="us")
    for r in (region, wide):
        assert slurm_region_sync(region=r).error == ""

    def no_region(**spec):
        return {k: v for k, v in job(**spec).items() if k != "region"}

    def anywhere(**spec):
        r = client.post("/api/v1/jobs/", no_region(**spec), content_type="application/json")
        assert r.status_code == 201, r.content
        return r.json()["id"]

    def sync_all():
        for r in (region, wide):
            assert not slurm_region_sync(region=r).error

    def until(check, timeout=40.0):
        deadline = time.monotonic() + timeout
        while not check():
            cycle()
            sync_all()
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.5)

    # No agent node has H100: the Slurm region with the most free H100 takes it (hpc-2: 4, hpc-1: 2).
    h = anywhere(command=["true"])
    result = cycle()
    assert result.sent_to_slurm == [h]
    w = Workload.objects.get(pk=h)
    assert w.region_id == wide.pk and w.pending_reason == "slurm" and "hpc-2: 4 free" in w.pending_message
    until(lambda: client.get(f"/api/v1/jobs/{h}/").json()["state"] == "succeeded")
    assert scontrol_job(SlurmJob.objects.get(workload_id=h).job_id)["Partition"] == "multi"

    # Agent regions first: one A100 fits the agent node; two do not, and go to hpc-1 (A100 there).
    on_agent = anywhere(gpu_models=[A100], command=["true"])
    pair = anywhere(gpu_models=[A100], gpu_count=2, command=["sleep", "8"])
    result = cycle()
    assert result.placed == [on_agent] and result.sent_to_slurm == [pair]
    assert Allocation.objects.get(workload_id=on_agent).node_id == agent_node.pk
    until(lambda: client.get(f"/api/v1/jobs/{pair}/").json()["state"] == "running")
    seen = scontrol_job(SlurmJob.objects.get(workload_id=pair).job_id)  # Slurm's own view
    assert "gres/gpu:a100=2" in seen["TRES"] and seen["Partition"] == "gpu"

    # Its A100 are taken: the next pair waits in gpupool (no region), and goes once they are free.
    later = anywhere(gpu_models=[A100], gpu_count=2, command=["true"])
    assert cycle().sent_to_slurm == []
    assert Workload.objects.get(pk=later).region_id is None
    until(lambda: client.get(f"/api/v1/jobs/{later}/").json()["state"] == "succeeded", timeout=60)
    assert Workload.objects.get(pk=later).region_id == region.pk
    assert client.get(f"/api/v1/jobs/{pair}/").json()["state"] == "succeeded"

    # An array is sent whole, as one Slurm array, while none of its tasks has run.
    arr = anywhere(
        command=["sh", "-c", 'echo "$GPUPOOL_ARRAY_INDEX $GPUPOOL_WORKLOAD_ID"'],
        array={"count": 3, "parallelism": 2},
    )
    result = cycle()
    assert result.sent_to_slurm == [arr]
    assert set(Workload.objects.filter(array_parent_id=arr).values_list("region_id", flat=True)) == {wide.pk}
    until(lambda: client.get(f"/api/v1/jobs/{arr}/").json()["state"] == "succeeded", timeout=60)
    array_id = SlurmJob.objects.get(workload_id=arr).job_id
    assert {rec["ArrayJobId"] for rec in scontrol_jobs(array_id)} == {str(array_id)}
    for t in Workload.objects.filter(array_parent_id=arr):
        assert t.region_id == wide.pk
        texts = list(WorkloadLogLine.objects.filter(workload_id=t.pk).values_list("text", flat=True))
        assert texts == [f"{t.array_index} {t.pk}"]
    # One with max_retries cannot be (a Slurm array's tasks are not retried alone): with no agent
    # node for it, it is refused.
    r = client.post(
        "/api/v1/jobs/",
        no_region(command=["true"], array={"count": 2}, max_retries=1),
        content_type="application/json",
    )
    assert r.status_code == 400 and "gpu_models" in r.json()["error"]["fields"], r.content

    # What a Slurm region does not run is not sent there: refused where no agent node has the GPUs.
    r = client.post(
        "/api/v1/jobs/",
        no_region(command=["true"], gpu_fraction_milli=500),
        content_type="application/json",
    )
    assert r.status_code == 400 and "gpu_models" in r.json()["error"]["fields"], r.content


def sacct_record(job_id: int) -> dict:
    """sacct's record of a job (JSON): its state, start, end and elapsed seconds."""
    (rec,) = [
        r
        for r in json.loads(slurm("sacct", "--json", *RECENT, "-j", str(job_id)))["jobs"]
        if r["job_id"] == job_id
    ]
    return rec


def sacct_wait(job_id: int, state: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            rec = sacct_record(job_id)
        except ValueError:  # no record yet
            rec = None
        if rec is not None and rec["state"]["current"] == state and rec["time"]["end"]:
            return rec
        assert time.monotonic() < deadline, f"sacct: job {job_id} not {state}"
        time.sleep(0.2)


def billed(wid: int) -> list[tuple[float, float, str, str, str]]:
    """(start, end, Slurm job, model, end reason) of each allocation of a workload."""
    return sorted(
        (a.started_at.timestamp(), a.ended_at.timestamp(), a.slurm_job_label, a.gpu_model.name, a.end_reason)
        for a in Allocation.objects.filter(workload_id=wid).select_related("gpu_model")
    )


def test_a_job_slurm_ran_between_two_syncs_is_billed_from_sacct(region, client, tenant, cycle):
    h100 = price_h100("3.60")
    # Both H100s of the partition are held by another job, so `true` waits in Slurm...
    hog = submit(client, gpu_count=2, command=["sleep", "60"], max_runtime_s=120)
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{hog}/").json()["state"] == "running")
    short = submit(client, gpu_count=2, command=["true"])
    sync_until(region, cycle, lambda: Workload.objects.get(pk=short).pending_reason == "capacity")
    job_id = SlurmJob.objects.get(workload_id=short).job_id
    # ...until the other job ends (cancelled in Slurm); Slurm then runs it, in well under a second,
    # and ends it before gpupool's next sync: gpupool never sees it run.
    slurm("scancel", str(SlurmJob.objects.get(workload_id=hog).job_id))
    rec = sacct_wait(job_id, "COMPLETED")
    start, end, elapsed = rec["time"]["start"], rec["time"]["end"], rec["time"]["elapsed"]
    assert end - start == elapsed < 10 and not Allocation.objects.filter(workload_id=short).exists()
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{short}/").json()["state"] == "succeeded")
    sync_until(region, cycle, lambda: True)  # a sync more adds nothing

    # Its two GPUs from sacct's start to its end, to the second (0 s if it fell in one second).
    assert billed(short) == [(start, end, str(job_id), H100, "slurm_completed")] * 2
    usage_build(tenant=tenant)
    usage_build(tenant=tenant)
    records = list(UsageRecord.objects.filter(workload_id=short))
    assert len(records) == 2 and all(
        (r.seconds, r.seconds + r.minimum_topup_s, r.gpu_model_id) == (elapsed, 60, h100.pk) for r in records
    )
    # On the invoice: the line of H100 is the records' sum (the other job's with it).
    invoice = invoice_build(tenant=tenant, period_start=period_of(timezone.now()))
    total = sum(r.amount for r in UsageRecord.objects.filter(tenant=tenant))
    assert [(line.gpu_model_id, line.amount) for line in invoice.lines.all()] == [
        (h100.pk, total.quantize(Decimal("0.01")))
    ]
    assert {r.invoice_id for r in UsageRecord.objects.filter(workload_id=short)} == {invoice.pk}


def test_a_job_seen_running_is_billed_once_from_sacct(region, client, tenant, cycle):
    price_h100("3.60")
    wid = submit(client, gpu_count=2, command=["sleep", "3"])
    sync_until(
        region,
        cycle,
        lambda: Allocation.objects.filter(workload_id=wid, ended_at__isnull=True).count() == 2,
    )
    job_id = SlurmJob.objects.get(workload_id=wid).job_id
    made = set(Allocation.objects.filter(workload_id=wid).values_list("pk", flat=True))
    squeue_start = {a.started_at.timestamp() for a in Allocation.objects.filter(workload_id=wid)}
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "succeeded")
    sync_until(region, cycle, lambda: True)
    rec = sacct_record(job_id)
    start, end, elapsed = rec["time"]["start"], rec["time"]["end"], rec["time"]["elapsed"]
    # The rows squeue's RUNNING made, from Slurm's start, closed at sacct's end: none added.
    assert squeue_start == {start} and elapsed >= 3
    assert set(Allocation.objects.filter(workload_id=wid).values_list("pk", flat=True)) == made
    assert billed(wid) == [(start, end, str(job_id), H100, "slurm_completed")] * 2
    usage_build(tenant=tenant)
    usage_build(tenant=tenant)
    records = list(UsageRecord.objects.filter(workload_id=wid))
    assert len(records) == 2 and {r.seconds for r in records} == {elapsed}


def test_a_job_stopped_in_gpupool_as_slurm_started_it_is_billed_what_slurm_ran(region, client, tenant, cycle):
    price_h100("3.60")
    hog = submit(client, gpu_count=2, command=["sleep", "60"], max_runtime_s=120)
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{hog}/").json()["state"] == "running")
    late = submit(client, gpu_count=1, command=["sleep", "60"])
    sync_until(region, cycle, lambda: Workload.objects.get(pk=late).pending_reason == "capacity")
    job_id = SlurmJob.objects.get(workload_id=late).job_id
    # Stopped while queued in gpupool (stopped at once); meanwhile Slurm starts it.
    assert client.post(f"/api/v1/jobs/{late}/stop/").status_code in (200, 202)
    assert client.get(f"/api/v1/jobs/{late}/").json()["state"] == "stopped"
    slurm("scancel", str(SlurmJob.objects.get(workload_id=hog).job_id))
    deadline = time.monotonic() + 30
    while slurm("squeue", "-h", "-j", str(job_id), "-o", "%T").strip() != "RUNNING":
        assert time.monotonic() < deadline, "Slurm did not start it"
        time.sleep(0.2)
    time.sleep(1.5)
    # The sync scancels it; sacct's record of what it ran is billed.
    sync_until(region, cycle, lambda: SlurmJob.objects.get(workload_id=late).accounted_at is not None)
    rec = sacct_record(job_id)
    assert rec["state"]["current"] == "CANCELLED"
    start, end = rec["time"]["start"], rec["time"]["end"]
    assert end - start >= 1
    assert billed(late) == [(start, end, str(job_id), H100, "slurm_cancelled")]
    usage_build(tenant=tenant)
    (record,) = UsageRecord.objects.filter(workload_id=late)
    assert record.seconds == end - start


def test_a_task_slurm_started_before_its_row_was_made_is_billed_when_the_array_stops(
    region, client, tenant, cycle
):
    price_h100("3.60")
    # Task 0 ends at once; Slurm starts task 1 then, before gpupool's cycle makes its row.
    command = ["sh", "-c", '[ "$SLURM_ARRAY_TASK_ID" = 0 ] || sleep 60']
    r = client.post(
        "/api/v1/jobs/",
        job(command=command, array={"count": 2, "parallelism": 1}),
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    aid = r.json()["id"]
    sync_until(region, cycle, lambda: SlurmJob.objects.filter(workload_id=aid).exists())
    array_id = SlurmJob.objects.get(workload_id=aid).job_id
    deadline = time.monotonic() + 30
    while slurm("squeue", "-h", "-j", f"{array_id}_1", "-o", "%T").strip() != "RUNNING":
        assert time.monotonic() < deadline, "Slurm did not start task 1"
        time.sleep(0.2)
    time.sleep(1.5)
    assert not Workload.objects.filter(array_parent_id=aid, array_index=1).exists()
    # Stopped: no more task rows from the cycle; the sync scancels the Slurm array.
    assert client.post(f"/api/v1/jobs/{aid}/stop/").status_code in (200, 202)
    sync_until(region, cycle, lambda: SlurmJob.objects.get(workload_id=aid).accounted_at is not None)
    sync_until(
        region,
        cycle,
        lambda: not SlurmJob.objects.filter(workload__array_parent_id=aid, accounted_at=None).exists(),
    )
    # Task 1 has its row (its reserved id, as its script was told), stopped, billed from sacct.
    task = Workload.objects.get(array_parent_id=aid, array_index=1)
    assert task.pk == Workload.objects.get(pk=aid).array_task_ids[1] and task.state == S.STOPPED
    records = json.loads(slurm("sacct", "--json", *RECENT, "-j", str(array_id)))["jobs"]
    (rec,) = [r for r in records if r["array"]["task_id"] == 1]
    assert rec["state"]["current"] == "CANCELLED"
    start, end = rec["time"]["start"], rec["time"]["end"]
    assert end - start >= 1
    assert billed(task.pk) == [(start, end, f"{array_id}_1", H100, "slurm_cancelled")]
    usage_build(tenant=tenant)
    (record,) = UsageRecord.objects.filter(workload_id=task.pk)
    assert record.seconds == end - start
    assert client.get(f"/api/v1/jobs/{aid}/").json()["state"] == "stopped"
