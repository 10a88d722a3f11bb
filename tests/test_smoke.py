"""`make run` from a clean copy, on SQLite and without Redis: it serves, the demo owner can log in,
an instance they launch on the simulated fleet reaches RUNNING, and Ctrl-C stops everything.

This is the README's first command exactly as a newcomer runs it: a copy of the working tree
without anything ignored (no .venv, no var/), a fresh virtualenv made by the Makefile, and no
DATABASE_URL or REDIS_URL.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
START_BUDGET_S = 180  # the promise: the login page within 3 minutes on a fresh clone

pytestmark = pytest.mark.slow


def _clean_copy(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if not src.exists():  # deleted in the working tree
            continue
        target = dest / name.decode()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _wait_for(url: str, deadline: float, proc: subprocess.Popen, log: Path) -> httpx.Response:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"make run exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            response = httpx.get(url, timeout=2)
            if response.status_code == 200:
                return response
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{url} did not answer within {START_BUDGET_S}s:\n{log.read_text()[-4000:]}")


def _wait_for_schedulable_gpus(browser: httpx.Client, deadline: float) -> str:
    """The name of a GPU model the simulated fleet offers, once its agents have registered."""
    seen = []
    while time.monotonic() < deadline:
        seen = browser.get("/api/v1/gpu-types/").json()
        for gpu_type in seen:
            if any(region["schedulable_gpus"] > 0 for region in gpu_type["availability"]):
                return gpu_type["name"]
        time.sleep(1)
    pytest.fail(f"no simulated GPU became schedulable: {seen}")


def _wait_for_state(browser: httpx.Client, instance_id: int, wanted: str, deadline: float) -> str:
    detail = {}
    while time.monotonic() < deadline:
        detail = browser.get(f"/api/v1/instances/{instance_id}/").json()
        if detail["state"] == wanted:
            return wanted
        time.sleep(0.5)
    events = browser.get(f"/api/v1/instances/{instance_id}/events/").json()
    pytest.fail(f"instance {instance_id} is {detail.get('state')}, not {wanted}: {detail} {events}")


def test_make_run_serves_the_portal_and_stops_on_ctrl_c(tmp_path):
    copy = tmp_path / "gpupool"
    _clean_copy(copy)
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DATABASE_URL", "REDIS_URL", "DJANGO_", "VIRTUAL_ENV"))
    }
    env.pop("DEBUG", None)
    env.update({"PORT": str(port), "PYTHON": shutil.which("python3") or "python3"})
    log = tmp_path / "make-run.log"
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["make", "run", f"PORT={port}"],
            cwd=copy,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = started + START_BUDGET_S
        health = _wait_for(f"{base}/healthz", deadline, proc, log)
        assert health.json() == {"status": "ok"}
        login_page = _wait_for(f"{base}/login/", deadline, proc, log)
        elapsed = time.monotonic() - started
        print(f"make run served the login page after {elapsed:.0f}s")

        output = log.read_text()
        assert f"http://127.0.0.1:{port}/" in output  # the URL is printed
        assert "owner@demo.gpupool.test" in output and "gpupool-demo" in output  # and the logins

        with httpx.Client(base_url=base, follow_redirects=False, timeout=10) as browser:
            page = browser.get("/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
            assert token, login_page.text[:500]
            response = browser.post(
                "/login/",
                data={
                    "csrfmiddlewaretoken": token.group(1),
                    "username": "owner@demo.gpupool.test",
                    "password": "gpupool-demo",
                },
                headers={"Referer": f"{base}/login/"},
            )
            assert response.status_code == 302, response.text[:2000]
            dashboard = browser.get(response.headers["location"])
            assert dashboard.status_code == 200
            assert "Demo Lab" in dashboard.text

            # The simulated agents registered through the real protocol and report their GPUs.
            model = _wait_for_schedulable_gpus(browser, time.monotonic() + 90)

            # The whole life of a request: submit (web), a scheduling cycle (worker), the start
            # command long-polled and run by the node's agent, its report, and RUNNING.
            created = browser.post(
                "/api/v1/instances/",
                json={"name": "smoke", "gpu_model": model, "gpu_count": 1, "image": "gpupool/smoke:1"},
                headers={"X-CSRFToken": browser.cookies["csrftoken"], "Referer": f"{base}/"},
            )
            assert created.status_code == 201, created.text
            instance_id = created.json()["id"]
            state = _wait_for_state(browser, instance_id, "running", time.monotonic() + 90)
            assert state == "running"

        ready = httpx.get(f"{base}/readyz", timeout=5)
        assert ready.status_code == 200, ready.text

        # The worker and beat run under the same supervisor.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            output = log.read_text()
            if re.search(r"celery@\S+ ready", output) and "beat: Starting" in output:
                break
            time.sleep(1)
        assert re.search(r"celery@\S+ ready", output), output[-3000:]
        assert "beat: Starting" in output, output[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"make run did not stop on Ctrl-C within 30s:\n{log.read_text()[-3000:]}")
    # Nothing is left listening or running.
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the web server is still listening after Ctrl-C"
    leftovers = subprocess.run(["pgrep", "-f", str(copy)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"processes still running after Ctrl-C: {leftovers}"
