from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from rest_framework import ISO_8601, serializers
from rest_framework.settings import api_settings

from portal.models import ApiToken, AuditEvent, Invitation, Membership, Role, Scope, Tenant

# What a read plan renders with the field's own ``to_representation``: fields that need no parent,
# context or request to render a value.
_PLAIN_FIELDS = (
    serializers.BooleanField,
    serializers.CharField,
    serializers.ChoiceField,
    serializers.DateField,
    serializers.DateTimeField,
    serializers.DecimalField,
    serializers.FloatField,
    serializers.IntegerField,
    serializers.JSONField,
    serializers.UUIDField,
)

_Step = Callable[[serializers.Serializer, Any], Any]

# Fields whose ``to_representation`` returns a value of this exact type unchanged (``str(value)``,
# ``int(value)``, the value itself): a read plan skips the call for it (three in four of a workload's
# values). Keyed by the method, so that a subclass that renders otherwise is not taken for them.
_RENDERED_AS_ITSELF: dict[Callable, type] = {
    serializers.CharField.to_representation: str,
    serializers.IntegerField.to_representation: int,
    serializers.BooleanField.to_representation: bool,
    serializers.JSONField.to_representation: object,
}


def _read_step(model, field: serializers.Field) -> _Step:
    """How ``field`` renders one instance, as DRF's ``Serializer.to_representation`` would."""
    source = field.source
    if isinstance(field, serializers.SerializerMethodField):
        method_name = field.method_name
        return lambda serializer, obj: getattr(serializer, method_name)(obj)
    if source == "*" or "." in source:
        pass  # a nested source: not planned (below)
    elif isinstance(field, serializers.ManyRelatedField) and isinstance(
        field.child_relation, serializers.SlugRelatedField
    ):
        slug = field.child_relation.slug_field
        return lambda serializer, obj: [getattr(o, slug) for o in getattr(obj, source).all()]
    elif isinstance(field, serializers.SlugRelatedField):
        slug = field.slug_field

        def related_slug(serializer, obj):
            related = getattr(obj, source)
            return None if related is None else getattr(related, slug)

        return related_slug
    elif isinstance(field, serializers.PrimaryKeyRelatedField) and field.pk_field is None:
        attname = model._meta.get_field(source).attname  # the id, without loading the object
        return lambda serializer, obj: getattr(obj, attname)
    elif (
        isinstance(field, serializers.DateTimeField)
        and not hasattr(field, "timezone")
        and str(getattr(field, "format", api_settings.DATETIME_FORMAT)).lower() == ISO_8601
    ):
        render = field.to_representation

        def iso_datetime(serializer, obj):
            # DRF's rendering, with the zone looked up once per rendering instead of per value (the
            # look-up cost three times the rest: 9 us a value against 2); what is not an aware
            # datetime, or does not fit in the zone, goes to DRF's own.
            value = getattr(obj, source)
            if value is None:
                return None
            zone = serializer.render_timezone()
            if zone is None or type(value) is not datetime or value.utcoffset() is None:
                return render(value)
            try:
                text = value.astimezone(zone).isoformat()
            except OverflowError:
                return render(value)
            return text[:-6] + "Z" if text.endswith("+00:00") else text

        return iso_datetime
    elif isinstance(field, _PLAIN_FIELDS) and not getattr(field, "binary", False):
        render = field.to_representation
        kind = _RENDERED_AS_ITSELF.get(type(field).to_representation)
        if kind is object:  # JSON: DRF returns the value itself

            def json_value(serializer, obj):
                return getattr(obj, source)

            return json_value
        if kind is not None:  # a str, int or bool renders as itself; anything else through DRF

            def same_kind(serializer, obj):
                value = getattr(obj, source)
                return value if value is None or type(value) is kind else render(value)

            return same_kind

        def plain(serializer, obj):
            value = getattr(obj, source)
            return None if value is None else render(value)

        return plain
    raise ImproperlyConfigured(
        f"{type(field).__name__} {field.field_name!r} (source {source!r}) has no read plan: "
        "render it with a SerializerMethodField or use a plain ModelSerializer"
    )


class ReadPlanSerializer(serializers.ModelSerializer):
    """A read-only model serializer that renders through a plan made once per class.

    DRF builds a ``ModelSerializer``'s fields from the model for every serializer it creates (every
    request) and renders each value through ``get_attribute`` and the field's checks: for a page of
    six workloads of 42 fields, a fifth of the request's CPU, and it grows with the page. The plan
    holds one step per field, taken from the fields DRF builds (so the output is DRF's own: the
    tests compare them): plain fields render with their own ``to_representation`` (date-times as DRF
    does, with the time zone looked up once per serializer), slug and
    primary-key relations by attribute, ``SerializerMethodField`` by its method on the serializer
    rendering. Fields of other kinds (nested serializers, dotted sources) are refused when the plan
    is made.
    """

    _plans: ClassVar[dict[type, list[tuple[str, _Step]]]] = {}
    _plans_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def read_plan(cls) -> list[tuple[str, _Step]]:
        plan = cls._plans.get(cls)
        if plan is None:
            with cls._plans_lock:
                plan = cls._plans.get(cls)
                if plan is None:
                    model = cls.Meta.model
                    plan = [(f.field_name, _read_step(model, f)) for f in cls()._readable_fields]
                    cls._plans[cls] = plan
        return plan

    def to_representation(self, instance):
        return {name: step(self, instance) for name, step in self.read_plan()}

    def render_timezone(self):
        """The zone times render in (DRF's ``DateTimeField.default_timezone``), once per serializer:
        a list's rows share their child serializer, and the zone does not change within a request."""
        try:
            return self._render_timezone
        except AttributeError:
            self._render_timezone = timezone.get_current_timezone() if settings.USE_TZ else None
            return self._render_timezone


class TenantSerializer(serializers.ModelSerializer):
    class Meta:
        model = Tenant
        fields = ["id", "slug", "name", "billing_email", "currency", "status", "suspended_reason"]
        read_only_fields = fields


class MemberSerializer(serializers.ModelSerializer):
    email = serializers.EmailField(source="user.email", read_only=True)
    full_name = serializers.CharField(source="user.full_name", read_only=True)
    role = serializers.ChoiceField(choices=Role.choices)

    class Meta:
        model = Membership
        fields = ["id", "email", "full_name", "role", "created"]
        read_only_fields = ["id", "email", "full_name", "created"]


class InvitationSerializer(serializers.ModelSerializer):
    role = serializers.ChoiceField(choices=Role.choices, default=Role.MEMBER)
    invited_by = serializers.EmailField(source="invited_by.email", read_only=True, default=None)

    class Meta:
        model = Invitation
        fields = ["id", "email", "role", "invited_by", "created", "expires_at", "accepted_at"]
        read_only_fields = ["id", "invited_by", "created", "expires_at", "accepted_at"]


class ApiTokenSerializer(serializers.ModelSerializer):
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices), allow_empty=False)
    prefix = serializers.CharField(source="display_prefix", read_only=True)
    status = serializers.CharField(read_only=True)
    created_by = serializers.EmailField(source="created_by.email", read_only=True, default=None)

    class Meta:
        model = ApiToken
        fields = [
            "id",
            "name",
            "prefix",
            "scopes",
            "status",
            "created_by",
            "created",
            "expires_at",
            "revoked_at",
            "last_used_at",
        ]
        read_only_fields = ["id", "prefix", "status", "created_by", "created", "revoked_at", "last_used_at"]


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    token = serializers.SerializerMethodField(help_text="The secret token. It is shown this once only.")

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token"]

    def get_token(self, obj) -> str:
        return self.context["plaintext"]


class AuditEventSerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor_repr", read_only=True)

    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "created",
            "actor_type",
            "actor",
            "action",
            "target_type",
            "target_id",
            "target_repr",
            "data",
        ]
        read_only_fields = fields


class MeSerializer(serializers.Serializer):
    tenant = TenantSerializer()
    scopes = serializers.ListField(child=serializers.CharField())
    user = serializers.EmailField(allow_null=True)
    token = serializers.DictField(allow_null=True)
