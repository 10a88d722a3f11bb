"""A form body past Django's limits is the client's doing on every API route: a 400 (too many
fields) or a 413 (too large) in the API's error shape, naming the limit, and nothing written.
Before, Django's TooManyFieldsSent and RequestDataTooBig surfaced as 500s."""

from __future__ import annotations

import pytest
from django.test import Client

from portal.models import AuditEvent, Membership, Role
from scheduling.models import SshKey, Workload

pytestmark = pytest.mark.django_db

ROUTES = [
    "/api/v1/instances/",
    "/api/v1/jobs/",
    "/api/v1/ssh-keys/",
    "/api/v1/invitations/",
    "/api/v1/volumes/",
]


def _fields(n: int) -> dict[str, str]:
    return {f"f{i}": "x" for i in range(n)}


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


def _nothing_written(before: tuple[int, int, int]) -> None:
    assert (AuditEvent.objects.count(), Workload.objects.count(), SshKey.objects.count()) == before


def _counts() -> tuple[int, int, int]:
    return AuditEvent.objects.count(), Workload.objects.count(), SshKey.objects.count()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("encoding", ["multipart", "urlencoded"])
def test_a_form_with_too_many_fields_is_a_400_naming_the_limit(
    tenant, make_token, api, settings, route, encoding
):
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 50
    client = api(make_token(tenant))
    before = _counts()
    # Control: the same route with as many fields as allowed is not refused for their number.
    if encoding == "multipart":
        ok = client.post(route, _fields(50))
    else:
        ok = client.post(
            route, "&".join(f"f{i}=x" for i in range(50)), content_type="application/x-www-form-urlencoded"
        )
    assert ok.status_code in (400, 201) and "too_many_fields" not in ok.content.decode(), ok.content
    if encoding == "multipart":
        response = client.post(route, _fields(51))
    else:
        response = client.post(
            route, "&".join(f"f{i}=x" for i in range(51)), content_type="application/x-www-form-urlencoded"
        )
    error = _error(response, 400, "too_many_fields")
    assert "50" in error["message"] and "DATA_UPLOAD_MAX_NUMBER_FIELDS" in error["message"]
    _nothing_written(before)


def test_a_member_signed_in_gets_the_same_400(tenant, settings):
    """Session authentication checks CSRF, which reads the form first: the same answer."""
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 50
    client = Client(enforce_csrf_checks=True)
    client.force_login(Membership.objects.get(tenant=tenant, role=Role.OWNER).user)
    assert client.get("/account/ssh-keys/").status_code == 200  # a page with a form sets the CSRF cookie
    token = client.cookies["csrftoken"].value
    ok = client.post("/api/v1/ssh-keys/", _fields(50), HTTP_X_CSRFTOKEN=token)
    assert ok.status_code == 400 and "too_many_fields" not in ok.content.decode(), ok.content
    response = client.post("/api/v1/ssh-keys/", _fields(51), HTTP_X_CSRFTOKEN=token)
    _error(response, 400, "too_many_fields")


def test_a_form_too_large_is_a_413_naming_the_limit(tenant, make_token, api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024
    client = api(make_token(tenant))
    before = _counts()
    response = client.post("/api/v1/ssh-keys/", {"name": "k", "public_key": "x" * 4096})
    error = _error(response, 413, "request_too_large")
    assert "1024" in error["message"]
    _nothing_written(before)
