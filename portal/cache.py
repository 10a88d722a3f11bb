"""The Redis cache backend: Django's, with one client (and connection pool) per process."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from django.core.cache.backends import redis as django_redis
from django.utils.functional import cached_property


class RedisCacheClient(django_redis.RedisCacheClient):
    """Django's, with one redis-py client per connection pool: Django made a new ``redis.Redis``
    (and its tables of response callbacks) for every cache operation, about 5 % of a cached API
    read's CPU. A ``redis.Redis`` over a pool is safe to share between threads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clients_by_pool: dict[int, Any] = {}

    def get_client(self, key=None, *, write=False):
        pool = self._get_connection_pool(write)  # kept for the process's life, so its id is too
        client = self._clients_by_pool.get(id(pool))
        if client is None:
            client = self._clients_by_pool.setdefault(id(pool), self._client(connection_pool=pool))
        return client


class RedisCache(django_redis.RedisCache):
    """Django's ``RedisCache``, its client shared by every cache object of the process.

    Django keeps a cache object per context (``caches`` is an asgiref ``Local`` that is not
    thread-critical), and each request starts in a fresh one: under ASGI a task's, and on the
    pages' thread pool a copy of the event loop's (``portal.threaded_wsgi``). So every request built a new client
    with a new connection pool and opened a new connection, with redis-py's handshake (which reads
    package metadata from disk): a third of an API read's CPU under ``bench/scale.py``. redis-py's
    pools are thread-safe and notice a fork, so one client per location and options serves all.
    """

    _clients: ClassVar[dict[tuple, Any]] = {}
    _clients_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, server, params) -> None:
        super().__init__(server, params)
        self._class = RedisCacheClient

    @cached_property
    def _cache(self):
        key = (tuple(self._servers), self._class, repr(sorted(self._options.items())))
        client = self._clients.get(key)
        if client is None:
            with self._clients_lock:
                client = self._clients.get(key)
                if client is None:
                    client = self._clients[key] = self._class(self._servers, **self._options)
        return client
