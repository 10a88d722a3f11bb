from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from django.utils.functional import SimpleLazyObject
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from portal.logging import log_context_bind
from portal.services import api_token_authenticate, api_token_touch


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer gpp_<id>_<secret>``. Wrong, revoked or expired tokens get 401."""

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Malformed Authorization header: use 'Bearer <token>'.")
        try:
            plaintext = header[1].decode()
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("The token contains invalid characters.") from None
        token = api_token_authenticate(plaintext=plaintext)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        if token.is_revoked:
            raise exceptions.AuthenticationFailed("This token has been revoked.")
        if token.is_expired:
            raise exceptions.AuthenticationFailed("This token has expired.")
        api_token_touch(token=token)
        log_context_bind(tenant_id=token.tenant_id, user_id=token.created_by_id)
        # The person the token acts for, loaded only if something asks (most reads never do).
        return (SimpleLazyObject(lambda: token.created_by or AnonymousUser()), token)

    def authenticate_header(self, request):
        return f'{self.keyword} realm="api"'


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "portal.api.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "gpp_<id>_<secret>"}
