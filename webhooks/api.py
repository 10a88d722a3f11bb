"""``/api/v1/webhooks/`` (endpoints) and ``/api/v1/webhook-deliveries/`` (their delivery log and
redelivery). Registered on portal's shared router when ``webhooks.api`` is imported; the rules live
in ``webhooks.services``. Both need the ``admin`` scope: an endpoint sends the team's events (billing
amounts included) to a system outside gpupool, as a token lets one in.
"""

from __future__ import annotations

from django.urls import path
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.api.routers import extra_urlpatterns, router
from portal.api.viewsets import TenantReadOnlyViewSet
from portal.errors import ValidationFailed
from portal.models import Scope
from webhooks.catalog import EVENT_TYPES
from webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from webhooks.services.deliveries import delivery_redeliver
from webhooks.services.endpoints import (
    endpoint_create,
    endpoint_delete,
    endpoint_roll_secret,
    endpoint_update,
)

WRITABLE = ("url", "event_types", "description", "enabled")


class WebhookEndpointSerializer(serializers.ModelSerializer):
    event_types = serializers.ListField(child=serializers.CharField())

    class Meta:
        model = WebhookEndpoint
        fields = [
            "id",
            "url",
            "description",
            "event_types",
            "enabled",
            "previous_secret_expires_at",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "previous_secret_expires_at": {
                "help_text": "After a roll that kept the old secret: deliveries are signed with it too "
                "until then (null: only the current secret)."
            }
        }


class WebhookEndpointCreatedSerializer(WebhookEndpointSerializer):
    secret = serializers.SerializerMethodField(
        help_text="The signing secret (whsec_...). It is shown this once only."
    )

    class Meta(WebhookEndpointSerializer.Meta):
        fields = [*WebhookEndpointSerializer.Meta.fields, "secret"]
        read_only_fields = fields

    def get_secret(self, obj) -> str:
        return self.context["secret"]


class WebhookEndpointWriteSerializer(serializers.Serializer):
    """What a create or a PATCH may carry; the service checks the values (and names the field)."""

    url = serializers.JSONField(required=False, help_text="https://... on a public address.")
    event_types = serializers.JSONField(required=False, help_text='Event type names, or ["*"].')
    description = serializers.JSONField(required=False)
    enabled = serializers.JSONField(required=False)


class RollSecretSerializer(serializers.Serializer):
    expire_previous_in_s = serializers.JSONField(
        required=False,
        help_text="Seconds (0 to 604800) the old secret keeps signing deliveries beside the new one; "
        "0 (the default): it stops now.",
    )


class EventTypeSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()


class WebhookAttemptSerializer(serializers.ModelSerializer):
    class Meta:
        model = WebhookAttempt
        fields = ["number", "manual", "at", "status", "latency_ms", "error", "response_excerpt"]
        read_only_fields = fields


class WebhookDeliverySerializer(serializers.ModelSerializer):
    event_id = serializers.SerializerMethodField()
    event_type = serializers.CharField(source="event.type", read_only=True)

    class Meta:
        model = WebhookDelivery
        fields = [
            "id",
            "endpoint",
            "event_id",
            "event_type",
            "state",
            "attempts",
            "next_attempt_at",
            "retry_until",
            "last_status",
            "last_error",
            "created_at",
            "delivered_at",
        ]
        read_only_fields = fields

    def get_event_id(self, obj) -> str:
        return f"evt_{obj.event_id}"


class WebhookDeliveryDetailSerializer(WebhookDeliverySerializer):
    attempt_log = WebhookAttemptSerializer(many=True, read_only=True)
    payload = serializers.SerializerMethodField(help_text="The JSON body each attempt sends.")

    class Meta(WebhookDeliverySerializer.Meta):
        fields = [*WebhookDeliverySerializer.Meta.fields, "payload", "attempt_log"]
        read_only_fields = fields

    def get_payload(self, obj) -> dict:
        import json

        from webhooks.services.events import event_body

        return json.loads(event_body(obj.event))


def _fields(request, *, required: tuple[str, ...] = ()) -> dict:
    data = request.data
    if not isinstance(data, dict):
        raise ValidationFailed(
            "The body must be a JSON object.", fields={"non_field_errors": ["Not an object."]}
        )
    unknown = sorted(set(data) - set(WRITABLE))
    if unknown:
        raise ValidationFailed(
            f"{unknown[0]}: not a field of a webhook endpoint.",
            fields={k: ["Unknown field."] for k in unknown},
        )
    missing = [f for f in required if f not in data]
    if missing:
        raise ValidationFailed(
            f"{missing[0]}: this field is required.", fields={k: ["This field is required."] for k in missing}
        )
    return {k: data[k] for k in WRITABLE if k in data}


class WebhookEndpointViewSet(TenantReadOnlyViewSet, mixins.CreateModelMixin, mixins.DestroyModelMixin):
    """Where the team's events are sent. The create answer carries the signing secret, once; each
    delivery is signed with it (``Gpupool-Signature: t=<unix>,v1=<HMAC-SHA256 of "t.body">``).
    PATCH changes ``url``, ``event_types``, ``description`` or ``enabled``; ``roll-secret`` makes a
    new secret (shown once), keeping the old one beside it for ``expire_previous_in_s`` seconds."""

    queryset = WebhookEndpoint.objects.all()
    serializer_class = WebhookEndpointSerializer
    read_scope = Scope.ADMIN
    write_scope = Scope.ADMIN
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]
    filterset_fields = ["enabled"]

    def get_serializer_class(self):
        if self.action in ("create", "partial_update"):
            return WebhookEndpointWriteSerializer
        return WebhookEndpointSerializer

    @extend_schema(request=WebhookEndpointWriteSerializer, responses={201: WebhookEndpointCreatedSerializer})
    def create(self, request, *args, **kwargs):
        values = _fields(request, required=("url", "event_types"))
        endpoint, secret = endpoint_create(tenant=self.ctx.tenant, actor=self.actor, **values)
        data = WebhookEndpointCreatedSerializer(endpoint, context={"secret": secret}).data
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=WebhookEndpointWriteSerializer, responses=WebhookEndpointSerializer)
    def partial_update(self, request, *args, **kwargs):
        endpoint = self.get_object()
        endpoint = endpoint_update(endpoint=endpoint, changes=_fields(request), actor=self.actor)
        return Response(WebhookEndpointSerializer(endpoint).data)

    def perform_destroy(self, instance):
        endpoint_delete(endpoint=instance, actor=self.actor)

    @extend_schema(request=RollSecretSerializer, responses=WebhookEndpointCreatedSerializer)
    @action(detail=True, methods=["post"], url_path="roll-secret")
    def roll_secret(self, request, pk=None):
        data = request.data if request.data else {}
        if not isinstance(data, dict):
            raise ValidationFailed(
                "The body must be a JSON object.", fields={"non_field_errors": ["Not an object."]}
            )
        unknown = sorted(set(data) - {"expire_previous_in_s"})
        if unknown:
            raise ValidationFailed(
                f"{unknown[0]}: not a field of a roll.", fields={k: ["Unknown field."] for k in unknown}
            )
        endpoint, secret = endpoint_roll_secret(
            endpoint=self.get_object(),
            actor=self.actor,
            expire_previous_in_s=data.get("expire_previous_in_s", 0),
        )
        return Response(WebhookEndpointCreatedSerializer(endpoint, context={"secret": secret}).data)


class WebhookDeliveryViewSet(TenantReadOnlyViewSet):
    """Each event sent to each endpoint, newest first (``?endpoint=ID``, ``?state=``); the detail
    has the body and every attempt (status, latency, error). ``redeliver`` sends it again now."""

    queryset = WebhookDelivery.objects.select_related("event")
    serializer_class = WebhookDeliverySerializer
    read_scope = Scope.ADMIN
    write_scope = Scope.ADMIN
    filterset_fields = ["endpoint", "state"]

    def get_queryset(self):
        queryset = super().get_queryset()
        if self.action == "retrieve":
            queryset = queryset.prefetch_related("attempt_log")
        return queryset

    def get_serializer_class(self):
        if self.action == "retrieve":
            return WebhookDeliveryDetailSerializer
        return WebhookDeliverySerializer

    @extend_schema(request=None, responses=WebhookDeliverySerializer)
    @action(detail=True, methods=["post"])
    def redeliver(self, request, pk=None):
        delivery = delivery_redeliver(delivery=self.get_object(), actor=self.actor)
        return Response(WebhookDeliverySerializer(delivery).data)


class EventTypesView(APIView):
    """The event types a webhook endpoint may ask for (any member may read them)."""

    @extend_schema(responses=EventTypeSerializer(many=True))
    def get(self, request):
        return Response([{"name": k, "description": v} for k, v in EVENT_TYPES.items()])


router.register("webhooks", WebhookEndpointViewSet, basename="webhook")
extra_urlpatterns.append(path("webhook-event-types/", EventTypesView.as_view(), name="webhook-event-types"))
router.register("webhook-deliveries", WebhookDeliveryViewSet, basename="webhook-delivery")
