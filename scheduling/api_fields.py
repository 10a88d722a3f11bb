"""Serializer fields the scheduling API modules share."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string"},
            {"type": "object", "properties": {"secret": {"type": "string"}}, "required": ["secret"]},
        ]
    }
)
class EnvValueField(serializers.JSONField):
    """A variable's value, or a reference to one of the tenant's secrets (``{"secret": "NAME"}``),
    passed as given: the service checks which (``scheduling.services.env``)."""
