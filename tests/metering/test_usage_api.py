"""The usage list's fast path (values_list + orjson) answers exactly what the serializer would."""

import json
from datetime import timedelta

import pytest
from rest_framework.renderers import JSONRenderer

from metering.api import UsageRecordSerializer
from metering.models import UsageRecord
from metering.services.usage import usage_build
from scheduling.models import Plan
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db


def test_the_usage_list_renders_what_the_serializer_does_and_pages_by_cursor(
    tenant, make_tenant, card, run, make_token, api
):
    odd = utc(2024, 3, 1, 0, 0, 7) + timedelta(microseconds=123456)
    run(tenant, odd, odd + timedelta(hours=2, seconds=3))
    run(tenant, utc(2024, 3, 2), utc(2024, 3, 2, 0, 0, 20), plan=Plan.SPOT, fraction_milli=333)
    run(tenant, utc(2024, 2, 28, 23), utc(2024, 3, 1, 1))  # two records, split at the month
    run(make_tenant("other"), utc(2024, 3, 1), utc(2024, 3, 1, 5))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    mine = UsageRecord.objects.filter(tenant=tenant).order_by("-id")
    assert mine.count() == 4
    expected = json.loads(JSONRenderer().render(UsageRecordSerializer(mine, many=True).data))
    assert any(r["minimum_topup_s"] != "0.000000" for r in expected)  # the 20 s run bills 60 s

    client = api(make_token(tenant, scopes=["read", "billing"]))
    body = client.get("/api/v1/usage/?page_size=10000").json()
    assert body["results"] == expected and body["next"] is None
    march = client.get("/api/v1/usage/?period=2024-03-01&page_size=10000").json()["results"]
    assert march == [r for r in expected if r["period_start"] == "2024-03-01"] and len(march) == 3

    seen, url = [], "/api/v1/usage/?page_size=1"
    while url:
        page = client.get(url).json()
        assert len(page["results"]) <= 1
        seen += page["results"]
        url = page["next"]
    assert seen == expected

    bad = client.get("/api/v1/usage/?period=March")
    assert bad.status_code == 400 and "period" in bad.json()["error"]["fields"]
