"""The API frame: one JSON error shape, pagination, filters, rate limits, schema and docs."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from django.test import override_settings
from django.urls import path
from rest_framework.views import APIView

from portal.models import AuditEvent, Membership, Role, User
from tests.conftest import cache_empty

pytestmark = pytest.mark.django_db


def _assert_error_shape(response, status, code):
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "fields"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    return body["error"]


def test_unknown_api_path_is_json_404(client):
    _assert_error_shape(client.get("/api/v1/no-such-thing/"), 404, "not_found")


def test_method_not_allowed_is_json_405(tenant, make_token, api):
    response = api(make_token(tenant)).delete("/api/v1/me/")
    _assert_error_shape(response, 405, "method_not_allowed")
    assert "GET" in response["Allow"]


def test_oversized_body_is_json_413_and_writes_nothing(tenant, make_token, api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024
    client = api(make_token(tenant))
    before = AuditEvent.objects.count()
    response = client.post(
        "/api/v1/invitations/", '{"email": "' + "a" * 5000 + '@x.test"}', content_type="application/json"
    )
    _assert_error_shape(response, 413, "request_too_large")
    assert AuditEvent.objects.count() == before


def test_malformed_json_is_400(tenant, make_token, api):
    response = api(make_token(tenant)).post(
        "/api/v1/invitations/", "{not json", content_type="application/json"
    )
    error = _assert_error_shape(response, 400, "invalid")
    assert "JSON" in error["message"]


def test_validation_errors_name_the_field(tenant, make_token, api):
    error = _assert_error_shape(
        api(make_token(tenant)).post(
            "/api/v1/invitations/",
            {"email": "not-an-email", "role": "emperor"},
            content_type="application/json",
        ),
        400,
        "invalid",
    )
    assert set(error["fields"]) == {"email", "role"}


class Boom(APIView):
    permission_classes = []
    authentication_classes = []

    def get(self, request):
        raise RuntimeError("kaboom")


urlpatterns = [path("api/v1/boom/", Boom.as_view())]


@override_settings(ROOT_URLCONF=__name__, DEBUG_PROPAGATE_EXCEPTIONS=False)
def test_unhandled_error_is_json_500_without_details(db):
    from django.test import Client

    response = Client(raise_request_exception=False).get("/api/v1/boom/")
    error = _assert_error_shape(response, 500, "server_error")
    assert "kaboom" not in error["message"]


def test_members_are_cursor_paginated_and_filterable(tenant, make_token, api):
    for i in range(5):
        user = User.objects.create_user(email=f"p{i}@acme.test", password="x")
        Membership.objects.create(tenant=tenant, user=user, role=Role.VIEWER if i % 2 else Role.MEMBER)
    client = api(make_token(tenant))
    page = client.get("/api/v1/members/?page_size=2").json()
    assert len(page["results"]) == 2 and page["next"] and "cursor=" in page["next"]
    seen = [r["id"] for r in page["results"]]
    while page["next"]:
        page = client.get(page["next"]).json()
        seen += [r["id"] for r in page["results"]]
    assert len(seen) == len(set(seen)) == 6
    viewers = client.get("/api/v1/members/?role=viewer").json()["results"]
    assert {r["role"] for r in viewers} == {"viewer"} and len(viewers) == 2
    bad = client.get("/api/v1/members/?role=emperor")
    assert bad.status_code == 400 and "role" in bad.json()["error"]["fields"]


def test_rate_limit_is_429_with_retry_after(tenant, make_token, api, monkeypatch):
    from portal.api.throttling import TokenRateThrottle

    monkeypatch.setattr(TokenRateThrottle, "THROTTLE_RATES", {"token": "3/min"})
    cache_empty()
    client = api(make_token(tenant))
    other = api(make_token(tenant, name="other"))
    assert [client.get("/api/v1/me/").status_code for _ in range(3)] == [200, 200, 200]
    response = client.get("/api/v1/me/")
    _assert_error_shape(response, 429, "throttled")
    assert int(response["Retry-After"]) > 0
    assert other.get("/api/v1/me/").status_code == 200  # limits are per token
    cache_empty()


def test_openapi_schema_and_docs_are_served_locally(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    doc = schema.json()
    assert doc["openapi"].startswith("3.")
    assert "/api/v1/tokens/" in doc["paths"] and "/api/v1/me/" in doc["paths"]
    assert "bearerAuth" in doc["components"]["securitySchemes"]
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    html = docs.content.decode()
    assert "swagger-ui" in html
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert assets and all(a.startswith("/static/") for a in assets), assets  # nothing from a CDN


def test_members_api_changes_roles_and_protects_the_last_owner(tenant, owner, make_token, api):
    client = api(make_token(tenant))
    owner_membership = Membership.objects.get(user=owner)
    response = client.patch(
        f"/api/v1/members/{owner_membership.pk}/", {"role": "member"}, content_type="application/json"
    )
    error = _assert_error_shape(response, 409, "last_owner")
    assert "owner" in error["message"]
    assert Membership.objects.get(pk=owner_membership.pk).role == Role.OWNER
    assert client.delete(f"/api/v1/members/{owner_membership.pk}/").status_code == 409
    assert Membership.objects.filter(pk=owner_membership.pk).exists()


def test_invitations_api_creates_and_emails(
    tenant, make_token, api, mailoutbox, django_capture_on_commit_callbacks
):
    client = api(make_token(tenant))
    with django_capture_on_commit_callbacks(execute=True):
        with_commit = client.post(
            "/api/v1/invitations/",
            {"email": "New@Example.test", "role": "viewer"},
            content_type="application/json",
        )
    assert with_commit.status_code == 201, with_commit.content
    assert with_commit.json()["email"] == "new@example.test"
    assert len(mailoutbox) == 1 and "/invitations/" in mailoutbox[0].body
    dup = client.post("/api/v1/invitations/", {"email": "owner@acme.test"}, content_type="application/json")
    assert dup.status_code == 409 and "email" in dup.json()["error"]["fields"]


def _rate_steps() -> None:
    from portal.ratelimit import rate_take

    # 3 per second: a quiet key may send 3 at once; the 4th waits for the window to move on.
    taken = [rate_take("k", limit=3, period_s=1) for _ in range(4)]
    assert taken[:3] == [0, 0, 0]
    assert 0 < taken[3] <= 2
    assert rate_take("other", limit=3, period_s=1) == 0  # per key
    time.sleep(2.05)  # two windows quiet: the whole allowance again
    assert [rate_take("k", limit=3, period_s=1) for _ in range(3)] == [0, 0, 0]


def test_request_rate_in_memory(settings):
    settings.RATELIMIT_STORAGE_URI = "memory://"
    _rate_steps()


def test_request_rate_on_redis_is_one_atomic_step(private_redis, settings):
    """On Redis the rate is one script of the `limits` library: exact under concurrent requests
    from many threads (as from many web processes)."""
    from portal.ratelimit import rate_take

    settings.RATELIMIT_STORAGE_URI = private_redis[0]
    _rate_steps()
    barrier = threading.Barrier(8)

    def burst(_):
        barrier.wait()
        return [rate_take("shared", limit=50, period_s=60) == 0 for _ in range(10)]

    with ThreadPoolExecutor(8) as pool:
        allowed = sum(sum(r) for r in pool.map(burst, range(8)))
    assert allowed == 50  # 80 tried, exactly the limit let through
    keys = redis.Redis.from_url(private_redis[0]).keys("gpupool-limits*")
    assert keys  # counted on that server, under the configured prefix


def test_a_request_without_filter_parameters_skips_the_filterset(rf):
    """portal.api.filters.FilterBackend leaves the queryset alone when no parameter names a filter;
    for every FilterSet of the API that is what the FilterSet itself gives for empty input."""
    from rest_framework.request import Request

    from metering.api import UsageFilter, UsageViewSet
    from portal.api.filters import FilterBackend
    from portal.api.views import ApiTokenFilter, ApiTokenViewSet
    from scheduling.api import JobViewSet, WorkloadFilter

    backend = FilterBackend()
    cases = (
        (WorkloadFilter, JobViewSet, {"state": "pending"}),
        (UsageFilter, UsageViewSet, {"period": "2026-01-01"}),
        (ApiTokenFilter, ApiTokenViewSet, {"status": "active"}),
    )
    for filterset, viewset, params in cases:
        queryset = viewset.queryset.all()
        view = viewset(filterset_class=filterset)
        assert str(filterset(data={}, queryset=queryset).qs.query) == str(queryset.query)
        plain = Request(rf.get("/", {"page_size": 5, "cursor": "x"}))
        assert backend.filter_queryset(plain, queryset, view) is queryset
        named = backend.filter_queryset(Request(rf.get("/", params)), queryset, view)
        assert str(named.query) != str(queryset.query)


def test_fields_built_once_per_class_are_a_fresh_bound_copy_per_serializer(tenant):
    """``FieldsOnceModelSerializer`` renders what DRF's ``ModelSerializer`` renders, builds the
    fields once per class, and gives each serializer fields of its own, bound to it."""
    from rest_framework import serializers

    from portal.api.serializers import FieldsOnceModelSerializer
    from portal.models import Tenant

    class Plain(serializers.ModelSerializer):
        class Meta:
            model = Tenant
            fields = ["id", "slug", "name", "currency", "status", "created"]

    class Once(FieldsOnceModelSerializer):
        Meta = Plain.Meta

    class Narrower(Once):
        class Meta(Plain.Meta):
            fields = ["slug"]

    first, second = Once(tenant), Once(tenant)
    assert first.data == Plain(tenant).data
    built = Once.__dict__["_fields_built"]
    assert second.data == first.data and Once.__dict__["_fields_built"] is built  # built once
    assert first.fields["slug"] is not second.fields["slug"] is not built["slug"]
    assert first.fields["slug"].parent is first and second.fields["slug"].parent is second
    assert built["slug"].field_name is None  # the class's own stay unbound
    assert list(Narrower(tenant).data) == ["slug"] and list(Once(tenant).data) == Plain.Meta.fields


def _schema(client) -> dict:
    return client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()


def test_schema_links_each_create_to_the_operations_on_what_it_made(client):
    """OpenAPI links (portal.api.schema): a client, or schemathesis' state machine, knows that the
    ``id`` in a 201 fills the ``{id}`` of the retrieve and the actions of that object."""
    doc = _schema(client)
    links = doc["paths"]["/api/v1/tokens/"]["post"]["responses"]["201"]["links"]
    assert set(links) == {"v1_tokens_retrieve", "v1_tokens_revoke_create"}
    assert links["v1_tokens_revoke_create"]["parameters"] == {"id": "$response.body#/id"}
    jobs = doc["paths"]["/api/v1/jobs/"]["post"]["responses"]["201"]["links"]
    on_a_job = {
        op["operationId"]
        for path, ops in doc["paths"].items()
        if path.startswith("/api/v1/jobs/{id}/")
        for op in ops.values()
    }
    assert set(jobs) == on_a_job
    assert {
        "v1_jobs_retrieve",
        "v1_jobs_stop_create",
        "v1_jobs_events_list",
        "v1_jobs_metrics_retrieve",
    } <= on_a_job
    operation_ids = {op["operationId"] for ops in doc["paths"].values() for op in ops.values()}
    assert all(link["operationId"] in operation_ids for link in jobs.values())
    # A 200 (no create) links nowhere.
    assert "links" not in doc["paths"]["/api/v1/me/"]["get"]["responses"]["200"]


def test_a_token_or_invitation_without_a_maker_says_null_as_documented(tenant, make_token, api, client):
    """Made by the system (staff, a script), or by an account since deleted: the API answered null
    where its schema promised an email address (found by the schemathesis run)."""
    from portal.actors import Actor
    from portal.services.invitations import invitation_create
    from portal.services.tokens import api_token_create

    admin = api(make_token(tenant))
    token, _ = api_token_create(tenant=tenant, name="by-staff", scopes=["read"], actor=Actor.system())
    invitation, _ = invitation_create(
        tenant=tenant, email="someone@acme.test", role=Role.MEMBER, actor=Actor.system()
    )
    assert admin.get(f"/api/v1/tokens/{token.pk}/").json()["created_by"] is None
    assert admin.get(f"/api/v1/invitations/{invitation.pk}/").json()["invited_by"] is None
    schemas = _schema(client)["components"]["schemas"]
    assert schemas["ApiToken"]["properties"]["created_by"]["nullable"] is True
    assert schemas["Invitation"]["properties"]["invited_by"]["nullable"] is True
