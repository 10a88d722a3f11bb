"""OpenAPI links from each create operation to what can be done with the object it made.

A ``POST /api/v1/<things>/`` that answers 201 with the new object's ``id`` links to every operation
under ``/api/v1/<things>/{id}/`` (retrieve, update, delete, the detail actions), that ``id`` filling
their path parameter. Clients can read the links as documentation; schemathesis' state machine
follows them to chain a create with the calls on what it created (tests/test_api_fuzz.py).
"""

from __future__ import annotations

from typing import Any

from drf_spectacular import openapi
from drf_spectacular.utils import OpenApiParameter

IDEMPOTENCY_TTL_TEXT = "IDEMPOTENCY_KEY_TTL, a day by default"

HTTP_METHODS = ("get", "put", "patch", "post", "delete")


def _component(result: dict, schema: dict) -> dict:
    """The schema itself, or the component a ``$ref`` names (``#/components/schemas/<name>``)."""
    ref = schema.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        return result.get("components", {}).get("schemas", {}).get(ref.rsplit("/", 1)[1], {})
    return schema


def _created_has_id(result: dict, response: dict) -> bool:
    schema = response.get("content", {}).get("application/json", {}).get("schema")
    return schema is not None and "id" in _component(result, schema).get("properties", {})


def add_create_links(result: dict[str, Any], generator, request, public) -> dict[str, Any]:
    """drf-spectacular postprocessing hook (``SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]``)."""
    paths = result.get("paths", {})
    for path, operations in paths.items():
        created = operations.get("post", {}).get("responses", {}).get("201")
        if created is None or not _created_has_id(result, created):
            continue
        detail = f"{path}{{id}}/"
        links = {}
        for other_path, other_operations in paths.items():
            if not other_path.startswith(detail):
                continue
            for method in HTTP_METHODS:
                operation_id = other_operations.get(method, {}).get("operationId")
                if operation_id:
                    links[operation_id] = {
                        "operationId": operation_id,
                        "parameters": {"id": "$response.body#/id"},
                        "description": f"{method.upper()} {other_path} on the object just created.",
                    }
        if links:
            created["links"] = dict(sorted(links.items()))
    return result


class AutoSchema(openapi.AutoSchema):
    """drf-spectacular's, with the ``Idempotency-Key`` header on every tenant create."""

    def get_override_parameters(self):
        from portal.api.viewsets import TenantScopedViewSet
        from portal.services.idempotency import HEADER

        parameters = list(super().get_override_parameters())
        if isinstance(self.view, TenantScopedViewSet) and getattr(self.view, "action", None) == "create":
            parameters.append(
                OpenApiParameter(
                    HEADER,
                    str,
                    OpenApiParameter.HEADER,
                    description="Makes the create safe to repeat: the same key, route and body get the "
                    f"first answer back (for {IDEMPOTENCY_TTL_TEXT}); another body with the key is 422.",
                )
            )
        return parameters
