# ruff: noqa: F811  (fixtures imported from test_e2e_agent)
"""A tenant's first session in a real browser, through the real portal and a real agent.

The real portal (uvicorn in a thread, ``tests.nodes.test_e2e_agent``'s fixtures), the real agent
program with the docker runtime on the real Docker Engine (the local busybox image), its SSH
endpoint and a volumes root of its own (the region's shared filesystem), Debian's Chromium and
OpenSSH's ``ssh``. The tenant, in the browser: opens the templates page, launches the catalog's
busybox httpd template with a new volume and an SSH key, watches it run, opens its HTTP port
through the portal's proxy, watches its output arrive live, logs in with ``ssh`` as the page says
and writes a file to the volume, stops it, restarts it, and finds the file (and both sessions'
marks) on the volume through the proxy.

This machine has no NVIDIA container runtime, so a container asking for the node's (simulated)
GPUs cannot start: the scheduling cycle the test runs (the portal asks Celery for none here) and
the edit of its start command to ask for no GPUs (with the CPU and memory a container without GPUs
must name) are one transaction, so the agent only ever sees the edited command. Everything else is
the real path. Screenshots land in ``var/screenshots/tenant-path-*.png``.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import shlex
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import pytest
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.db import connections, transaction

from nodes.models import CommandKind, Node, NodeCommand, NodeState
from portal.actors import Actor
from portal.services.tenants import tenant_create
from scheduling.models import Volume, Workload, WorkloadTemplate
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.templates import template_create
from tests.browser import SCREENSHOTS, chromium_page
from tests.conftest import free_port
from tests.docker_engine import TEST_IMAGE, docker_engine  # noqa: F401  (the real engine)
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    H100,
    Portal,
    _no_scheduling_cycles,
    agent_views_in_test_thread,
    e2e_database,
    registered,
    running_portal,
    start_agent,
    wait_for,
)
from tests.ssh_keys import key_pair

pytestmark = pytest.mark.slow

EMAIL, PASSWORD = "first@path.test", "tenant-path-pw-1"
TEMPLATE = "busybox-httpd"
LIVE_MS = 90_000  # two cores shared with other work
# The template's command: mark the volume with this session, serve the volume through httpd under
# the proxy's path (as Jupyter does with its base_url), and write a line every second; on SIGTERM
# (``wait`` lets the trap run at once) say bye.
SERVE = (
    'echo "session $GPUPOOL_WORKLOAD_ID" >> /workspace/sessions.txt; '
    "d=/tmp/www/proxy/$GPUPOOL_WORKLOAD_ID/8080; mkdir -p $d && ln -s /workspace $d/files; "
    'echo "<h1>workload $GPUPOOL_WORKLOAD_ID</h1>" > $d/index.html; '
    "httpd -p 8080 -h /tmp/www; echo serving /workspace on 8080; "
    "trap 'echo bye; exit 0' TERM; n=0; while true; do n=$((n+1)); echo tick $n; sleep 1 & wait $!; done"
)


@pytest.fixture(scope="module")
def portal(e2e_database) -> Iterator[Portal]:
    """The e2e portal, with its static files served as ``runserver`` serves them (Django's
    ``ASGIStaticFilesHandler``): the pages' CSS and scripts, which no ``collectstatic`` made here."""
    asgi = importlib.import_module("portal.asgi")
    app = asgi.application
    asgi.application = ASGIStaticFilesHandler(app)  # what Portal.start serves
    server = Portal(free_port())
    try:
        server.start()
    finally:
        asgi.application = app
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def db_thread():
    """Playwright's sync API keeps an event loop in the test's thread, where Django refuses
    database calls: they run on a thread of their own."""
    with ThreadPoolExecutor(max_workers=1) as pool:

        def call(fn, *args):
            return pool.submit(fn, *args).result(timeout=120)

        yield call
        pool.submit(connections.close_all).result()


@pytest.fixture
def containers(docker_engine: docker.DockerClient):
    ids: list[int] = []
    yield ids
    for wid in ids:
        with contextlib.suppress(docker.errors.NotFound):
            docker_engine.api.remove_container(f"gpupool-{wid}", force=True)
        with contextlib.suppress(docker.errors.NotFound):
            docker_engine.networks.get(f"gpupool-{wid}").remove()


@pytest.fixture
def volumes_root(monkeypatch):
    path = tempfile.mkdtemp(prefix="gpupool-path-volumes-")
    monkeypatch.setenv("GPUPOOL_VOLUMES_ROOT", path)  # the agent's volumes_root
    yield Path(path)
    subprocess.run(["rm", "-rf", path], check=False)


def seed() -> None:
    tenant_create(
        slug="path", name="Path Lab", owner_email=EMAIL, owner_password=PASSWORD, actor=Actor.system()
    )
    WorkloadTemplate.objects.filter(name=TEMPLATE).delete()
    template_create(
        tenant=None,
        data={
            "name": TEMPLATE,
            "description": "busybox httpd serving its volume on port 8080.",
            "image": TEST_IMAGE,
            "command": ["sh", "-c", SERVE],
            "ports": [8080],
            "volume_mount_path": "/workspace",
            "volume_required": True,
        },
        actor=Actor.system(),
    )


def only_this_node(hostname: str) -> int:
    node = Node.objects.get(hostname=hostname)
    Node.objects.exclude(pk=node.pk).update(state=NodeState.CORDONED)  # the module's other tests' nodes
    return node.pk


def place(wid: int) -> None:
    """A scheduling cycle, and its start command made to ask for no GPUs, in one transaction (the
    module's docstring)."""
    with transaction.atomic():
        assert scheduling_cycle_run().ran
        (command,) = NodeCommand.objects.select_for_update().filter(
            kind=CommandKind.START_WORKLOAD, payload__workload_id=str(wid)
        )
        command.payload["gpu_uuids"] = []
        command.payload["cpu_millicores"] = command.payload.get("cpu_millicores") or 500
        command.payload["ram_mib"] = command.payload.get("ram_mib") or 128
        command.save(update_fields=["payload"])


def text_of(page, url: str) -> str:
    """A text file as the browser opens it (with its session), byte for byte."""
    response = page.goto(url)
    assert response is not None and response.status == 200, (url, response and response.status)
    return response.text()


def state(wid: int) -> str:
    return Workload.objects.get(pk=wid).state


def test_a_tenants_first_session_in_the_browser(
    start_agent, running_portal, volumes_root, containers, db_thread, tmp_path, docker_engine
):
    from playwright.sync_api import expect

    url = running_portal.url
    db_thread(seed)
    agent = start_agent(
        "path-docker", gpus=1, runtime="docker",
        extra_args=("--advertise-address", "127.0.0.1", "--publish-address", "127.0.0.1",
                    "--ssh-listen", "127.0.0.1:0"),
    )  # fmt: skip
    db_thread(lambda: registered(agent))
    db_thread(only_this_node, "path-docker")
    db_thread(
        lambda: wait_for(
            lambda: Node.objects.filter(hostname="path-docker", ssh_port__isnull=False).exists(),
            what="the agent to announce its SSH endpoint",
        )
    )
    private, public = key_pair(comment="first@laptop")
    key_file = tmp_path / "id_ed25519"
    key_file.write_bytes(private)
    key_file.chmod(0o600)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    with chromium_page(width=1440, height=1000) as page:
        page.set_default_timeout(30_000)
        page.goto(f"{url}/login/")
        page.get_by_label("Email").fill(EMAIL)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(f"{url}/**")

        # The templates page: the catalog's template, launched from.
        page.locator(".sidebar").get_by_role("link", name="Templates").click()
        row = page.locator(f'[data-templates="catalog"] [data-template="{TEMPLATE}"]')
        expect(row).to_contain_text("/workspace")
        expect(row).to_contain_text("needed")
        page.screenshot(path=str(SCREENSHOTS / "tenant-path-templates.png"), full_page=True)
        row.locator("[data-template-launch]").click()
        page.wait_for_url(f"{url}/launch/?template={TEMPLATE}")
        expect(page.locator("#id_template")).to_have_value(TEMPLATE)
        expect(page.locator("#id_mount_path")).to_have_value("/workspace")
        expect(page.locator(f'[data-template-card="{TEMPLATE}"]')).to_contain_text("Needs one")
        page.locator('[data-gpu-offer*="H100"]').first.get_by_role("radio").check()
        page.locator("#id_name").fill("first-notebook")
        page.locator("#id_ssh_public_key").fill(public)
        page.locator("#id_region").select_option("e2e-1")
        page.locator("#id_new_volume_name").fill("work")
        page.locator("#id_new_volume_size_gib").fill("1")
        page.screenshot(path=str(SCREENSHOTS / "tenant-path-launch.png"), full_page=True)
        page.locator("#launch-submit").click()

        # Its page: placed (the test's cycle), running without a reload.
        page.wait_for_url(re.compile(rf"{re.escape(url)}/workloads/\d+/$"))
        first = int(page.url.rstrip("/").rsplit("/", 1)[1])
        containers.append(first)
        volume = db_thread(lambda: Volume.objects.select_related("region").get(name="work"))
        assert (volume.size_gib, volume.region.code) == (1, "e2e-1")
        page.evaluate("window.__noReload = true")
        db_thread(place, first)
        badge = page.locator(f'h1 [data-workload-state="{first}"]')
        expect(badge).to_have_text("Running", timeout=LIVE_MS)

        # The HTTP port through the portal's proxy, as the page links it.
        link = page.locator('[data-port="8080"] [data-port-url]')
        expect(link).to_have_attribute("href", f"{url}/proxy/{first}/8080/", timeout=LIVE_MS)
        expect(page.locator("[data-share-create]")).to_be_visible()  # a reachable port: shareable
        with page.context.expect_page() as opened:
            link.click()
        app = opened.value
        app.wait_for_load_state()
        expect(app.locator("h1")).to_have_text(f"workload {first}")
        assert text_of(app, f"{url}/proxy/{first}/8080/files/sessions.txt") == f"session {first}\n"

        # Its output, live: the ticks keep coming while the page is open.
        lines = page.locator("[data-log-lines]")
        expect(page.locator("[data-log-status]")).to_have_text("Following", timeout=LIVE_MS)
        expect(lines).to_contain_text("serving /workspace on 8080", timeout=LIVE_MS)
        expect(lines).to_contain_text("tick 2", timeout=LIVE_MS)
        last = max(int(n) for n in re.findall(r"tick (\d+)", lines.inner_text()))
        expect(lines).to_contain_text(f"tick {last + 3}", timeout=LIVE_MS)
        assert page.evaluate("window.__noReload") is True
        page.screenshot(path=str(SCREENSHOTS / "tenant-path-running.png"), full_page=True)

        # SSH as the page says, with its known_hosts line: a file written to the volume.
        command = page.locator("[data-connect]").inner_text()
        (tmp_path / "known_hosts").write_text(page.locator("[data-known-hosts]").inner_text() + "\n")
        pasted = shlex.split(command)
        assert pasted[0] == "ssh"
        done = subprocess.run(
            ["ssh", "-i", str(key_file), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
             "-o", f"UserKnownHostsFile={tmp_path / 'known_hosts'}", "-o", "StrictHostKeyChecking=yes",
             "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR", "-T", *pasted[1:],
             "echo written over ssh in $GPUPOOL_WORKLOAD_ID > /workspace/notes.txt && cat /workspace/notes.txt"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (done.returncode, done.stdout) == (0, f"written over ssh in {first}\n"), done.stderr

        # Stop it; restart it: a new instance, with the same template, volume and key.
        page.once("dialog", lambda dialog: dialog.accept())
        page.locator("#workload-status").get_by_role("button", name="Stop").click()
        expect(badge).to_have_text("Stopped", timeout=LIVE_MS)
        expect(lines).to_contain_text("bye", timeout=LIVE_MS)  # it had its SIGTERM
        assert db_thread(state, first) == S.STOPPED
        page.locator("#workload-status").get_by_role("button", name="Restart").click()
        page.wait_for_url(re.compile(rf"{re.escape(url)}/workloads/(?!{first}/)\d+/$"))
        second = int(page.url.rstrip("/").rsplit("/", 1)[1])
        containers.append(second)
        db_thread(place, second)
        expect(page.locator(f'h1 [data-workload-state="{second}"]')).to_have_text("Running", timeout=LIVE_MS)
        expect(page.locator('[data-port="8080"] [data-port-url]')).to_have_attribute(
            "href", f"{url}/proxy/{second}/8080/", timeout=LIVE_MS
        )

        # The file written over ssh, and both sessions' marks, on the volume.
        assert text_of(app, f"{url}/proxy/{second}/8080/files/notes.txt") == f"written over ssh in {first}\n"
        sessions = text_of(app, f"{url}/proxy/{second}/8080/files/sessions.txt")
        assert sessions == f"session {first}\nsession {second}\n"
        # The old instance's URL is gone with it.
        response = app.goto(f"{url}/proxy/{first}/8080/")
        assert response is not None and response.status == 404
        page.screenshot(path=str(SCREENSHOTS / "tenant-path-relaunched.png"), full_page=True)

    stored = db_thread(lambda: list(Workload.objects.filter(pk__in=[first, second]).order_by("pk")))
    assert [(w.template, w.ssh_public_key.split()[:2]) for w in stored] == [
        (TEMPLATE, public.split()[:2])
    ] * 2
    on_disk = volumes_root / f"vol-{volume.pk}"
    assert sorted(p.name for p in on_disk.rglob("*.txt")) == ["notes.txt", "sessions.txt"], list(
        on_disk.rglob("*")
    )
