"""Waking a node's long poll when a command is queued for it.

With REDIS_URL set, ``node_commands_notify`` publishes on a per-node channel with the cache's Redis
client (django-redis's, one connection pool per process). Each web process (each event loop) holds
**one** Redis pub/sub connection (``subscriber_client``), pattern-subscribed once to every node's
channel, and a task that reads it and sets the asyncio Events of the polls waiting for that node: a
poll costs no Redis connection and no database connection while it waits. The connection is
re-opened with backoff when it drops; after each (re)connect every waiting poll is woken to check
the database once (a message may have been lost meanwhile). While Redis is unreachable, polls check
the database about every ``REDIS_DOWN_POLL_S`` (with jitter). Without REDIS_URL (development,
SQLite), the long poll checks the database every NODE_COMMANDS_POLL_INTERVAL_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import weakref
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings
from django_redis import get_redis_connection

logger = logging.getLogger(__name__)

CHANNEL_PREFIX = "gpupool:nodes:commands:"
# While Redis is configured but unreachable, a waiting poll checks the database this often (+-25 %).
REDIS_DOWN_POLL_S = 1.0
# Reconnect backoff of the shared pub/sub connection: doubling from the first value up to the second.
RECONNECT_BACKOFF_S = (0.1, 5.0)

# Each read of the pub/sub connection waits at most this long (see the cancel note in _run).
READ_TIMEOUT_S = 1.0


def channel_for(node_id: int) -> str:
    return f"{CHANNEL_PREFIX}{node_id}"


def listener_client_name() -> str:
    """The name the pub/sub connection gives itself (``CLIENT LIST`` shows it): one per process."""
    return f"gpupool-wakeup-{os.getpid()}"


def _publisher() -> redis.Redis | None:
    """The cache's client (its server is REDIS_URL's); None without Redis."""
    if not settings.REDIS_URL:
        return None
    return get_redis_connection("default")


def subscriber_client(url: str) -> aioredis.Redis:
    """A new asyncio client for the pub/sub connection, named for ``CLIENT LIST``: django-redis's
    clients are synchronous, and a subscription holds its connection for itself anyway."""
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=2,
        socket_keepalive=True,
        health_check_interval=15,
        client_name=listener_client_name(),
    )


def node_commands_notify(*, node_id: int) -> None:
    node_commands_notify_many(node_ids=[node_id])


def node_commands_notify_many(*, node_ids: list[int]) -> None:
    """Wake the long polls of these nodes: one message per node, sent in one round trip."""
    client = _publisher()
    if client is None or not node_ids:
        return
    try:
        pipe = client.pipeline(transaction=False)
        for node_id in node_ids:
            pipe.publish(channel_for(node_id), b"1")
        pipe.execute()
    except redis.RedisError:
        logger.warning("Could not wake the long polls of %d node(s)", len(node_ids), exc_info=True)


class _Listener:
    """The per-event-loop pub/sub reader: one connection, one pattern subscription, and the Events
    of the polls waiting in this loop, by node."""

    def __init__(self, url: str):
        self.url = url
        self.waiters: dict[int, set[asyncio.Event]] = {}
        self.connected = False
        self.task = asyncio.get_running_loop().create_task(self._run(), name="gpupool-wakeup")

    def add(self, node_id: int, event: asyncio.Event) -> None:
        self.waiters.setdefault(node_id, set()).add(event)

    def discard(self, node_id: int, event: asyncio.Event) -> None:
        events = self.waiters.get(node_id)
        if events is not None:
            events.discard(event)
            if not events:
                del self.waiters[node_id]

    def _wake(self, node_id: int) -> None:
        for event in self.waiters.get(node_id, ()):
            event.set()

    def _wake_all(self) -> None:
        for events in self.waiters.values():
            for event in events:
                event.set()

    async def _run(self) -> None:
        delay, max_delay = RECONNECT_BACKOFF_S
        failures = 0
        while True:
            client: Any = subscriber_client(self.url)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(f"{CHANNEL_PREFIX}*")
                if failures:
                    logger.info("Redis is back: long polls are woken by pub/sub again")
                self.connected = True
                failures = 0
                delay = RECONNECT_BACKOFF_S[0]
                self._wake_all()  # anything published while we were away: check the database once
                this = asyncio.current_task()
                while True:
                    message = await pubsub.get_message(timeout=READ_TIMEOUT_S)
                    if this is not None and this.cancelling():
                        # A cancel that lands inside redis-py's read can be swallowed there (seen
                        # with redis 8.1 on Python 3.11): honour it here, at most a read later.
                        raise asyncio.CancelledError
                    if message is None or message.get("type") != "pmessage":
                        continue
                    channel = message["channel"]
                    if isinstance(channel, bytes):
                        channel = channel.decode()
                    tail = channel[len(CHANNEL_PREFIX) :]
                    if tail.isdigit():
                        self._wake(int(tail))
            except asyncio.CancelledError:
                raise
            except (redis.RedisError, OSError) as exc:
                if failures == 0:
                    logger.warning("Redis pub/sub lost (%s): long polls check the database meanwhile", exc)
                failures += 1
            finally:
                self.connected = False
                try:
                    await pubsub.aclose()
                    await client.aclose()
                except (redis.RedisError, OSError):
                    pass
            self._wake_all()  # the waiting polls switch to checking the database
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, max_delay)


_listeners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Listener] = weakref.WeakKeyDictionary()


def _listener() -> _Listener | None:
    url = settings.REDIS_URL
    if not url:
        return None
    loop = asyncio.get_running_loop()
    listener = _listeners.get(loop)
    if listener is None or listener.url != url or listener.task.done():
        if listener is not None:
            listener.task.cancel()
        listener = _listeners[loop] = _Listener(url)
    return listener


def wakeup_connected() -> bool:
    """Whether this event loop's pub/sub connection is up (for tests and diagnostics)."""
    listener = _listeners.get(asyncio.get_running_loop())
    return listener is not None and listener.connected


class CommandWaiter:
    """``async with CommandWaiter(node_id) as w``, then per round ``w.arm()``, check the database,
    ``await w.wait(seconds)``: returns when the node is notified after the last ``arm()``, or after
    ``seconds`` (Redis up), or after at most one database-poll interval (Redis down, or none)."""

    def __init__(self, node_id: int):
        self.node_id = node_id
        self._event = asyncio.Event()
        self._listener: _Listener | None = None

    @property
    def notified_by_redis(self) -> bool:
        return self._listener is not None and self._listener.connected

    async def __aenter__(self) -> CommandWaiter:
        self._listener = _listener()
        if self._listener is not None:
            self._listener.add(self.node_id, self._event)
        return self

    def arm(self) -> None:
        """Forget earlier wake-ups: call before each database check, so that a command queued
        after the check wakes the next ``wait``."""
        self._event.clear()

    async def wait(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self._listener is None:
            await asyncio.sleep(min(seconds, settings.NODE_COMMANDS_POLL_INTERVAL_S))
            return
        if not self._listener.connected:
            seconds = min(seconds, REDIS_DOWN_POLL_S * random.uniform(0.75, 1.25))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout=seconds)

    async def __aexit__(self, *exc: object) -> None:
        if self._listener is not None:
            self._listener.discard(self.node_id, self._event)
