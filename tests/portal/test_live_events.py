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


def _member(tenant, role: str, email: str) -> Membership:
    user = User.objects.create_user(email=email, password="pw-for-tests-1")
    return Membership.objects.create(tenant=tenant, user=user, role=role)


@database_sync_to_async
def _as_system(fn, **kwargs):
    from portal.actors import Actor

    return fn(**kwargs, actor=Actor.system())


def test_a_member_removed_while_connected_is_cut_off(make_tenant):
    from portal.services.members import membership_remove

    tenant = make_tenant("alpha")
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
    leaving = _member(tenant, Role.MEMBER, "leaving@alpha.test")
    cookie_owner, cookie_leaving = _session_cookie(owner), _session_cookie(leaving.user)
    event = {"type": "workload.state", "id": 1}

    async def scenario():
        sock_owner, sock_leaving = _socket(cookie_owner), _socket(cookie_leaving)
        assert (await sock_owner.connect())[0] and (await sock_leaving.connect())[0]
        await publish_from_thread(tenant_id=tenant.pk, event=event)
        assert await sock_owner.receive_json_from(timeout=5) == event  # both get it (control)
        assert await sock_leaving.receive_json_from(timeout=5) == event
        await _as_system(membership_remove, membership=leaving)
        closed = await sock_leaving.receive_output(timeout=5)
        assert closed == {"type": "websocket.close", "code": 4403}
        await publish_from_thread(tenant_id=tenant.pk, event={**event, "id": 2})
        assert (await sock_owner.receive_json_from(timeout=5))["id"] == 2
        assert await sock_leaving.receive_nothing(timeout=0.5)
        await sock_owner.disconnect()

    async_to_sync(scenario)()


def test_budget_alerts_reach_only_the_roles_that_see_billing(make_tenant):
    from decimal import Decimal

    from django.utils import timezone

    from metering.models import Budget
    from metering.services.budgets import budget_alert_fire

    tenant = make_tenant("alpha")
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
    people = {
        "owner": owner,
        "billing": _member(tenant, Role.BILLING, "pay@alpha.test").user,
        "member": _member(tenant, Role.MEMBER, "dev@alpha.test").user,
        "viewer": _member(tenant, Role.VIEWER, "look@alpha.test").user,
    }
    cookies = {name: _session_cookie(user) for name, user in people.items()}
    budget = Budget.objects.create(tenant=tenant, monthly_limit=Decimal("100"))

    async def scenario():
        socks = {name: _socket(cookie) for name, cookie in cookies.items()}
        for sock in socks.values():
            assert (await sock.connect())[0]
        await publish_from_thread(tenant_id=tenant.pk, event={"type": "workload.state", "id": 1})
        for sock in socks.values():  # every role sees workloads (control)
            assert (await sock.receive_json_from(timeout=5))["id"] == 1
        await database_sync_to_async(budget_alert_fire)(
            budget=budget, threshold=80, amount=Decimal("81.5"), currency="USD", now=timezone.now()
        )
        for name in ("owner", "billing"):
            alert = await socks[name].receive_json_from(timeout=5)
            assert alert["type"] == "budget.alert" and alert["amount"] == "81.50"
        for name in ("member", "viewer"):
            assert await socks[name].receive_nothing(timeout=0.5), name
        for sock in socks.values():
            await sock.disconnect()

    async_to_sync(scenario)()


def test_a_demoted_member_stops_receiving_billing_events_at_once(make_tenant):
    from portal.services.members import membership_change_role

    tenant = make_tenant("alpha")
    payer = _member(tenant, Role.BILLING, "pay@alpha.test")
    cookie = _session_cookie(payer.user)
    alert = {"type": "budget.alert", "amount": "1.00"}

    async def scenario():
        sock = _socket(cookie)
        assert (await sock.connect())[0]
        await publish_from_thread(tenant_id=tenant.pk, event=alert, scope="billing")
        assert await sock.receive_json_from(timeout=5) == alert
        await _as_system(membership_change_role, membership=payer, role=Role.VIEWER)
        await publish_from_thread(tenant_id=tenant.pk, event=alert, scope="billing")
        await publish_from_thread(tenant_id=tenant.pk, event={"type": "workload.state", "id": 3})
        assert (await sock.receive_json_from(timeout=5))["id"] == 3  # still connected, as a viewer
        assert await sock.receive_nothing(timeout=0.5)
        await sock.disconnect()

    async_to_sync(scenario)()


def test_a_deactivated_account_loses_its_socket(make_tenant):
    tenant = make_tenant("alpha")
    person = _member(tenant, Role.ADMIN, "gone@alpha.test").user
    cookie = _session_cookie(person)

    def deactivate():
        person.is_active = False
        person.save()  # as the Django admin's user form saves it

    async def scenario():
        sock = _socket(cookie)
        assert (await sock.connect())[0]
        await publish_from_thread(tenant_id=tenant.pk, event={"type": "workload.state", "id": 1})
        assert (await sock.receive_json_from(timeout=5))["id"] == 1  # control
        await database_sync_to_async(deactivate)()
        assert await sock.receive_output(timeout=5) == {"type": "websocket.close", "code": 4403}

    async_to_sync(scenario)()
