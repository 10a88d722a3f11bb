"""What one tenant API request costs the web server, counted in instructions, not seconds.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/web_cost.py

Seeds its own database (``gpupool_bench_web_cost_<pid>``; dropped at the end) with one tenant of
``--jobs`` jobs on an 8-GPU node (``bench/api_read.py``'s seed), starts one uvicorn process as
``bench/scale.py`` starts the web (``portal.asgi:application``, httptools, uvloop) under valgrind's
callgrind, and for each endpoint sends ``--warm`` requests, zeroes the counters, sends
``--requests`` more over one keep-alive connection and reads the server's instruction count. The
count is the same whatever else the machine runs (within about 2 %), so two trees compare on a busy
machine where ``bench/scale.py``'s seconds do not; it counts every thread of the server (uvicorn's
loop and the WSGI pool). ``--cpu`` runs the server without valgrind and reports its CPU time per
request instead. After the reads, the two creates of ``bench/scale.py``'s tenant mix (``POST
/api/v1/jobs/`` and ``/instances/``, its bodies on one H100) with a second token of the tenant's
that may write: its quota lifted and scheduling cycles off, each created workload stays queued, so
every POST does the same work. Prints one line per endpoint, then one JSON object (a POST's key
starts with ``POST``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pgdb import drop_database, recreate_database  # noqa: E402
from bench.stack import free_port, stack_env  # noqa: E402

DB_NAME = f"gpupool_bench_web_cost_{os.getpid()}"  # two runs side by side do not collide
ENDPOINTS = ("/api/v1/jobs/", "/api/v1/jobs/{id}/", "/api/v1/instances/", "/api/v1/gpu-types/")
# bench/scale.py's create bodies (its 1-GPU choice), sent after the reads so the lists stay as seeded.
CREATES = {
    "/api/v1/jobs/": {
        "gpu_models": ["NVIDIA H100 SXM 80GB"],
        "gpu_count": 1,
        "image": "ghcr.io/bench/train:1",
        "command": ["python", "train.py"],
        "env": {"GPUPOOL_SIM_DURATION_S": "30"},
    },
    "/api/v1/instances/": {
        "gpu_models": ["NVIDIA H100 SXM 80GB"],
        "gpu_count": 1,
        "image": "ghcr.io/bench/train:1",
    },
}


def seed_database(base: str, redis_url: str, work: Path, jobs: int) -> tuple[dict[str, str], str, str, int]:
    """Migrate and seed; returns the server's environment, the tenant's read token, a token of its
    that may also write (its quota lifted, for the creates) and one job's id."""
    env = stack_env(recreate_database(base, DB_NAME), redis_url, work, 4)
    env["SCHEDULING_TRIGGER_CYCLES"] = "0"
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    os.environ.update(env)
    import django

    django.setup()
    from django.db import connection

    from bench.api_read import seed
    from portal.actors import Actor
    from portal.services.tokens import api_token_create
    from scheduling.models import Quota, Workload

    tenant, token = seed(jobs)
    job_id = Workload.objects.filter(tenant=tenant).values_list("id", flat=True).first()
    _, write_token = api_token_create(
        tenant=tenant, name="bench-write", scopes=["read", "write"], actor=Actor.system()
    )
    Quota.objects.filter(tenant=tenant).update(
        max_gpus_total=None, max_concurrent_workloads=None, max_spot_gpus=None, max_gpus_per_request=None
    )
    connection.close()
    return env, token, write_token, job_id


class Server:
    """One uvicorn process, under callgrind unless ``cpu``."""

    def __init__(self, env: dict[str, str], work: Path, cpu: bool):
        self.port, self.work, self.cpu = free_port(), work, cpu
        cmd = [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1",
               "--port", str(self.port), "--http", "httptools", "--loop", "uvloop", "--log-level", "warning",
               "--no-access-log", "--lifespan", "off"]  # fmt: skip
        if not cpu:
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={work}/callgrind.out",
                   "--dump-instr=no", *cmd]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)

    def _count(self) -> float:
        """CPU seconds so far, or (callgrind) the instructions since the last dump: each dump
        zeroes the counters."""
        if self.cpu:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        subprocess.run(["callgrind_control", "--dump", str(self.proc.pid)], check=True, capture_output=True)
        total = 0
        for dump in self.work.glob("callgrind.out*"):
            for line in dump.read_text().splitlines():
                if line.startswith(("summary:", "totals:")):
                    total += int(line.split()[1])
                    break
            dump.unlink()
        return total

    def mark(self) -> None:
        self.marked = self._count()

    def since_mark(self) -> float:
        count = self._count()
        return count - self.marked if self.cpu else count

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--warm", type=int, default=30)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    ap.add_argument("--cpu", action="store_true", help="CPU seconds of the server without valgrind")
    args = ap.parse_args()
    base = os.environ.get("DATABASE_URL", "")
    if not base.startswith(("postgres://", "postgresql://")):
        sys.exit("Set DATABASE_URL to a PostgreSQL server (the bench makes its own database there).")
    if not args.cpu and not shutil.which("callgrind_control"):
        sys.exit("valgrind is not installed (Debian package valgrind); use --cpu for CPU time instead.")
    work = Path(tempfile.mkdtemp(prefix="gpupool-web-cost-"))
    env, token, write_token, job_id = seed_database(base, args.redis_url, work, args.jobs)
    server = Server(env, work, args.cpu)
    unit = "ms CPU" if args.cpu else "M instructions"
    out: dict[str, float] = {}
    try:
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{server.port}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=300,
        )
        deadline = time.monotonic() + 1200  # valgrind starts Python slowly, slower still on a busy machine
        while True:
            try:
                client.get("/api/v1/gpu-types/")
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        for endpoint in ENDPOINTS:
            url = endpoint.format(id=job_id)
            for _ in range(args.warm):
                client.get(url).raise_for_status()
            server.mark()
            for _ in range(args.requests):
                client.get(url)
            per_request = server.since_mark() / args.requests
            out[endpoint] = round(per_request * 1000, 2) if args.cpu else round(per_request / 1e6, 2)
            print(f"GET {endpoint:24} {out[endpoint]:8.2f} {unit} a request", flush=True)
        writer = {"Authorization": f"Bearer {write_token}"}
        for endpoint, body in CREATES.items():
            for _ in range(args.warm):
                client.post(endpoint, json=body, headers=writer).raise_for_status()
            server.mark()
            for _ in range(args.requests):
                client.post(endpoint, json=body, headers=writer).raise_for_status()
            per_request = server.since_mark() / args.requests
            key = f"POST {endpoint}"
            out[key] = round(per_request * 1000, 2) if args.cpu else round(per_request / 1e6, 2)
            print(f"{key:28} {out[key]:8.2f} {unit} a request", flush=True)
    finally:
        server.stop()
        drop_database(base, DB_NAME)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"jobs": args.jobs, "requests": args.requests, "unit": unit, "per_request": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
