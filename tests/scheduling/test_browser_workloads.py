"""The workload pages in a real browser, on a simulated fleet, updated live over a real websocket.

The whole stack runs as it does in production, each part in a process of its own against one SQLite
file: the portal under uvicorn (the Redis channel layer, broker and cache under prefixes of their
own), a Celery worker that runs the scheduling cycles the portal asks for, and the real agent program
(``python -m nodes.agent.cli run``) with the simulated collector and runtime, speaking HTTP to the
portal. Debian's Chromium (headless, driven by Playwright) signs in, launches an instance, watches it
reach RUNNING without reloading, sees its GPU charts fill, stops it and sees its usage and cost on
the Usage page (metering's usage build run by the worker); a viewer cannot launch; staff
lower the team's quota in the Django admin and the next launch shows the quota error in the form.
Screenshots land in ``var/screenshots/workload*.png``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
from django.conf import settings

from tests.browser import SCREENSHOTS, chromium_page
from tests.conftest import free_port
from tests.ssh_keys import public_key

pytestmark = [pytest.mark.slow]

OWNER, VIEWER, STAFF = "owner@lab.test", "viewer@lab.test", "ops@gpupool.test"
PASSWORD = "workload-browser-pw-1"
IMAGE = "ghcr.io/lab/notebook:2"
KEY = public_key(comment="lab@laptop")
LIVE_TIMEOUT_MS = 90_000  # two cores shared with other work: cycles and heartbeats can be slow

# Runs in the stack's environment (its database): `python -c SETUP <command> ...`.
SETUP = r"""
import json, sys
from datetime import timedelta
from decimal import Decimal
import django
django.setup()
from django.utils import timezone
from nodes.models import GpuModel, Node, Region
from nodes.services.registration import bootstrap_token_create
from portal.actors import Actor
from portal.models import Membership, Role, User
from portal.services.tenants import tenant_create
from scheduling.models import Quota, Workload

command, args = sys.argv[1], sys.argv[2:]

def seed():
    owner, viewer, staff, password = args
    region = Region.objects.create(code="us-east-1", name="US East", location="Ashburn")
    Region.objects.create(code="eu-west-1", name="EU West", location="Dublin")
    tenant = tenant_create(slug="lab", name="Vision Lab", owner_email=owner, owner_password=password, actor=Actor.system())
    user = User.objects.create_user(email=viewer, password=password, full_name="Vic Viewer")
    Membership.objects.create(tenant=tenant, user=user, role=Role.VIEWER)
    User.objects.create_user(email=staff, password=password, full_name="Ops Person", is_staff=True, is_superuser=True)
    Quota.objects.create(tenant=tenant, max_gpus_total=8)
    try:  # list prices, when metering's rate cards are there
        from metering.models import GpuPrice, RateCard, RateCardVersion
        card = RateCard.objects.create(name="List prices", is_default=True)
        version = RateCardVersion.objects.create(rate_card=card, number=1, effective_from=timezone.now() - timedelta(days=1))
        h100 = GpuModel.objects.get(name="NVIDIA H100 SXM 80GB")
        for plan, price in (("on_demand", "2.49"), ("spot", "0.99"), ("reserved", "1.75")):
            GpuPrice.objects.create(version=version, gpu_model=h100, plan=plan, price_per_gpu_hour=Decimal(price))
    except ImportError:
        pass
    print(bootstrap_token_create(region=region, actor=Actor.system())[1])

def nodes():
    print(json.dumps(list(Node.objects.values_list("hostname", "state"))))

def workload():
    w = Workload.objects.get(pk=int(args[0]))
    print(json.dumps({"state": w.state, "gpu_count": w.gpu_count, "image": w.image, "ssh": w.ssh_public_key,
                      "models": [m.name for m in w.gpu_models.all()], "allocations": w.allocations.count()}))

def count():
    print(Workload.objects.count())

def submit():  # a launch through the API's service, as another member's script would
    from portal.models import Tenant
    from scheduling.services.submission import workload_submit
    w = workload_submit(tenant=Tenant.objects.get(slug="lab"), kind="job", actor=Actor.system(),
                        spec={"name": args[0], "gpu_models": ["H100"], "image": "x:1", "command": ["sleep", "1"]})
    print(w.pk)

def submit_elastic():  # an elastic training job, as the API or the CLI submits one
    from portal.models import Tenant
    from scheduling.services.submission import workload_submit
    w = workload_submit(tenant=Tenant.objects.get(slug="lab"), kind="job", actor=Actor.system(),
                        spec={"name": args[0], "gpu_models": ["H100"], "image": "x:1", "command": ["train"],
                              "elastic": {"min_gpus": 1, "max_gpus": 3, "on_resize": "restart"}})
    print(w.pk)

def resizes():  # the resize commands the node was sent: (world size, state)
    from nodes.models import CommandKind, NodeCommand
    rows = NodeCommand.objects.filter(kind=CommandKind.RESIZE_WORKLOAD, payload__workload_id=args[0]).order_by("created_at")
    print(json.dumps([[c.payload["world_size"], c.state] for c in rows]))

def stop():
    from scheduling.services.lifecycle import workload_stop
    workload_stop(workload=Workload.objects.get(pk=int(args[0])), actor=Actor.system())

def usage():  # metering's usage build, sent to the worker as beat would send it
    from metering.tasks import usage_build
    print(usage_build.delay().id)

def usage_sum():
    from django.db.models import Count, Sum
    from metering.models import UsageRecord
    agg = UsageRecord.objects.filter(tenant__slug="lab").aggregate(n=Count("id"), s=Sum("gpu_seconds"), a=Sum("amount"))
    print(json.dumps({"records": agg["n"], "gpu_seconds": str(agg["s"] or 0), "amount": str(agg["a"] or 0)}))

{"seed": seed, "nodes": nodes, "workload": workload, "count": count, "submit": submit, "stop": stop,
 "usage": usage, "usage_sum": usage_sum, "submit_elastic": submit_elastic, "resizes": resizes}[command]()
"""


def _redis_url() -> str:
    # The whole stack shares it: broker, cache and channel layer (settings give the channel layer
    # the long read timeout its blocking reads need).
    return os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/7"


class Stack:
    """uvicorn + a Celery worker + one simulated agent, sharing a SQLite file."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tag = uuid.uuid4().hex[:8]
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            "DEBUG": "1",
            "GPUPOOL_VAR_DIR": str(tmp),
            "DATABASE_URL": f"sqlite:///{tmp / 'stack.sqlite3'}",
            "REDIS_URL": _redis_url(),
            "CHANNELS_PREFIX": f"wl-browser-{tag}",
            "CACHE_KEY_PREFIX": f"wl-browser-{tag}",
            # Its own broker queues: no other process on this Redis database takes its cycles, and
            # nothing stale waits in them (a purge at the worker's start could race the first launch).
            "CELERY_BROKER_KEY_PREFIX": f"wl-browser-{tag}:",
            "SCHEDULING_CYCLE_DEBOUNCE_S": "0.2",
            "LOG_LEVEL": "WARNING",
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", SETUP, *args],
            cwd=settings.BASE_DIR, env=self.env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> None:
        self.logs[name] = self.tmp / f"{name}.log"
        with open(self.logs[name], "wb") as log:
            self.procs[name] = subprocess.Popen(
                argv, cwd=settings.BASE_DIR, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def log(self, name: str) -> str:
        path = self.logs.get(name)
        return path.read_text(errors="replace") if path and path.exists() else ""

    def wait(self, what: str, predicate, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited:\n{self.log(name)[-4000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.3)

    def start(self) -> None:
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=settings.BASE_DIR, env=self.env, check=True, timeout=300,
        )  # fmt: skip
        token = self.manage("seed", OWNER, VIEWER, STAFF, PASSWORD)
        self.spawn("web", [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1",
                           "--port", str(self.port), "--log-level", "warning"])  # fmt: skip
        # The worker runs the scheduling cycles that submissions and releases ask for, and the usage
        # build the test sends (no beat: the triggers are what the test relies on), from the stack's
        # own queues.
        self.spawn("worker", [sys.executable, "-m", "celery", "-A", "portal", "worker", "--pool", "threads",
                              "--concurrency", "2", "-Q", "scheduling,default,commands,metering",
                              "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING"])  # fmt: skip

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        self.wait("uvicorn to answer /healthz", healthy, 90)
        agent_env = {k: v for k, v in self.env.items() if k != "DJANGO_SETTINGS_MODULE"}
        agent_env["PYTHONPATH"] = str(settings.BASE_DIR)
        agent_env["GPUPOOL_ALLOW_INSECURE_HTTP"] = "1"  # the portal listens on loopback
        config = self.tmp / "agent.toml"
        config.write_text(
            "backoff_initial_s = 0.2\nbackoff_max_s = 2.0\nrequest_timeout_s = 10.0\nstop_grace_s = 1.0\n"
        )
        self.spawn("agent", [sys.executable, "-m", "nodes.agent.cli", "run", "--config", str(config),
                             "--portal-url", self.url, "--bootstrap-token", token, "--state-dir", str(self.tmp / "agent"),
                             "--collector", "simulated", "--runtime", "simulated", "--hostname", "sim-use1-h100-01",
                             "--region", "us-east-1", "--sim-gpus", json.dumps([{"model": "NVIDIA H100 80GB HBM3", "count": 4}]),
                             "--sample-interval", "0.5", "--heartbeat-interval", "1", "--commands-wait", "2",
                             "--log-level", "INFO"], env=agent_env)  # fmt: skip
        self.wait(
            "the agent to register and report",
            lambda: json.loads(self.manage("nodes")) == [["sim-use1-h100-01", "ready"]],
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("workloads-browser"))
    try:
        s.start()
        yield s
    finally:
        s.stop()
    web = s.log("web")
    assert "Traceback" not in web, web[-4000:]


@pytest.fixture
def page():
    with chromium_page(width=1440, height=1000) as page:
        page.set_default_timeout(30_000)
        yield page


def sign_in(page, stack: Stack, email: str) -> None:
    page.goto(f"{stack.url}/login/")
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{stack.url}/**")


def test_launch_an_instance_watch_it_run_see_its_gpus_and_stop_it(stack, page):
    from playwright.sync_api import expect

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    sign_in(page, stack, OWNER)
    expect(page.locator("#panel-workloads")).to_contain_text("Nothing running or waiting.")

    # the launch page: the simulated fleet's H100s, free in us-east-1, with their list prices
    page.locator(".sidebar").get_by_role("link", name="Launch").click()
    expect(page.get_by_role("heading", name="Launch", exact=True)).to_be_visible()
    offer = page.locator('[data-gpu-offer="NVIDIA H100 SXM 80GB"]')
    expect(offer).to_contain_text("us-east-1 4/4")
    expect(offer).to_contain_text("2.49 USD")
    offer.get_by_role("radio").check()
    page.get_by_label("Name").fill("vision-notebook")
    page.get_by_label("Image").fill(IMAGE)
    page.get_by_label("SSH public key").fill(KEY)
    page.locator("#id_region").select_option("us-east-1")
    expect(page.locator("#id_command")).to_be_visible()  # optional for an instance: its image's default
    # the estimate follows the form
    page.get_by_label("GPUs", exact=True).fill("2")
    expect(page.locator('[data-estimate="hour"]')).to_have_text("4.98 USD")
    page.locator("#id_plan").select_option("spot")
    expect(page.locator('[data-estimate="hour"]')).to_have_text("1.98 USD")
    expect(page.get_by_label("Highest spot price per GPU-hour")).to_be_visible()
    page.locator("#id_plan").select_option("on_demand")
    expect(page.locator('[data-estimate="day"]')).to_have_text("119.52 USD")
    page.screenshot(path=str(SCREENSHOTS / "workload-launch.png"), full_page=True)
    page.get_by_role("button", name="Launch").click()

    # its page: pending, then placed, starting, running, without a reload
    page.wait_for_url(f"{stack.url}/workloads/*/")
    wid = int(page.url.rstrip("/").rsplit("/", 1)[1])
    page.evaluate("window.__noReload = true")
    expect(page.locator("[data-live-status]")).to_have_attribute("data-state", "open")
    badge = page.locator(f'h1 [data-workload-state="{wid}"]')
    expect(badge).to_have_text("Running", timeout=LIVE_TIMEOUT_MS)
    expect(badge).to_have_class("badge badge-wl badge-wl-running")
    expect(page.locator('#workload-live [data-stage="running"]')).to_have_class("stage done current")
    expect(page.locator("#timeline")).to_contain_text("→ Running", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#placement")).to_contain_text("sim-use1-h100-01")
    # a simulated agent serves no SSH: the page says why rather than show a command
    expect(page.locator("[data-ssh-unavailable]")).to_contain_text(
        re.compile("serves no SSH endpoint|not available on the simulated fleet")
    )
    expect(page.locator("[data-connect]")).to_have_count(0)
    stored = json.loads(stack.manage("workload", str(wid)))
    assert stored["state"] == "running" and stored["gpu_count"] == 2 and stored["allocations"] == 2
    assert stored["models"] == ["NVIDIA H100 SXM 80GB"] and stored["image"] == IMAGE and stored["ssh"] == KEY

    # its GPU charts fill from the agent's telemetry
    util = page.locator('[data-workload-charts] [data-chart="util"]')
    expect(page.locator("[data-workload-charts] .chart canvas")).to_have_count(3, timeout=LIVE_TIMEOUT_MS)
    expect(util).not_to_have_attribute("data-points", "0", timeout=LIVE_TIMEOUT_MS)
    assert int(util.get_attribute("data-points")) > 0
    expect(page.locator("[data-workload-charts] .u-legend")).to_have_count(3)
    expect(page.locator("[data-workload-charts] .u-legend").first).to_contain_text("sim-use1-h100-01 · GPU")
    assert page.evaluate("window.__noReload") is True
    page.screenshot(path=str(SCREENSHOTS / "workload-running.png"), full_page=True)

    # stop it: stopping at once, stopped when the agent reports
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#workload-status").get_by_role("button", name="Stop").click()
    expect(badge).to_have_text("Stopped", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#workload-status").get_by_role("button", name="Restart")).to_be_visible()
    expect(page.locator("#timeline")).to_contain_text("Stopping → Stopped", timeout=LIVE_TIMEOUT_MS)
    assert page.evaluate("window.__noReload") is True
    assert json.loads(stack.manage("workload", str(wid)))["state"] == "stopped"
    page.screenshot(path=str(SCREENSHOTS / "workload-stopped.png"), full_page=True)

    # its usage and cost: the usage build (metering's Celery task, run by the worker) records the
    # stopped instance's GPU time, and the Usage page shows the records' sums
    stack.manage("usage")
    stack.wait("the usage records", lambda: json.loads(stack.manage("usage_sum"))["records"] >= 2)
    usage = json.loads(stack.manage("usage_sum"))
    assert usage["records"] == 2  # one per GPU, both ended
    hours = (Decimal(usage["gpu_seconds"]) / 3600).quantize(Decimal("0.001"), ROUND_HALF_UP)
    cost = Decimal(usage["amount"]).quantize(Decimal("0.01"), ROUND_HALF_UP)
    assert Decimal(usage["gpu_seconds"]) >= 120 and cost > 0  # two GPUs, at least the minimum each
    page.locator(".sidebar").get_by_role("link", name="Usage").click()
    expect(page.get_by_role("heading", name="Usage", exact=True)).to_be_visible()
    expect(page.locator("[data-usage-gpu-hours]")).to_have_text(str(hours))
    expect(page.locator("[data-usage-cost]")).to_have_text(f"{cost} USD")
    expect(page.locator("[data-usage-models]")).to_contain_text("NVIDIA H100 SXM 80GB")
    expect(page.locator("[data-usage-days] tbody tr")).to_have_count(1)
    expect(page.locator("[data-usage-days]")).to_contain_text(f"{hours}")
    expect(page.locator("[data-usage-chart] svg")).to_have_count(2)
    expect(page.locator("[data-cost-to-date]")).to_contain_text("USD")
    page.screenshot(path=str(SCREENSHOTS / "billing-usage.png"), full_page=True)

    # the list shows it, and a launch from elsewhere is announced
    page.locator(".sidebar").get_by_role("link", name="Workloads").click()
    expect(page.locator(f"#workload-{wid} [data-workload-state]")).to_have_text("Stopped")
    expect(page.locator("[data-live-status]")).to_have_attribute("data-state", "open")
    other = int(stack.manage("submit", "nightly-eval"))
    note = page.locator("[data-new-workloads]")
    expect(note).to_contain_text("1 new workload(s)", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator(f'#workload-rows [data-workload-state="{other}"]')).to_have_count(0)
    page.screenshot(path=str(SCREENSHOTS / "workloads.png"), full_page=True)
    note.get_by_role("link", name="Show them").click()
    expect(page.locator(f"#workload-{other}")).to_contain_text("nightly-eval")
    stack.manage("stop", str(other))
    expect(page.locator(f'#workload-{other} [data-workload-state="{other}"]')).to_have_text(
        re.compile("Stopping|Stopped"), timeout=LIVE_TIMEOUT_MS
    )


def test_resize_an_elastic_job_from_its_page(stack, page):
    """Before the staff test lowers the team's quota to 1 GPU."""
    from playwright.sync_api import expect

    wid = int(stack.manage("submit_elastic", "elastic-train"))
    sign_in(page, stack, OWNER)
    page.goto(f"{stack.url}/workloads/{wid}/")
    expect(page.locator(f'h1 [data-workload-state="{wid}"]')).to_have_text("Running", timeout=LIVE_TIMEOUT_MS)
    page.reload()  # the live part reloads on state changes; the form comes with RUNNING
    expect(page.locator("[data-elastic]")).to_contain_text("between 1 and 3 GPUs")
    form = page.locator("[data-resize-form]")
    field = form.get_by_label("Resize to")
    expect(field).to_have_attribute("max", "3")

    # To two GPUs: a growth from its minimum (or a shrink, if a cycle grew it meanwhile).
    field.fill("2")
    form.get_by_role("button", name="Resize").click()
    expect(page.locator('#workload-live [role="status"]')).to_contain_text(
        re.compile("Target 2 GPUs|Shrunk to 2 GPUs")
    )
    stack.wait(
        "the job to hold 2 GPUs", lambda: json.loads(stack.manage("workload", str(wid)))["gpu_count"] == 2
    )
    page.reload()
    expect(page.locator("[data-elastic-held]")).to_have_text("2")
    page.screenshot(path=str(SCREENSHOTS / "workload-elastic.png"), full_page=True)

    # Down to one: at once, said in the card without a reload, and the node is told.
    page.evaluate("window.__noReload = true")
    page.locator("[data-resize-form]").get_by_label("Resize to").fill("1")
    page.locator("[data-resize-form]").get_by_role("button", name="Resize").click()
    expect(page.locator('#workload-live [role="status"]')).to_have_text("Shrunk to 1 GPU; its node is told.")
    expect(page.locator("[data-elastic-held]")).to_have_text("1")
    assert page.evaluate("window.__noReload") is True
    stack.wait(
        "the agent to apply the resizes",
        lambda: (r := json.loads(stack.manage("resizes", str(wid)))) and r[-1] == [1, "succeeded"],
    )
    assert all(state == "succeeded" for _, state in json.loads(stack.manage("resizes", str(wid))))
    stack.manage("stop", str(wid))


def test_a_viewer_cannot_launch(stack, page):
    from playwright.sync_api import expect

    sign_in(page, stack, VIEWER)
    page.locator(".sidebar").get_by_role("link", name="Launch").click()
    expect(page.locator("#launch-read-only")).to_contain_text("can look but not launch")
    expect(page.get_by_role("button", name="Launch")).to_have_count(0)
    expect(page.get_by_label("Image")).to_be_disabled()
    before = stack.manage("count")
    # a crafted POST is refused too
    status = page.evaluate(
        """async () => {
            const token = document.querySelector("input[name=csrfmiddlewaretoken]").value;
            const body = new URLSearchParams({csrfmiddlewaretoken: token, kind: "instance", gpu_model: "NVIDIA H100 SXM 80GB",
                                              gpu_count: "1", fraction: "1000", plan: "on_demand", image: "x:1"});
            const r = await fetch("/launch/", {method: "POST", body, credentials: "same-origin"});
            return r.status;
        }"""
    )
    assert status == 403 and stack.manage("count") == before
    page.screenshot(path=str(SCREENSHOTS / "workload-launch-viewer.png"), full_page=True)


def test_staff_lower_the_quota_and_the_next_launch_shows_it(stack, page):
    from playwright.sync_api import expect

    sign_in(page, stack, STAFF)
    page.goto(f"{stack.url}/admin/scheduling/quota/")
    page.get_by_role("link", name="Vision Lab").click()
    page.get_by_label("Max gpus total").fill("1")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.locator(".messagelist")).to_contain_text("was changed successfully")
    page.context.clear_cookies()

    sign_in(page, stack, OWNER)
    page.goto(f"{stack.url}/launch/")
    page.locator('[data-gpu-offer="NVIDIA H100 SXM 80GB"]').get_by_role("radio").check()
    page.get_by_label("Image").fill(IMAGE)
    page.get_by_label("GPUs", exact=True).fill("2")
    before = stack.manage("count")
    page.get_by_role("button", name="Launch").click()
    error = page.locator("#id_gpu_count_error")
    expect(error).to_contain_text("Quota max_gpus_total exceeded: limit 1 GPUs")
    expect(page.get_by_label("GPUs", exact=True)).to_have_attribute("aria-invalid", "true")
    expect(page.locator(".alert-error[role=alert]")).to_contain_text("max_gpus_total")
    expect(page.get_by_label("Image")).to_have_value(IMAGE)  # what was typed stays
    assert stack.manage("count") == before
    page.locator("#launch-form").screenshot(path=str(SCREENSHOTS / "workload-launch-quota.png"))


def test_reserve_gpus_with_the_price_and_saving_shown_before_confirming(stack, page):
    from playwright.sync_api import expect

    sign_in(page, stack, OWNER)
    page.locator(".sidebar").get_by_role("link", name="Reservations").click()
    expect(page.locator("[data-reservations-empty]")).to_contain_text("No reservations yet")
    # the list price: H100 reserved 1.75/h, on demand 2.49/h; 730 hours a month, 12 months 20% off
    page.get_by_label("GPU model").select_option("NVIDIA H100 SXM 80GB")
    page.get_by_label("Region").select_option("us-east-1")
    page.get_by_label("GPUs", exact=True).fill("2")
    expect(page.locator('[data-quote="monthly"]')).to_have_text("2555.00 USD")  # 1.75 x 730 x 2
    page.get_by_label("Term").select_option("12")
    monthly = Decimal("1.75") * 730 * Decimal("0.8") * 2
    on_demand = Decimal("2.49") * 730 * 2 * 12
    expect(page.locator('[data-quote="monthly"]')).to_have_text(f"{monthly:.2f} USD")
    expect(page.locator('[data-quote="total"]')).to_have_text(f"{monthly * 12:.2f} USD")
    expect(page.locator('[data-quote="saving"]')).to_contain_text(f"{on_demand - monthly * 12:.2f} USD")
    page.get_by_role("button", name="Review the price").click()
    expect(page.locator("[data-confirm-summary]")).to_contain_text("2 \u00d7 NVIDIA H100 SXM 80GB")
    expect(page.locator('[data-quote="total"]')).to_have_text(f"{monthly * 12:.2f} USD")
    page.screenshot(path=str(SCREENSHOTS / "billing-reservation-confirm.png"), full_page=True)
    page.get_by_role("button", name="Confirm purchase").click()
    expect(page.locator("[data-reservations]")).to_contain_text("2 \u00d7 H100")
    expect(page.locator("[data-reservations]")).to_contain_text("Requested")
    page.screenshot(path=str(SCREENSHOTS / "billing-reservations.png"), full_page=True)
    # a bad count is refused next to the field
    page.get_by_label("GPUs", exact=True).fill("0")
    # the live quote answers first (a click while it is in flight raced it on a loaded machine)
    expect(page.locator("#reservation-quote")).to_contain_text("Correct the form to see the price.")
    page.get_by_role("button", name="Review the price").click()
    expect(page.locator("#id_count_error")).to_contain_text("greater than or equal to 1")

    # the budget: set through the form, shown against the month's cost
    page.locator(".sidebar").get_by_role("link", name="Budget").click()
    page.get_by_label("Monthly budget").fill("250")
    page.get_by_label("Alert at (percent of the budget)").fill("25, 75, 100")
    page.get_by_role("button", name="Save the budget").click()
    expect(page.locator("[data-budget-standing]")).to_contain_text("of 250.00 USD")
    expect(page.get_by_label("Alert at (percent of the budget)")).to_have_value("25, 75, 100")
    page.screenshot(path=str(SCREENSHOTS / "billing-budget.png"), full_page=True)
    page.locator(".sidebar").get_by_role("link", name="Invoices").click()
    expect(page.locator("[data-credit-total]")).to_have_text("0.00 USD")
    page.screenshot(path=str(SCREENSHOTS / "billing-invoices.png"), full_page=True)
