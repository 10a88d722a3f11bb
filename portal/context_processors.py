"""What every page template gets: the active tenant, the person's tenants and the sidebar."""

from portal.dashboard import nav_for
from portal.selectors import memberships_for_user


def tenancy(request):
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    membership = getattr(request, "membership", None)
    return {
        "active_membership": membership,
        "active_tenant": getattr(request, "tenant", None),
        "user_memberships": memberships_for_user(user=user),
        "nav_links": nav_for(request),
        "can_admin": membership is not None and "admin" in membership.scopes,
    }
