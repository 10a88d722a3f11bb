"""Signing in with a password, wherever the form is (the site's, the Django admin's): every check of
a password by ``django.contrib.auth.authenticate`` passes the attempt limiter first, and sign-ins,
failures and lockouts are audited. Password-change forms check the old password with
``check_password`` instead; ``LimitedPasswordChangeMixin`` puts them behind the same limiter, with the
same counts (per account email and per address), so a stolen session cannot guess it either.

The limiter counts each attempt before the password is checked, per email and per client address,
so parallel attempts get no more tries than sequential ones. A refused attempt raises
PermissionDenied (``authenticate`` then answers None, as for a wrong password) and marks the
request, so that the form says why and the response is a 429 with Retry-After
(``SignInLimitMiddleware``).
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import PermissionDenied

from portal.ratelimit import AttemptLimiter, client_ip

BACKEND = "portal.signin.LimitedModelBackend"
RETRY_AFTER_ATTR = "sign_in_retry_after"

email_limiter = AttemptLimiter(
    "login", limit=settings.GPUPOOL_LOGIN_FAILURE_LIMIT, window_s=settings.GPUPOOL_LOGIN_FAILURE_WINDOW_S
)
address_limiter = AttemptLimiter(
    "login-address",
    limit=settings.GPUPOOL_LOGIN_ADDRESS_LIMIT,
    window_s=settings.GPUPOOL_LOGIN_FAILURE_WINDOW_S,
)


def retry_after(request) -> int:
    """Seconds the request's sign-in was refused for by the limiter; 0 when it was not."""
    return getattr(request, RETRY_AFTER_ATTR, 0) if request is not None else 0


def too_many_message(seconds: int) -> str:
    minutes = max(1, round(seconds / 60))
    return f"Too many attempts. Try again in about {minutes} minute{'s' if minutes != 1 else ''}."


class LimitedModelBackend(ModelBackend):
    """Django's model backend behind the sign-in attempt limiter (only for requests: management
    commands and code that passes no request are not limited)."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is not None and password is not None:
            email = str(username or kwargs.get("email") or "")[:254].lower()
            address = client_ip(request)
            wait = max(email_limiter.take(email), address_limiter.take(address))
            if wait:
                setattr(request, RETRY_AFTER_ATTR, wait)
                raise PermissionDenied(too_many_message(wait))
            user = super().authenticate(request, username=username, password=password, **kwargs)
            if user is not None:
                email_limiter.reset(email)  # the person got in: their account's count starts again
            return user
        return super().authenticate(request, username=username, password=password, **kwargs)


class LimitedLoginFormMixin:
    """For an AuthenticationForm: the limiter's refusal is the form's error, not 'wrong password'."""

    def get_invalid_login_error(self):
        from django.core.exceptions import ValidationError

        wait = retry_after(self.request)  # type: ignore[attr-defined]
        if wait:
            return ValidationError(too_many_message(wait), code="too_many_attempts")
        return super().get_invalid_login_error()  # type: ignore[misc]


class LimitedPasswordChangeMixin:
    """For a PasswordChangeForm built with ``request=``: the old password is checked only after the
    attempt limiter allowed it (the count is the account's sign-in count), a refusal marks the
    request for the 429, and failures and lockouts are audited as ``account.password_change_*``."""

    def __init__(self, *args, request, **kwargs):
        self.request = request
        super().__init__(*args, **kwargs)

    def clean_old_password(self):
        from django.core.exceptions import ValidationError

        email, address = self.user.email.lower(), client_ip(self.request)  # type: ignore[attr-defined]
        wait = max(email_limiter.take(email), address_limiter.take(address))
        if wait:
            setattr(self.request, RETRY_AFTER_ATTR, wait)
            self._audit("account.password_change_locked", address)
            raise ValidationError(too_many_message(wait), code="too_many_attempts")
        try:
            old = super().clean_old_password()  # type: ignore[misc]
        except ValidationError:
            self._audit("account.password_change_failed", address)
            raise
        email_limiter.reset(email)  # the person knew it: their account's count starts again
        return old

    def _audit(self, action: str, address: str) -> None:
        from portal.actors import Actor
        from portal.services.audit import audit_record

        user = self.user  # type: ignore[attr-defined]
        audit_record(tenant=None, actor=Actor(user=user), action=action, target=user, data={"ip": address})
