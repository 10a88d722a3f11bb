"""End to end: an instance's HTTP port through the portal's proxy (issue 28, Access: ports).

The real portal (uvicorn serving ``portal.asgi`` in a thread, its own database) and the real agent
program, set up by ``tests.nodes.test_e2e_agent``'s fixtures:

- with the docker runtime on the real Docker Engine, a busybox ``httpd`` in an instance is reached
  through ``/proxy/<id>/8080/`` by its tenant (token and session: 200, the right body), not by
  another tenant or anyone else (404), and by a share link until it is revoked. This machine has no
  NVIDIA container runtime, so the test takes the GPU device request out of the scheduler's start
  command before the agent sees it (``tests/agent/test_docker_runtime.py`` covers GPUs); the rest
  of the command is the scheduler's;
- with the simulated runtime, the API says the ports are not reachable; then the port is pointed (by
  ``workload_ports_record``, the service the start report goes through) at an aiohttp server of the
  test's own, which shows what the proxy forwards: websockets both ways, headers without the
  portal's credentials, bodies streamed, the limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import docker
import httpx
import pytest
from aiohttp import WSMsgType, web
from django.test import Client
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from nodes.models import CommandKind, NodeCommand
from portal.actors import Actor
from portal.models import AuditEvent, Membership, Role, Scope
from portal.services.tenants import tenant_create
from portal.services.tokens import api_token_create
from scheduling.models import PublishedPort, Workload
from scheduling.models import WorkloadState as S
from scheduling.services.access import NOT_PUBLISHED_SIMULATED, workload_ports_record
from scheduling.services.cycle import scheduling_cycle_run
from tests.conftest import free_port
from tests.docker_engine import TEST_IMAGE, docker_engine  # noqa: F401  (fixture)
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    H100,
    _no_scheduling_cycles,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    start_agent,
    wait_for,
)

pytestmark = pytest.mark.slow

HTTPD_IMAGE = "gpupool-test/httpd:ports"
# The app serves under the proxy's path (as Jupyter does with its base_url).
HTTPD_DOCKERFILE = f"""FROM {TEST_IMAGE}
CMD ["sh", "-c", "d=/tmp/www/proxy/$GPUPOOL_WORKLOAD_ID/8080; mkdir -p $d && echo hello from $GPUPOOL_WORKLOAD_ID > $d/index.html && exec httpd -f -p 8080 -h /tmp/www"]
"""


class Team:
    """A tenant, its owner's read-write token and a signed-in session of the owner."""

    def __init__(self, slug: str) -> None:
        self.tenant = tenant_create(
            slug=slug, name=slug.title(), owner_email=f"owner@{slug}.test", actor=Actor.system()
        )
        owner = Membership.objects.get(tenant=self.tenant, role=Role.OWNER).user
        _, self.token = api_token_create(
            tenant=self.tenant, name="proxy", scopes=[Scope.READ, Scope.WRITE], actor=Actor(user=owner)
        )
        client = Client()
        client.force_login(owner)
        self.session = client.cookies["sessionid"].value

    def api(self, portal_url: str) -> httpx.Client:
        return httpx.Client(
            base_url=portal_url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10
        )

    def browser(self, portal_url: str) -> httpx.Client:
        return httpx.Client(base_url=portal_url, cookies={"sessionid": self.session}, timeout=10)


def submit(team: Team, portal_url: str, **spec: Any) -> Workload:
    body = {"gpu_models": [H100], "cpu_millicores": 500, "ram_mib": 64, **spec}
    with team.api(portal_url) as api:
        r = api.post("/api/v1/instances/", json=body)
    assert r.status_code == 201, r.text
    return Workload.objects.get(pk=r.json()["id"])


def state(w: Workload) -> str:
    return Workload.objects.get(pk=w.pk).state


def access(team: Team, portal_url: str, w: Workload) -> dict[str, Any]:
    with team.api(portal_url) as api:
        r = api.get(f"/api/v1/instances/{w.pk}/")
    assert r.status_code == 200, r.text
    return r.json()["access"]


@pytest.fixture
def httpd_image(docker_engine: docker.DockerClient) -> str:  # noqa: F811
    """The busybox image with httpd as its command (an instance runs its image's command); built
    from the local test image, no registry."""
    docker_engine.images.build(fileobj=io.BytesIO(HTTPD_DOCKERFILE.encode()), tag=HTTPD_IMAGE, rm=True)
    return HTTPD_IMAGE


@pytest.fixture
def containers(docker_engine: docker.DockerClient) -> Iterator[list[int]]:  # noqa: F811
    """Workload ids whose containers and networks go afterwards, whatever the test left."""
    ids: list[int] = []
    yield ids
    for wid in ids:
        with contextlib.suppress(docker.errors.NotFound):
            docker_engine.api.remove_container(f"gpupool-{wid}", force=True)
        with contextlib.suppress(docker.errors.NotFound):
            docker_engine.networks.get(f"gpupool-{wid}").remove()


def test_an_http_port_in_a_docker_instance_through_the_proxy(
    start_agent, running_portal, httpd_image, containers, docker_engine  # noqa: F811
):  # fmt: skip
    url = running_portal.url
    owner, other = Team("porta"), Team("portb")
    agent = start_agent(
        "ports-docker", gpus=1, runtime="docker",
        extra_args=("--advertise-address", "127.0.0.1", "--publish-address", "127.0.0.1"),
    )  # fmt: skip
    node = registered(agent)
    assert agent.stop() == 0  # its start command is edited below before the agent reads it

    w = submit(owner, url, image=httpd_image, ports=[8080, {"port": 7000, "protocol": "tcp"}])
    containers.append(w.pk)
    assert w.ports == [{"port": 7000, "protocol": "tcp"}, {"port": 8080, "protocol": "http"}]
    assert scheduling_cycle_run().ran and state(w) == S.SCHEDULED
    (command,) = NodeCommand.objects.filter(node=node, kind=CommandKind.START_WORKLOAD)
    assert command.payload["ports"] == w.ports
    command.payload["gpu_uuids"] = []  # no NVIDIA runtime here (see the module's docstring)
    command.save(update_fields=["payload"])
    # Before it runs, the API and the page give no address.
    assert [p["url"] for p in access(owner, url, w)["ports"]] == [None, None]
    agent.start()

    wait_for(lambda: state(w) == S.RUNNING, timeout=60, what="the instance to run")
    wait_for(lambda: PublishedPort.objects.filter(workload=w).count() == 2, what="the published ports")
    ports = {p["port"]: p for p in access(owner, url, w)["ports"]}
    info = docker_engine.api.inspect_container(f"gpupool-{w.pk}")
    published = {k: int(v[0]["HostPort"]) for k, v in info["NetworkSettings"]["Ports"].items()}
    proxy = f"{url}/proxy/{w.pk}/8080/"
    assert ports[8080] == {
        "port": 8080, "protocol": "http", "host_port": published["8080/tcp"], "host": None, "url": proxy,
        "note": "",
    }  # fmt: skip
    assert (ports[7000]["host"], ports[7000]["host_port"], ports[7000]["url"]) == (
        "127.0.0.1", published["7000/tcp"], None,
    )  # fmt: skip

    # The tenant's members: by token and by session, 200 and the app's page.
    expected = f"hello from {w.pk}\n"

    def fetch(client: httpx.Client) -> httpx.Response:
        return client.get(proxy)

    with owner.api(url) as api:
        r = wait_for(lambda: (r := fetch(api)).status_code == 200 and r, what="httpd to answer")
        assert r.text == expected
    with owner.browser(url) as browser:
        assert (fetch(browser).status_code, fetch(browser).text) == (200, expected)
        # The page lists the URL, as a link.
        page = browser.get(f"/workloads/{w.pk}/live/").text
        assert f'href="{proxy}"' in page and "data-port-url" in page
    # Anyone else: 404, as for a workload that does not exist.
    with other.api(url) as api, other.browser(url) as browser, httpx.Client(timeout=10) as anonymous:
        for client in (api, browser, anonymous):
            r = fetch(client)
            assert (r.status_code, r.text) == (404, "Not found.\n")
            assert client.get(f"{url}/proxy/{w.pk}/7000/").status_code == 404  # a TCP port: never proxied
        assert api.get(f"/api/v1/instances/{w.pk}/").status_code == 404

    # A share link: made by the owner, it opens the port to anyone holding it until revoked.
    with owner.api(url) as api:
        r = api.post(f"/api/v1/instances/{w.pk}/share-link/")
        assert r.status_code == 200, r.text
        (link,) = r.json()["urls"]
        assert link.startswith(f"{proxy}?gpupool_share=gpl_")
        assert access(owner, url, w)["share_link"]["created_at"]
    with httpx.Client(timeout=10) as stranger:
        first = stranger.get(link)
        assert first.status_code == 303 and first.headers["location"] == f"/proxy/{w.pk}/8080/"
        assert (
            f"Path=/proxy/{w.pk}/" in first.headers["set-cookie"]
            and "HttpOnly" in first.headers["set-cookie"]
        )
        r = stranger.get(proxy)
        assert (r.status_code, r.text) == (200, expected)
        # A forged or another workload's secret opens nothing.
        assert httpx.get(f"{proxy}?gpupool_share=gpl_forged", timeout=10).status_code == 404
        with owner.api(url) as api:
            assert api.delete(f"/api/v1/instances/{w.pk}/share-link/").status_code == 204
            assert api.delete(f"/api/v1/instances/{w.pk}/share-link/").status_code == 204  # idempotent
        assert stranger.get(proxy).status_code == 404
        assert httpx.get(link, timeout=10).status_code == 404
    actions = list(
        AuditEvent.objects.filter(action__startswith="workload.share_link")
        .order_by("id")
        .values_list("action", flat=True)
    )
    assert actions == ["workload.share_link.create", "workload.share_link.revoke"]

    # Stopped: its ports go with it.
    with owner.api(url) as api:
        assert api.post(f"/api/v1/instances/{w.pk}/stop/").status_code == 200
    wait_for(lambda: state(w) == S.STOPPED, timeout=60, what="the instance to stop")
    assert not PublishedPort.objects.filter(workload=w).exists()
    assert [p["url"] for p in access(owner, url, w)["ports"]] == [None, None]
    with owner.api(url) as api:
        assert fetch(api).status_code == 404


# --- what the proxy forwards, seen by an upstream of the test's own ---------------------------------


class Upstream:
    """An aiohttp server in a thread: ``headers`` answers what it received (and tries to set the
    portal's session cookie), ``echo`` streams the body back, ``slow`` answers after a pause, ``ws``
    echoes websocket messages."""

    def __init__(self) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _headers(self, request: web.Request) -> web.Response:
        response = web.json_response({"path": request.path_qs, "headers": dict(request.headers)})
        response.headers.add("Set-Cookie", "sessionid=planted; Path=/")
        response.headers.add("Set-Cookie", "app=1; Path=/")
        return response

    async def _echo(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        async for chunk in request.content.iter_chunked(65536):
            await response.write(chunk)
        await response.write_eof()
        return response

    async def _slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(3)
        return web.Response(text="late")

    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=["echo.v1"])
        await ws.prepare(request)
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                await ws.send_str(f"echo:{message.data}")
            elif message.type == WSMsgType.BINARY:
                await ws.send_bytes(message.data[::-1])
        return ws

    def start(self, prefix: str) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get(f"{prefix}headers", self._headers)
        app.router.add_post(f"{prefix}echo", self._echo)
        app.router.add_get(f"{prefix}slow", self._slow)
        app.router.add_get(f"{prefix}ws", self._ws)
        self.thread.start()

        async def serve() -> None:
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        asyncio.run_coroutine_threadsafe(serve(), self.loop).result(10)

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.stop()


def test_websockets_headers_streams_and_limits_through_the_proxy(
    start_agent, running_portal, upstream, settings  # noqa: F811
):  # fmt: skip
    url = running_portal.url
    owner, other = Team("wsa"), Team("wsb")
    agent = start_agent("ports-sim", gpus=1, extra_args=("--advertise-address", "127.0.0.1"))
    node = registered(agent)
    w = submit(owner, url, image="ghcr.io/acme/notebook:1", ports=[8765])
    assert scheduling_cycle_run().ran
    wait_for(lambda: state(w) == S.RUNNING, what="the instance to run")
    # The simulated runtime publishes nothing, and the API and the page say so: no URL.
    wait_for(lambda: PublishedPort.objects.filter(workload=w).exists(), what="the start report")
    (port,) = access(owner, url, w)["ports"]
    assert (port["url"], port["host_port"], port["note"]) == (None, None, NOT_PUBLISHED_SIMULATED)
    with owner.browser(url) as browser:
        page = browser.get(f"/workloads/{w.pk}/live/").text
        assert NOT_PUBLISHED_SIMULATED in page and "data-port-url" not in page
        assert browser.get(f"/proxy/{w.pk}/8765/").status_code == 404

    # The port as a node that published it on the test's own server would report it.
    prefix = f"/proxy/{w.pk}/8765/"
    upstream.start(prefix)
    workload_ports_record(workload=w, node_id=node.pk, result={"ports": {"8765": upstream.port}})
    (port,) = access(owner, url, w)["ports"]
    assert port["url"] == f"{url}{prefix}"

    # Headers: the app gets its own cookie and the query, never the portal's cookies or token;
    # it cannot set the portal's session cookie.
    cookies = {"sessionid": owner.session, "csrftoken": "c", "app": "mine"}
    with httpx.Client(base_url=url, cookies=cookies, timeout=10) as browser:
        r = browser.get(
            f"{prefix}headers?x=1", headers={"X-Custom": "kept", "Connection": "keep-alive, X-Custom"}
        )
        seen = r.json()
        assert r.status_code == 200 and seen["path"] == f"{prefix}headers?x=1"
        assert seen["headers"]["Cookie"] == "app=mine"
        assert "X-Custom" not in seen["headers"]  # named by Connection: hop-by-hop
        assert r.headers.get_list("set-cookie") == ["app=1; Path=/"]
    with owner.api(url) as api:
        seen = api.get(f"{prefix}headers").json()["headers"]
        assert "Authorization" not in seen and "Cookie" not in seen, sorted(seen.items())
        assert seen["X-Forwarded-Proto"] == "http" and seen["Host"] == f"127.0.0.1:{running_portal.port}"
        # An app's own Authorization passes (the member signed in by session).
        with owner.browser(url) as browser:
            own = browser.get(f"{prefix}headers", headers={"Authorization": "token jupyter-secret"}).json()
        assert own["headers"]["Authorization"] == "token jupyter-secret" and "Cookie" not in own["headers"]

        # A body streams both ways: 8 MiB sent in chunks comes back whole.
        blob = bytes(range(256)) * (32 * 1024)

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(blob), 1 << 20):
                yield blob[i : i + (1 << 20)]

        r = api.post(f"{prefix}echo", content=chunks())
        assert r.status_code == 200 and r.content == blob
        # Over the body limit: 413, by its length or as it streams.
        settings.PROXY_MAX_BODY_BYTES = 1 << 20
        assert api.post(f"{prefix}echo", content=blob).status_code == 413
        assert api.post(f"{prefix}echo", content=chunks()).status_code == 413
        settings.PROXY_MAX_BODY_BYTES = 100 << 20
        # An upstream slower than the idle timeout: 504.
        settings.PROXY_IDLE_TIMEOUT_S = 0.5
        running_portal.stop()  # the proxy's client is made per event loop: a new loop, new timeouts
        running_portal.start()
        url = running_portal.url
        assert api.get(f"{prefix}slow").status_code == 504
        settings.PROXY_IDLE_TIMEOUT_S = 300.0

    # Websockets: the subprotocol, text and bytes both ways, for the tenant only.
    ws_url = f"ws://127.0.0.1:{running_portal.port}{prefix}ws"
    with ws_connect(
        ws_url, additional_headers={"Authorization": f"Bearer {owner.token}"}, subprotocols=["echo.v1"]
    ) as ws:
        assert ws.subprotocol == "echo.v1"
        ws.send("hi")
        assert ws.recv(timeout=5) == "echo:hi"
        ws.send(b"\x00\x01\x02")
        assert ws.recv(timeout=5) == b"\x02\x01\x00"
    with ws_connect(ws_url, additional_headers={"Cookie": f"sessionid={owner.session}"}) as ws:
        ws.send("by session")
        assert ws.recv(timeout=5) == "echo:by session"
    for headers in ({"Authorization": f"Bearer {other.token}"}, {"Cookie": f"sessionid={other.session}"}, {}):
        with pytest.raises(InvalidStatus) as refused:
            ws_connect(ws_url, additional_headers=headers).close()
        assert refused.value.response.status_code == 404
    # A browser's handshake from another site is refused whoever's cookie it carries.
    with pytest.raises(InvalidStatus):
        ws_connect(
            ws_url, additional_headers={"Cookie": f"sessionid={owner.session}"}, origin="http://evil.test"
        ).close()

    # The concurrency limit: over it, 503 until a connection closes.
    settings.PROXY_MAX_CONNECTIONS_PER_WORKLOAD = 1
    with ws_connect(ws_url, additional_headers={"Authorization": f"Bearer {owner.token}"}) as held:
        held.send("x")
        assert held.recv(timeout=5) == "echo:x"
        with owner.api(url) as api:
            assert api.get(f"{prefix}headers").status_code == 503
    time.sleep(0.2)
    with owner.api(url) as api:
        assert api.get(f"{prefix}headers").status_code == 200
    settings.PROXY_MAX_CONNECTIONS_PER_WORKLOAD = 64
    assert json.dumps(access(owner, url, w))  # still serialisable with the port published


def test_on_a_proxy_origin_of_its_own_members_pass_by_ticket_and_the_portal_stays_apart(
    start_agent, running_portal, upstream, settings  # noqa: F811
):  # fmt: skip
    """``PROXY_ORIGIN``: the apps on http://localhost:<port>, the portal on http://127.0.0.1:<port>
    (two origins to a browser: cookies of one never go to the other)."""
    url = running_portal.url
    apps = f"http://localhost:{running_portal.port}"
    settings.PROXY_ORIGIN = apps
    owner, other = Team("origa"), Team("origb")
    agent = start_agent("ports-origin", gpus=1, extra_args=("--advertise-address", "127.0.0.1"))
    node = registered(agent)
    w = submit(owner, url, image="ghcr.io/acme/notebook:1", ports=[8765])
    assert scheduling_cycle_run().ran
    wait_for(lambda: state(w) == S.RUNNING, what="the instance to run")
    wait_for(lambda: PublishedPort.objects.filter(workload=w).exists(), what="the start report")
    prefix = f"/proxy/{w.pk}/8765/"
    upstream.start(prefix)
    workload_ports_record(workload=w, node_id=node.pk, result={"ports": {"8765": upstream.port}})
    (port,) = access(owner, url, w)["ports"]
    assert port["url"] == f"{apps}{prefix}"

    with owner.api(url) as api:
        # A token works on the apps' origin only; the portal is not served there.
        assert api.get(f"{apps}{prefix}headers").status_code == 200
        assert api.get(f"{url}{prefix}headers").status_code == 404
        assert api.get(f"{apps}/api/v1/instances/").status_code == 404
        assert api.get(f"{url}/api/v1/instances/").status_code == 200
    # A member's browser: the page's link goes through the portal for a ticket, which the apps'
    # origin turns into a cookie of its own; the portal's session never goes there, and would not
    # count if it did.
    with owner.browser(url) as browser:
        page = browser.get(f"/workloads/{w.pk}/live/").text
        assert f'href="/workloads/{w.pk}/open/8765/"' in page
        r = browser.get(f"/workloads/{w.pk}/open/8765/")
        assert r.status_code == 302 and r.headers["location"].startswith(f"{apps}{prefix}?gpupool_ticket=")
        ticket_url = r.headers["location"]
    with httpx.Client(timeout=10, cookies={"sessionid": owner.session}) as app_browser:
        assert app_browser.get(f"{apps}{prefix}headers").status_code == 404  # the session: not here
        r = app_browser.get(ticket_url)
        assert r.status_code == 303 and r.headers["location"] == prefix
        assert f"gpupool_member_{w.pk}=" in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]
        seen = app_browser.get(f"{apps}{prefix}headers")
        assert seen.status_code == 200 and "Cookie" not in seen.json()["headers"], seen.json()["headers"].get(
            "Cookie"
        )  # none of the portal's
        # The same cookie and ticket do not open another workload, and a forged ticket nothing.
        assert app_browser.get(f"{apps}/proxy/{w.pk + 1}/8765/headers").status_code == 404
    assert httpx.get(f"{apps}{prefix}headers?gpupool_ticket=forged", timeout=10).status_code == 404
    # Another tenant's member gets no ticket for it.
    with other.browser(url) as browser:
        assert browser.get(f"/workloads/{w.pk}/open/8765/").status_code == 404
    # A websocket on the apps' origin, from a page of that origin, by the member cookie.
    with httpx.Client(timeout=10) as app_browser:
        app_browser.get(ticket_url)
        member = app_browser.cookies.get(f"gpupool_member_{w.pk}")
    ws_url = f"ws://localhost:{running_portal.port}{prefix}ws"
    with ws_connect(
        ws_url, additional_headers={"Cookie": f"gpupool_member_{w.pk}={member}"}, origin=apps
    ) as ws:
        ws.send("hi")
        assert ws.recv(timeout=5) == "echo:hi"
