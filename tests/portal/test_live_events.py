"""The events websocket: authenticated, and a tenant never receives another tenant's event."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client

from portal.asgi import application
from portal.events import publish, publish_many
from portal.models import Membership, Role, User

pytestmark = pytest.mark.django_db(transaction=True)

# Like a Celery task or a view would: in a thread of its own, whose connection is closed after.
publish_from_thread = database_sync_to_async(publish)
publish_many_from_thread = database_sync_to_async(publish_many)


def _session_cookie(user) -> bytes:
    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()


def _socket(cookie: bytes | None) -> WebsocketCommunicator:
    headers = [(b"origin", b"http://testserver"), (b"host", b"testserver")]
    if cookie:
        headers.append((b"cookie", cookie))
    return WebsocketCommunicator(application, "/ws/events/", headers=headers)


def test_events_reach_only_their_tenant(make_tenant):
    a = make_tenant("alpha")
    b = make_tenant("beta")
    user_a = Membership.objects.get(tenant=a, role=Role.OWNER).user
    user_b = Membership.objects.get(tenant=b, role=Role.OWNER).user
    cookie_a, cookie_b = _session_cookie(user_a), _session_cookie(user_b)

    async def scenario():
        sock_a, sock_b = _socket(cookie_a), _socket(cookie_b)
        assert (await sock_a.connect())[0] and (await sock_b.connect())[0]
        await publish_from_thread(
            tenant_id=a.pk, event={"type": "workload.state", "id": 1, "state": "RUNNING"}
        )
        assert await sock_a.receive_json_from(timeout=5) == {
            "type": "workload.state",
            "id": 1,
            "state": "RUNNING",
        }
        assert await sock_b.receive_nothing(timeout=0.5)
        await publish_from_thread(tenant_id=b.pk, event={"type": "workload.state", "id": 2})
        assert (await sock_b.receive_json_from(timeout=5))["id"] == 2
        assert await sock_a.receive_nothing(timeout=0.5)
        await sock_a.disconnect()
        await sock_b.disconnect()

    async_to_sync(scenario)()


def test_staff_receive_fleet_events_and_tenants_do_not(make_tenant):
    tenant = make_tenant("alpha")
    member = Membership.objects.get(tenant=tenant).user
    staff = User.objects.create_user(email="ops@gpupool.test", password="x", is_staff=True)
    cookie_member, cookie_staff = _session_cookie(member), _session_cookie(staff)

    async def scenario():
        sock_member, sock_staff = _socket(cookie_member), _socket(cookie_staff)
        assert (await sock_member.connect())[0] and (await sock_staff.connect())[0]
        await publish_from_thread(tenant_id=None, event={"type": "node.state", "node": 7}, staff=True)
        assert (await sock_staff.receive_json_from(timeout=5))["node"] == 7
        assert await sock_member.receive_nothing(timeout=0.5)
        await sock_member.disconnect()
        await sock_staff.disconnect()

    async_to_sync(scenario)()


def test_anonymous_sockets_are_refused(db):
    async def scenario():
        sock = _socket(None)
        connected, code = await sock.connect()
        assert not connected and code == 4401

    async_to_sync(scenario)()


def test_events_published_together_arrive_in_order_and_only_to_their_tenant(make_tenant):
    a = make_tenant("alpha")
    b = make_tenant("beta")
    user_a = Membership.objects.get(tenant=a, role=Role.OWNER).user
    user_b = Membership.objects.get(tenant=b, role=Role.OWNER).user
    cookie_a, cookie_b = _session_cookie(user_a), _session_cookie(user_b)

    async def scenario():
        sock_a, sock_b = _socket(cookie_a), _socket(cookie_b)
        assert (await sock_a.connect())[0] and (await sock_b.connect())[0]
        await publish_many_from_thread(
            events=[(a.pk, {"id": 1}), (b.pk, {"id": 2}), (a.pk, {"id": 3}), (None, {"id": 4})]
        )
        assert [(await sock_a.receive_json_from(timeout=5))["id"] for _ in range(2)] == [1, 3]
        assert (await sock_b.receive_json_from(timeout=5))["id"] == 2
        assert await sock_a.receive_nothing(timeout=0.5)
        assert await sock_b.receive_nothing(timeout=0.2)
        await sock_a.disconnect()
        await sock_b.disconnect()

    async_to_sync(scenario)()


def test_sends_from_sync_code_share_one_loop_and_the_layers_connections(db):
    """Views, tasks and on-commit callbacks send live events through one event loop per process
    (``portal.events._SenderLoop``): with a new loop per send (``async_to_sync``), channels_redis
    opened a Redis connection for every event. Events sent from several threads arrive in order."""
    import threading

    import redis
    from channels.layers import get_channel_layer

    from portal import events

    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(events.tenant_group(7), channel)
    on_redis = "redis" in settings.CHANNEL_LAYERS["default"]["BACKEND"].lower()

    def connections_received() -> int:
        return redis.Redis.from_url(settings.REDIS_URL).info("stats")["total_connections_received"]

    events._send(events.tenant_group(7), {"type": "t", "i": 0})  # the loop and its connections exist
    before = connections_received() if on_redis else 0
    loops = set()

    def send(first: int) -> None:
        for i in range(first, first + 10):
            events._send(events.tenant_group(7), {"type": "t", "i": i})
        loops.add(events._SenderLoop.loop())

    for first in (1, 11, 21):  # one thread after another, so the order is known
        thread = threading.Thread(target=send, args=(first,))
        thread.start()
        thread.join()
    if on_redis:  # 30 sends; a connection each before (the count is the server's, so allow a few)
        assert connections_received() - before <= 3
    assert len(loops) == 1 and next(iter(loops)).is_running()
    # (each receive here runs on a new loop of async_to_sync's, with a connection of its own)
    got = [async_to_sync(layer.receive)(channel)["event"]["i"] for _ in range(31)]
    assert got == list(range(31))
