"""The webhooks pages: the endpoints (add one: its secret is shown in that answer only), an
endpoint's page (its deliveries and their attempts, redeliver, enable or disable, roll the secret,
delete). Admin scope, as in the API. Forms check the shape; ``webhooks.services`` the rules."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.shortcuts import redirect
from django.utils.cache import add_never_cache_headers
from django.views import View
from django.views.generic import TemplateView

from portal.dashboard import register_nav
from portal.errors import DomainError
from portal.forms import apply_domain_error
from portal.models import Scope
from portal.views.base import TenantScopedMixin, htmx_partial, render_page
from webhooks.catalog import ALL, EVENT_TYPES
from webhooks.models import WebhookDelivery, WebhookEndpoint
from webhooks.services.deliveries import delivery_redeliver
from webhooks.services.endpoints import (
    endpoint_create,
    endpoint_delete,
    endpoint_roll_secret,
    endpoint_update,
)

register_nav("webhooks", "Webhooks", "webhooks:list", order=92, scope=Scope.ADMIN, icon="settings")
DELIVERIES_SHOWN = 50


class EndpointForm(forms.Form):
    url = forms.CharField(
        label="URL", max_length=2000, help_text="https:// on a public address; deliveries are POSTed there."
    )
    event_types = forms.MultipleChoiceField(
        label="Events",
        choices=[(ALL, "Every event type (now and later)"), *((k, k) for k in EVENT_TYPES)],
        widget=forms.CheckboxSelectMultiple,
    )
    description = forms.CharField(label="Description", max_length=200, required=False)


class WebhooksMixin(TenantScopedMixin):
    model = WebhookEndpoint
    read_scope = Scope.ADMIN
    write_scope = Scope.ADMIN


class WebhooksView(WebhooksMixin, TemplateView):
    template_name = "webhooks/list.html"

    def page(self, *, form=None, status=200, **extra):
        context = {
            "endpoints": self.scoped(WebhookEndpoint).order_by("id"),
            "form": form or EndpointForm(),
            "event_types": EVENT_TYPES,
            **extra,
        }
        return self.render(context, status=status)

    def get(self, request):
        return self.page()

    def post(self, request):
        form = EndpointForm(request.POST)
        if not form.is_valid():
            return self.page(form=form, status=400)
        try:
            endpoint, secret = endpoint_create(
                tenant=self.tenant,
                url=form.cleaned_data["url"],
                event_types=form.cleaned_data["event_types"],
                description=form.cleaned_data["description"],
                actor=self.actor,
            )
        except DomainError as exc:
            apply_domain_error(form, exc)
            return self.page(form=form, status=exc.status_code)
        response = self.page(status=201, created=endpoint, secret=secret)
        add_never_cache_headers(response)  # the secret is in this answer only
        return response


class WebhookDetailView(WebhooksMixin, TemplateView):
    template_name = "webhooks/detail.html"
    partial_template_name = "webhooks/_deliveries.html"

    def page(self, endpoint, *, status=200, **extra):
        deliveries = (
            WebhookDelivery.objects.for_tenant(self.tenant)
            .filter(endpoint=endpoint)
            .select_related("event")
            .prefetch_related("attempt_log")
            .order_by("-id")[:DELIVERIES_SHOWN]
        )
        context = {"endpoint": endpoint, "deliveries": deliveries, "shown": DELIVERIES_SHOWN, **extra}
        return self.render(context, status=status)

    def get(self, request, pk: int):
        return self.page(self.get_scoped_object(pk=pk))

    def post(self, request, pk: int):
        """``action``: enable, disable, roll (a new secret, shown in this answer only; the old one
        keeps signing for ``expire_previous_in_s``) or delete."""
        endpoint = self.get_scoped_object(pk=pk)
        what = request.POST.get("action")
        if what in ("enable", "disable"):
            endpoint_update(endpoint=endpoint, changes={"enabled": what == "enable"}, actor=self.actor)
            messages.success(request, f"Endpoint {'enabled' if what == 'enable' else 'disabled'}.")
            return redirect("webhooks:detail", pk=endpoint.pk)
        if what == "delete":
            endpoint_delete(endpoint=endpoint, actor=self.actor)
            messages.success(request, "Endpoint deleted.")
            return redirect("webhooks:list")
        if what == "roll":
            keep = request.POST.get("expire_previous_in_s", "0")
            try:
                endpoint, secret = endpoint_roll_secret(
                    endpoint=endpoint,
                    actor=self.actor,
                    expire_previous_in_s=int(keep) if keep.isdigit() else keep,
                )
            except DomainError as exc:
                return self.page(endpoint, status=exc.status_code, error=exc.message)
            response = self.page(endpoint, secret=secret)
            add_never_cache_headers(response)
            return response
        return self.page(endpoint, status=400, error="Unknown action.")


class RedeliverView(WebhooksMixin, View):
    http_method_names = ["post"]

    def post(self, request, pk: int):
        delivery = self.get_scoped_object(WebhookDelivery.objects.select_related("event"), pk=pk)
        try:
            delivery = delivery_redeliver(delivery=delivery, actor=self.actor)
        except DomainError as exc:
            if htmx_partial(request):
                return render_page(
                    request,
                    "webhooks/_delivery_row.html",
                    {"d": delivery, "error": exc.message},
                    status=exc.status_code,
                )
            messages.error(request, exc.message)
            return redirect("webhooks:detail", pk=delivery.endpoint_id)
        if htmx_partial(request):
            return render_page(request, "webhooks/_delivery_row.html", {"d": delivery, "queued": True})
        messages.success(request, f"Delivery {delivery.pk} queued to be sent again.")
        return redirect("webhooks:detail", pk=delivery.endpoint_id)
