from portal.selectors import memberships_for_user


def tenancy(request):
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {
        "active_membership": getattr(request, "membership", None),
        "active_tenant": getattr(request, "tenant", None),
        "user_memberships": memberships_for_user(user=user),
    }
