"""Property-based fuzzing of the whole tenant API from its own OpenAPI schema: whatever a client
sends, the answer is never a 5xx, and errors keep the JSON error shape.

Schemathesis generates requests (valid and invalid bodies, query strings and path ids) for every
operation in ``/api/schema/``, so new endpoints are fuzzed without editing this file.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from portal.api.throttling import TokenRateThrottle
from portal.wsgi import application

schema = schemathesis.openapi.from_wsgi("/api/schema/", application)

pytestmark = pytest.mark.django_db


@pytest.fixture
def wsgi_keeps_the_test_connection():
    """The WSGI handler closes the database connection after each request; the test's transaction
    lives on it (Django's own test client does the same unhooking)."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def full_token(make_tenant, make_token, monkeypatch, wsgi_keeps_the_test_connection):
    monkeypatch.setattr(TokenRateThrottle, "THROTTLE_RATES", {"token": "1000000/min"})
    from nodes.catalog import catalog_seed

    catalog_seed()
    return make_token(make_tenant("fuzz"))


def error_shape(ctx, response, case):
    """Every 4xx/5xx from the API is ``{"error": {"code", "message", "fields"}}``."""
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert {"code", "message", "fields"} <= set(body["error"]), body
    return None


@schema.parametrize()
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
    derandomize=True,
)
def test_no_request_makes_the_api_fail(case, full_token):
    case.call_and_validate(
        headers={"Authorization": f"Bearer {full_token}"},
        checks=[not_a_server_error, error_shape],
    )
