from rest_framework.throttling import SimpleRateThrottle

from portal.models import ApiToken
from portal.ratelimit import client_ip, rate_take


class TokenRateThrottle(SimpleRateThrottle):
    """Per-token request rate (``API_RATE_LIMIT``); people are limited per user, others per address
    (the client's, as ``portal.ratelimit.client_ip`` decides: never a header the client sets).

    Counted by ``portal.ratelimit.rate_take`` (one atomic step of the `limits` library's moving
    window) instead of DRF's history of request times, which it reads and writes whole."""

    scope = "token"
    wait_s = 0.0

    def get_cache_key(self, request, view):
        if isinstance(request.auth, ApiToken):
            ident = f"t{request.auth.pk}"
        elif request.user and request.user.is_authenticated:
            ident = f"u{request.user.pk}"
        else:
            ident = f"a{client_ip(request)}"
        return self.cache_format % {"scope": self.scope, "ident": ident}

    def allow_request(self, request, view):
        if self.rate is None:
            return True
        key = self.get_cache_key(request, view)
        if key is None:
            return True
        self.wait_s = rate_take(key, limit=self.num_requests, period_s=self.duration)
        return self.wait_s == 0

    def wait(self):
        return self.wait_s
