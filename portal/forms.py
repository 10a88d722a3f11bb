"""Forms of the web shell. They check the shape of input; the services check the rules."""

from __future__ import annotations

import datetime as dt
from zoneinfo import available_timezones

from django import forms
from django.contrib.admin.forms import AdminAuthenticationForm, AdminPasswordChangeForm
from django.contrib.auth import forms as auth_forms
from django.utils import timezone

from portal.errors import DomainError
from portal.models import ROLE_SCOPES, Role, Scope, User
from portal.signin import LimitedLoginFormMixin, LimitedPasswordChangeMixin

SCOPE_HELP = {
    Scope.READ: "See instances, jobs, usage and the fleet.",
    Scope.WRITE: "Start, stop and change instances and jobs.",
    Scope.BILLING: "See invoices, budgets and payment details.",
    Scope.ADMIN: "Manage members, invitations and tokens.",
}

EXPIRY_CHOICES = [
    ("never", "Never"),
    ("7", "In 7 days"),
    ("30", "In 30 days"),
    ("90", "In 90 days"),
    ("365", "In 1 year"),
    ("date", "On a date…"),
]


def apply_domain_error(form: forms.Form, exc: DomainError) -> None:
    """Show a service's error on the form: its message on top, its field errors next to the fields."""
    form.add_error(None, exc.message)
    for field, messages in (exc.fields or {}).items():
        messages = messages if isinstance(messages, list | tuple) else [messages]
        for message in messages:
            form.add_error(field if field in form.fields else None, str(message))


class LoginForm(LimitedLoginFormMixin, auth_forms.AuthenticationForm):
    username = forms.EmailField(
        label="Email",
        max_length=254,
        widget=forms.EmailInput(attrs={"autofocus": True, "autocomplete": "email"}),
    )
    password = forms.CharField(
        label="Password",
        strip=False,
        widget=forms.PasswordInput(attrs={"autocomplete": "current-password"}),
    )

    error_messages = {
        **auth_forms.AuthenticationForm.error_messages,
        "invalid_login": "That email and password do not match an account. Check both and try again.",
    }


class AdminLoginForm(LimitedLoginFormMixin, AdminAuthenticationForm):
    """The Django admin's sign-in, behind the same attempt limiter as the site's."""


class LimitedAdminPasswordChangeForm(LimitedPasswordChangeMixin, AdminPasswordChangeForm):
    """The Django admin's password change, behind the sign-in attempt limiter."""


class PasswordResetRequestForm(auth_forms.PasswordResetForm):
    email = forms.EmailField(
        label="Email", max_length=254, widget=forms.EmailInput(attrs={"autocomplete": "email"})
    )

    def get_users(self, email):
        """Active people with this address, including those who never set a password.

        Owners made by ``createtenant`` start without one; proving they read this address's mail
        is how they set it. Django's default skips them silently.
        """
        return (
            user
            for user in User.objects.filter(email__iexact=email, is_active=True)
            if user.email.casefold() == email.casefold()
        )


class NewPasswordForm(auth_forms.SetPasswordForm):
    """Django's set-password form with shorter labels."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["new_password1"].label = "New password"
        self.fields["new_password2"].label = "Repeat the new password"


class TenantSwitchForm(forms.Form):
    tenant = forms.IntegerField(min_value=1, max_value=2**63 - 1)
    next = forms.CharField(required=False, max_length=2000)


class InvitationSignupForm(forms.Form):
    """A new person's account, made from an invitation: the email address is the invitation's."""

    full_name = forms.CharField(
        label="Your name", max_length=150, widget=forms.TextInput(attrs={"autocomplete": "name"})
    )
    password = forms.CharField(
        label="Password",
        strip=False,
        max_length=4096,
        widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
        help_text="At least 8 characters; not a common password and not only digits.",
    )
    password_confirm = forms.CharField(
        label="Repeat the password",
        strip=False,
        max_length=4096,
        widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
    )

    def clean(self):
        data = super().clean()
        if (
            data.get("password")
            and data.get("password_confirm")
            and data["password"] != data["password_confirm"]
        ):
            self.add_error("password_confirm", "The two passwords differ.")
        return data


def role_choices_for(role: str | None) -> list[tuple[str, str]]:
    """Roles someone with ``role`` may hand out: only owners can make owners."""
    return [(value, label) for value, label in Role.choices if value != Role.OWNER or role == Role.OWNER]


class InviteForm(forms.Form):
    email = forms.EmailField(
        label="Email",
        max_length=254,
        widget=forms.EmailInput(attrs={"placeholder": "name@example.com", "autocomplete": "off"}),
    )
    role = forms.ChoiceField(label="Role", choices=Role.choices, initial=Role.MEMBER)

    def __init__(self, *args, inviter_role: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["role"].choices = role_choices_for(inviter_role)


class RoleForm(forms.Form):
    role = forms.ChoiceField(label="Role", choices=Role.choices)


class TokenCreateForm(forms.Form):
    name = forms.CharField(
        label="Name",
        max_length=100,
        help_text="What the token is for, e.g. “CI pipeline”.",
        widget=forms.TextInput(attrs={"placeholder": "CI pipeline", "autocomplete": "off"}),
    )
    scopes = forms.MultipleChoiceField(
        label="Scopes",
        widget=forms.CheckboxSelectMultiple,
        error_messages={"required": "Choose at least one scope."},
    )
    expiry = forms.ChoiceField(label="Expires", choices=EXPIRY_CHOICES, initial="90")
    expires_on = forms.DateField(
        label="Expiry date",
        required=False,
        widget=forms.DateInput(attrs={"type": "date"}),
        help_text="The token stops working at the start of the next day, in your time zone.",
    )

    def __init__(self, *args, role: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        held = ROLE_SCOPES.get(role, frozenset()) if role else frozenset()
        self.fields["scopes"].choices = [(v, label) for v, label in Scope.choices if v in held]
        self.fields["scopes"].initial = [Scope.READ] if Scope.READ in held else []
        self.scope_help = SCOPE_HELP

    def clean(self):
        data = super().clean()
        expiry = data.get("expiry")
        data["expires_at"] = None
        if expiry == "date":
            day = data.get("expires_on")
            if day is None:
                if "expires_on" not in self.errors:
                    self.add_error("expires_on", "Pick the day the token expires.")
                return data
            if day > timezone.localdate() + dt.timedelta(days=3650):
                self.add_error("expires_on", "Choose a date within ten years.")
                return data
            zone = timezone.get_current_timezone()
            end = dt.datetime.combine(day + dt.timedelta(days=1), dt.time.min).replace(tzinfo=zone)
            if end <= timezone.now():
                self.add_error("expires_on", "The expiry date must be today or later.")
                return data
            data["expires_at"] = end
        elif expiry and expiry != "never":
            data["expires_at"] = timezone.now() + dt.timedelta(days=int(expiry))
        return data


def _time_zone_choices() -> list[tuple[str, str]]:
    zones = sorted(z for z in available_timezones() if "/" in z or z == "UTC")
    return [(z, z.replace("_", " ")) for z in zones]


class ProfileForm(forms.Form):
    full_name = forms.CharField(label="Name", max_length=150, required=False)
    time_zone = forms.ChoiceField(
        label="Time zone", choices=_time_zone_choices, help_text="Times on every page are shown in it."
    )
