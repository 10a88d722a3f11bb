from __future__ import annotations

import copy
from functools import cached_property

from rest_framework import serializers
from rest_framework.fields import SkipField
from rest_framework.relations import PKOnlyObject

from portal.inputs import bounded_datetime
from portal.models import ApiToken, AuditEvent, Invitation, Membership, Role, Scope, Tenant, TenantSecret


class FieldsOnceModelSerializer(serializers.ModelSerializer):
    """A ``ModelSerializer`` that builds its fields from the model once per class and gives each
    instance a copy, as a plain ``Serializer`` copies its declared fields; DRF would build them again
    for every serializer, so every request, at twice the cost of the copy. For serializers whose
    fields depend on nothing but the class (no ``get_fields`` of their own that reads the instance,
    the context or the request)."""

    def get_fields(self):
        built = type(self).__dict__.get("_fields_built")
        if built is None:
            built = super().get_fields()  # unbound: binding happens on the copy (``fields``)
            type(self)._fields_built = built  # two threads may both build it: the same fields
        return copy.deepcopy(built)

    @cached_property
    def read_plan(self) -> list[tuple[str, serializers.Field, str | None]]:
        """Each readable field as (name, field, column): ``column`` is the model attribute it reads
        where the field is a plain one over a concrete, non-relational model field (DRF's generic
        ``get_attribute`` would find the same value), else None."""
        meta = self.Meta.model._meta
        columns = {f.name: f.attname for f in meta.concrete_fields if not f.is_relation}
        plan = []
        for name, field in self.fields.items():
            if field.write_only:
                continue
            plain = type(field).get_attribute is serializers.Field.get_attribute
            plan.append((name, field, columns.get(field.source) if plain else None))
        return plan

    def to_representation(self, instance):
        """DRF's rendering, field by field (``None`` stays ``None``, anything else goes through the
        field's ``to_representation``), with a model column read by ``getattr`` where DRF's
        ``get_attribute`` takes its generic path (dotted sources, mappings, callables, defaults),
        about half of a list's rendering time. Anything other than a model instance renders the DRF
        way."""
        if not isinstance(instance, self.Meta.model):
            return super().to_representation(instance)
        ret = {}
        for name, field, column in self.read_plan:
            if column is None:
                try:
                    value = field.get_attribute(instance)
                except SkipField:
                    continue
                if isinstance(value, PKOnlyObject):
                    ret[name] = None if value.pk is None else field.to_representation(value)
                    continue
            else:
                value = getattr(instance, column)
            ret[name] = None if value is None else field.to_representation(value)
        return ret


class BoundedDateTimeField(serializers.DateTimeField):
    """An ISO 8601 time in UTC within ``portal.inputs``' bounds (a 400 naming the field outside)."""

    def to_internal_value(self, value):
        return bounded_datetime(super().to_internal_value(value))


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
    # Null when the system (staff, a script) invited, or the inviter's account is gone.
    invited_by = serializers.EmailField(
        source="invited_by.email", read_only=True, default=None, allow_null=True
    )

    class Meta:
        model = Invitation
        fields = ["id", "email", "role", "invited_by", "created", "expires_at", "accepted_at"]
        read_only_fields = ["id", "invited_by", "created", "expires_at", "accepted_at"]


class ApiTokenSerializer(serializers.ModelSerializer):
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices), allow_empty=False)
    prefix = serializers.CharField(source="display_prefix", read_only=True)
    status = serializers.CharField(read_only=True)
    # Null when the system (staff, a script) made it, or its maker's account is gone.
    created_by = serializers.EmailField(
        source="created_by.email", read_only=True, default=None, allow_null=True
    )

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


class SecretSerializer(serializers.ModelSerializer):
    """A secret as the API shows it: its name and times, never its value."""

    class Meta:
        model = TenantSecret
        fields = ["name", "created_at", "updated_at"]
        read_only_fields = fields


class TextOnlyField(serializers.CharField):
    """A string and nothing else (DRF's CharField would take 5 as "5"), kept exactly as given."""

    def __init__(self, **kwargs):
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class SecretCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=64)
    # The service checks it (no NUL, at most 16 KiB).
    value = TextOnlyField(write_only=True)


class SecretValueSerializer(serializers.Serializer):
    value = TextOnlyField(write_only=True)
