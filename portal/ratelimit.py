"""Limits kept in the cache: failed attempts (sign-in, password reset) per key in a window, and
request rates (the API throttle)."""

from __future__ import annotations

import hashlib
import time

from django.core.cache import DEFAULT_CACHE_ALIAS, cache, caches
from django.core.cache.backends.redis import RedisCache
from redis.exceptions import NoScriptError


class AttemptLimiter:
    """At most ``limit`` attempts per key in ``window_s`` seconds; a key is blocked after that
    until its window ends. Keys are hashed, so addresses and emails are not stored in clear."""

    def __init__(self, scope: str, *, limit: int, window_s: int):
        self.scope, self.limit, self.window_s = scope, limit, window_s

    def _key(self, key: str) -> str:
        return f"attempts:{self.scope}:{hashlib.sha256(key.lower().encode()).hexdigest()[:32]}"

    def retry_after(self, *keys: str) -> int:
        """Seconds until the first blocked key frees up; 0 when none is blocked."""
        now = time.time()
        waits = [
            max(1, int(started + self.window_s - now))
            for count, started in filter(None, cache.get_many([self._key(k) for k in keys if k]).values())
            if count >= self.limit
        ]
        return max(waits, default=0)

    def hit(self, *keys: str) -> None:
        for key in filter(None, keys):
            cache_key = self._key(key)
            count, started = cache.get(cache_key) or (0, time.time())
            remaining = max(1, int(started + self.window_s - time.time()))
            cache.set(cache_key, (count + 1, started), timeout=remaining)

    def reset(self, *keys: str) -> None:
        cache.delete_many([self._key(k) for k in keys if k])


def client_ip(request) -> str:
    return request.META.get("REMOTE_ADDR", "")


# --- request rates: the generic cell rate algorithm ----------------------------------------------
#
# One number per key, the "theoretical arrival time" (TAT): when the key's allowance would be back
# to full. A request at ``now`` is allowed when TAT - burst <= now, and moves TAT on by one
# interval (period / limit); ``burst`` (period - interval) lets a quiet key send ``limit`` requests
# at once. On Redis the step is one Lua script (atomic across processes, one round trip, the
# server's clock); elsewhere (the embedded cache) a read and a write of the cache.

_GCRA_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local wait = tat - burst - now
if wait > 0 then return wait end
tat = tat + interval
redis.call('SET', KEYS[1], string.format('%d', tat), 'PX', math.floor((tat - now) / 1000) + 1)
return 0
"""
_GCRA_SHA = hashlib.sha1(_GCRA_LUA.encode(), usedforsecurity=False).hexdigest()


def rate_take(key: str, *, limit: int, period_s: float, using=None) -> float:
    """Count one request against ``key``'s ``limit`` per ``period_s``: 0 when it is allowed, else
    the seconds until the next would be. ``using``: a cache (the default cache when None)."""
    store = using if using is not None else caches[DEFAULT_CACHE_ALIAS]  # the backend, not its proxy
    interval_us = int(period_s * 1_000_000 / limit)
    burst_us = int(period_s * 1_000_000) - interval_us
    full_key = f"rate:{key}"
    if isinstance(store, RedisCache):
        cache_key = store.make_and_validate_key(full_key)
        client = store._cache.get_client(cache_key, write=True)
        try:
            wait_us = client.evalsha(_GCRA_SHA, 1, cache_key, interval_us, burst_us)
        except NoScriptError:  # the server's first use, or after a restart: EVAL loads it
            wait_us = client.eval(_GCRA_LUA, 1, cache_key, interval_us, burst_us)
        return wait_us / 1_000_000
    now_us = int(time.time() * 1_000_000)
    tat = max(store.get(full_key) or now_us, now_us)
    wait_us = tat - burst_us - now_us
    if wait_us > 0:
        return wait_us / 1_000_000
    tat += interval_us
    store.set(full_key, tat, timeout=max(1, -(-(tat - now_us) // 1_000_000)))
    return 0.0
