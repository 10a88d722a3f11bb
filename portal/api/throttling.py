from rest_framework.throttling import SimpleRateThrottle

from portal.models import ApiToken


class TokenRateThrottle(SimpleRateThrottle):
    """Per-token request rate (``API_RATE_LIMIT``); people are limited per user, others per address."""

    scope = "token"

    def get_cache_key(self, request, view):
        if isinstance(request.auth, ApiToken):
            ident = f"t{request.auth.pk}"
        elif request.user and request.user.is_authenticated:
            ident = f"u{request.user.pk}"
        else:
            ident = f"a{self.get_ident(request)}"
        return self.cache_format % {"scope": self.scope, "ident": ident}
