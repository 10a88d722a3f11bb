from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from hypothesis import settings as hypothesis_settings

from portal.actors import Actor
from portal.models import Membership, Role, Tenant, User
from portal.services.tenants import tenant_create
from portal.services.tokens import api_token_create

# In CI property tests replay the same examples every run (a failure there is then reproducible
# and never a matter of luck); developers' runs keep exploring new ones.
hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")


def cache_empty() -> None:
    """Forget what the default cache holds. On Redis only the cache's own keys go (django-redis's
    ``delete_pattern``, under its KEY_PREFIX): ``clear()`` would flush the whole database, and the
    Celery broker's queues and bindings with it."""
    from django.core.cache import caches
    from django_redis.cache import RedisCache

    cache = caches["default"]
    if isinstance(cache, RedisCache):
        cache.delete_pattern("*")
    else:
        cache.clear()


@pytest.fixture(autouse=True)
def _empty_cache():
    """Cached answers, throttle and sign-in counters must not leak from one test into the next."""
    from portal.ratelimit import reset_all

    cache_empty()
    reset_all()
    yield
    cache_empty()
    reset_all()


@pytest.fixture(autouse=True)
def _root_logger_kept():
    """The root logger's level as settings.LOGGING set it, back after every test. A Celery worker
    started in a test (``start_worker``) sets the root level to the worker's log level (ERROR unless
    it is given one), and nothing set it back: any later test that reads INFO records saw none."""
    import logging

    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


@pytest.fixture
def make_tenant(db):
    def make(slug: str = "acme", owner_email: str | None = None, **kwargs) -> Tenant:
        return tenant_create(
            slug=slug,
            name=kwargs.pop("name", slug.title()),
            owner_email=owner_email or f"owner@{slug}.test",
            owner_password=kwargs.pop("owner_password", "pw-for-tests-1"),
            actor=Actor.system(),
            **kwargs,
        )

    return make


@pytest.fixture
def tenant(make_tenant) -> Tenant:
    return make_tenant("acme")


@pytest.fixture
def owner(tenant) -> User:
    return Membership.objects.get(tenant=tenant, role=Role.OWNER).user


@pytest.fixture
def make_token(db):
    def make(tenant: Tenant, scopes=("read", "write", "billing", "admin"), **kwargs) -> str:
        """A token made by the tenant's (first) owner, as the tokens page would make it."""
        owner = Membership.objects.filter(tenant=tenant, role=Role.OWNER).order_by("pk").first()
        _, plaintext = api_token_create(
            tenant=tenant,
            name=kwargs.pop("name", "test"),
            scopes=scopes,
            actor=Actor(user=owner.user),
            **kwargs,
        )
        return plaintext

    return make


@pytest.fixture
def api(client):
    """A Django test client that sends a bearer token: ``api(token).get(url)``."""

    def with_token(token: str):
        from django.test import Client

        return Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    return with_token


@contextmanager
def keeping_the_test_connection():
    """Django's handlers (WSGI, and ASGI for agent requests that fall back to it) send
    request_started and request_finished, whose receiver ``close_old_connections`` would close the
    database connection that the test's transaction lives on; Django's own test client unhooks it
    the same way, around each request. Nested uses leave the reconnecting to the outermost."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    started = request_started.disconnect(close_old_connections)
    finished = request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        if started:
            request_started.connect(close_old_connections)
        if finished:
            request_finished.connect(close_old_connections)


@pytest.fixture
def handlers_keep_the_test_connection():
    """``keeping_the_test_connection`` for the whole test."""
    with keeping_the_test_connection():
        yield


def postgres_only(reason: str) -> None:
    """Skip the calling test, saying why, unless the suite runs on PostgreSQL (CI does)."""
    __tracebackhide__ = True  # the skip is reported at the caller's line
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip(f"needs PostgreSQL: {reason}")


def python_run(code: str, *, timeout: float = 60, **env: str | None) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter at the repository's root, with this process's environment
    changed by ``env`` (a None value removes the variable): settings and start-up as a new process
    reads them. Not checked: the caller asserts on the return code, the output and the errors."""
    environ = {**os.environ, **env}
    environ = {k: v for k, v in environ.items() if v is not None}
    return subprocess.run(
        [sys.executable, "-c", code],
        env=environ,
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def private_redis():
    """A Redis server of this test's own, which the test can stop and start again."""
    binary = shutil.which("redis-server")
    # scripts/install-system-deps (run by `make test`) installs it: missing, the test fails.
    assert binary is not None, "redis-server is not installed: run scripts/install-system-deps"
    port = free_port()
    procs: list[subprocess.Popen] = []

    def start() -> None:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"],
            stdout=subprocess.DEVNULL,
        )
        procs.append(proc)
        for _ in range(100):
            try:
                redis.Redis(port=port).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop() -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(5)

    start()
    yield f"redis://127.0.0.1:{port}/0", start, stop
    stop()
