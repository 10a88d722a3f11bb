"""The tenant and scopes a request acts with, resolved once per request.

A bearer token acts for its own tenant with its scopes, within what its creator's current role there
allows (``ApiToken.effective_scopes``). A signed-in person acts for the tenant
chosen in the session (see ``portal.middleware.TenantMiddleware``) with the scopes of their role.
"""

from __future__ import annotations

from dataclasses import dataclass

from portal.models import ApiToken, Membership, Tenant


@dataclass(frozen=True)
class RequestContext:
    tenant: Tenant | None
    scopes: frozenset[str]
    membership: Membership | None = None
    token: ApiToken | None = None


_EMPTY = RequestContext(tenant=None, scopes=frozenset())


def request_context(request) -> RequestContext:
    """The context of a DRF request, kept on it for the rest of the request. Django's request's
    attributes (``membership``) are read through DRF's request, which passes on what it lacks."""
    cached = getattr(request, "gpupool_context", None)
    if cached is not None:
        return cached
    auth = getattr(request, "auth", None)
    if isinstance(auth, ApiToken):
        ctx = RequestContext(tenant=auth.tenant, scopes=auth.effective_scopes or frozenset(), token=auth)
    else:
        membership = getattr(request, "membership", None)
        ctx = (
            RequestContext(tenant=membership.tenant, scopes=membership.scopes, membership=membership)
            if membership is not None
            else _EMPTY
        )
    request.gpupool_context = ctx
    return ctx
