"""Objects of another tenant do not exist for the web pages: every id-taking URL answers 404.

The id-taking pages are discovered from the URL resolver (every ``TenantScopedMixin`` view with a
``pk``), so a new page is covered without editing this file. Every refusal has a positive control:
the owner's session reaches an object of its own through the same URL with the same method first
(a page, or a write that changes something), so a 404 for the wrong reason fails the test.
"""

from __future__ import annotations

import itertools
import json

import pytest
from django.db.models import Model
from django.forms.models import model_to_dict
from django.test import Client
from django.urls import reverse

from metering.views import FinanceStaffMixin
from nodes.models import Node
from nodes.views.base import StaffRequiredMixin
from portal.actors import Actor
from portal.models import ApiToken, Invitation, Membership, Role, User
from portal.services.invitations import invitation_create
from portal.tenancy import TenantOwnedModel
from portal.views.base import TenantScopedMixin
from scheduling.models import Reservation, ReservationStatus, Workload, WorkloadShareLink
from scheduling.services.lifecycle import workload_stop
from scheduling.services.submission import workload_submit
from scheduling.views.staff import StaffOnlyMixin
from tests.portal.conftest import HTMX
from tests.routes import walk_urls
from tests.tenant_objects import H100, catalog_gpu, make_tenant_object
from webhooks.models import WebhookDelivery

pytestmark = pytest.mark.django_db


@pytest.fixture
def foreign(make_tenant, make_token, add_member):
    """Tenant A's membership, token and open invitation."""
    a = make_tenant("alpha")
    member = add_member(a, Role.MEMBER)
    make_token(a, name="alpha-token")
    invitation, _ = invitation_create(
        tenant=a, email="guest@alpha.test", role=Role.VIEWER, actor=Actor.system()
    )
    return {"member": member, "token": ApiToken.objects.get(name="alpha-token"), "invitation": invitation}


@pytest.fixture
def b_owner_client(make_tenant, signed_in):
    b = make_tenant("bravo")
    return signed_in(Membership.objects.get(tenant=b, role=Role.OWNER).user, b)


@pytest.mark.parametrize("htmx", [False, True])
def test_member_of_b_gets_404_on_a_ids(foreign, b_owner_client, htmx):
    headers = HTMX if htmx else {}
    m, t, i = foreign["member"].pk, foreign["token"].pk, foreign["invitation"].pk
    attempts = {
        f"/team/members/{m}/role/": {"role": "viewer"},
        f"/team/members/{m}/remove/": {},
        f"/tokens/{t}/revoke/": {},
        f"/team/invitations/{i}/revoke/": {},
        f"/team/invitations/{i}/resend/": {},
    }
    for url, data in attempts.items():
        assert b_owner_client.post(url, data, **headers).status_code == 404, url
    foreign["member"].refresh_from_db()
    foreign["token"].refresh_from_db()
    assert foreign["member"].role == Role.MEMBER
    assert foreign["token"].revoked_at is None
    assert Invitation.objects.filter(pk=i).exists()


def test_pages_of_b_show_nothing_of_a(foreign, b_owner_client):
    team = b_owner_client.get("/team/").content.decode()
    tokens = b_owner_client.get("/tokens/").content.decode()
    assert foreign["member"].user.email not in team
    assert "guest@alpha.test" not in team
    assert "alpha-token" not in tokens
    for url in ("/panels/team/", "/panels/activity/", "/panels/getting-started/"):
        html = b_owner_client.get(url, **HTMX).content.decode()
        assert "alpha" not in html.lower(), url


# --- the walk -------------------------------------------------------------------------------------

# Pages whose view names no ``model`` (it picks its queryset in the handler): the model of the id.
PAGE_MODELS: dict[str, type[Model]] = {
    "portal:member-role": Membership,
    "portal:member-remove": Membership,
    "portal:invitation-revoke": Invitation,
    "portal:invitation-resend": Invitation,
    "scheduling:workload-share-link": WorkloadShareLink,  # a link is a row of its own
    "webhooks:redeliver": WebhookDelivery,
}
# What a write sends so that it succeeds for its owner.
PAGE_BODIES: dict[str, dict] = {
    "portal:member-role": {"role": Role.VIEWER},
    "scheduling:workload-share-link": {"action": "create"},
    "scheduling:template-edit": {
        "name": "walker-edited",
        "image": "ghcr.io/acme/walker:2",
        "min_gpu_memory_gib": "0",
    },
    "webhooks:detail": {"action": "disable"},
    "scheduling:workload-resize": {"gpu_count": 1},  # a shrink of a running elastic job, at once
}
_emails = itertools.count(1)


def _workload(tenant, *, finished: bool = False) -> Workload:
    spec = {"gpu_models": [H100], "image": "ghcr.io/acme/train:1", "command": ["true"]}
    w = workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())
    return workload_stop(workload=w, actor=Actor.system()) if finished else w


def _invitation(tenant) -> Invitation:
    email = f"guest-{next(_emails)}@walker.test"
    return invitation_create(tenant=tenant, email=email, role=Role.MEMBER, actor=Actor.system())[0]


# An object a page can act on (a restart needs a finished workload with a spec that is valid).
def _instance_with_http_port(tenant) -> Workload:
    """An instance with an HTTP port (a share link needs one)."""
    spec = {"gpu_models": [H100], "image": "ghcr.io/acme/notebook:1", "ports": [8888]}
    return workload_submit(tenant=tenant, kind="instance", spec=spec, actor=Actor.system())


PAGE_OBJECTS = {
    "scheduling:workload-restart": lambda tenant: _workload(tenant, finished=True),
    "scheduling:workload-share-link": _instance_with_http_port,
    "portal:invitation-resend": _invitation,
    "portal:invitation-revoke": _invitation,
    "scheduling:workload-resize": lambda tenant: make_tenant_object(
        Workload,
        tenant=tenant,
        state="running",
        gpu_count=2,
        elastic_min_gpus=1,
        elastic_max_gpus=2,
        elastic_target_gpus=2,
        elastic_on_resize="signal",
    ),
}
MODEL_OBJECTS = {Workload: _workload}


class Page:
    def __init__(self, route: str, name: str, view_class: type):
        self.route, self.name, self.view_class = route, name, view_class

    def __str__(self) -> str:
        return self.name

    @property
    def model(self) -> type[Model] | None:
        return PAGE_MODELS.get(self.name) or getattr(self.view_class, "model", None)

    @property
    def methods(self) -> list[str]:
        allowed = self.view_class.http_method_names
        return [m for m in ("get", "post") if hasattr(self.view_class, m) and m in allowed]

    def make(self, tenant):
        maker = PAGE_OBJECTS.get(self.name) or MODEL_OBJECTS.get(self.model)
        return maker(tenant) if maker else make_tenant_object(self.model, tenant=tenant)

    def url(self, pk) -> str:
        return reverse(self.name, kwargs={"pk": pk})


def _pages(mixins: tuple[type, ...], *, with_pk: bool) -> list[Page]:
    pages = []
    for route, name, pattern in walk_urls():
        view_class = getattr(pattern.callback, "view_class", None)
        if view_class is None or not issubclass(view_class, mixins):
            continue
        if ("pk" in pattern.pattern.regex.groupindex) == with_pk:
            pages.append(Page(route, name, view_class))
    return pages


# Pages whose URL needs more than the id, tested with their own objects: opening a port
# (tests/scheduling/test_proxy_e2e.py, another tenant's member gets 404).
WALKED_ELSEWHERE = {"scheduling:workload-open"}
ID_PAGES = [p for p in _pages((TenantScopedMixin,), with_pk=True) if p.name not in WALKED_ELSEWHERE]
STAFF_PAGES = _pages((StaffRequiredMixin, StaffOnlyMixin, FinanceStaffMixin), with_pk=False) + _pages(
    (StaffRequiredMixin, StaffOnlyMixin, FinanceStaffMixin), with_pk=True
)


def test_the_walker_sees_the_pages():
    assert {p.name for p in ID_PAGES} >= {
        "scheduling:workload",
        "scheduling:workload-restart",
        "metering:invoice-pdf",
        "metering:reservation-cancel",
        "portal:member-role",
        "portal:token-revoke",
    }
    assert {p.name for p in STAFF_PAGES} >= {
        "nodes:node",
        "scheduling:staff-quota",
        "metering:finance-revenue",
    }


@pytest.fixture
def sessions(make_tenant, signed_in, settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False
    catalog_gpu()
    a, b = make_tenant("alpha"), make_tenant("bravo")
    owner = {t: Membership.objects.get(tenant=t, role=Role.OWNER).user for t in (a, b)}
    return {"a": a, "b": b, "a_owner": signed_in(owner[a], a), "b_owner": signed_in(owner[b], b)}


def _snapshot(obj):
    fresh = type(obj)._base_manager.filter(pk=obj.pk).first()
    return None if fresh is None else json.dumps(model_to_dict(fresh), default=str, sort_keys=True)


def _send(client: Client, page: Page, method: str, pk, htmx: bool):
    headers = HTMX if htmx else {}
    return getattr(client, method)(page.url(pk), PAGE_BODIES.get(page.name, {}), **headers)


@pytest.mark.parametrize("htmx", [False, True], ids=["page", "htmx"])
@pytest.mark.parametrize(
    "call", [(p, m) for p in ID_PAGES for m in p.methods], ids=lambda c: f"{c[0].name}-{c[1]}"
)
def test_another_tenants_ids_are_404_on_every_page(call, htmx, sessions):
    page, method = call
    model = page.model
    assert model is not None and issubclass(model, TenantOwnedModel), (
        f"{page.route}: teach this test the model of its id (PAGE_MODELS)"
    )
    a = sessions["a"]
    own = page.make(a)
    before, rows = _snapshot(own), model._base_manager.filter(tenant=a).count()
    ok = _send(sessions["a_owner"], page, method, own.pk, htmx)
    expected = (200,) if method == "get" else (200, 204, 302)
    assert ok.status_code in expected, f"positive control {method.upper()} {page.route}: {ok.status_code}"
    if method == "post":  # the write took effect: its object changed, or a row was added
        changed = _snapshot(own) != before or model._base_manager.filter(tenant=a).count() != rows
        assert changed, f"positive control {method.upper()} {page.route}: nothing changed"
    theirs = page.make(a) if method == "post" else own  # a write changed its object: B gets a twin
    before = _snapshot(theirs)
    refused = _send(sessions["b_owner"], page, method, theirs.pk, htmx)
    assert refused.status_code == 404, f"{method.upper()} {page.route} as B: {refused.status_code}"
    assert _snapshot(theirs) == before, f"{page.route}: B changed A's object"


def _staff_url(page: Page, tenant) -> str:
    """The staff page's URL with real ids: a node, its GPU, a tenant (a quota's row)."""
    from nodes.models import Gpu

    node = Node.objects.get(hostname="walker-h100")
    gpu = Gpu.objects.get(node=node).pk
    ids = {
        "nodes:gpu-return": gpu,
        "nodes:gpu-mig": gpu,
        "nodes:gpu-mig-cancel": gpu,
        "scheduling:staff-quota": tenant.pk,
    }
    if page.name in ("nodes:rollout", "nodes:rollout-action"):
        ids[page.name] = _walker_rollout().pk
    kwargs = {"pk": ids.get(page.name, node.pk)} if "<int:pk>" in page.route else {}
    if "<str:action>" in page.route:
        kwargs["action"] = "pause" if page.name == "nodes:rollout-action" else "cordon"
    return reverse(page.name, kwargs=kwargs)


def _walker_rollout():
    """A running rolling-upgrade campaign over the walker's node."""
    from nodes.models import RolloutCampaign
    from nodes.services.rollouts import rollout_start

    if not RolloutCampaign.objects.exists():
        body = {"name": "walk", "upgrade": "walk-1", "label": "walker=1", "batch_size": 1,
                "max_region_share": "1", "drain_deadline_s": 60}  # fmt: skip
        Node.objects.filter(hostname="walker-h100").update(labels={"walker": "1"})
        rollout_start(data=body, actor=Actor.system())
    return RolloutCampaign.objects.get()


@pytest.mark.parametrize("page", STAFF_PAGES, ids=str)
def test_staff_pages_are_for_staff_only(page, sessions, signed_in, add_member):
    """Every role of a tenant gets 403 from the staff pages, reads and writes alike; staff get the
    page (positive control), and their writes reach the form (no 403)."""
    a = sessions["a"]
    url = _staff_url(page, a)
    staff = User.objects.create_user(email="staff@gpupool.test", password="pw-for-tests-1", is_staff=True)
    clients = {role: signed_in(add_member(a, role).user, a) for role in Role.values}
    assert page.methods, f"{page.route}: teach this test the staff page's methods"
    for method in page.methods:
        nodes_before = json.dumps(list(Node.objects.values()), default=str)
        for role, client in clients.items():
            response = getattr(client, method)(url)
            assert response.status_code == 403, (
                f"{method.upper()} {page.route} as {role}: {response.status_code}"
            )
        assert json.dumps(list(Node.objects.values()), default=str) == nodes_before
        allowed = getattr(signed_in(staff), method)(url)
        expected = (200,) if method == "get" else (200, 201, 302, 400, 409)  # reached the handler
        assert allowed.status_code in expected, f"positive control {page.route}: {allowed.status_code}"


def test_the_launch_form_refuses_another_tenants_reservation(sessions):
    a, b = sessions["a"], sessions["b"]
    own = make_tenant_object(Reservation, tenant=a, status=ReservationStatus.ACTIVE)
    foreign = make_tenant_object(Reservation, tenant=b, status=ReservationStatus.ACTIVE)
    form = {"kind": "job", "gpu_model": H100, "gpu_count": 1, "fraction": 1000, "plan": "reserved"}
    form |= {"image": "ghcr.io/acme/train:1", "command": "true"}
    ok = sessions["a_owner"].post(reverse("scheduling:launch"), {**form, "reservation": own.pk})
    assert ok.status_code == 302, ok.content.decode()[:500]  # positive control
    assert Workload.objects.filter(tenant=a, reservation=own).count() == 1
    for htmx in (False, True):
        refused = sessions["a_owner"].post(
            reverse("scheduling:launch"), {**form, "reservation": foreign.pk}, **(HTMX if htmx else {})
        )
        assert refused.status_code == 400
        assert "reservation" in refused.context["form"].errors
    assert not Workload.objects.filter(reservation=foreign).exists()
    assert Workload.objects.filter(tenant=a).count() == 1


def test_the_tenant_switch_refuses_another_tenants_id(sessions, add_member):
    a, b = sessions["a"], sessions["b"]
    user = Membership.objects.get(tenant=a, role=Role.OWNER).user
    add_member(b, Role.VIEWER, email=user.email)
    client = sessions["a_owner"]
    assert client.post(reverse("portal:tenant-switch"), {"tenant": b.pk}).status_code == 302  # control
    Membership.objects.filter(tenant=b, user=user).delete()
    assert client.post(reverse("portal:tenant-switch"), {"tenant": a.pk}).status_code == 302
    refused = client.post(reverse("portal:tenant-switch"), {"tenant": b.pk})
    assert refused.status_code == 404
    assert client.get(reverse("portal:team")).context["request"].tenant == a
