"""A Slurm region through slurmrestd (the ``rest`` connector) on the real single-host cluster: the
same jobs as over the commands (tests/scheduling/test_slurm_e2e.py), checked in Slurm's own view:
inventory, submission, states and pending reasons, stop, an array, a retry, accounting and the
tenant's account, all over HTTP with a JWT."""

from __future__ import annotations

import contextlib
import json
import math
import time

import pytest

from metering.models import UsageRecord
from metering.services.usage import usage_build
from nodes.models import Gpu, Node, Region, RegionBackend
from nodes.slurm.rest import expand_hostlist
from scheduling.models import Allocation, SlurmJob, Workload, WorkloadLogLine
from scheduling.services.slurm import slurm_region_sync
from tests.scheduling.conftest import A100, H100
from tests.scheduling.test_slurm_e2e import (
    RECENT,
    price_h100,
    scontrol_job,
    scontrol_jobs,
    slurm_clear,
    submit,
    sync_until,
)
from tests.slurm_cluster import NODE, NODE2, OUTPUT_DIR, slurm

pytestmark = pytest.mark.django_db


@pytest.fixture
def region(slurm_rest, db):
    url, token = slurm_rest
    slurm_clear()
    yield Region.objects.create(
        code="hpc-1",
        name="HPC over REST",
        backend=RegionBackend.SLURM,
        slurm={
            "connector": "rest",
            "rest_url": url,
            "rest_user": "root",
            "jwt_file": str(token),
            "partitions": {"default": "gpu"},
            "gres_types": {H100: "h100", A100: "a100"},
            "output_dir": str(OUTPUT_DIR),
            "account_prefix": "gpr-",
        },
    )
    slurm_clear()


@pytest.fixture
def client(tenant, make_token, api):
    return api(make_token(tenant))


def test_node_lists_expand_as_slurm_writes_them():
    assert expand_hostlist("gpu-[01-03,07],big,n[8-10]x") == [
        "gpu-01",
        "gpu-02",
        "gpu-03",
        "gpu-07",
        "big",
        "n8x",
        "n9x",
        "n10x",
    ]
    assert expand_hostlist(NODE) == [NODE]


def test_a_job_through_slurmrestd_from_submission_to_usage(region, client, tenant, cycle):
    # The account of a tenant new to the cluster is made over /slurmdb/ (sacctmgr shows it).
    with contextlib.suppress(AssertionError):  # (none yet, or an earlier run's)
        slurm("sacctmgr", "-i", "delete", "account", "gpr-acme")
    assert "gpr-acme" not in slurm("sacctmgr", "-n", "-P", "show", "account", "format=account")
    result = slurm_region_sync(region=region)
    assert result.error == "" and result.nodes == 2
    node = Node.objects.get(region=region, labels__slurm_node=NODE)
    assert sorted(Gpu.objects.filter(node=node).values_list("reported_name", flat=True)) == [
        "gres gpu:a100",
        "gres gpu:a100",
        "gres gpu:h100",
        "gres gpu:h100",
    ]
    h100 = price_h100("3.60")

    wid = submit(
        client,
        gpu_count=1,
        cpu_millicores=1500,
        ram_mib=256,
        max_runtime_s=120,
        env={"GREETING": "hello 'rest'"},
        command=["sh", "-c", 'echo "$GREETING from $GPUPOOL_WORKLOAD_ID"; sleep 1'],
    )
    sync_until(region, cycle, lambda: SlurmJob.objects.filter(workload_id=wid).exists())
    sj = SlurmJob.objects.get(workload_id=wid)
    seen = scontrol_job(sj.job_id)  # Slurm's own view of what slurmrestd was asked
    assert (
        seen["JobName"] == f"gpupool-{wid}" and seen["Account"] == "gpr-acme" and seen["Partition"] == "gpu"
    )
    assert "gres/gpu:h100=1" in seen["TRES"] and seen["TimeLimit"] == "00:02:00"
    assert seen["NumCPUs"] == "2" and "mem=256M" in seen["TRES"]
    assert "gpr-acme|root" in slurm("sacctmgr", "-n", "-P", "show", "associations", "format=account,user")

    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "succeeded")
    assert client.get(f"/api/v1/jobs/{wid}/").json()["exit_code"] == 0
    lines = list(WorkloadLogLine.objects.filter(workload_id=wid).values_list("text", flat=True))
    assert lines == [f"hello 'rest' from {wid}"]
    usage_build(tenant=tenant)
    (rec,) = UsageRecord.objects.filter(workload_id=wid)
    assert rec.gpu_model_id == h100.pk and rec.seconds + rec.minimum_topup_s == 60


def test_pending_stop_array_and_retry_through_slurmrestd(region, client, cycle, tmp_path):
    hog = submit(client, gpu_count=2, command=["sleep", "60"])
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{hog}/").json()["state"] == "running")
    waiting = submit(client, gpu_count=1, command=["true"])

    def capacity():
        body = client.get(f"/api/v1/jobs/{waiting}/").json()
        return body["state"] == "queued" and body["pending"]["reason"] == "capacity"

    sync_until(region, cycle, capacity)
    assert client.post(f"/api/v1/jobs/{hog}/stop/").status_code in (200, 202)
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{hog}/").json()["state"] == "stopped")
    assert scontrol_job(SlurmJob.objects.get(workload_id=hog).job_id)["JobState"] == "CANCELLED"
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{waiting}/").json()["state"] == "succeeded")
    rows = Allocation.objects.filter(workload_id=hog)
    assert rows.count() == 2 and {a.end_reason for a in rows} == {"slurm_cancelled"}

    # An array: one Slurm array job; each task its own id; one task stopped alone (DELETE <id>_<i>).
    r = client.post(
        "/api/v1/jobs/",
        {
            "image": "ghcr.io/acme/train:1",
            "region": "hpc-1",
            "gpu_models": ["H100"],
            "command": ["sh", "-c", 'echo "task $GPUPOOL_ARRAY_INDEX id $GPUPOOL_WORKLOAD_ID"; sleep 2'],
            "array": {"count": 3, "parallelism": 1},
        },
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    aid = r.json()["id"]
    sync_until(region, cycle, lambda: SlurmJob.objects.filter(workload_id=aid).exists())
    array_id = SlurmJob.objects.get(workload_id=aid).job_id
    assert {rec["ArrayJobId"] for rec in scontrol_jobs(array_id)} == {str(array_id)}
    reserved = Workload.objects.get(pk=aid).array_task_ids

    def task_running(i):
        return lambda: Workload.objects.filter(array_parent_id=aid, array_index=i, state="running").exists()

    sync_until(region, cycle, task_running(0))
    first = Workload.objects.get(array_parent_id=aid, array_index=0).pk
    assert client.post(f"/api/v1/jobs/{first}/stop/").status_code in (200, 202)
    assert slurm_region_sync(region=region).cancelled == [first]
    sync_until(
        region, cycle, lambda: client.get(f"/api/v1/jobs/{aid}/").json()["state"] in ("failed", "succeeded")
    )
    tasks = {t.array_index: t for t in Workload.objects.filter(array_parent_id=aid)}
    assert [tasks[i].state for i in range(3)] == ["stopped", "succeeded", "succeeded"]
    assert slurm("sacct", "-n", "-P", "-X", *RECENT, "-o", "State", "-j", f"{array_id}_0").startswith(
        "CANCELLED"
    )
    for i in (1, 2):
        lines = list(WorkloadLogLine.objects.filter(workload_id=tasks[i].pk).values_list("text", flat=True))
        assert lines == [f"task {i} id {reserved[i]}"] and tasks[i].pk == reserved[i]

    # A retry: a failed job is submitted again over REST as a new Slurm job.
    marker = tmp_path / "once"
    flaky = submit(
        client,
        max_retries=1,
        command=["sh", "-c", f"sleep 1; if [ -e {marker} ]; then echo ok; else touch {marker}; exit 2; fi"],
    )
    sync_until(
        region, cycle, lambda: client.get(f"/api/v1/jobs/{flaky}/").json()["state"] == "succeeded", timeout=60
    )
    body = client.get(f"/api/v1/jobs/{flaky}/").json()
    assert (body["retries"], body["attempt"]) == (1, 2)
    sj = SlurmJob.objects.get(workload_id=flaky)
    (earlier,) = sj.earlier_job_ids
    states = json.loads(slurm("sacct", "--json", *RECENT, "-j", f"{earlier},{sj.job_id}"))["jobs"]
    assert sorted(j["state"]["current"] for j in states) == ["COMPLETED", "FAILED"]


def test_a_job_slurm_requeues_itself_after_a_node_failure_is_followed(region, client, cycle):
    # Over 22.05's REST API a job cannot be told not to be requeued: Slurm requeues it when its
    # node fails. gpupool follows: its GPUs go back at once, it waits queued (no retry used), and
    # holds GPUs again when Slurm runs it again.
    region.slurm = {**region.slurm, "partitions": {"default": "multi"}}
    region.save(update_fields=["slurm"])
    assert slurm_region_sync(region=region).nodes == 2
    wid = submit(client, gpu_count=2, gpus_per_node=[1], command=["sh", "-c", "sleep 4; echo done"])
    sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "running")
    job_id = SlurmJob.objects.get(workload_id=wid).job_id
    assert scontrol_job(job_id)["Requeue"] == "1"  # (what 22.05 makes of requeue=false)
    try:
        slurm("scontrol", "update", f"nodename={NODE2}", "state=down", "reason=gpupool-test")
        sync_until(region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "queued")
        requeued_at = time.time()
    finally:
        if "down" in slurm("sinfo", "-h", "-N", "-n", NODE2, "-o", "%T"):
            slurm("scontrol", "update", f"nodename={NODE2}", "state=resume")
    first = list(Allocation.objects.filter(workload_id=wid))
    assert len(first) == 2 and {a.end_reason for a in first} == {"slurm_requeued"}
    assert all(a.ended_at is not None for a in first)
    # (Slurm holds a requeued job back for CredExpire, 2 minutes by default: let it go once both
    # nodes are idle again, the first run's steps gone, and its credential's revocation is in an
    # earlier whole second than the new one's issue: slurmd refuses a launch credential made in
    # the second it revoked the job's credentials, and the run would fail.)
    assert scontrol_job(job_id)["JobState"] == "PENDING"
    deadline = time.monotonic() + 30
    while slurm("sinfo", "-h", "-N", "-n", f"{NODE},{NODE2}", "-o", "%T").split() != ["idle"] * 4:
        assert time.monotonic() < deadline, "the nodes did not come back idle"
        time.sleep(0.5)
    time.sleep(max(0.0, math.floor(requeued_at) + 2 - time.time()))
    slurm("scontrol", "update", f"jobid={job_id}", "starttime=now")
    sync_until(
        region, cycle, lambda: client.get(f"/api/v1/jobs/{wid}/").json()["state"] == "succeeded", timeout=60
    )
    body = client.get(f"/api/v1/jobs/{wid}/").json()
    assert (body["retries"], body["attempt"]) == (0, 1)
    sj = SlurmJob.objects.get(workload_id=wid)
    assert (sj.job_id, sj.earlier_job_ids) == (job_id, [])  # the same Slurm job, run again
    reasons = [e["reason"] for e in client.get(f"/api/v1/jobs/{wid}/events/").json()]
    assert reasons.count("node_down") == 1 and reasons[-1] == "exited"
    # Billed per run: the first run's GPUs to the requeue, the second's from its start to sacct's end.
    allocs = list(Allocation.objects.filter(workload_id=wid).order_by("started_at", "pk"))
    assert [a.end_reason for a in allocs] == ["slurm_requeued"] * 2 + ["slurm_completed"] * 2
    assert max(a.ended_at for a in allocs[:2]) <= min(a.started_at for a in allocs[2:])
    states = slurm("sacct", "-n", "-P", "-X", "-D", *RECENT, "-o", "State", "-j", str(job_id)).split()
    assert states[-1] == "COMPLETED" and len(states) >= 2
