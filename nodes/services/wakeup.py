"""Waking a node's long poll when a command is queued for it.

With REDIS_URL set, ``node_commands_notify`` publishes on a per-node channel and the long poll
waits on that channel (one Redis connection per waiting request, no database connection). Without
Redis, the long poll checks the database every NODE_COMMANDS_POLL_INTERVAL_S.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

logger = logging.getLogger(__name__)

_client: redis.Redis | None = None
# With Redis, the database is still checked at least this often (a lost message costs at most this).
REDIS_RECHECK_S = 5.0


def channel_for(node_id: int) -> str:
    return f"gpupool:nodes:commands:{node_id}"


def node_commands_notify(*, node_id: int) -> None:
    global _client
    url = settings.REDIS_URL
    if not url:
        return
    try:
        if _client is None:
            _client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        _client.publish(channel_for(node_id), b"1")
    except redis.RedisError:
        logger.warning("Could not wake the long poll of node %s", node_id, exc_info=True)


def node_commands_notify_many(*, node_ids: list[int]) -> None:
    """``node_commands_notify`` for several nodes: one message per node, sent in one round trip."""
    global _client
    url = settings.REDIS_URL
    if not url or not node_ids:
        return
    try:
        if _client is None:
            _client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        pipe = _client.pipeline(transaction=False)
        for node_id in node_ids:
            pipe.publish(channel_for(node_id), b"1")
        pipe.execute()
    except redis.RedisError:
        logger.warning("Could not wake the long polls of %d node(s)", len(node_ids), exc_info=True)


class CommandWaiter:
    """``async with CommandWaiter(node_id) as w: await w.wait(seconds)``: returns when the node is
    notified, or after ``seconds`` (with Redis), or after at most one poll interval (without)."""

    def __init__(self, node_id: int):
        self.node_id = node_id
        self._client: Any = None
        self._pubsub: Any = None

    @property
    def notified_by_redis(self) -> bool:
        return self._pubsub is not None

    async def __aenter__(self) -> CommandWaiter:
        if settings.REDIS_URL:
            try:
                self._client = aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2)
                self._pubsub = self._client.pubsub()
                await self._pubsub.subscribe(channel_for(self.node_id))
            except (redis.RedisError, OSError):
                logger.warning("Redis unavailable: node %s polls the database", self.node_id, exc_info=True)
                await self._close()
        return self

    async def wait(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self._pubsub is None:
            await asyncio.sleep(min(seconds, settings.NODE_COMMANDS_POLL_INTERVAL_S))
            return
        try:
            await self._pubsub.get_message(
                ignore_subscribe_messages=True, timeout=min(seconds, REDIS_RECHECK_S)
            )
        except (redis.RedisError, OSError):
            logger.warning("Redis lost: node %s polls the database", self.node_id, exc_info=True)
            await self._close()

    async def _close(self) -> None:
        pubsub, client = self._pubsub, self._client
        self._pubsub = self._client = None
        try:
            if pubsub is not None:
                await pubsub.aclose()
            if client is not None:
                await client.aclose()
        except (redis.RedisError, OSError):
            pass

    async def __aexit__(self, *exc: object) -> None:
        await self._close()
