"""Staff taking finance data away (the staff API's reports, the finance pages' CSV files) is audited."""

from __future__ import annotations

import pytest
from django.test import Client

from portal.actors import Actor
from portal.models import AuditEvent, StaffScope, User
from portal.staff_tokens import staff_token_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff(db) -> User:
    return User.objects.create_user(email="ops@gpupool.test", password="pw-for-tests-1", is_staff=True)


def exports():
    return list(AuditEvent.objects.filter(action="finance.exported").order_by("id"))


def test_staff_api_reports_and_csv_exports_are_audited(staff):
    _, plaintext = staff_token_create(
        user=staff, name="ro", scopes=[StaffScope.FINANCE_READ], actor=Actor(user=staff)
    )
    api = Client(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    for path in ("revenue/", "gpu-hours/", "receivables/"):
        assert api.get(f"/api/staff/v1/finance/{path}", {"end": "2024-03"}).status_code == 200
    # A refused request takes nothing away: not audited.
    assert api.get("/api/staff/v1/finance/revenue/", {"end": "2024-13"}).status_code == 400
    page = Client()
    page.force_login(staff)
    assert page.get("/staff/finance/").status_code == 200  # a page view is no export
    assert page.get("/staff/finance/", {"export": "csv", "end": "2024-03"}).status_code == 200
    events = exports()
    assert [(e.data["report"], e.data["format"]) for e in events] == [
        ("revenue", "json"),
        ("gpu-hours", "json"),
        ("receivables", "json"),
        ("revenue", "csv"),
    ]
    assert all(e.actor_user == staff for e in events)
    assert events[0].data["query"] == {"end": "2024-03"}
