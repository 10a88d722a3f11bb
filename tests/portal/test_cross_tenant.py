"""Every route under /api/v1/ and /api/staff/v1/, present and future, keeps tenants apart.

The routes are discovered from the URL resolver, and objects are made with model_bakery for
whatever model a viewset serves, so a new endpoint is covered without editing this file. A model
that model_bakery cannot build can get a maker in ``tests/tenant_objects.py``; a write that needs a
body to succeed gets one in ``OWNER_BODIES``.

Every refusal has a positive control: the owner reaches its own object through the same route with
the same method (and the same body) first, so a 404 or 403 for the wrong reason (an object of the
wrong kind, a body the route refuses anyway) fails the test instead of passing it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from django.core.exceptions import FieldDoesNotExist
from django.db.models import ForeignKey
from django.forms.models import model_to_dict
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from django_filters import ModelChoiceFilter, ModelMultipleChoiceFilter
from rest_framework.viewsets import ViewSetMixin

from nodes.models import Node, Region, RolloutCampaign
from nodes.services.rollouts import rollout_pause, rollout_start
from portal.actors import Actor
from portal.api.filters import FilterBackend
from portal.models import ROLE_SCOPES, Membership, Role, Scope, User
from portal.services.members import membership_change_role
from portal.services.tokens import api_token_create, scopes_clean
from portal.staff_tokens import staff_token_create
from portal.tenancy import PersonOwnedModel, TenantOwnedModel
from scheduling.models import ReservationStatus
from tests.routes import walk_urls
from tests.ssh_keys import public_key
from tests.tenant_objects import H100, catalog_gpu, make_person_object, make_tenant_object

pytestmark = pytest.mark.django_db

UNSAFE = ("post", "put", "patch", "delete")
UNKNOWN = 987654321

# What a write sends so that it succeeds for its owner (the positive control). A new write route
# that needs a body gets an entry here; without one its positive control fails and says so.
OWNER_BODIES: dict[tuple[str, str], dict] = {
    ("api:member-detail", "patch"): {"role": Role.VIEWER},
    ("api:invitation-list", "post"): {"email": "new-person@walker.test", "role": Role.MEMBER},
    # A token grants only scopes its maker holds: the admin scope alone is enough to make this one.
    ("api:token-list", "post"): {"name": "walker", "scopes": [Scope.ADMIN]},
    ("api:instance-list", "post"): {"gpu_models": [H100], "image": "ghcr.io/acme/notebook:1"},
    ("api:job-list", "post"): {"gpu_models": [H100], "image": "ghcr.io/acme/train:1", "command": ["true"]},
    ("api:cost-estimate", "post"): {"gpu_model": H100},
    ("api:budget", "put"): {"monthly_limit": "100"},
    ("api:secret-list", "post"): {"name": "walker", "value": "walker-value"},
    ("api:secret-detail", "put"): {"value": "walker-value"},
    ("api:template-list", "post"): {"name": "walker", "image": "ghcr.io/acme/walker:1"},
    ("api:template-detail", "patch"): {"description": "walker"},
    ("api:volume-detail", "patch"): {"size_gib": 64},  # growing always succeeds
    ("api:webhook-list", "post"): {"url": "https://hooks.example.com/walker", "event_types": ["*"]},
    ("api:webhook-detail", "patch"): {"description": "walker"},
    ("api:job-resize", "post"): {"gpu_count": 1},  # a shrink of a running elastic job, at once
}
# Creates whose name must be new in the tenant: each call gets its own.
UNIQUE_NAMES = {("api:secret-list", "post"), ("api:template-list", "post")}
_names = itertools.count(1)
# What a body needs besides the id for a foreign-key field to be used at all.
FIELD_BODIES: dict[str, dict] = {"reservation": {"plan": "reserved"}}
# What an object needs to be used by a field that names it.
FIELD_OBJECTS: dict[str, dict] = {"reservation": {"status": ReservationStatus.ACTIVE}}
# What a route's object needs besides its kind (an array's tasks are listed for an array job only).
ROUTE_OBJECTS: dict[str, dict] = {
    "api:job-tasks": {"array_count": 2, "array_parallelism": 1},
    "api:job-resize": {
        "state": "running",
        "gpu_count": 2,
        "elastic_min_gpus": 1,
        "elastic_max_gpus": 2,
        "elastic_target_gpus": 2,
        "elastic_on_resize": "signal",
    },
}
# Routes a workload's own process calls with its task's signed token (GPUPOOL_WORK_TOKEN), never
# with a tenant's credentials: the walker checks that tenants' credentials open none of them
# (test_work_routes_take_no_tenant_credential); the token's binding to its task and attempt is
# tests/scheduling/test_arrays.py's and test_work_queue_e2e.py's.
WORK_ROUTES = {"api:work-next", "api:work-item-done", "api:work-item-renew"}


def _volume_body() -> dict:
    """A new volume (names are unique per tenant and region: each call a new one)."""
    catalog_gpu()  # its region
    return {"name": f"walker-{timezone.now().timestamp():.6f}", "region": "us-east-1", "size_gib": 1}


def _reservation_body() -> dict:
    start = timezone.now() + timedelta(days=1)
    return {
        "gpu_model": H100,
        "region": "us-east-1",
        "count": 1,
        "starts_at": start.isoformat(),
        "ends_at": (start + timedelta(days=30)).isoformat(),
    }


@dataclass
class Route:
    name: str
    route: str
    view_class: type
    actions: dict[str, str] = field(default_factory=dict)  # http method -> viewset action
    kwargs: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.name

    @property
    def model(self):
        queryset = getattr(self.view_class, "queryset", None)
        return queryset.model if queryset is not None else None

    @property
    def tenant_owned(self) -> bool:
        return self.model is not None and issubclass(self.model, TenantOwnedModel)

    @property
    def lookup_field(self) -> str:
        """The object's field a detail URL names it by (``pk``, or e.g. a secret's ``name``)."""
        return getattr(self.view_class, "lookup_field", "pk")

    @property
    def lookup(self) -> str:
        return getattr(self.view_class, "lookup_url_kwarg", None) or self.lookup_field

    @property
    def person_owned(self) -> bool:
        """A person's rows (saved SSH keys): another tenant's person's are as absent as another
        tenant's rows, and the caller's own are made for the caller (``make``'s ``person``)."""
        return self.model is not None and issubclass(self.model, PersonOwnedModel)

    @property
    def owned(self) -> bool:
        return self.tenant_owned or self.person_owned

    @property
    def is_detail(self) -> bool:
        return self.lookup in self.kwargs

    def row_key(self, obj) -> object:
        """How a list row names ``obj``: its ``id``, or its lookup field where that is not the pk."""
        return obj.pk if self.lookup_field == "pk" else getattr(obj, self.lookup_field)

    @property
    def row_key_name(self) -> str:
        return "id" if self.lookup_field == "pk" else self.lookup_field

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

    def success(self, method: str) -> int:
        """The status of the owner's successful call."""
        if method == "delete":
            return 204
        if method == "post" and self.actions.get("post") == "create":
            return 201
        return 200

    def scope(self, method: str) -> str:
        """The scope the route says it needs (``TenantScopePermission``'s rule)."""
        per_action = getattr(self.view_class, "scope_for_action", {})
        action = self.actions.get(method)
        if action in per_action:
            return per_action[action]
        if method == "get":
            return getattr(self.view_class, "read_scope", Scope.READ)
        return getattr(self.view_class, "write_scope", Scope.WRITE)

    def body(self, method: str) -> dict:
        if (self.name, method) == ("api:reservation-list", "post"):
            return _reservation_body()
        if (self.name, method) == ("api:volume-list", "post"):
            return _volume_body()
        if (self.name, method) == ("api:ssh-key-list", "post"):  # a new key each time: no duplicate
            return {"name": "walker", "public_key": public_key()}
        body = dict(OWNER_BODIES.get((self.name, method), {}))
        if (self.name, method) in UNIQUE_NAMES:  # a second create by the same name is a 400
            body["name"] = f"{body['name']}-{next(_names)}"
        return body

    def make(self, tenant, person=None, **fields):
        """An object of the kind this route serves (a workload of the viewset's ``kind``); a
        person's row is ``person``'s, by default the tenant's first owner's (whose tokens the
        walker's ``two_tenants`` holds)."""
        if self.person_owned:
            if person is None:
                person = Membership.objects.filter(tenant=tenant, role=Role.OWNER).order_by("pk").first().user
            return make_person_object(self.model, person=person, **fields)
        kind = getattr(self.view_class, "kind", None)
        if kind:
            fields.setdefault("kind", kind)
        fields = {**ROUTE_OBJECTS.get(self.name, {}), **fields}
        if kind == "instance":
            fields.setdefault("ports", [{"port": 8888, "protocol": "http"}])  # something to share
        return make_tenant_object(self.model, tenant=tenant, **fields)


def api_routes(prefix: str = "api/v1/", *, work: bool = False) -> list[Route]:
    """The API's routes under ``prefix``: those tenants' credentials open, or (``work``) the work
    queue's, which only a task's work token opens."""
    routes = []
    for route, name, pattern in walk_urls():
        if not route.startswith(prefix) or (name in WORK_ROUTES) != work:
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
STAFF_ROUTES = api_routes("api/staff/v1/")
CALLS = [(r, m) for r in ROUTES for m in r.methods]


def _call_id(call) -> str:
    return f"{call[0].name}-{call[1]}"


def test_work_routes_take_no_tenant_credential(two_tenants, client, make_tenant):
    """The work queue's routes answer 401 to a tenant's full token and to a signed-in owner: only a
    task's work token opens them, so no tenant credential reaches any tenant's items."""
    routes = api_routes(work=True)
    assert {r.name for r in routes} == WORK_ROUTES
    owner = Membership.objects.filter(tenant=two_tenants["a"], role=Role.OWNER).first().user
    client.force_login(owner)
    for route in routes:
        url = reverse(route.name, kwargs=dict.fromkeys(route.kwargs, 0))
        for who, caller in (("token", two_tenants["a_all"]), ("session", client)):
            response = _call(caller, "post", url)
            assert response.status_code == 401, f"{route.route} with a tenant's {who}: {response.status_code}"
            assert response.json()["error"]["code"] == "work_token_invalid"


def test_the_walker_sees_the_api():
    names = {r.name for r in ROUTES}
    assert {"api:me", "api:member-list", "api:member-detail", "api:token-list", "api:token-revoke"} <= names
    assert {"api:instance-stop", "api:job-logs", "api:reservation-cancel", "api:invoice-pdf"} <= names
    assert {"api:ssh-key-list", "api:ssh-key-detail"} <= names
    assert {r.name for r in STAFF_ROUTES} >= {"metering:finance-api-revenue"}


@pytest.fixture
def two_tenants(make_tenant, make_token, settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False
    catalog_gpu()
    a = make_tenant("tenant-a-marker", name="Tenant A Marker")
    b = make_tenant("tenant-b", name="Tenant B")
    return {
        "a": a,
        "b": b,
        "a_all": _bearer(make_token(a)),
        "a_read": _bearer(make_token(a, scopes=["read"])),
        "b_all": _bearer(make_token(b)),
    }


def _bearer(token: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def _url(route: Route, pk=None) -> str:
    """The route's URL for the object of primary key ``pk`` (by its lookup field where the route
    names objects otherwise)."""
    kwargs = {}
    for name in route.kwargs:
        if name == "pk":
            kwargs["pk"] = pk
        elif name == route.lookup and route.lookup_field != "pk":
            obj = route.model._base_manager.filter(pk=pk).first()
            kwargs[name] = getattr(obj, route.lookup_field) if obj is not None else "no-such-object"
        else:
            raise AssertionError(f"{route.route}: teach this test how to fill the URL argument {name!r}")
    return reverse(route.name, kwargs=kwargs)


def _snapshot(obj):
    fresh = type(obj)._base_manager.filter(pk=obj.pk).first()
    return None if fresh is None else json.dumps(model_to_dict(fresh), default=str, sort_keys=True)


def _call(client: Client, method: str, url: str, body: dict | None = None):
    if method == "get":
        return client.get(url, data=body or {})
    return getattr(client, method)(url, data=json.dumps(body or {}), content_type="application/json")


def _owner_call(client: Client, route: Route, method: str, tenant, obj=None, person=None):
    """The positive control: the owner's call on ``obj`` (by default a fresh object of its own,
    ``person``'s for a person's row), which must succeed."""
    if obj is None and route.is_detail and route.owned:
        obj = route.make(tenant, person)
    pk = (
        obj.pk
        if obj is not None
        else (route.model.objects.order_by("pk").first().pk if route.is_detail else None)
    )
    response = _call(client, method, _url(route, pk), route.body(method))
    assert response.status_code == route.success(method), (
        f"positive control: {method.upper()} {route.route} as the owner: {response.status_code} "
        f"{response.content[:300]!r}"
    )
    return response


@pytest.mark.parametrize("call", [c for c in CALLS if c[0].is_detail], ids=_call_id)
def test_another_tenants_objects_do_not_exist(call, two_tenants):
    route, method = call
    assert route.model is not None, f"{route.route}: a detail route must serve a model queryset"
    if not route.owned:
        # Shared data (the GPU catalog): every tenant may read it, no tenant may change it.
        assert method not in UNSAFE, f"{route.route}: tenants must not write shared data"
        _owner_call(two_tenants["b_all"], route, method, two_tenants["b"])
        return
    obj = route.make(two_tenants["a"])
    if method in UNSAFE:  # a write changes its object: the owner's goes to a twin made the same way
        _owner_call(two_tenants["a_all"], route, method, two_tenants["a"])
    else:
        _owner_call(two_tenants["a_all"], route, method, two_tenants["a"], obj)
    before = _snapshot(obj)
    response = _call(two_tenants["b_all"], method, _url(route, obj.pk), route.body(method))
    assert response.status_code == 404, f"{method.upper()} {route.route} as tenant B: {response.status_code}"
    assert response.json()["error"]["code"] == "not_found"
    assert _snapshot(obj) == before, f"{route.route}: tenant B changed tenant A's object"


@pytest.mark.parametrize("route", [r for r in ROUTES if not r.is_detail and "get" in r.methods], ids=str)
def test_lists_never_show_another_tenant(route, two_tenants):
    own_ids = set()
    if route.owned:
        own_ids.add(route.row_key(route.make(two_tenants["a"])))
    key = route.row_key_name
    own = two_tenants["a_all"].get(reverse(route.name))
    assert own.status_code == 200, own.content
    if "results" in own.json():  # positive control: the owner sees its row where B must not
        assert own_ids <= {row.get(key) for row in own.json()["results"]}, f"{route.route}: owner's rows"
    response = two_tenants["b_all"].get(reverse(route.name))
    assert response.status_code == 200, response.content
    body = response.json()
    text = json.dumps(body)
    assert "tenant-a-marker" not in text and "Tenant A Marker" not in text
    if own_ids:
        seen = {row.get(key) for row in body.get("results", [])}
        assert not (own_ids & seen), f"{route.route} lists tenant A's rows to tenant B"


def _writes(route) -> set[str]:
    """The route's unsafe methods that need more than ``read`` (the cost estimate's POST writes
    nothing and says so with ``write_scope = read``; test_each_scope_alone opens it with read)."""
    return {m for m in set(route.methods) & set(UNSAFE) if route.scope(m) != Scope.READ}


@pytest.mark.parametrize("route", [r for r in ROUTES if _writes(r)], ids=lambda r: r.name)
def test_a_read_only_token_cannot_write(route, two_tenants):
    pk = None
    obj = None
    if route.is_detail:
        obj = route.make(two_tenants["a"]) if route.owned else None
        pk = obj.pk if obj is not None else 1
    before = _snapshot(obj) if obj is not None else None
    for method in _writes(route):
        response = _call(two_tenants["a_read"], method, _url(route, pk), route.body(method))
        assert response.status_code == 403, (
            f"{method.upper()} {route.route} with a read token: {response.status_code}"
        )
        assert response.json()["error"]["code"] == "permission_denied"
    if obj is not None:
        assert _snapshot(obj) == before


# --- foreign ids in filters and bodies ------------------------------------------------------------


def _tenant_row_target(model, path: str):
    """The tenant-owned model a filter's ``field_name`` ends on through a foreign key, if any."""
    target = None
    for part in path.split("__"):
        try:
            model_field = model._meta.get_field(part)  # a name or an attname (``workload_id``)
        except FieldDoesNotExist:
            return None
        target = model_field.related_model if model_field.is_relation else None
        if target is None:
            return None
        model = target
    return target if target is not None and issubclass(target, TenantOwnedModel) else None


def _id_filters() -> list[tuple[Route, str, type]]:
    """(list route, filter name, tenant-owned model) for every filter that takes a tenant-owned
    row's id: a choice among rows, or any filter on a foreign key to one."""
    found = []
    for route in ROUTES:
        if route.is_detail or "get" not in route.methods or route.model is None:
            continue
        view = route.view_class()
        filterset = FilterBackend().get_filterset_class(view, route.view_class.queryset)
        for name, f in (filterset.base_filters if filterset else {}).items():
            if isinstance(f, ModelChoiceFilter | ModelMultipleChoiceFilter):
                model = f.queryset.model if issubclass(f.queryset.model, TenantOwnedModel) else None
            else:
                model = _tenant_row_target(route.model, f.field_name)
            if model is not None:
                found.append((route, name, model))
    return found


ID_FILTERS = _id_filters()


def test_the_walker_sees_the_id_filters():
    assert {(r.name, name) for r, name, _ in ID_FILTERS} >= {("api:usage-list", "workload")}


def _same_answer(refused, unknown, foreign_id) -> None:
    assert refused.status_code == unknown.status_code
    assert refused.content.decode().replace(str(foreign_id), "ID") == unknown.content.decode().replace(
        str(UNKNOWN), "ID"
    )


@pytest.mark.parametrize("case", ID_FILTERS, ids=lambda c: f"{c[0].name}-{c[1]}")
def test_a_foreign_id_in_a_filter_is_an_unknown_id(case, two_tenants):
    route, name, model = case
    client = two_tenants["a_all"]
    own = make_tenant_object(model, tenant=two_tenants["a"])
    foreign = make_tenant_object(model, tenant=two_tenants["b"])
    ok = client.get(reverse(route.name), {name: own.pk})
    assert ok.status_code == 200, f"positive control ?{name}=<own id>: {ok.content[:300]!r}"
    unknown = client.get(reverse(route.name), {name: UNKNOWN})
    assert unknown.status_code == 400 and name in unknown.json()["error"]["fields"], unknown.content
    refused = client.get(reverse(route.name), {name: foreign.pk})
    _same_answer(refused, unknown, foreign.pk)


def _id_fields() -> list[tuple[Route, str, str, type]]:
    """(write route, method, body field, tenant-owned model) for every body field that names a
    tenant-owned row: a serializer field named as the route's model's foreign key to one."""
    found = []
    for route in ROUTES:
        if route.model is None or not issubclass(route.view_class, ViewSetMixin):
            continue
        for method in set(route.methods) & {"post", "put", "patch"}:
            view = route.view_class(action=route.actions[method], request=None, format_kwarg=None, kwargs={})
            serializer = view.get_serializer_class()()
            for name, serializer_field in serializer.fields.items():
                if serializer_field.read_only:
                    continue
                try:
                    model_field = route.model._meta.get_field(name)
                except FieldDoesNotExist:  # not a model field: not an id of one
                    continue
                target = model_field.related_model if isinstance(model_field, ForeignKey) else None
                if target is not None and issubclass(target, TenantOwnedModel):
                    found.append((route, method, name, target))
    return found


ID_FIELDS = _id_fields()


def test_the_walker_sees_the_id_fields():
    assert {(r.name, name) for r, _, name, _ in ID_FIELDS} >= {
        ("api:instance-list", "reservation"),
        ("api:job-list", "reservation"),
    }


@pytest.mark.parametrize("case", ID_FIELDS, ids=lambda c: f"{c[0].name}-{c[1]}-{c[2]}")
def test_a_foreign_id_in_a_body_is_refused(case, two_tenants):
    route, method, name, model = case
    client = two_tenants["a_all"]
    extra = {**FIELD_BODIES.get(name, {})}
    own = make_tenant_object(model, tenant=two_tenants["a"], **FIELD_OBJECTS.get(name, {}))
    foreign = make_tenant_object(model, tenant=two_tenants["b"], **FIELD_OBJECTS.get(name, {}))
    url = _url(route, route.make(two_tenants["a"]).pk if route.is_detail else None)
    ok = _call(client, method, url, {**route.body(method), **extra, name: own.pk})
    assert ok.status_code == route.success(method), f"positive control: {ok.content[:300]!r}"
    rows = route.model._base_manager.count()
    unknown = _call(client, method, url, {**route.body(method), **extra, name: UNKNOWN})
    assert 400 <= unknown.status_code < 500 and name in unknown.json()["error"]["fields"], unknown.content
    refused = _call(client, method, url, {**route.body(method), **extra, name: foreign.pk})
    _same_answer(refused, unknown, foreign.pk)
    assert route.model._base_manager.count() == rows, f"{route.route}: a refused body wrote a row"
    assert not route.model._base_manager.filter(**{name: foreign}).exists()


# --- token kinds and scopes -----------------------------------------------------------------------


def _open_scopes(scope: str) -> frozenset[str]:
    return frozenset(scopes_clean([scope]))


def _opens_or_refuses(
    client: Client, route: Route, method: str, tenant, *, opens: bool, who: str, person=None
) -> None:
    """Success on a fresh object of the tenant's where ``opens`` (the positive control), else a 403
    that leaves its object as it was."""
    if opens:
        _owner_call(client, route, method, tenant, person=person)
        return
    obj = route.make(tenant, person) if route.is_detail and route.owned else None
    before = _snapshot(obj) if obj is not None else None
    pk = obj.pk if obj is not None else (1 if route.is_detail else None)
    response = _call(client, method, _url(route, pk), route.body(method))
    assert response.status_code == 403, f"{method.upper()} {route.route} as {who}: {response.status_code}"
    assert response.json()["error"]["code"] == "permission_denied"
    if obj is not None:
        assert _snapshot(obj) == before


@pytest.mark.parametrize("call", CALLS, ids=_call_id)
def test_each_scope_alone(call, two_tenants, make_token):
    """A token with one scope opens exactly the routes that need it (positive control) and gets
    403 from every other, writing nothing."""
    route, method = call
    a = two_tenants["a"]
    needed = route.scope(method)
    assert needed in Scope.values, f"{route.route}: {needed!r} is not a tenant scope"
    for scope in Scope.values:
        client = _bearer(make_token(a, scopes=[scope], name=f"only-{scope}"))
        opens = needed in _open_scopes(scope)
        _opens_or_refuses(client, route, method, a, opens=opens, who=f"a token with only {scope}")


@pytest.mark.parametrize("call", CALLS, ids=_call_id)
def test_each_role_signed_in(call, two_tenants, add_member, signed_in):
    """A signed-in member's session opens exactly the routes its role's scopes reach."""
    route, method = call
    a = two_tenants["a"]
    for role in Role.values:
        person = add_member(a, role).user
        client = signed_in(person, a)
        opens = route.scope(method) in ROLE_SCOPES[role]
        _opens_or_refuses(client, route, method, a, opens=opens, who=f"a {role}'s session", person=person)


def _token_of(member: Membership, scopes) -> str:
    _, plaintext = api_token_create(
        tenant=member.tenant, name="member-token", scopes=scopes, actor=Actor(user=member.user)
    )
    return plaintext


def _member_token(tenant, role: str, scopes, add_member) -> tuple[Membership, str]:
    member = add_member(tenant, role)
    return member, _token_of(member, scopes)


def test_a_demoted_creators_token_loses_what_the_new_role_lacks(two_tenants, add_member):
    """Demoted through the service, a token beyond the new role is revoked (401 everywhere) and
    one within it keeps working; demoted any other way (a data fix), the scopes beyond the role
    stop working at once while those within it still do."""
    a = two_tenants["a"]
    me, audit = reverse("api:me"), reverse("api:audit-event-list")
    admin, wide = _member_token(a, Role.ADMIN, ["read", "admin"], add_member)
    narrow = _token_of(admin, ["read"])
    assert _bearer(wide).get(audit).status_code == 200  # positive controls
    assert _bearer(narrow).get(me).status_code == 200
    membership_change_role(membership=admin, role=Role.VIEWER, actor=Actor.system())
    assert _bearer(wide).get(me).status_code == 401
    assert _bearer(wide).get(audit).status_code == 401
    assert _bearer(narrow).get(me).status_code == 200

    other, other_wide = _member_token(a, Role.ADMIN, ["read", "admin"], add_member)
    assert _bearer(other_wide).get(audit).status_code == 200  # positive control
    Membership.objects.filter(pk=other.pk).update(role=Role.VIEWER)
    refused = _bearer(other_wide).get(audit)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    assert _bearer(other_wide).get(me).status_code == 200


@pytest.mark.parametrize("call", CALLS, ids=_call_id)
def test_a_deactivated_creators_token_is_refused_everywhere(call, two_tenants, add_member):
    route, method = call
    a = two_tenants["a"]
    member, token = _member_token(a, Role.OWNER, Scope.values, add_member)
    client = _bearer(token)
    _owner_call(client, route, method, a, person=member.user)
    User.objects.filter(pk=member.user.pk).update(is_active=False)
    obj = route.make(a, member.user) if route.is_detail and route.owned else None
    before = _snapshot(obj) if obj is not None else None
    pk = obj.pk if obj is not None else (1 if route.is_detail else None)
    response = _call(client, method, _url(route, pk), route.body(method))
    assert response.status_code == 401, f"{method.upper()} {route.route}: {response.status_code}"
    if obj is not None:
        assert _snapshot(obj) == before


def test_a_staff_made_tenant_token_opens_its_tenant_only(two_tenants):
    """A token made for a tenant without a member (``createapitoken`` without --user: the system
    acts) opens that tenant's API with its own scopes, and never another tenant's objects."""
    a, b = two_tenants["a"], two_tenants["b"]
    _, plaintext = api_token_create(tenant=a, name="ops", scopes=["read", "write"], actor=Actor.system())
    client = _bearer(plaintext)
    me = client.get(reverse("api:me"))
    assert me.status_code == 200 and me.json()["tenant"]["slug"] == a.slug
    route = next(r for r in ROUTES if r.name == "api:instance-detail")
    assert client.get(_url(route, route.make(a).pk)).status_code == 200
    assert client.get(_url(route, route.make(b).pk)).status_code == 404
    assert client.get(reverse("api:audit-event-list")).status_code == 403  # admin was not given


# --- the staff API --------------------------------------------------------------------------------


@pytest.fixture
def staff_user(db):
    return User.objects.create_user(email="staff@gpupool.test", password="pw-for-tests-1", is_staff=True)


def test_staff_credentials_never_open_the_tenant_api(two_tenants, staff_user, signed_in):
    """A staff token gets 401 from every tenant route, and a staff person who is no tenant's member
    gets 403: staff reach tenants' data through the admin and the staff API only."""
    _, staff_token = staff_token_create(
        user=staff_user, name="walker", scopes=["finance:read"], actor=Actor(user=staff_user)
    )
    token, session = _bearer(staff_token), signed_in(staff_user)
    a = two_tenants["a"]
    assert token.get(reverse("metering:finance-api-revenue")).status_code == 200  # positive control
    for route, method in CALLS:
        obj = route.make(a) if route.is_detail and route.owned else None
        before = _snapshot(obj) if obj is not None else None
        url = _url(route, obj.pk if obj is not None else (1 if route.is_detail else None))
        refused = _call(token, method, url, route.body(method))
        assert refused.status_code == 401, (
            f"{method.upper()} {route.route}, staff token: {refused.status_code}"
        )
        refused = _call(session, method, url, route.body(method))
        assert refused.status_code == 403, (
            f"{method.upper()} {route.route}, staff session: {refused.status_code}"
        )
        if obj is not None:
            assert _snapshot(obj) == before


def _walk_region() -> Region:
    return Region.objects.get_or_create(code="walk-region", defaults={"name": "Walk"})[0]


_walk_nodes = itertools.count(1)
_walked: dict[str, RolloutCampaign] = {}


def _walk_node_body() -> dict:
    """A valid rollout campaign over a node of its own in the walk region (chosen by its label)."""
    hostname = f"walk-node-{next(_walk_nodes)}"
    Node.objects.create(hostname=hostname, region=_walk_region(), labels={"host": hostname})
    return {"name": "walk", "upgrade": "walk-1", "label": f"host={hostname}", "batch_size": 1,
            "max_region_share": "1", "drain_deadline_s": 60}  # fmt: skip


def _staff_url(route) -> str:
    """A staff route's URL; a region route gets a region of its own, a rollout route a campaign (a
    paused one for resume)."""
    kwargs = {}
    for name in route.kwargs:
        if name == "code":
            kwargs[name] = _walk_region().code
        elif name == "pk" and route.name.startswith("nodes-staff-api:staff-rollout"):
            campaign = rollout_start(data=_walk_node_body(), actor=Actor.system())
            if route.name.endswith("-resume"):
                rollout_pause(campaign=campaign, actor=Actor.system())
            _walked[route.name] = campaign
            kwargs[name] = campaign.pk
        elif name == "pk" and route.name == "nodes-staff-api:gpu-mig":
            kwargs[name] = _walk_gpu().pk
        elif name == "pk" and route.name == "nodes-staff-api:gpu-mig-cancel":
            kwargs[name] = _walk_draining_gpu().pk
        else:
            raise AssertionError(f"{route.route}: teach this test the kwarg {name!r}")
    return reverse(route.name, kwargs=kwargs)


def _walk_gpu():
    """An idle H100 for the staff MIG route."""
    from nodes.models import Gpu, GpuModel

    node = Node.objects.get_or_create(hostname="walk-gpu-node", defaults={"region": _walk_region()})[0]
    model = GpuModel.objects.get(name="NVIDIA H100 SXM 80GB")
    return Gpu.objects.get_or_create(
        node=node, index=0, defaults={"uuid": "GPU-walk-0", "model": model, "reported_name": model.name}
    )[0]


def _walk_draining_gpu():
    """An H100 whose staff MIG change waits for its work to end, for the cancel route."""
    from nodes.models import Gpu

    gpu = _walk_gpu()
    drained = Gpu.objects.get_or_create(
        node=gpu.node,
        index=1,
        defaults={"uuid": "GPU-walk-1", "model": gpu.model, "reported_name": gpu.reported_name},
    )[0]
    Gpu.objects.filter(pk=drained.pk).update(
        mig_configuring=True,
        mig_pending={"enable": True, "layout": [], "reason": "", "requested_by": "walk", "command": None},
    )
    return drained


def _walked_state(name: str):
    return lambda: RolloutCampaign.objects.get(pk=_walked[name].pk).state


# What a write sends (valid, so that only the permission can refuse it; a callable makes it) and the
# row it would change.
STAFF_WRITES = {
    "nodes-staff-api:gpu-mig": (
        {"enable": True, "profiles": ["7g.80gb"]},
        lambda: _walk_gpu().mig_configuring,
    ),
    "nodes-staff-api:gpu-mig-cancel": (
        {},
        lambda: _walk_gpu().__class__.objects.get(uuid="GPU-walk-1").mig_pending,
    ),
    "scheduling:staff-api-region": (
        {"queue_policy": "sjf"},
        lambda: Region.objects.get(code="walk-region").queue_policy,
    ),
    "nodes-staff-api:staff-rollout-list": (_walk_node_body, lambda: RolloutCampaign.objects.count()),
    "nodes-staff-api:staff-rollout-pause": ({}, _walked_state("nodes-staff-api:staff-rollout-pause")),
    "nodes-staff-api:staff-rollout-resume": ({}, _walked_state("nodes-staff-api:staff-rollout-resume")),
    "nodes-staff-api:staff-rollout-abort": ({}, _walked_state("nodes-staff-api:staff-rollout-abort")),
}


@pytest.mark.parametrize("route", STAFF_ROUTES, ids=str)
def test_the_staff_api_is_for_staff_only(route, two_tenants, staff_user, add_member, signed_in, make_token):
    url = _staff_url(route)
    methods = route.methods
    writes = [m for m in methods if m != "get"]
    assert set(methods) <= {"get", "patch", "post"}, f"{route.route}: teach this test the staff API's writes"
    assert not writes or route.name in STAFF_WRITES, f"{route.route}: teach STAFF_WRITES this route"
    _, staff_token = staff_token_create(
        user=staff_user, name="walker", scopes=[route.view_class.staff_scope], actor=Actor(user=staff_user)
    )
    if "get" in methods:
        assert _bearer(staff_token).get(url).status_code == 200  # positive control: the staff token
        assert signed_in(staff_user).get(url).status_code == 200  # and the staff session
    a = two_tenants["a"]
    assert Client().get(url).status_code == 401
    refusals = {"tenant token, every scope": _bearer(make_token(a))}
    for role in Role.values:
        member = add_member(a, role)
        refusals[f"{role} token"] = _bearer(make_token(a, scopes=sorted(member.scopes), name=role))
        refusals[f"{role} session"] = signed_in(member.user, a)
    # A tenant token never opens it, whoever made it: a member who is also staff, or the system.
    staff_member = Membership.objects.create(tenant=a, user=staff_user, role=Role.OWNER)
    _, by_staff = api_token_create(
        tenant=a, name="staff-made", scopes=Scope.values, actor=Actor(user=staff_member.user)
    )
    _, by_system = api_token_create(tenant=a, name="system-made", scopes=Scope.values, actor=Actor.system())
    refusals["token made by staff"] = _bearer(by_staff)
    refusals["token made by the system"] = _bearer(by_system)
    for who, client in refusals.items():
        response = client.get(url) if "get" in methods else _call(client, "post", url, {})
        assert response.status_code == 403, f"{route.route} as {who}: {response.status_code}"
        assert response.json()["error"]["code"] == "permission_denied"
    if writes:
        body, current = STAFF_WRITES[route.name]
        body = body() if callable(body) else body
        before = current()
        for method in writes:
            for who, client in {**refusals, "anonymous": Client()}.items():
                response = _call(client, method, url, body)
                assert response.status_code in (401, 403), f"{method} {route.route} as {who}"
            assert current() == before
            # Positive control: the staff token's write is taken.
            assert _call(_bearer(staff_token), method, url, body).status_code in (200, 201)
            assert current() != before


@pytest.mark.parametrize("call", [c for c in CALLS if c[1] in UNSAFE], ids=_call_id)
def test_an_empty_body_is_a_clear_answer(call, two_tenants):
    """The owner's write with an empty body succeeds or is a 4xx naming what is missing; never a 500."""
    route, method = call
    obj = route.make(two_tenants["a"]) if route.is_detail and route.owned else None
    response = _call(two_tenants["a_all"], method, _url(route, obj.pk if obj else None), {})
    assert response.status_code < 500, f"{method.upper()} {route.route} with {{}}: {response.status_code}"
    if response.status_code >= 400:
        assert response.json()["error"]["fields"], f"{route.route}: a 4xx naming no field"
