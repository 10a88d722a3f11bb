"""Time to running: a warm-pool hit versus a cold start, on the simulated fleet.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/warm_start.py

Everything real but the GPUs: a database of its own (``gpupool_bench_warm``, created, migrated,
dropped at the end), the portal under uvicorn, and the agent program (``gpupool-agent fleet``,
simulated collector and runtime) for two 8-GPU nodes, speaking HTTP to it. The simulated runtime
pulls an image it has not seen for ``--cold-start`` seconds (``GPUPOOL_SIM_COLD_START_S``), as a
node pulls a large image; the ``prewarm`` command pulls it ahead.

A warm pool (H100, one image, the region) is kept at ``--warm`` slots and prewarmed by
``warm_pools_reconcile``; once its slots are ready (the agent reported the prewarm finished, which
sets ``WarmSlot.ready_at``), instances are submitted one at a time, alternately with the pool's image (a warm hit: bound to a warm slot) and with an image no
node has (a cold start). This process plays the scheduler's part: it runs a cycle as soon as a
workload is submitted (as the debounced trigger does) and the reconciler after each warm hit.
Time to running is from submission to the workload's RUNNING event (written when the agent's start
report arrives). REDIS_URL, when set, is passed on (long polls then wake by pub/sub).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pgdb import django_on_own_database, drop_database  # noqa: E402

DB_NAME = "gpupool_bench_warm"
REGION = "us-east-1"
H100 = "NVIDIA H100 SXM 80GB"
WARM_IMAGE = "ghcr.io/acme/notebook:warm"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(what: str, check, timeout: float, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise SystemExit(f"timed out waiting for {what}")


def _time_to_running(tenant, image: str, *, warm: bool) -> float:
    from portal.actors import Actor
    from scheduling.models import WorkloadEvent, WorkloadState
    from scheduling.services.cycle import scheduling_cycle_run
    from scheduling.services.submission import workload_submit

    w = workload_submit(
        tenant=tenant,
        kind="instance",
        spec={"image": image, "gpu_models": [H100], "region": REGION, "other_regions_ok": False},
        actor=Actor.system(),
    )
    _wait(f"{w.pk} placed", lambda: w.pk in scheduling_cycle_run().placed, 30, every=0.01)
    placed = WorkloadEvent.objects.filter(workload_id=w.pk, to_state=WorkloadState.SCHEDULED).get()
    assert (placed.reason == "warm_hit") == warm, (placed.reason, warm)
    running = _wait(
        f"{w.pk} running",
        lambda: WorkloadEvent.objects.filter(workload_id=w.pk, to_state=WorkloadState.RUNNING).first(),
        120,
        every=0.01,
    )
    return (running.at - w.submitted_at).total_seconds()


def run(args: argparse.Namespace, tmp: Path) -> dict:
    from django.conf import settings

    from nodes.models import CommandKind, CommandState, GpuModel, Node, NodeCommand, NodeState, Region
    from nodes.services.registration import bootstrap_token_create
    from portal.actors import Actor
    from portal.models import Tenant
    from scheduling.models import Quota, WarmPool, WarmSlot
    from scheduling.services.warm_pools import warm_pools_reconcile

    region = Region.objects.get_or_create(code=REGION, defaults={"name": "US East"})[0]
    nodes = []
    for i in range(2):
        _, token = bootstrap_token_create(region=region, actor=Actor.system(), intended_hostname=f"warm-{i}")
        nodes.append(
            {
                "hostname": f"warm-{i}",
                "region": REGION,
                "bootstrap_token": token,
                "cpu_cores": 96,
                "ram_mib": 1048576,
                "interconnect": "nvswitch",
                "gpus": [{"model": "NVIDIA H100 80GB HBM3", "count": 8}],
            }
        )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    fleet_file = tmp / "fleet.json"
    fleet_file.write_text(json.dumps({"portal_url": url, "nodes": nodes}))
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(
        SCHEDULING_TRIGGER_CYCLES="0", LOG_LEVEL="WARNING", GPUPOOL_SIM_COLD_START_S=str(args.cold_start)
    )
    server_cmd = [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1"]
    server_cmd += ["--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(server_cmd, env={**env, "DJANGO_SETTINGS_MODULE": "portal.settings"}, cwd=ROOT)
    fleet = None
    try:
        _wait("the portal", lambda: _answers(f"{url}/healthz"), 60, every=0.2)
        fleet_cmd = [sys.executable, "-m", "nodes.agent.cli", "fleet", "--fleet-file", str(fleet_file)]
        fleet_cmd += [
            "--state-root",
            str(tmp / "agents"),
            "--heartbeat-interval",
            "1",
            "--log-level",
            "WARNING",
        ]
        fleet = subprocess.Popen(fleet_cmd, env=env, cwd=ROOT)
        _wait(
            "two READY nodes",
            lambda: Node.objects.filter(state=NodeState.READY, gpus__isnull=False).distinct().count() == 2,
            60,
            every=0.2,
        )
        print(
            f"warm: portal on {url}, 2 simulated nodes x 8 H100, cold start {args.cold_start} s per new image, "
            f"redis: {'yes' if settings.REDIS_URL else 'no'}"
        )
        tenant = Tenant.objects.create(name="Warm", slug="warm", billing_email="warm@example.com")
        Quota.objects.create(tenant=tenant, max_gpus_total=None, max_concurrent_workloads=None)
        WarmPool.objects.create(
            gpu_model=GpuModel.objects.get(name=H100),
            region=region,
            image=WARM_IMAGE,
            min_size=args.warm,
            max_size=args.warm,
            cold_start_s=int(args.cold_start),
        )

        def prewarmed() -> bool:
            warm_pools_reconcile()
            ready = WarmSlot.objects.filter(ended_at__isnull=True, ready_at__isnull=False).count()
            failed = NodeCommand.objects.filter(kind=CommandKind.PREWARM, state=CommandState.FAILED).count()
            if failed:
                print(f"warm: {failed} prewarm command(s) failed; their slots are prewarmed elsewhere")
            return ready >= args.warm

        t = time.perf_counter()
        _wait("the prewarm commands", prewarmed, args.cold_start + 60, every=0.2)
        print(f"warm: pool of {args.warm} slots prewarmed in {time.perf_counter() - t:.1f} s")
        warm, cold = [], []
        for i in range(args.samples):
            warm.append(_time_to_running(tenant, WARM_IMAGE, warm=True))
            _wait("the pool refilled", prewarmed, args.cold_start + 60, every=0.2)
            cold.append(_time_to_running(tenant, f"ghcr.io/acme/notebook:cold-{i}", warm=False))
            print(f"warm: sample {i + 1}: warm hit {warm[-1]:.3f} s, cold start {cold[-1]:.3f} s")
    finally:
        for proc in (fleet, server):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
        for proc in (fleet, server):
            if proc is not None:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
    return {"warm": warm, "cold": cold}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cold-start", type=float, default=8.0, help="seconds to pull an image a node lacks")
    ap.add_argument("--warm", type=int, default=2, help="warm slots")
    ap.add_argument("--samples", type=int, default=3)
    a = ap.parse_args()
    base = django_on_own_database(DB_NAME, ROOT)
    try:
        from django.conf import settings
        from django.core.management import call_command
        from django.db import connections

        settings.SCHEDULING_TRIGGER_CYCLES = False
        call_command("migrate", verbosity=0)
        with tempfile.TemporaryDirectory() as tmp:
            out = run(a, Path(tmp))
        connections.close_all()
    finally:
        drop_database(base, DB_NAME)
    warm, cold = statistics.median(out["warm"]), statistics.median(out["cold"])
    load = os.getloadavg()
    print(
        f"warm: time to running, median of {a.samples}: warm-pool hit {warm:.3f} s, cold start {cold:.3f} s "
        f"(image pull {a.cold_start} s)"
    )
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(
        json.dumps(
            {
                "warm_hit_time_to_running_s": round(warm, 3),
                "cold_start_time_to_running_s": round(cold, 3),
                "warm_samples_s": [round(x, 3) for x in out["warm"]],
                "cold_samples_s": [round(x, 3) for x in out["cold"]],
                "sim_cold_start_s": a.cold_start,
                "load_1m": round(load[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
