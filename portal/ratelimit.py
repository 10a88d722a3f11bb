"""Counting failed attempts (sign-in, password reset) per key in the cache, with a window."""

from __future__ import annotations

import hashlib
import time

from django.core.cache import cache


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
