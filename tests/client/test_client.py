"""``gpupool.client`` against the live portal: pagination, retries (429 with Retry-After, lost
connections), idempotent creates, errors; the client held to the portal's OpenAPI schema; and the
distribution's independence from the server."""

from __future__ import annotations

import ast
import asyncio
import itertools
import re
import subprocess
import sys
import time
import tomllib
from datetime import date, datetime
from decimal import Decimal

import httpx
import pytest
import yaml
from django.test import Client as DjangoClient

from gpupool import ApiError, AsyncClient, Client, ConnectionFailed
from gpupool.models import MODELS
from portal.api.throttling import TokenRateThrottle
from portal.models import ApiToken
from tests.client.conftest import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


class Recording(httpx.HTTPTransport):
    """A real transport that records each answer's status; ``lose`` requests are sent and then
    reported lost (a read error), ``refuse`` ones fail to connect before being sent."""

    def __init__(self, refuse: int = 0, lose: int = 0) -> None:
        super().__init__()
        self.statuses: list[int] = []
        self.answers: list[tuple[float, int, str]] = []  # (when, status, Retry-After)
        self.refuse, self.lose = refuse, lose

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.refuse:
            self.refuse -= 1
            raise httpx.ConnectError("refused (test)", request=request)
        response = super().handle_request(request)
        response.read()
        self.statuses.append(response.status_code)
        self.answers.append((time.monotonic(), response.status_code, response.headers.get("Retry-After", "")))
        if self.lose:
            self.lose -= 1
            raise httpx.ReadError("connection lost after sending (test)", request=request)
        return response


@pytest.fixture
def portal(live_server, tenant, make_token):
    return live_server.url, make_token(tenant)


def test_iterates_over_every_cursor_page(portal, tenant):
    url, token = portal
    with Client(url, token) as c:
        made = [c.create_token(name=f"t{i}", scopes=["read"]).id for i in range(7)]
    transport = Recording()
    with Client(url, token, transport=transport) as c:
        listed = [t.id for t in c.tokens(page_size=3)]
    assert set(made) <= set(listed) and len(listed) == len(set(listed)) == 8  # and the fixture's own
    assert transport.statuses == [200, 200, 200]  # 3 + 3 + 2


def test_a_429_is_retried_after_retry_after(portal, monkeypatch):
    url, token = portal
    monkeypatch.setattr(TokenRateThrottle, "rate", "2/s", raising=False)  # DRF reads `rate` first
    # The positive control: the portal does throttle.
    with Client(url, token, retries=0) as c, pytest.raises(ApiError) as refused:
        for _ in range(5):
            c.me()
    assert (refused.value.status, refused.value.code) == (429, "throttled")
    transport = Recording()
    with Client(url, token, transport=transport, retries=5) as c:
        for _ in range(5):
            assert c.me().tenant["slug"] == "acme"
    assert 429 in transport.statuses and transport.statuses[-1] == 200
    # Each 429's next request waited what its Retry-After said (whole seconds, as DRF rounds).
    for (at, status, retry_after), (next_at, _, _) in itertools.pairwise(transport.answers):
        if status == 429:
            assert retry_after.isdigit() and next_at - at >= int(retry_after) - 0.05, transport.answers
    # And the async client alike.
    recorded = AsyncRecording()

    async def go():
        async with AsyncClient(url, token, transport=recorded, retries=5) as c:
            return [(await c.me()).tenant["slug"] for _ in range(5)]

    assert asyncio.run(go()) == ["acme"] * 5
    assert 429 in recorded.statuses and recorded.statuses[-1] == 200


def test_connection_errors_are_retried_and_give_up_with_connection_failed(portal):
    url, token = portal
    transport = Recording(refuse=2)
    with Client(url, token, transport=transport, backoff=0.01) as c:
        assert c.me().tenant["slug"] == "acme"
    assert transport.statuses == [200]
    with Client("http://127.0.0.1:9", token, retries=2, backoff=0.01) as c, pytest.raises(ConnectionFailed):
        c.me()


def test_a_create_whose_answer_is_lost_is_retried_and_made_once(portal, tenant):
    url, token = portal
    transport = Recording(lose=1)
    with Client(url, token, transport=transport, backoff=0.01) as c:
        made = c.create_token(name="once", scopes=["read"])
    assert transport.statuses == [201, 201]  # sent twice, the second answered from the first
    assert ApiToken.objects.filter(tenant=tenant, name="once").count() == 1
    assert made.token.startswith("gpp_")


def test_a_lost_answer_to_an_unsafe_call_is_not_retried(portal, tenant, make_token):
    url, token = portal
    victim = ApiToken.objects.get(tenant=tenant)
    transport = Recording(lose=1)
    with Client(url, token, transport=transport, backoff=0.01) as c, pytest.raises(ConnectionFailed):
        c.revoke_token(victim.pk)
    assert transport.statuses == [200]  # sent once


def test_errors_carry_the_code_and_fields(portal):
    url, token = portal
    with Client(url, token) as c:
        with pytest.raises(ApiError) as bad:
            c.create_volume(name="", region="nowhere", size_gib=0)
        assert bad.value.status == 400 and bad.value.code == "invalid"
        assert set(bad.value.fields) & {"name", "region", "size_gib"}
        with pytest.raises(ApiError) as missing:
            c.workload("job", 999_999)
        assert (missing.value.status, missing.value.code) == (404, "not_found")


def test_models_are_typed(portal, tenant):
    url, token = portal
    with Client(url, token) as c:
        t = c.create_token(name="typed", scopes=["read"])
        assert isinstance(t.created, datetime) and t.created.tzinfo is not None
        b = c.budget()
        assert isinstance(b.amount, Decimal) and isinstance(b.period_start, date)


def test_the_async_client(portal, tenant):
    url, token = portal

    async def go():
        async with AsyncClient(url, token) as c:
            made = await c.create_secret(name="from-async", value="v")
            names = [s.name async for s in c.secrets()]
            me = await c.me()
            return made, names, me

    made, names, me = asyncio.run(go())
    assert made.name == "from-async" and names == ["from-async"] and me.tenant["slug"] == "acme"


class AsyncRecording(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.statuses: list[int] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        await response.aread()
        self.statuses.append(response.status_code)
        return response


def test_the_async_client_iterates_over_every_cursor_page(portal, tenant):
    url, token = portal
    with Client(url, token) as c:
        made = {c.create_token(name=f"a{i}", scopes=["read"]).id for i in range(4)}
    transport = AsyncRecording()

    async def go():
        async with AsyncClient(url, token, transport=transport) as c:
            return [t.id async for t in c.tokens(page_size=2)]

    listed = asyncio.run(go())
    assert made <= set(listed) and len(listed) == len(set(listed)) == 5  # and the fixture's own
    assert transport.statuses == [200, 200, 200]  # 2 + 2 + 1


def test_webhook_calls_are_repeated_only_where_a_repeat_is_harmless(portal, tenant):
    from portal.models import AuditEvent
    from webhooks.models import WebhookEndpoint

    url, token = portal
    transport = Recording(lose=1)
    with Client(url, token, transport=transport, backoff=0.01) as c:
        made = c.create_webhook(url="https://hooks.example.com/in", event_types=["budget.alert"])
    assert transport.statuses == [201, 201] and WebhookEndpoint.objects.count() == 1  # made once
    assert made.secret.startswith("whsec_") and made.event_types == ["budget.alert"]
    transport = Recording(lose=1)
    with Client(url, token, transport=transport, backoff=0.01) as c:
        changed = c.update_webhook(made.id, enabled=False, description="paused")
    assert transport.statuses == [200, 200] and (changed.enabled, changed.description) == (False, "paused")
    # A second roll would make a second secret and lose the first answer's: never repeated.
    transport = Recording(lose=1)
    with Client(url, token, transport=transport, backoff=0.01) as c, pytest.raises(ConnectionFailed):
        c.roll_webhook_secret(made.id)
    assert transport.statuses == [200]
    assert AuditEvent.objects.filter(action="webhook.roll_secret").count() == 1
    with Client(url, token) as c:
        assert [e.id for e in c.webhooks(enabled=False)] == [made.id]
        assert [e.id for e in c.webhooks(enabled=True)] == []
        assert {t.name for t in c.webhook_event_types()} >= {"workload.state", "invoice.overdue"}
        with pytest.raises(ApiError) as bad:
            c.update_webhook(made.id, url="https://169.254.169.254/latest")
        assert bad.value.status == 400 and "url" in bad.value.fields
        c.delete_webhook(made.id)
        assert list(c.webhooks()) == []


def test_the_client_and_the_schema_agree(tenant, make_token):
    """Every call the client makes is an operation of the schema, and every model's fields are its
    component's properties, with decimals, times and days typed as the schema says."""
    # Every operation the client's source names (``_op(method, path)``), whichever calls ran before.
    source = (ROOT / "client" / "src" / "gpupool" / "client.py").read_text()
    OPERATIONS = {
        (node.args[0].value, node.args[1].value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_op"
    }
    token = make_token(tenant)
    raw = DjangoClient(HTTP_AUTHORIZATION=f"Bearer {token}").get("/api/schema/").content
    schema = yaml.safe_load(raw)
    operations = {(method.upper(), path) for path, ops in schema["paths"].items() for method in ops}
    assert OPERATIONS and operations >= OPERATIONS, sorted(OPERATIONS - operations)
    components = schema["components"]["schemas"]
    formats = {"decimal": Decimal, "date-time": datetime, "date": date}
    for model in MODELS:
        properties = components[model.SCHEMA]["properties"]
        fields = model.api_fields()
        assert set(fields) == set(properties), (model.__name__, set(fields) ^ set(properties))
        for name, prop in properties.items():
            expected = formats.get(prop.get("format"))
            if expected is not None:
                assert fields[name] is expected, (model.__name__, name, fields[name], expected)
            elif fields[name] in (datetime, date) or (
                fields[name] is Decimal and prop.get("type") != "string"
            ):
                # (Some money fields are decimal strings without the format: Decimal is right there.)
                raise AssertionError(f"{model.__name__}.{name} is {fields[name]}, the schema says {prop}")
    # The creates the client calls document the header the client sends.
    for method, path in OPERATIONS:
        if method == "POST" and not path.endswith("}/") and "{" not in path:
            params = schema["paths"][path]["post"].get("parameters", [])
            assert any(p["name"] == "Idempotency-Key" for p in params), path


def test_the_distribution_needs_no_server():
    project = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "gpupool"
    assert not any(d.lower().startswith(("django", "celery", "psycopg")) for d in project["dependencies"])
    code = (
        "import sys; import gpupool.cli, gpupool.client; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'django', 'portal', 'scheduling', 'metering', 'nodes', 'rest_framework'}); print(bad)"
    )
    env = {"PYTHONPATH": str(ROOT / "client" / "src"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/",
                         timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert server["name"] == "gpupool-server"


def test_every_library_the_client_imports_is_a_declared_dependency():
    """``pip install gpupool`` installs what the package imports, and nothing of the server's:
    each third-party import in client/src is in its dependencies (``keyring`` in its extra)."""
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower() for d in client["dependencies"]}
    extras = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower() for ds in client["optional-dependencies"].values()
              for d in ds}  # fmt: skip
    distribution = {"yaml": "pyyaml"}  # import name -> distribution name, where they differ
    imported = set()
    for path in (ROOT / "client" / "src" / "gpupool").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {
        n for n in imported if n not in sys.stdlib_module_names and n not in ("gpupool", "__future__")
    }
    assert third_party == {"httpx", "click", "rich", "yaml", "keyring"}, third_party
    needed = {distribution.get(n, n) for n in third_party}
    assert needed - {"keyring"} <= declared and "keyring" in extras, (needed, declared, extras)


def test_a_client_from_the_environment_or_a_saved_profile(portal, monkeypatch, tmp_path):
    from gpupool import config

    url, token = portal
    monkeypatch.setenv("GPUPOOL_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("GPUPOOL_NO_KEYRING", "1")
    for name in ("GPUPOOL_URL", "GPUPOOL_TOKEN", "GPUPOOL_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(config.NotConfigured, match="gpupool login"):
        Client.from_config()
    config.save_profile("lab", url, token, make_default=True)
    with Client.from_config() as c, Client.from_config("lab") as named:
        assert c.me().tenant["slug"] == named.me().tenant["slug"] == "acme"
    with pytest.raises(config.NotConfigured, match="No profile named 'other'"):
        Client.from_config("other")
    monkeypatch.setenv("GPUPOOL_URL", url)
    monkeypatch.setenv("GPUPOOL_TOKEN", "gpp_from_the_environment")  # the environment wins
    with Client.from_config(retries=0) as c, pytest.raises(ApiError) as refused:
        c.me()
    assert refused.value.status == 401

    async def go():
        monkeypatch.setenv("GPUPOOL_TOKEN", token)
        async with AsyncClient.from_config() as c:
            return (await c.me()).tenant["slug"]

    assert asyncio.run(go()) == "acme"


def test_the_async_client_follows_logs_where_the_server_does_not_stream(portal, tenant, submit, cycle):
    """This live server is WSGI: ``follow`` is a 400 there, and the client polls instead."""
    from scheduling.services.lifecycle import workload_on_exited
    from tests.scheduling.conftest import H100
    from tests.scheduling.logs_fixtures import batch, register_node

    url, token = portal
    node = register_node()
    job = submit(tenant, gpu_models=[H100])
    cycle()
    now = time.time()
    assert node.send(batch(1, job, [[now, "stdout", "a"], [now + 0.001, "stderr", "b"]])).status_code == 200
    workload_on_exited(node_id=node.node.pk, workload_id=job.pk, state="exited", exit_code=0)

    async def go():
        async with AsyncClient(url, token) as c:
            return [(x["stream"], x["text"]) async for x in c.follow_logs("job", job.pk, poll_s=0.05)]

    assert asyncio.run(go()) == [("stdout", "a"), ("stderr", "b")]
