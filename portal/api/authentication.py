from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from django.utils.functional import SimpleLazyObject
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from portal.logging import log_context_bind
from portal.models import StaffToken
from portal.services.tokens import api_token_authenticate, api_token_touch
from portal.staff_tokens import staff_token_authenticate


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer gpp_<id>_<secret>``. Wrong, revoked or expired tokens get 401."""

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        plaintext = _plaintext(header)
        if plaintext.startswith(f"{StaffToken.PREFIX}_"):
            raise exceptions.AuthenticationFailed("A staff token opens only the staff API (/api/staff/v1/).")
        token = api_token_authenticate(plaintext=plaintext)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        if token.is_revoked:
            raise exceptions.AuthenticationFailed("This token has been revoked.")
        if token.is_expired:
            raise exceptions.AuthenticationFailed("This token has expired.")
        if token.effective_scopes is None:
            raise exceptions.AuthenticationFailed(
                "The person this token acts for is no longer an active member of its tenant."
            )
        api_token_touch(token=token)
        log_context_bind(tenant_id=token.tenant_id, user_id=token.created_by_id)
        # The person the token acts for, loaded only if something asks (most reads never do).
        return (SimpleLazyObject(lambda: token.created_by or AnonymousUser()), token)

    def authenticate_header(self, request):
        return f'{self.keyword} realm="api"'


def _plaintext(header: list[bytes]) -> str:
    if len(header) != 2:
        raise exceptions.AuthenticationFailed("Malformed Authorization header: use 'Bearer <token>'.")
    try:
        return header[1].decode()
    except UnicodeDecodeError:
        raise exceptions.AuthenticationFailed("The token contains invalid characters.") from None


class StaffTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer gps_<id>_<secret>``, for the staff APIs only. Other bearer tokens are
    left to the next class (a tenant's token is then refused by ``StaffPermission``); a wrong or
    revoked staff token, or one whose person is no longer active staff, gets 401."""

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        plaintext = _plaintext(header)
        if not plaintext.startswith(f"{StaffToken.PREFIX}_"):
            return None
        token = staff_token_authenticate(plaintext=plaintext)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid, revoked or expired staff token.")
        log_context_bind(user_id=token.user_id)
        return (token.user, token)

    def authenticate_header(self, request):
        return f'{self.keyword} realm="staff-api"'


class StaffTokenScheme(OpenApiAuthenticationExtension):
    target_class = "portal.api.authentication.StaffTokenAuthentication"
    name = "staffBearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "gps_<id>_<secret>"}


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "portal.api.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "gpp_<id>_<secret>"}
