from __future__ import annotations

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.api.context import request_context
from portal.api.filters import TenantFilterSet
from portal.api.serializers import (
    ApiTokenCreatedSerializer,
    ApiTokenSerializer,
    AuditEventSerializer,
    InvitationSerializer,
    MemberSerializer,
    MeSerializer,
    SecretCreateSerializer,
    SecretSerializer,
    SecretValueSerializer,
    TenantSerializer,
)
from portal.api.viewsets import TenantReadOnlyViewSet
from portal.errors import ValidationFailed
from portal.models import ApiToken, AuditEvent, Invitation, Membership, Scope, TenantSecret
from portal.services.invitations import invitation_create, invitation_revoke
from portal.services.members import membership_change_role, membership_remove
from portal.services.secrets import secret_create, secret_delete, secret_update
from portal.services.tokens import api_token_create, api_token_revoke


class MeView(APIView):
    """The tenant and scopes this request acts with."""

    @extend_schema(responses=MeSerializer)
    def get(self, request):
        ctx = request_context(request)
        token = ctx.token
        return Response(
            {
                "tenant": TenantSerializer(ctx.tenant).data,
                "scopes": [s for s in Scope.values if s in ctx.scopes],
                "user": request.user.email if request.user.is_authenticated else None,
                "token": ApiTokenSerializer(token).data if token is not None else None,
            }
        )


class MemberViewSet(TenantReadOnlyViewSet, mixins.UpdateModelMixin, mixins.DestroyModelMixin):
    """People in the tenant. Invite with ``/invitations/``; change a role with PATCH; remove with DELETE."""

    queryset = Membership.objects.select_related("user")
    serializer_class = MemberSerializer
    write_scope = Scope.ADMIN
    http_method_names = ["get", "patch", "delete", "head", "options"]
    filterset_fields = ["role"]

    def perform_update(self, serializer):
        # A PATCH need not name every field, but the role is the only one there is to change.
        if "role" not in serializer.validated_data:
            raise ValidationFailed("Name the new role.", fields={"role": ["This field is required."]})
        membership_change_role(
            membership=serializer.instance, role=serializer.validated_data["role"], actor=self.actor
        )

    def perform_destroy(self, instance):
        membership_remove(membership=instance, actor=self.actor)


class InvitationViewSet(TenantReadOnlyViewSet, mixins.CreateModelMixin, mixins.DestroyModelMixin):
    """Open invitations; creating one emails a link (an open one to the same address is resent)."""

    queryset = Invitation.objects.select_related("invited_by").filter(accepted_at__isnull=True)
    serializer_class = InvitationSerializer
    read_scope = Scope.ADMIN
    write_scope = Scope.ADMIN

    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        invitation, _ = invitation_create(
            tenant=self.ctx.tenant, actor=self.actor, **serializer.validated_data
        )
        return Response(self.get_serializer(invitation).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        invitation_revoke(invitation=instance, actor=self.actor)


class ApiTokenFilter(TenantFilterSet):
    status = django_filters.ChoiceFilter(
        choices=[("active", "active"), ("revoked", "revoked")], method="filter_status"
    )

    class Meta:
        model = ApiToken
        fields = ["status"]

    def filter_status(self, queryset, name, value):
        return queryset.usable() if value == "active" else queryset.filter(revoked_at__isnull=False)


class ApiTokenViewSet(TenantReadOnlyViewSet, mixins.CreateModelMixin):
    """API tokens. The secret is in the create response only; it cannot be read again."""

    queryset = ApiToken.objects.select_related("created_by")
    serializer_class = ApiTokenSerializer
    read_scope = Scope.ADMIN
    write_scope = Scope.ADMIN
    filterset_class = ApiTokenFilter

    @extend_schema(responses={201: ApiTokenCreatedSerializer})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        token, plaintext = api_token_create(
            tenant=self.ctx.tenant, actor=self.actor, **serializer.validated_data
        )
        data = ApiTokenCreatedSerializer(token, context={"plaintext": plaintext}).data
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=ApiTokenSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        token = api_token_revoke(token=self.get_object(), actor=self.actor)
        return Response(self.get_serializer(token).data)


class AuditEventViewSet(TenantReadOnlyViewSet):
    """The tenant's audit log: who changed what, newest first."""

    queryset = AuditEvent.objects.all()
    serializer_class = AuditEventSerializer
    read_scope = Scope.ADMIN
    filterset_fields = ["action", "actor_type", "target_type"]


class SecretViewSet(TenantReadOnlyViewSet, mixins.CreateModelMixin, mixins.DestroyModelMixin):
    """The tenant's secrets, by name. Write-only: answers carry names and times, never a value.
    Workloads refer to one from their env as ``{"KEY": {"secret": "NAME"}}``; PUT ``{name}/``
    replaces the value (running workloads keep the value they started with)."""

    queryset = TenantSecret.objects.all()
    serializer_class = SecretSerializer
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
    http_method_names = ["get", "post", "put", "delete", "head", "options"]

    def get_serializer_class(self):
        if self.action == "create":
            return SecretCreateSerializer
        if self.action == "update":
            return SecretValueSerializer
        return SecretSerializer

    @extend_schema(responses={201: SecretSerializer})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        secret = secret_create(tenant=self.ctx.tenant, actor=self.actor, **serializer.validated_data)
        return Response(SecretSerializer(secret).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=SecretValueSerializer, responses=SecretSerializer)
    def update(self, request, *args, **kwargs):
        secret = self.get_object()
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        secret = secret_update(secret=secret, value=serializer.validated_data["value"], actor=self.actor)
        return Response(SecretSerializer(secret).data)

    def perform_destroy(self, instance):
        secret_delete(secret=instance, actor=self.actor)
