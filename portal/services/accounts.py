"""Users: accounts made for owners and invitees, the account-setup mail, passwords and profiles."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.mail import send_mail
from django.core.validators import validate_email
from django.db import transaction
from django.template.loader import render_to_string

from portal.errors import ValidationFailed
from portal.models import Tenant, User


def clean_email(email: str, field: str = "email") -> str:
    email = (email or "").strip().lower()
    try:
        validate_email(email)
    except DjangoValidationError:
        raise ValidationFailed(
            f"{email!r} is not a valid email address.", fields={field: ["Enter a valid email address."]}
        ) from None
    return email


def user_get_or_create(*, email: str, password: str | None = None, full_name: str = "") -> tuple[User, bool]:
    email = clean_email(email)
    user = User.objects.filter(email__iexact=email).first()
    if user is not None:
        return user, False
    user = User.objects.create_user(email=email, password=password, full_name=full_name)
    if password is None:
        user.set_unusable_password()
        user.save(update_fields=["password"])
    return user, True


def user_send_account_setup(*, user: User, tenant: Tenant) -> None:
    """Email a new owner the link to choose a password (a password-reset link: it proves the
    address and works once)."""
    from django.contrib.auth.tokens import default_token_generator
    from django.urls import reverse
    from django.utils.encoding import force_bytes
    from django.utils.http import urlsafe_base64_encode

    path = reverse(
        "portal:password-reset-confirm",
        kwargs={
            "uidb64": urlsafe_base64_encode(force_bytes(user.pk)),
            "token": default_token_generator.make_token(user),
        },
    )
    context = {"user": user, "tenant": tenant, "url": settings.SITE_URL.rstrip("/") + path}
    send_mail(
        subject=f"Your gpupool team {tenant.name} is ready",
        message=render_to_string("portal/email/account_setup.txt", context),
        from_email=settings.DEFAULT_FROM_EMAIL,
        recipient_list=[user.email],
    )


def check_new_password(password: str, user: User) -> None:
    from django.contrib.auth import password_validation

    if not password:
        raise ValidationFailed("Choose a password.", fields={"password": ["A password is required."]})
    try:
        password_validation.validate_password(password, user=user)
    except DjangoValidationError as exc:
        raise ValidationFailed(
            "Choose a stronger password.", fields={"password": list(exc.messages)}
        ) from None


@transaction.atomic
def user_update_profile(*, user: User, full_name: str, time_zone: str) -> User:
    """Change a person's display name and the time zone their pages show times in."""
    from zoneinfo import available_timezones

    errors: dict[str, list[str]] = {}
    full_name = (full_name or "").strip()
    if len(full_name) > 150:
        errors["full_name"] = ["Use at most 150 characters."]
    time_zone = (time_zone or "").strip()
    if time_zone not in available_timezones():
        errors["time_zone"] = [f"{time_zone[:64]!r} is not a time zone such as Europe/Berlin."]
    if errors:
        raise ValidationFailed("The profile could not be saved.", fields=errors)
    user.full_name = full_name
    user.time_zone = time_zone
    user.save(update_fields=["full_name", "time_zone"])
    return user
