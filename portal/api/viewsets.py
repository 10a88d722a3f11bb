"""The one DRF base for tenant-owned resources: every queryset goes through ``for_tenant``."""

from __future__ import annotations

import json

from django.db import transaction
from django.http.request import RawPostDataException
from rest_framework import mixins, viewsets
from rest_framework.response import Response

from portal.actors import Actor, actor_from_request
from portal.api.context import RequestContext, request_context
from portal.services.idempotency import HEADER, Replay, idempotency_key_claim, idempotency_key_store


def _body_bytes(request) -> bytes:
    """The raw body; a form body that CSRF's check has already read, as its fields in order."""
    try:
        return request.body
    except RawPostDataException:
        return json.dumps(sorted(request.POST.lists())).encode()


class _Replayed(Exception):
    """Raised from ``initial`` to answer with a stored create (``handle_exception`` turns it back)."""

    def __init__(self, replay: Replay) -> None:
        super().__init__("replayed")
        self.replay = replay


class TenantScopedViewSet(viewsets.GenericViewSet):
    """Base for every tenant-owned API resource.

    Subclasses set ``queryset`` to the model's default manager (a ``TenantQuerySet``); this class
    narrows it to the request's tenant, so objects of other tenants answer 404.
    """

    lookup_value_regex = r"[0-9]+"
    _idempotency_row = None

    # --- Idempotency-Key on creates (portal/services/idempotency.py has the rule) ------------------

    def _idempotent_create(self, request) -> bool:
        return (
            request.method == "POST" and self.action_map.get("post") == "create" and HEADER in request.headers
        )

    def dispatch(self, request, *args, **kwargs):
        if not self._idempotent_create(request):
            return super().dispatch(request, *args, **kwargs)
        # The key's row and what the create writes commit together (or not at all).
        with transaction.atomic():
            return super().dispatch(request, *args, **kwargs)

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        if self._idempotent_create(request) and self.ctx.tenant is not None:
            claimed = idempotency_key_claim(
                tenant=self.ctx.tenant,
                key=request.headers[HEADER],
                route=f"POST {request.path}",
                body=_body_bytes(request),
            )
            if isinstance(claimed, Replay):
                raise _Replayed(claimed)
            self._idempotency_row = claimed

    def handle_exception(self, exc):
        if isinstance(exc, _Replayed):
            response = Response(exc.replay.body, status=exc.replay.status_code)
            response["Idempotent-Replayed"] = "true"
            return response
        return super().handle_exception(exc)

    def finalize_response(self, request, response, *args, **kwargs):
        row, self._idempotency_row = self._idempotency_row, None
        if row is not None and not transaction.get_rollback():
            idempotency_key_store(row=row, status_code=response.status_code, body=response.data)
        return super().finalize_response(request, response, *args, **kwargs)

    @property
    def ctx(self) -> RequestContext:
        return request_context(self.request)

    @property
    def actor(self) -> Actor:
        return actor_from_request(self.request)

    def get_queryset(self):
        return self.scoped(super().get_queryset())

    def scoped(self, queryset):
        """``queryset`` (of a tenant-owned model) narrowed to the request's tenant: what
        ``get_queryset`` applies, for a view that reads another queryset of the model."""
        return queryset.for_tenant(self.ctx.tenant)


class TenantReadOnlyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantScopedViewSet):
    pass


class PersonScopedViewSet(TenantScopedViewSet):
    """Base for rows that belong to a person (saved SSH keys): the request's person's only, a
    token's creator's for a token, so another person's rows answer 404. The tenant and scope checks
    still apply (``write`` to change)."""

    def get_queryset(self):
        return self.queryset.all().for_person(self.actor.user)
