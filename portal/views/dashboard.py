"""The dashboard frame and portal's own panels (see ``portal.dashboard`` for the registry)."""

from __future__ import annotations

from django.shortcuts import render
from django.views.generic import TemplateView

from portal import selectors
from portal.dashboard import panels_for
from portal.models import ApiToken, Scope
from portal.views.base import PanelView, TenantScopedMixin

ACTION_VERBS = {
    "tenant.create": "created the team",
    "tenant.suspend": "suspended the team",
    "tenant.grace": "marked the team's payment overdue",
    "tenant.reactivate": "reactivated the team",
    "member.add": "added",
    "member.role_change": "changed the role of",
    "member.remove": "removed",
    "invitation.create": "invited",
    "invitation.revoke": "revoked the invitation of",
    "token.create": "created the API token",
    "token.revoke": "revoked the API token",
}


class DashboardView(TenantScopedMixin, TemplateView):
    """The frame: one card per registered panel; each card loads its body with htmx."""

    template_name = "portal/dashboard.html"

    def handle_no_tenant(self, request):
        # Home for someone who belongs to no team yet: an empty state, not an error.
        return render(request, "portal/no_tenant.html")

    def get_context_data(self, **kwargs):
        return super().get_context_data(panels=panels_for(self.membership), **kwargs)


class GettingStartedPanel(PanelView):
    panel_template_name = "portal/panels/getting_started.html"
    title = "Getting started"

    def get_context_data(self, **kwargs):
        summary = selectors.tenant_team_summary(tenant=self.tenant)
        is_admin = self.has_scope(Scope.ADMIN)
        steps = [
            {
                "title": "Invite your team",
                "text": "Bring in the people who run workloads, with the role each needs.",
                "done": summary["members"] > 1 or summary["open_invitations"] > 0,
                "url_name": "portal:team",
                "action": "Open team" if is_admin else "See team",
            },
            {
                "title": "Create an API token",
                "text": "Automate with the API or the CLI; a token carries only the scopes you pick.",
                "done": self.scoped(ApiToken).exists(),
                "url_name": "portal:tokens" if is_admin else None,
                "action": "Create token",
            },
            {
                "title": "Set your time zone",
                "text": "Every time in the portal is shown in it.",
                "done": self.request.user.time_zone != "UTC",
                "url_name": "portal:profile",
                "action": "Edit profile",
            },
            {
                "title": "Read the API reference",
                "text": "Every page here has an endpoint under /api/v1/.",
                "done": False,
                "url_name": "api-docs",
                "action": "Open docs",
            },
        ]
        done = sum(1 for s in steps if s["done"])
        return super().get_context_data(steps=steps, done=done, total=len(steps), **kwargs)


class TeamPanel(PanelView):
    panel_template_name = "portal/panels/team.html"
    title = "Team"

    def get_context_data(self, **kwargs):
        members = selectors.tenant_members(tenant=self.tenant)
        return super().get_context_data(
            summary=selectors.tenant_team_summary(tenant=self.tenant),
            members=members[:5],
            **kwargs,
        )


class ActivityPanel(PanelView):
    panel_template_name = "portal/panels/activity.html"
    title = "Recent activity"
    read_scope = Scope.ADMIN

    def get_context_data(self, **kwargs):
        events = [
            {
                "event": e,
                "verb": ACTION_VERBS.get(e.action, e.action.replace(".", " ").replace("_", " ")),
                # a membership reads "person in Team (role)": the team is this one, say it once
                "target": e.target_repr.replace(f" in {self.tenant.name} (", " ("),
            }
            for e in selectors.audit_events_recent(tenant=self.tenant, limit=10)
        ]
        return super().get_context_data(events=events, **kwargs)
