"""The building blocks every web view uses: tenant scoping, role checks and htmx partials.

``TenantScopedMixin`` is the web side of the one tenant-scoping mechanism (``portal.tenancy``): a view
takes its querysets through :meth:`TenantScopedMixin.scoped`, which goes through
``Model.objects.for_tenant(request.tenant)``, and looks objects up with
:meth:`TenantScopedMixin.get_scoped_object`, so objects of another tenant answer 404. Other apps use
it for their pages too::

    class FleetView(TenantScopedMixin, TemplateView):
        template_name = "nodes/fleet.html"
        partial_template_name = "nodes/_fleet_table.html"

        def get_context_data(self, **kwargs):
            return super().get_context_data(nodes=self.scoped(Node), **kwargs)
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from django.contrib.auth.mixins import AccessMixin
from django.core.exceptions import ImproperlyConfigured
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils.cache import patch_vary_headers
from django.views.generic import TemplateView

from portal.actors import Actor, actor_from_request
from portal.models import Scope

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MESSAGE_HEADER = "X-Gpupool-Message"


def htmx_partial(request: HttpRequest) -> bool:
    """True when the request wants a fragment: an htmx request that is not a boosted navigation."""
    htmx = getattr(request, "htmx", None)
    return bool(htmx) and not htmx.boosted


def render_page(
    request: HttpRequest,
    template_name: str,
    context: dict[str, Any] | None = None,
    *,
    partial_template_name: str | None = None,
    status: int = 200,
) -> HttpResponse:
    """The partial for htmx requests, the full page otherwise (NetBox's ``htmx_partial``)."""
    name = partial_template_name if partial_template_name and htmx_partial(request) else template_name
    response = render(request, name, context, status=status)
    patch_vary_headers(response, ["HX-Request"])
    return response


def _with_message(response: HttpResponse, message: str) -> HttpResponse:
    # Header values are Latin-1: the message travels percent-encoded; static/js/gpupool.js decodes it.
    response[MESSAGE_HEADER] = quote(message[:500])
    return response


def bad_request(request: HttpRequest, message: str) -> HttpResponse:
    return _with_message(render(request, "400.html", {"message": message}, status=400), message)


def forbidden(request: HttpRequest, message: str) -> HttpResponse:
    """A 403 page saying why (htmx requests show the message as a toast)."""
    return _with_message(render(request, "403.html", {"message": message}, status=403), message)


def not_found(request: HttpRequest, message: str) -> HttpResponse:
    return _with_message(render(request, "404.html", {"message": message}, status=404), message)


class TenantScopedMixin(AccessMixin):
    """Sign-in, the active tenant, role scopes and tenant-scoped querysets for a web view.

    * anonymous → redirect to the sign-in page;
    * signed in but in no tenant → the "no team yet" page (403), see :meth:`handle_no_tenant`;
    * GET/HEAD/OPTIONS need ``read_scope``, other methods ``write_scope`` (``None``: any member);
      a missing scope answers a 403 page naming it;
    * querysets come from :meth:`scoped` and objects from :meth:`get_scoped_object` (404 outside
      the tenant);
    * ``template_name`` is the full page, ``partial_template_name`` (optional) what htmx requests get.
    """

    read_scope: str | None = Scope.READ
    write_scope: str | None = Scope.WRITE
    model: type[Model] | None = None
    partial_template_name: str | None = None

    def dispatch(self, request, *args, **kwargs):
        if not request.user.is_authenticated:
            return self.handle_no_permission()
        if getattr(request, "membership", None) is None:
            return self.handle_no_tenant(request)
        scope = self.read_scope if request.method in SAFE_METHODS else self.write_scope
        if scope is not None and scope not in request.membership.scopes:
            return forbidden(request, self.scope_denied_message(scope))
        return super().dispatch(request, *args, **kwargs)

    def handle_no_tenant(self, request):
        return render(request, "portal/no_tenant.html", status=403)

    def scope_denied_message(self, scope: str) -> str:
        m = self.request.membership
        return (
            f"Your role in {m.tenant.name} is {m.get_role_display()}, which does not include the "
            f"{Scope(scope).label.lower()} scope this needs. Ask an owner or admin of the team."
        )

    @property
    def tenant(self):
        return self.request.tenant

    @property
    def membership(self):
        return self.request.membership

    @property
    def actor(self) -> Actor:
        return actor_from_request(self.request)

    def has_scope(self, scope: str) -> bool:
        return scope in self.request.membership.scopes

    def scoped(self, source: type[Model] | QuerySet) -> QuerySet:
        """``source`` (a tenant-owned model or one of its querysets) narrowed to the active tenant."""
        queryset = source._default_manager.all() if isinstance(source, type) else source
        return queryset.for_tenant(self.request.tenant)

    def get_queryset(self) -> QuerySet:
        if self.model is None:
            raise ImproperlyConfigured(
                f"{type(self).__name__} sets no model; set one or override get_queryset()."
            )
        return self.scoped(self.model)

    def get_scoped_object(self, queryset: QuerySet | None = None, **lookups) -> Model:
        """One object of the active tenant; Http404 when it is missing or belongs to another."""
        source = self.get_queryset() if queryset is None else self.scoped(queryset)
        return get_object_or_404(source, **lookups)

    def render(self, context: dict[str, Any], *, status: int = 200, template_name: str | None = None):
        return render_page(
            self.request,
            template_name or self.template_name,  # type: ignore[attr-defined]
            context,
            partial_template_name=self.partial_template_name,
            status=status,
        )


class PanelView(TenantScopedMixin, TemplateView):
    """A dashboard panel: ``panel_template_name`` is the card's body.

    htmx requests (the dashboard's ``hx-get``) get the body alone; opening the URL directly shows it
    inside the page layout.
    """

    panel_template_name: str = ""
    title: str = ""

    def get(self, request, *args, **kwargs):
        context = self.get_context_data(**kwargs)
        if htmx_partial(request):
            response = render(request, self.panel_template_name, context)
        else:
            context.update(panel_template=self.panel_template_name, panel_title=self.title)
            response = render(request, "portal/panel_page.html", context)
        patch_vary_headers(response, ["HX-Request"])
        return response
