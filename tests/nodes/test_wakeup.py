"""The command long poll's wake-up: one shared Redis pub/sub connection per process (per event loop),
a command wakes its node's poll at once, and Redis going away falls back to the database."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
from asgiref.sync import async_to_sync
from django.db import connection
from django_redis import get_redis_connection

from nodes.services import wakeup
from nodes.services.commands import node_command_enqueue
from tests.conftest import free_port

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def use_redis(settings):
    """``use_redis(url)``: REDIS_URL and the cache (whose client publishes the wake-ups) on ``url``,
    as settings.py sets them; the cache's connections to it are closed at the end."""

    def point(url: str) -> None:
        settings.REDIS_URL = url
        settings.CACHES = {
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": url,
                "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 2},
            }
        }

    yield point
    get_redis_connection("default").connection_pool.disconnect()


def wakeup_connections(url: str) -> list[dict]:
    client = redis.Redis.from_url(url)
    try:
        return [c for c in client.client_list() if c.get("name") == wakeup.listener_client_name()]
    finally:
        client.close()


def enqueue_after(delay: float, node, done: dict) -> threading.Thread:
    """Queue a ``drain`` for ``node`` after ``delay`` s from another thread (its own commit)."""

    def run():
        time.sleep(delay)
        try:
            node_command_enqueue(node=node, kind="drain", payload={})
            done["at"] = time.monotonic()
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


async def poll(agent, wait: float) -> tuple[float, dict]:
    response = await agent.arequest("GET", agent.url("commands"), params={"wait": wait})
    assert response.status_code == 200, response.content
    return time.monotonic(), response.json()


def test_concurrent_polls_share_one_connection_and_a_command_wakes_its_node_at_once(
    register_node, private_redis, use_redis
):
    url = private_redis[0]
    use_redis(url)
    agents = [register_node() for _ in range(20)]
    target = agents[7]
    target_node = target.node  # read here: threads below must not open connections of their own
    seen: dict = {}

    async def main():
        polls = [asyncio.create_task(poll(a, 2.5)) for a in agents]
        await asyncio.sleep(0.5)
        assert wakeup.wakeup_connected()
        seen["connections"] = len(wakeup_connections(url))
        done: dict = {}
        thread = await asyncio.to_thread(lambda: enqueue_after(0, target_node, done))
        results = await asyncio.gather(*polls)
        await asyncio.to_thread(thread.join)
        return done["at"], results

    started = time.monotonic()
    enqueued_at, results = async_to_sync(main)()
    assert seen["connections"] == 1  # twenty waiting polls, one Redis connection
    by_node = dict(zip([a.node_id for a in agents], results, strict=True))
    answered_at, body = by_node[target.node_id]
    assert [c["kind"] for c in body["commands"]] == ["drain"]
    assert answered_at - enqueued_at < 0.3, answered_at - enqueued_at  # woken, not polled
    for agent in agents:
        if agent is not target:
            at, other = by_node[agent.node_id]
            assert other == {"commands": []} and at - started >= 2.4  # the others slept their wait out
    # The connection belongs to the event loop: closed with it.
    for _ in range(20):
        if not wakeup_connections(url):
            break
        time.sleep(0.05)
    assert wakeup_connections(url) == []


def test_redis_going_away_falls_back_to_the_database_and_comes_back(register_node, private_redis, use_redis):
    url, start, stop = private_redis
    use_redis(url)
    agent = register_node()
    node = agent.node

    async def main():
        # Redis up: woken at once.
        done: dict = {}
        task = asyncio.create_task(poll(agent, 5))
        await asyncio.sleep(0.4)
        assert wakeup.wakeup_connected() and len(wakeup_connections(url)) == 1
        await asyncio.to_thread(lambda: enqueue_after(0, node, done).join())
        at, body = await task
        assert len(body["commands"]) == 1 and at - done["at"] < 0.3

        # Redis gone while a poll waits: the poll goes on (no error), checks the database about
        # every second, and so still gets a command queued meanwhile (whose wake-up is lost).
        task = asyncio.create_task(poll(agent, 6))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(stop)
        await asyncio.sleep(0.3)
        assert not wakeup.wakeup_connected()
        done = {}
        await asyncio.to_thread(lambda: enqueue_after(0, node, done).join())
        at, body = await task
        assert len(body["commands"]) == 1
        assert 0 <= at - done["at"] < 1.6, at - done["at"]

        # A poll while Redis is still away answers its empty list after its wait, without errors.
        started = time.monotonic()
        at, body = await poll(agent, 1.0)
        assert body == {"commands": []} and at - started >= 0.95

        # Redis back: the connection is made again (backoff) and wake-ups are immediate again.
        await asyncio.to_thread(start)
        for _ in range(100):
            if wakeup.wakeup_connected():
                break
            await asyncio.sleep(0.1)
        assert wakeup.wakeup_connected() and len(wakeup_connections(url)) == 1
        done = {}
        task = asyncio.create_task(poll(agent, 5))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(lambda: enqueue_after(0, node, done).join())
        at, body = await task
        assert len(body["commands"]) == 1 and at - done["at"] < 0.3

    async_to_sync(main)()


def test_redis_unreachable_from_the_start_is_no_error(register_node, use_redis):
    use_redis(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    agent = register_node()
    node = agent.node

    async def main():
        done: dict = {}
        task = asyncio.create_task(poll(agent, 5))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(lambda: enqueue_after(0, node, done).join())
        at, body = await task
        assert len(body["commands"]) == 1 and at - done["at"] < 1.6

    async_to_sync(main)()
