"""Every id filter of the tenant API answers another tenant's id exactly as an id that does not exist."""

from __future__ import annotations

from datetime import date

import pytest

from metering.models import UsageRecord
from metering.services.invoices import invoice_build
from metering.services.usage import usage_build
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db

UNKNOWN = 987654321


@pytest.fixture
def two_tenants(tenant, make_tenant, card, run):
    other = make_tenant("other")
    mine = run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 2))
    theirs = run(other, utc(2024, 3, 1), utc(2024, 3, 1, 3))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    invoices = {t.pk: invoice_build(tenant=t, period_start=date(2024, 3, 1)) for t in (tenant, other)}
    return {
        "workload": (mine.workload_id, theirs.workload_id),
        "invoice": (invoices[tenant.pk].pk, invoices[other.pk].pk),
    }


@pytest.mark.parametrize("name", ["workload", "invoice"])
def test_usage_filters_do_not_tell_a_foreign_id_from_an_unknown_one(
    tenant, two_tenants, make_token, api, name
):
    client = api(make_token(tenant, scopes=["read", "billing"]))
    own, foreign = two_tenants[name]
    assert UsageRecord.objects.filter(**{f"{name}_id": foreign}).exists()  # it is there, elsewhere
    ok = client.get(f"/api/v1/usage/?{name}={own}")
    assert ok.status_code == 200 and len(ok.json()["results"]) == 1, ok.content  # positive control
    unknown = client.get(f"/api/v1/usage/?{name}={UNKNOWN}")
    assert unknown.status_code == 400 and name in unknown.json()["error"]["fields"]
    refused = client.get(f"/api/v1/usage/?{name}={foreign}")
    assert refused.status_code == unknown.status_code
    assert refused.json() == unknown.json()


def test_every_filter_set_of_the_tenant_api_is_scoped(db):
    """The class of fault, not the instance: a filter set that is not a TenantFilterSet (declared or
    made from ``filterset_fields``) would offer every tenant's rows as choices."""
    from django.urls import get_resolver  # the router registers when the URLconf loads

    from portal.api.filters import FilterBackend, TenantFilterSet
    from portal.api.routers import router

    get_resolver().url_patterns  # noqa: B018
    checked = []
    for prefix, viewset, _ in router.registry:
        if getattr(viewset, "queryset", None) is None:
            continue
        filterset = FilterBackend().get_filterset_class(viewset(), viewset.queryset)
        if filterset is not None:
            assert issubclass(filterset, TenantFilterSet), prefix
            checked.append(prefix)
    assert {"usage", "invoices", "instances", "jobs", "reservations", "members", "tokens"} <= set(checked)
