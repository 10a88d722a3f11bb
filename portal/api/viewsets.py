"""The one DRF base for tenant-owned resources: every queryset goes through ``for_tenant``."""

from __future__ import annotations

from rest_framework import mixins, viewsets

from portal.actors import Actor, actor_from_request
from portal.api.context import RequestContext, request_context


class TenantScopedViewSet(viewsets.GenericViewSet):
    """Base for every tenant-owned API resource.

    Subclasses set ``queryset`` to the model's default manager (a ``TenantQuerySet``); this class
    narrows it to the request's tenant, so objects of other tenants answer 404.
    """

    lookup_value_regex = r"[0-9]+"

    @property
    def ctx(self) -> RequestContext:
        return request_context(self.request)

    @property
    def actor(self) -> Actor:
        return actor_from_request(self.request)

    def get_queryset(self):
        return super().get_queryset().for_tenant(self.ctx.tenant)


class TenantReadOnlyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantScopedViewSet):
    pass


class PersonScopedViewSet(TenantScopedViewSet):
    """Base for rows that belong to a person (saved SSH keys): the request's person's only, a
    token's creator's for a token, so another person's rows answer 404. The tenant and scope checks
    still apply (``write`` to change)."""

    def get_queryset(self):
        return self.queryset.all().for_person(self.actor.user)
