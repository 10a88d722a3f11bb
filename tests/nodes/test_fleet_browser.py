"""The fleet pages in a real browser, updated live over a real websocket.

A real ASGI server (uvicorn, as ``make run`` starts it) runs in a subprocess against a SQLite file in
a temporary directory, with the Redis channel layer (``REDIS_URL``, default the local server) under a
prefix of its own. The test changes the fleet from a second process through the nodes services and
the snapshot task, as the Celery worker would, and watches Debian's Chromium (headless, driven by
Playwright) update without reloading. Screenshots land in ``var/screenshots/fleet*.png``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from django.conf import settings

from tests.browser import SCREENSHOTS, chromium_page
from tests.conftest import free_port

pytestmark = [pytest.mark.slow]

EMAIL, PASSWORD = "ops@gpupool.test", "fleet-browser-pw-1"

# Runs in the server's environment (its database, its channel layer): `python -c SETUP <command> ...`.
SETUP = r"""
import json, math, sys
from datetime import timedelta
import django
django.setup()
from django.utils import timezone
from nodes.models import *
from nodes.services.commands import node_command_enqueue, node_commands_deliver_due, node_command_report
from nodes.services.health import node_cordon
from nodes.tasks import publish_fleet_snapshot
from portal.actors import Actor
from portal.models import AuditEvent, User

command, args = sys.argv[1], sys.argv[2:]
now = timezone.now()

def seed():
    staff = User.objects.create_user(email=args[0], password=args[1], is_staff=True, full_name="Ops Person")
    regions = {}
    for code, name, where in (("us-east-1", "US East", "Ashburn, Virginia"), ("eu-west-1", "EU West", "Dublin"),
                              ("ap-northeast-1", "Asia Pacific (Tokyo)", "Tokyo")):
        regions[code] = Region.objects.create(code=code, name=name, location=where)
    plan = [("us-east-1", "use1-h100", "NVIDIA H100 SXM 80GB", 8, 4, False),
            ("us-east-1", "use1-a100", "NVIDIA A100 SXM 80GB", 8, 2, False),
            ("eu-west-1", "euw1-l40s", "NVIDIA L40S", 4, 3, False),
            ("eu-west-1", "euw1-h200", "NVIDIA H200 SXM 141GB", 8, 2, False),
            ("ap-northeast-1", "sim-apne1-t4", "NVIDIA T4", 4, 4, True),
            ("ap-northeast-1", "sim-apne1-mi300x", "AMD Instinct MI300X", 8, 1, True)]
    nodes, k = [], 0
    for code, prefix, model_name, count, n, sim in plan:
        model = GpuModel.objects.get(name=model_name)
        for i in range(1, n + 1):
            node = Node.objects.create(
                hostname=f"{prefix}-{i:02d}", region=regions[code], cpu_cores=192 if count == 8 else 64,
                ram_mib=(2048 if count == 8 else 512) * 1024, driver_version="560.35.03",
                cuda_version="" if model.vendor == "amd" else "12.6", rocm_version="6.2" if model.vendor == "amd" else "",
                agent_version="0.1.0", interconnect="nvswitch" if count == 8 else "pcie",
                labels={"rack": f"r{i}", "pool": "general"}, last_heartbeat_at=now, simulated=sim)
            nodes.append(node)
            for g in range(count):
                k += 1
                util = round(50 + 48 * math.sin(k * 0.7) * math.cos(k * 0.13), 1)
                Gpu.objects.create(node=node, index=g, uuid=f"GPU-{node.hostname}-{g}", model=model,
                    reported_name=model.name, memory_mib=model.memory_gib * 1024, nvlink_island=0, numa_node=g // 4,
                    last_sample_at=now, last_util_pct=util, last_mem_used_mib=int(model.memory_gib * 1024 * util / 110),
                    last_power_w=80 + 6 * util, last_temp_c=int(38 + util * 0.4))
    watched = nodes[0]
    gpus = list(watched.gpus.order_by("index"))
    minute = now.replace(second=0, microsecond=0)
    rollups = []
    for back in range(45, 0, -1):
        for g in gpus:
            u = max(0.0, min(100.0, 55 + 35 * math.sin((back + g.index * 3) / 7)))
            rollups.append(GpuMinuteRollup(gpu=g, minute=minute - timedelta(minutes=back), sample_count=12,
                util_sum=12 * u, util_count=12, util_max=u, mem_used_sum=12 * int(800 * u), mem_used_count=12,
                mem_used_max=int(800 * u), power_sum=12 * (90 + 6 * u), power_count=12, temp_max=int(40 + u * 0.4)))
    GpuMinuteRollup.objects.bulk_create(rollups)
    for g in gpus:
        GpuSample.objects.create(gpu=g, ts=minute, util_pct=g.last_util_pct, mem_used_mib=g.last_mem_used_mib,
                                 power_w=g.last_power_w, temp_c=g.last_temp_c)
    done = node_command_enqueue(node=watched, kind="prewarm", payload={"image": "nvcr.io/nvidia/pytorch:24.08-py3"})
    node_commands_deliver_due(node_id=watched.pk)
    node_command_report(node_id=watched.pk, command_id=done.pk, status="succeeded")
    node_command_enqueue(node=watched, kind="start_workload",
                         payload={"workload_id": "wl-7f3a", "image": "ghcr.io/acme/train:1.4", "gpu_uuids": [gpus[0].uuid]})
    bad = nodes[1].gpus.get(index=5)
    Gpu.objects.filter(pk=bad.pk).update(health=GpuHealth.UNHEALTHY, isolated=True, health_reason="XID 79: fell off the bus")
    Node.objects.filter(pk=nodes[7].pk).update(state=NodeState.CORDONED, state_reason="cordon by ops: fan noise")
    Node.objects.filter(pk=nodes[12].pk).update(state=NodeState.DOWN, state_reason="No heartbeat since 09:12:03 UTC.")
    Gpu.objects.filter(node=nodes[12]).update(last_sample_at=now - timedelta(hours=2))
    UnknownGpuReport.objects.create(reported_name="NVIDIA B200", gpu_count=8, example_node=nodes[9])
    other = nodes[4]
    print(json.dumps({"node": watched.pk, "host": watched.hostname, "gpu": gpus[2].pk, "bad_node": nodes[1].pk, "bad_gpu": bad.pk, "quiet": nodes[10].pk,
                      "other": other.pk, "other_host": other.hostname, "other_gpu": other.gpus.get(index=0).pk}))

def telemetry():
    gpu_id, util = int(args[0]), float(args[1])
    Gpu.objects.filter(pk=gpu_id).update(last_util_pct=util, last_sample_at=timezone.now(), last_temp_c=81,
                                         last_power_w=690.0, last_mem_used_mib=70 * 1024)
    print(publish_fleet_snapshot())

def cordon():
    node = Node.objects.get(pk=int(args[0]))
    node_cordon(node=node, actor=Actor(user=User.objects.get(email=args[1])), reason=args[2])

def silence():
    # The node stops talking: the health reconciler marks it SUSPECT with one UPDATE (no signal);
    # the next snapshot carries it.
    from nodes.services.health import node_health_reconcile
    Node.objects.filter(pk=int(args[0])).update(last_heartbeat_at=timezone.now() - timedelta(seconds=60))
    print(node_health_reconcile().suspect, publish_fleet_snapshot())

def gpu():
    g = Gpu.objects.get(pk=int(args[0]))
    print(json.dumps({"health": g.health, "isolated": g.isolated,
                      "audit": list(AuditEvent.objects.filter(target_type="nodes.gpu", target_id=str(g.pk)).values_list("action", flat=True))}))

def state():
    node = Node.objects.get(pk=int(args[0]))
    audit = list(AuditEvent.objects.filter(target_type="nodes.node", target_id=str(node.pk)).values_list("action", "actor_repr"))
    print(json.dumps({"state": node.state, "reason": node.state_reason, "audit": audit}))

{"seed": seed, "telemetry": telemetry, "cordon": cordon, "state": state, "gpu": gpu, "silence": silence}[command]()
"""


def _redis_url() -> str:
    # redis-py 8 reads with a 5 s socket timeout by default, and channels_redis waits for messages
    # with a blocking BZPOPMIN of about as long: idle websockets then die every few seconds with
    # "Timeout reading from 127.0.0.1:6379" (django/channels_redis#422, redis/redis-py#4091). The
    # server here reads with a longer timeout; the project's CHANNEL_LAYERS needs the same fix.
    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/6"
    return url if "socket_timeout=" in url else url + ("&" if "?" in url else "?") + "socket_timeout=30"


class Server:
    def __init__(self, tmp: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            "DEBUG": "1",
            "GPUPOOL_VAR_DIR": str(tmp),
            "DATABASE_URL": f"sqlite:///{tmp / 'fleet.sqlite3'}",
            "REDIS_URL": _redis_url(),
            "CHANNELS_PREFIX": f"fleet-browser-{uuid.uuid4().hex[:8]}",
            "CACHE_KEY_PREFIX": f"fleet-browser-{uuid.uuid4().hex[:8]}",
            # This test watches the fleet pages; no scheduling cycles on node changes.
            "SCHEDULING_TRIGGER_CYCLES": "0",
            "LOG_LEVEL": "WARNING",
        }
        self.log = tmp / "server.log"
        self.process: subprocess.Popen | None = None

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", SETUP, *args],
            cwd=settings.BASE_DIR,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

    def start(self) -> None:
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=settings.BASE_DIR,
            env=self.env,
            check=True,
            timeout=240,
        )
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1",
                 "--port", str(self.port), "--log-level", "warning"],
                cwd=settings.BASE_DIR, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            assert self.process.poll() is None, self.log.read_text()[-4000:]
            assert time.monotonic() < deadline, "uvicorn did not answer /healthz within 60 s"
            time.sleep(0.3)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
    log = srv.log.read_text() if srv.log.exists() else ""
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture
def page():
    with chromium_page(width=1440, height=1000) as page:
        yield page


def test_fleet_pages_update_live_and_node_actions_work(server, page):
    from playwright.sync_api import expect

    seeded_minute = int(time.time() // 60)
    seeded = json.loads(server.manage("seed", EMAIL, PASSWORD))
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    page.goto(f"{server.url}/login/")
    page.get_by_label("Email").fill(EMAIL)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{server.url}/**")

    # the overview: counts, heat map, the table; the socket opens
    page.get_by_role("link", name="Fleet").click()
    expect(page.get_by_role("heading", name="Fleet", exact=True)).to_be_visible()
    expect(page.locator("[data-live-status]")).to_have_attribute("data-state", "open")
    expect(page.locator('[data-count="nodes"]').first).to_have_text("16")
    expect(page.locator("#heatmap i.hc[data-g]")).to_have_count(4 * 8 + 2 * 8 + 3 * 4 + 2 * 8 + 4 * 4 + 8)
    expect(page.locator(".hm-node .hm-sim")).to_have_count(5)
    page.evaluate("window.__noReload = true")
    page.screenshot(path=str(SCREENSHOTS / "fleet.png"), full_page=True)

    # a GPU gets busy and a node is cordoned elsewhere: the page follows without reloading
    cell = page.locator(f'i.hc[data-g="{seeded["other_gpu"]}"]')
    server.manage("telemetry", str(seeded["other_gpu"]), "2")
    expect(cell).to_have_class("hc u0")
    server.manage("telemetry", str(seeded["other_gpu"]), "97")
    expect(cell).to_have_class("hc u9")
    expect(page.locator('[data-count="state:cordoned"]').first).to_have_text("1")
    server.manage("cordon", str(seeded["other"]), EMAIL, "bad DIMM")
    badge = page.locator(f'#node-table [data-node-state="{seeded["other"]}"]')
    expect(badge).to_have_text("Cordoned")
    expect(badge).to_have_class("badge badge-node badge-node-cordoned")
    expect(page.locator(f'.hm-node[data-node="{seeded["other"]}"]')).to_have_class("hm-node s-cordoned")
    server.manage("telemetry", str(seeded["other_gpu"]), "97")  # the next snapshot carries the counts
    expect(page.locator('[data-count="state:cordoned"]').first).to_have_text("2")
    server.manage("silence", str(seeded["quiet"]))
    expect(page.locator(f'.hm-node[data-node="{seeded["quiet"]}"]')).to_have_class("hm-node s-suspect")
    expect(page.locator(f'#node-table [data-node-state="{seeded["quiet"]}"]')).to_have_text("Suspect")
    expect(page.locator('[data-count="state:suspect"]').first).to_have_text("1")
    expect(page.locator('[data-count="state:ready"]').first).to_have_text("12")
    assert page.evaluate("window.__noReload") is True

    # hovering a cell shows its node, GPU and numbers
    cell.hover()
    tip = page.locator(".hm-tip")
    expect(tip).to_be_visible()
    expect(tip).to_contain_text(f"{seeded['other_host']} · GPU 0")
    expect(tip).to_contain_text("97 %")
    expect(tip).to_contain_text("81 °C")
    page.locator("#heatmap").screenshot(path=str(SCREENSHOTS / "fleet-heatmap.png"))

    # filter the table to the cordoned nodes
    page.get_by_label("State", exact=True).select_option("cordoned")
    expect(page.locator("#node-rows tbody tr")).to_have_count(2)
    expect(page).to_have_url(f"{server.url}/fleet/?q=&region=&state=cordoned&model=")

    # node detail: the charts draw, follow the snapshots, and the node is cordoned from the page
    page.goto(f"{server.url}/fleet/nodes/{seeded['node']}/")
    expect(page.get_by_role("heading", name=seeded["host"])).to_be_visible()
    expect(page.locator(".chart canvas")).to_have_count(4)
    width = page.locator('[data-chart="util"] canvas').evaluate("c => c.width")
    assert width > 200
    expect(page.locator("[data-live-status]")).to_have_attribute("data-state", "open")
    expect(page.locator("#commands")).to_contain_text("Prewarm")
    expect(page.locator("#commands")).to_contain_text("Start workload")
    points = int(page.locator('[data-chart="util"]').get_attribute("data-points"))
    if int(time.time() // 60) == seeded_minute:
        assert points == 46  # 45 finished minutes and the raw samples of this one
    else:  # the minute turned (before or after the page loaded): the seeded raw samples may now
        # sit in a finished minute with no rollup yet
        assert points in (45, 46)
    server.manage("telemetry", str(seeded["gpu"]), "91")
    expect(page.locator('[data-chart="util"]')).to_have_attribute("data-points", str(points + 1))
    expect(page.locator(f'[data-gpu-metric="{seeded["gpu"]}:util"]')).to_have_text("91 %")
    page.evaluate("window.__noReload = true")
    page.screenshot(path=str(SCREENSHOTS / "fleet-node.png"), full_page=True)

    page.locator("#node-state").get_by_label("Reason").fill("replacing a fan")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#node-state").get_by_role("button", name="Cordon").click()
    expect(page.locator(f'#node-state [data-node-state="{seeded["node"]}"]')).to_have_text("Cordoned")
    expect(page.locator(f'h1 [data-node-state="{seeded["node"]}"]')).to_have_text("Cordoned")
    expect(page.locator("#node-state")).to_contain_text("was cordoned")
    expect(page.locator("#node-state").get_by_role("button", name="Return to service")).to_be_visible()
    assert page.evaluate("window.__noReload") is True
    stored = json.loads(server.manage("state", str(seeded["node"])))
    assert stored["state"] == "cordoned" and stored["reason"] == "replacing a fan"
    assert stored["audit"] == [["node.cordon", EMAIL]]

    # maintenance without a reason: the error shows inline and nothing changes
    page.locator("#node-state").get_by_label("Reason").fill("")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#node-state").get_by_role("button", name="Maintenance").click()
    expect(page.locator("#node-reason-error")).to_contain_text("Say why")
    expect(page.locator("#node-reason")).to_have_attribute("aria-invalid", "true")
    assert json.loads(server.manage("state", str(seeded["node"])))["state"] == "cordoned"
    page.locator("#node-state").screenshot(path=str(SCREENSHOTS / "fleet-node-actions.png"))

    # a GPU that fell off the bus goes back into service from its node's page
    page.goto(f"{server.url}/fleet/nodes/{seeded['bad_node']}/")
    row = page.locator(f"#gpu-{seeded['bad_gpu']}")
    expect(row.locator(f'[data-gpu-health="{seeded["bad_gpu"]}"]')).to_have_text("Unhealthy")
    row.get_by_text("Return to service").click()
    row.get_by_label("Why it can return").fill("reseated, ran dcgmi diag -r 3")
    page.locator("#gpus").screenshot(path=str(SCREENSHOTS / "fleet-node-gpus.png"))
    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Return GPU 5").click()
    expect(row).to_contain_text("back in service")
    expect(row.locator(f'[data-gpu-health="{seeded["bad_gpu"]}"]')).to_have_text("Healthy")
    stored = json.loads(server.manage("gpu", str(seeded["bad_gpu"])))
    assert stored == {"health": "healthy", "isolated": False, "audit": ["gpu.return_to_service"]}
