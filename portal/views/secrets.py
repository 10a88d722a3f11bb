"""The secrets page: names and times, a form to set (create or replace) a value, and delete.
Values go in and never come out: no page shows one, not even to the person who set it."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.shortcuts import redirect
from django.views import View
from django.views.generic import TemplateView

from portal.errors import DomainError
from portal.forms import apply_domain_error
from portal.models import Scope, TenantSecret
from portal.services.secrets import secret_create, secret_delete, secret_update
from portal.views.base import TenantScopedMixin


class SecretForm(forms.Form):
    name = forms.CharField(label="Name", max_length=64, help_text="Letters, digits and _ . -")
    value = forms.CharField(
        label="Value",
        strip=False,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "off"}),
        help_text="Stored encrypted; it cannot be shown again, only replaced.",
    )


class SecretsMixin(TenantScopedMixin):
    template_name = "portal/secrets.html"
    model = TenantSecret
    read_scope = Scope.READ
    write_scope = Scope.WRITE

    def page(self, form: SecretForm | None = None, status: int = 200):
        context = {
            "secrets": self.scoped(TenantSecret).order_by("name"),
            "form": form or SecretForm(),
            "can_write": self.has_scope(Scope.WRITE),
        }
        return self.render(context, status=status)


class SecretsView(SecretsMixin, TemplateView):
    def get(self, request):
        return self.page()

    def post(self, request):
        """Set a secret: create it, or replace the value of the one with that name."""
        form = SecretForm(request.POST)
        if not form.is_valid():
            return self.page(form, status=400)
        name, value = form.cleaned_data["name"], form.cleaned_data["value"]
        existing = self.scoped(TenantSecret).filter(name=name).first()
        try:
            if existing is None:
                secret_create(tenant=self.tenant, name=name, value=value, actor=self.actor)
            else:
                secret_update(secret=existing, value=value, actor=self.actor)
        except DomainError as exc:
            apply_domain_error(form, exc)
            return self.page(form, status=exc.status_code)
        messages.success(request, f"Secret {name} {'replaced' if existing else 'saved'}.")
        return redirect("portal:secrets")


class SecretDeleteView(SecretsMixin, View):
    http_method_names = ["post"]

    def post(self, request, pk: int):
        secret = self.get_scoped_object(pk=pk)
        secret_delete(secret=secret, actor=self.actor)
        messages.success(request, f"Secret {secret.name} deleted.")
        return redirect("portal:secrets")
