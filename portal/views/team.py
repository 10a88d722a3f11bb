"""The team page: members and their roles, invitations.

Everyone in the tenant sees the member list; changing it needs the admin scope. Each action answers
htmx with the section it changed (members or invitations) and a full page redirect otherwise; a
service's refusal comes back as the section with the message next to the row and its 4xx status.
"""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect
from django.views import View
from django.views.generic import TemplateView

from portal import selectors
from portal.errors import DomainError
from portal.forms import InviteForm, RoleForm, apply_domain_error, role_choices_for
from portal.models import Invitation, Membership, Role, Scope
from portal.services.invitations import invitation_create, invitation_revoke
from portal.services.members import membership_change_role, membership_remove
from portal.views.base import TenantScopedMixin, htmx_partial, render_page


class TeamMixin(TenantScopedMixin):
    template_name = "portal/team.html"
    write_scope = Scope.ADMIN

    def team_context(self, *, invite_form=None, row_errors=None, invitation_errors=None):
        can_manage = self.has_scope(Scope.ADMIN)
        context = {
            "members": selectors.tenant_members(tenant=self.tenant),
            "can_manage": can_manage,
            "role_choices": role_choices_for(self.membership.role),
            "row_errors": row_errors or {},
            "invitation_errors": invitation_errors or {},
        }
        if can_manage:
            context["invite_form"] = invite_form or InviteForm(inviter_role=self.membership.role)
            context["invitations"] = selectors.invitations_open(tenant=self.tenant)
        return context

    def section(self, partial: str, status: int = 200, **kwargs) -> HttpResponse:
        """htmx: the changed section (with messages out of band); otherwise the team page."""
        context = self.team_context(**kwargs)
        if htmx_partial(self.request) or status >= 400:
            return render_page(
                self.request, self.template_name, context, partial_template_name=partial, status=status
            )
        return redirect("portal:team")


class TeamView(TeamMixin, TemplateView):
    def get_context_data(self, **kwargs):
        return super().get_context_data(**self.team_context(), **kwargs)


class InviteView(TeamMixin, View):
    http_method_names = ["post"]

    def post(self, request):
        form = InviteForm(request.POST, inviter_role=self.membership.role)
        if form.is_valid():
            try:
                invitation, _ = invitation_create(
                    tenant=self.tenant,
                    email=form.cleaned_data["email"],
                    role=form.cleaned_data["role"],
                    actor=self.actor,
                )
            except DomainError as exc:
                apply_domain_error(form, exc)
                return self.section("portal/team/_invite_response.html", exc.status_code, invite_form=form)
            messages.success(request, f"Invitation sent to {invitation.email}.")
            return self.section("portal/team/_invite_response.html")
        return self.section("portal/team/_invite_response.html", 400, invite_form=form)


class MemberRoleView(TeamMixin, View):
    http_method_names = ["post"]

    def post(self, request, pk):
        membership = self.get_scoped_object(Membership.objects.select_related("user", "tenant"), pk=pk)
        form = RoleForm(request.POST)
        if not form.is_valid():
            errors = "; ".join(form.errors.get("role", ["Choose a role."]))
            return self.section("portal/team/_members.html", 400, row_errors={membership.pk: errors})
        try:
            membership_change_role(membership=membership, role=form.cleaned_data["role"], actor=self.actor)
        except DomainError as exc:
            return self.section(
                "portal/team/_members.html", exc.status_code, row_errors={membership.pk: exc.message}
            )
        messages.success(request, f"{membership.user.display_name} is now {Role(membership.role).label}.")
        if membership.user_id == request.user.pk and Scope.ADMIN not in membership.scopes:
            return _leave_page(request, "portal:team")
        return self.section("portal/team/_members.html")


class MemberRemoveView(TeamMixin, View):
    http_method_names = ["post"]

    def post(self, request, pk):
        membership = self.get_scoped_object(Membership.objects.select_related("user", "tenant"), pk=pk)
        name = membership.user.display_name
        try:
            membership_remove(membership=membership, actor=self.actor)
        except DomainError as exc:
            return self.section(
                "portal/team/_members.html", exc.status_code, row_errors={membership.pk: exc.message}
            )
        if membership.user_id == request.user.pk:
            messages.success(request, f"You left {self.tenant.name}.")
            return _leave_page(request, "portal:dashboard")
        messages.success(request, f"{name} was removed from the team.")
        return self.section("portal/team/_members.html")


class InvitationRevokeView(TeamMixin, View):
    http_method_names = ["post"]

    def post(self, request, pk):
        invitation = self.get_scoped_object(Invitation.objects.filter(accepted_at__isnull=True), pk=pk)
        invitation_revoke(invitation=invitation, actor=self.actor)
        messages.success(request, f"The invitation of {invitation.email} was revoked.")
        return self.section("portal/team/_invitations.html")


class InvitationResendView(TeamMixin, View):
    http_method_names = ["post"]

    def post(self, request, pk):
        invitation = self.get_scoped_object(Invitation.objects.filter(accepted_at__isnull=True), pk=pk)
        try:
            invitation_create(
                tenant=self.tenant, email=invitation.email, role=invitation.role, actor=self.actor
            )
        except DomainError as exc:
            return self.section(
                "portal/team/_invitations.html",
                exc.status_code,
                invitation_errors={invitation.pk: exc.message},
            )
        messages.success(request, f"A new invitation link was sent to {invitation.email}.")
        return self.section("portal/team/_invitations.html")


def _leave_page(request, url_name: str) -> HttpResponse:
    """The person lost access to this page: htmx follows a client-side redirect."""
    from django.urls import reverse

    if htmx_partial(request):
        response = HttpResponse(status=204)
        response["HX-Redirect"] = reverse(url_name)
        return response
    return redirect(url_name)
