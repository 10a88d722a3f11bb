from __future__ import annotations

from rest_framework import exceptions, permissions

from portal.api.context import request_context
from portal.models import ApiToken, Scope, StaffToken


class TenantScopePermission(permissions.BasePermission):
    """Authenticated, acting for an active tenant, and holding the scope the view asks for.

    A view declares ``read_scope`` (safe methods) and ``write_scope`` (the rest); the defaults are
    ``read`` and ``write``. ``scope_for_action`` may name a scope per viewset action.
    """

    def has_permission(self, request, view) -> bool:
        if isinstance(request.auth, StaffToken):
            raise exceptions.PermissionDenied("A staff token never opens the tenant API.")
        if not (isinstance(request.auth, ApiToken) or request.user.is_authenticated):
            raise exceptions.NotAuthenticated()
        ctx = request_context(request)
        if ctx.tenant is None:
            raise exceptions.PermissionDenied("You are not a member of any tenant.")
        if not ctx.tenant.is_active:
            reason = f": {ctx.tenant.suspended_reason}" if ctx.tenant.suspended_reason else ""
            raise exceptions.PermissionDenied(f"Tenant {ctx.tenant.slug} is suspended{reason}.")
        needed = required_scope(request, view)
        if needed not in ctx.scopes:
            raise exceptions.PermissionDenied(f"This needs the '{needed}' scope.")
        return True


def required_scope(request, view) -> str:
    per_action = getattr(view, "scope_for_action", {})
    action = getattr(view, "action", None)
    if action in per_action:
        return per_action[action]
    if request.method in permissions.SAFE_METHODS:
        return getattr(view, "read_scope", Scope.READ)
    return getattr(view, "write_scope", Scope.WRITE)


class StaffPermission(permissions.BasePermission):
    """The staff APIs: a signed-in, active staff person, or a staff token holding the view's
    ``staff_scope``. A tenant's token never opens them, whoever made it."""

    def has_permission(self, request, view) -> bool:
        if isinstance(request.auth, ApiToken):
            raise exceptions.PermissionDenied(
                "A tenant token never opens the staff API: use a staff token (gps_...) or a staff session."
            )
        user = request.user
        if not (user and user.is_authenticated):
            raise exceptions.NotAuthenticated()
        if not (user.is_active and user.is_staff):
            raise exceptions.PermissionDenied("The staff API is for gpupool staff.")
        if isinstance(request.auth, StaffToken):
            needed = view.staff_scope
            if needed not in request.auth.scopes:
                raise exceptions.PermissionDenied(f"This needs the '{needed}' staff scope.")
        return True
