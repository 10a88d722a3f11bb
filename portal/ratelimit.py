"""Limits on how often a key may act, counted by the `limits` library: sign-in and password-reset
attempts per address and per email (a moving window: exact), and the API's request rate per token
(a sliding window counter: two numbers per key, however high the rate).

Each count is one atomic step of the storage: on Redis (``REDIS_URL``) a script that every web
process shares, otherwise this process's memory under a lock. The client's address is the peer's,
or what the trusted proxies (``TRUSTED_PROXIES``) say it is, never what a client says of itself.
"""

from __future__ import annotations

import hashlib
import ipaddress
import time
from functools import cache

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from limits import RateLimitItemPerSecond
from limits.storage import Storage, storage_from_string
from limits.strategies import MovingWindowRateLimiter, SlidingWindowCounterRateLimiter


@cache
def _storage() -> Storage:
    uri = settings.RATELIMIT_STORAGE_URI
    if uri.startswith(("redis://", "rediss://")):
        return storage_from_string(uri, key_prefix=settings.RATELIMIT_KEY_PREFIX)
    return storage_from_string(uri)


@cache
def _limiter() -> MovingWindowRateLimiter:
    return MovingWindowRateLimiter(_storage())


@cache
def _rate_limiter() -> SlidingWindowCounterRateLimiter:
    return SlidingWindowCounterRateLimiter(_storage())


@receiver(setting_changed, dispatch_uid="portal.ratelimit.storage_setting")
def _storage_setting_changed(setting: str, **kwargs) -> None:
    if setting in ("RATELIMIT_STORAGE_URI", "RATELIMIT_KEY_PREFIX"):
        _storage.cache_clear()
        _limiter.cache_clear()
        _rate_limiter.cache_clear()


def reset_all() -> None:
    """Forget every count (the test suite, between tests)."""
    _storage().reset()


def _hashed(key: str) -> str:
    return hashlib.sha256(key.lower().encode()).hexdigest()[:32]


def rate_take(key: str, *, limit: int, period_s: int) -> float:
    """Count one request against ``key``'s ``limit`` per ``period_s``: 0 when it is allowed, else
    the seconds until the next one would be."""
    item = RateLimitItemPerSecond(limit, period_s, namespace="rate")
    limiter = _rate_limiter()
    if limiter.hit(item, key):
        return 0.0
    return max(0.001, limiter.get_window_stats(item, key).reset_time - time.time())


class AttemptLimiter:
    """At most ``limit`` attempts per key in any ``window_s`` seconds. An attempt is counted before
    it is tried, so parallel attempts cannot get past the limit between a check and a count. Keys
    are hashed, so addresses and emails are not stored in clear."""

    def __init__(self, scope: str, *, limit: int, window_s: int):
        self.scope, self.limit, self.window_s = scope, limit, window_s

    def _item(self) -> RateLimitItemPerSecond:
        return RateLimitItemPerSecond(self.limit, self.window_s, namespace=f"attempts-{self.scope}")

    def take(self, *keys: str) -> int:
        """Count one attempt against each key: 0 when every key allows it, else the seconds until
        the blocked ones free up (the attempt is then refused, and counted where it was allowed)."""
        item, limiter = self._item(), _limiter()
        blocked = [k for k in filter(None, keys) if not limiter.hit(item, _hashed(k))]
        waits = [limiter.get_window_stats(item, _hashed(k)).reset_time - time.time() for k in blocked]
        return max((max(1, int(w + 0.999)) for w in waits), default=0)

    def exhausted(self, key: str) -> bool:
        """Whether ``key`` has no attempt left in its window (the last one was just taken)."""
        return bool(key) and _limiter().get_window_stats(self._item(), _hashed(key)).remaining == 0

    def reset(self, *keys: str) -> None:
        for key in filter(None, keys):
            _limiter().clear(self._item(), _hashed(key))


def _trusted(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in _trusted_networks())


def _trusted_networks() -> tuple:
    return tuple(ipaddress.ip_network(cidr.strip(), strict=False) for cidr in settings.TRUSTED_PROXIES)


def client_ip(request) -> str:
    """The client's address: the peer's, unless the peer is a trusted proxy; then the nearest
    address in ``X-Forwarded-For`` that is not a trusted proxy (a client can prepend anything to
    the header, but not past the proxies that appended to it)."""
    peer = request.META.get("REMOTE_ADDR", "")
    if not _trusted(peer):
        return peer
    hops = [h.strip() for h in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if h.strip()]
    for hop in reversed(hops):
        if not _trusted(hop):
            return hop[:64]
    return hops[0][:64] if hops else peer
