"""Signing in and out, password reset, invitations, the tenant switcher and the profile page."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.auth import login
from django.contrib.auth import views as auth_views
from django.contrib.auth.mixins import LoginRequiredMixin
from django.shortcuts import redirect, render
from django.urls import reverse, reverse_lazy
from django.utils.http import url_has_allowed_host_and_scheme
from django.views import View

from portal import selectors, signin
from portal.actors import Actor
from portal.errors import DomainError, NotFound
from portal.forms import (
    InvitationSignupForm,
    LimitedAdminPasswordChangeForm,
    LoginForm,
    NewPasswordForm,
    PasswordResetRequestForm,
    ProfileForm,
    TenantSwitchForm,
    apply_domain_error,
)
from portal.middleware import SESSION_TENANT_KEY
from portal.ratelimit import AttemptLimiter, client_ip
from portal.services.accounts import user_update_profile
from portal.services.audit import audit_record
from portal.services.invitations import invitation_accept, invitation_accept_signup, invitation_lookup
from portal.signin import too_many_message
from portal.views.base import bad_request, forbidden, not_found


class _BadRequestOnInvalid:
    """Django's auth views answer 200 to a form with errors; the web shell answers 400."""

    def form_invalid(self, form):
        response = super().form_invalid(form)  # type: ignore[misc]
        response.status_code = 400
        return response


reset_limiter = AttemptLimiter(
    "password-reset",
    limit=settings.GPUPOOL_PASSWORD_RESET_LIMIT,
    window_s=settings.GPUPOOL_LOGIN_FAILURE_WINDOW_S,
)


def _too_many(request, template_name, form, retry_after: int):
    form.add_error(None, too_many_message(retry_after))
    response = render(request, template_name, {"form": form}, status=429)
    response["Retry-After"] = str(retry_after)
    return response


class LoginView(_BadRequestOnInvalid, auth_views.LoginView):
    """Sign-in attempts are limited per email and per address by the authentication backend
    (``portal.signin``, as for every password form); past the limit: 429."""

    template_name = "registration/login.html"
    form_class = LoginForm
    redirect_authenticated_user = True


class LogoutView(auth_views.LogoutView):
    """POST only (Django's rule): the session, and with it the chosen tenant, is flushed."""


class AdminPasswordChangeView(auth_views.PasswordChangeView):
    """The Django admin's password change, routed ahead of the admin's own URL (``AdminSite`` has no
    setting for its form): the old password is checked behind the sign-in limiter; past it: 429."""

    form_class = LimitedAdminPasswordChangeForm
    success_url = reverse_lazy("admin:password_change_done")

    def get_form_kwargs(self):
        return {**super().get_form_kwargs(), "request": self.request}

    def get_context_data(self, **kwargs):
        return {**admin.site.each_context(self.request), **super().get_context_data(**kwargs)}


class PasswordResetView(_BadRequestOnInvalid, auth_views.PasswordResetView):
    """Reset emails are limited per address and per email, so the form cannot be used to flood
    someone's inbox."""

    template_name = "registration/password_reset_form.html"
    form_class = PasswordResetRequestForm
    email_template_name = "registration/password_reset_email.txt"
    subject_template_name = "registration/password_reset_subject.txt"
    success_url = reverse_lazy("portal:password-reset-done")

    def post(self, request, *args, **kwargs):
        email = (request.POST.get("email") or "")[:254]
        wait = reset_limiter.take(client_ip(request), email)
        if wait:
            return _too_many(request, self.template_name, self.get_form(), wait)
        audit_record(
            tenant=None,
            actor=Actor.system(),
            action="account.password_reset_requested",
            data={"email": email.lower(), "ip": client_ip(request)},
        )
        return super().post(request, *args, **kwargs)


class PasswordResetDoneView(auth_views.PasswordResetDoneView):
    template_name = "registration/password_reset_done.html"


class PasswordResetConfirmView(_BadRequestOnInvalid, auth_views.PasswordResetConfirmView):
    template_name = "registration/password_reset_confirm.html"
    form_class = NewPasswordForm
    success_url = reverse_lazy("portal:password-reset-complete")


class PasswordResetCompleteView(auth_views.PasswordResetCompleteView):
    template_name = "registration/password_reset_complete.html"


def _enter_tenant(request, membership) -> None:
    request.session[SESSION_TENANT_KEY] = membership.tenant_id


class InvitationAcceptView(View):
    """``/invitations/<token>/``: the link in an invitation email.

    * signed in with the invited address: a button accepts it;
    * signed in as someone else: 403, saying whom the invitation is for;
    * not signed in, no account yet: a form creates the account (name, password) and accepts;
    * not signed in, an account exists: a link to sign in and come back.
    Every way in ends in the invitation's tenant.
    """

    template_name = "portal/invitations/accept.html"

    def _lookup(self, token):
        try:
            return invitation_lookup(token=token)
        except NotFound as exc:
            return exc

    def _context(self, invitation, token, **extra):
        from portal.models import User

        existing = User.objects.filter(email__iexact=invitation.email).first()
        return {
            "invitation": invitation,
            "token": token,
            "has_account": existing is not None and existing.has_usable_password(),
            "login_url": f"{reverse('portal:login')}?next={reverse('portal:invitation-accept', args=[token])}",
            **extra,
        }

    def _wrong_user(self, request, invitation):
        return forbidden(
            request,
            f"This invitation is for {invitation.email}, but you are signed in as {request.user.email}. "
            "Sign out and open the link again.",
        )

    def get(self, request, token):
        invitation = self._lookup(token)
        if isinstance(invitation, NotFound):
            return not_found(request, invitation.message)
        if request.user.is_authenticated and request.user.email.lower() != invitation.email.lower():
            return self._wrong_user(request, invitation)
        return render(
            request, self.template_name, self._context(invitation, token, form=InvitationSignupForm())
        )

    def post(self, request, token):
        invitation = self._lookup(token)
        if isinstance(invitation, NotFound):
            return not_found(request, invitation.message)
        if request.user.is_authenticated:
            if request.user.email.lower() != invitation.email.lower():
                return self._wrong_user(request, invitation)
            try:
                membership = invitation_accept(token=token, user=request.user)
            except DomainError as exc:
                return (
                    forbidden(request, exc.message)
                    if exc.status_code == 403
                    else not_found(request, exc.message)
                )
            return self._done(request, membership)

        form = InvitationSignupForm(request.POST)
        status = 400
        if form.is_valid():
            try:
                membership = invitation_accept_signup(
                    token=token,
                    password=form.cleaned_data["password"],
                    full_name=form.cleaned_data["full_name"],
                )
            except DomainError as exc:
                apply_domain_error(form, exc)
                status = exc.status_code
            else:
                login(request, membership.user, backend=signin.BACKEND)
                return self._done(request, membership)
        return render(request, self.template_name, self._context(invitation, token, form=form), status=status)

    def _done(self, request, membership):
        _enter_tenant(request, membership)
        messages.success(
            request, f"Welcome to {membership.tenant.name}. You joined as {membership.get_role_display()}."
        )
        return redirect("portal:dashboard")


class TenantSwitchView(LoginRequiredMixin, View):
    """The top bar's tenant switcher: only tenants the person belongs to can be chosen."""

    http_method_names = ["post"]

    def post(self, request):
        form = TenantSwitchForm(request.POST)
        if not form.is_valid():
            return bad_request(request, "Choose a team from the list.")
        membership = selectors.membership_for_user(user=request.user, tenant_id=form.cleaned_data["tenant"])
        if membership is None:
            return not_found(request, "You are not a member of that team.")
        _enter_tenant(request, membership)
        messages.success(request, f"Switched to {membership.tenant.name}.")
        target = form.cleaned_data.get("next") or ""
        if not url_has_allowed_host_and_scheme(
            target, {request.get_host()}, require_https=request.is_secure()
        ):
            target = reverse("portal:dashboard")
        return redirect(target)


class ProfileView(LoginRequiredMixin, View):
    """The person's own name and time zone (not tenant data: no tenant scoping applies)."""

    template_name = "portal/profile.html"

    def get(self, request):
        form = ProfileForm(initial={"full_name": request.user.full_name, "time_zone": request.user.time_zone})
        return render(request, self.template_name, {"form": form})

    def post(self, request):
        form = ProfileForm(request.POST)
        status = 400
        if form.is_valid():
            try:
                user_update_profile(user=request.user, **form.cleaned_data)
            except DomainError as exc:
                apply_domain_error(form, exc)
                status = exc.status_code
            else:
                messages.success(request, "Your profile is saved.")
                return redirect("portal:profile")
        return render(request, self.template_name, {"form": form}, status=status)
