"""The one tenant-scoping mechanism.

Every tenant-owned model inherits :class:`TenantOwnedModel`, whose default manager is built from
:class:`TenantQuerySet`. Views and API viewsets never filter by tenant themselves: they go through
``for_tenant`` (see ``portal.api.viewsets.TenantScopedViewSet`` and ``portal.views.TenantScopedMixin``).
Objects of another tenant therefore do not exist for a request: lookups answer 404.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

from django.db import models

if TYPE_CHECKING:
    from portal.models import Membership, Tenant


class TenantQuerySet(models.QuerySet):
    def for_tenant(self, tenant: Tenant | None) -> Self:
        if tenant is None:
            return self.none()
        return self.filter(tenant=tenant)

    def visible_to(self, membership: Membership | None) -> Self:
        """Rows the member may see; models with role-dependent visibility override this."""
        if membership is None:
            return self.none()
        return self.for_tenant(membership.tenant)


class TenantOwnedModel(models.Model):
    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")

    objects: Any = TenantQuerySet.as_manager()

    class Meta:
        abstract = True


def tenant_owned_models() -> list[type[models.Model]]:
    from django.apps import apps

    return [m for m in apps.get_models() if issubclass(m, TenantOwnedModel)]


class PersonQuerySet(models.QuerySet):
    def for_person(self, user: Any) -> Self:
        """The rows of one person; nobody's for an anonymous request or a token without a person."""
        if user is None or not getattr(user, "is_authenticated", False):
            return self.none()
        return self.filter(user=user)


class PersonOwnedModel(models.Model):
    """A row that belongs to a person, not to a tenant (saved SSH keys): the API and pages reach it
    through ``for_person`` with the request's person (a token's: its creator), so another person's
    row answers 404 as another tenant's does."""

    user = models.ForeignKey("portal.User", on_delete=models.CASCADE, related_name="+")

    objects: Any = PersonQuerySet.as_manager()

    class Meta:
        abstract = True
