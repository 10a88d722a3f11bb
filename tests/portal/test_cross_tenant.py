"""Every route under /api/v1/, present and future, keeps tenants apart.

The routes are discovered from the URL resolver, and objects are made with model_bakery for
whatever model a viewset serves, so a new endpoint is covered without editing this file. A model
that model_bakery cannot build can get a maker in ``tests/tenant_objects.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from django.forms.models import model_to_dict
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from rest_framework.viewsets import ViewSetMixin

from portal.tenancy import TenantOwnedModel
from tests.tenant_objects import make_tenant_object

pytestmark = pytest.mark.django_db

UNSAFE = ("post", "put", "patch", "delete")


@dataclass
class Route:
    name: str
    route: str
    view_class: type
    actions: dict[str, str] = field(default_factory=dict)  # http method -> viewset action
    kwargs: tuple[str, ...] = ()

    @property
    def model(self):
        queryset = getattr(self.view_class, "queryset", None)
        return queryset.model if queryset is not None else None

    @property
    def is_detail(self) -> bool:
        return "pk" in self.kwargs

    @property
    def methods(self) -> list[str]:
        allowed = self.view_class.http_method_names
        if issubclass(self.view_class, ViewSetMixin):
            return [m for m in self.actions if m in allowed and m not in ("head", "options")]
        return [
            m
            for m in ("get", "post", "put", "patch", "delete")
            if hasattr(self.view_class, m) and m in allowed
        ]


def _walk(patterns, prefix="", namespace=""):
    for p in patterns:
        if isinstance(p, URLResolver):
            ns = f"{namespace}{p.namespace}:" if p.namespace else namespace
            yield from _walk(p.url_patterns, prefix + str(p.pattern), ns)
        elif isinstance(p, URLPattern):
            yield prefix + str(p.pattern), f"{namespace}{p.name}", p


def api_routes() -> list[Route]:
    routes = []
    for route, name, pattern in _walk(get_resolver().url_patterns):
        if not route.startswith("api/v1/"):
            continue
        callback = pattern.callback
        view_class = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
        assert view_class is not None, f"{route} is not a DRF view; the API is DRF only"
        routes.append(
            Route(
                name=name,
                route=route,
                view_class=view_class,
                actions=dict(getattr(callback, "actions", None) or {}),
                kwargs=tuple(pattern.pattern.regex.groupindex),
            )
        )
    return routes


ROUTES = api_routes()


def test_the_walker_sees_the_api():
    names = {r.name for r in ROUTES}
    assert {"api:me", "api:member-list", "api:member-detail", "api:token-list", "api:token-revoke"} <= names


@pytest.fixture
def two_tenants(make_tenant, make_token):
    a = make_tenant("tenant-a-marker", name="Tenant A Marker")
    b = make_tenant("tenant-b", name="Tenant B")
    return {
        "a": a,
        "b": b,
        "a_read": Client(HTTP_AUTHORIZATION=f"Bearer {make_token(a, scopes=['read'])}"),
        "b_all": Client(HTTP_AUTHORIZATION=f"Bearer {make_token(b)}"),
    }


def _url(route: Route, pk=None) -> str:
    kwargs = {}
    for name in route.kwargs:
        if name != "pk":
            raise AssertionError(f"{route.route}: teach this test how to fill the URL argument {name!r}")
        kwargs["pk"] = pk
    return reverse(route.name, kwargs=kwargs)


def _snapshot(obj):
    fresh = type(obj)._base_manager.filter(pk=obj.pk).first()
    return None if fresh is None else json.dumps(model_to_dict(fresh), default=str, sort_keys=True)


def _call(client: Client, method: str, url: str):
    return getattr(client, method)(url, data={} if method == "get" else "{}", content_type="application/json")


@pytest.mark.parametrize("route", [r for r in ROUTES if r.is_detail], ids=lambda r: r.name)
def test_another_tenants_objects_do_not_exist(route, two_tenants):
    model = route.model
    assert model is not None, f"{route.route}: a detail route must serve a model queryset"
    if not issubclass(model, TenantOwnedModel):
        # Shared data (the GPU catalog): every tenant may read it, no tenant may change it.
        assert not set(route.methods) & set(UNSAFE), f"{route.route}: tenants must not write shared data"
        return
    obj = make_tenant_object(model, tenant=two_tenants["a"])
    before = _snapshot(obj)
    for method in route.methods:
        response = _call(two_tenants["b_all"], method, _url(route, obj.pk))
        assert response.status_code == 404, (
            f"{method.upper()} {route.route} as tenant B: {response.status_code}"
        )
        assert response.json()["error"]["code"] == "not_found"
    assert _snapshot(obj) == before, f"{route.route}: tenant B changed tenant A's object"


@pytest.mark.parametrize(
    "route", [r for r in ROUTES if not r.is_detail and "get" in r.methods], ids=lambda r: r.name
)
def test_lists_never_show_another_tenant(route, two_tenants):
    model = route.model
    own_ids = set()
    if model is not None and issubclass(model, TenantOwnedModel):
        own_ids.add(make_tenant_object(model, tenant=two_tenants["a"]).pk)
    response = two_tenants["b_all"].get(reverse(route.name))
    assert response.status_code == 200, response.content
    body = response.json()
    text = json.dumps(body)
    assert "tenant-a-marker" not in text and "Tenant A Marker" not in text
    if own_ids:
        seen = {row.get("id") for row in body.get("results", [])}
        assert not (own_ids & seen), f"{route.route} lists tenant A's rows to tenant B"


@pytest.mark.parametrize("route", [r for r in ROUTES if set(r.methods) & set(UNSAFE)], ids=lambda r: r.name)
def test_a_read_only_token_cannot_write(route, two_tenants):
    pk = None
    obj = None
    if route.is_detail:
        model = route.model
        obj = (
            make_tenant_object(model, tenant=two_tenants["a"])
            if issubclass(model, TenantOwnedModel)
            else None
        )
        pk = obj.pk if obj is not None else 1
    before = _snapshot(obj) if obj is not None else None
    for method in set(route.methods) & set(UNSAFE):
        response = _call(two_tenants["a_read"], method, _url(route, pk))
        assert response.status_code == 403, (
            f"{method.upper()} {route.route} with a read token: {response.status_code}"
        )
        assert response.json()["error"]["code"] == "permission_denied"
    if obj is not None:
        assert _snapshot(obj) == before
