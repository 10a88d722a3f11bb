"""The API tokens page: create (the secret is shown in that one response only), list, revoke.

Managing tokens needs the admin scope, as in the API. The plaintext secret exists only in the
response to the create POST: it is not stored in the database (only its hash) nor in the session,
and that response is marked ``Cache-Control: no-store``.
"""

from __future__ import annotations

from django.contrib import messages
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers
from django.views import View
from django.views.generic import TemplateView

from portal import selectors
from portal.errors import DomainError
from portal.forms import TokenCreateForm, apply_domain_error
from portal.models import ApiToken, Scope
from portal.services.tokens import api_token_create, api_token_revoke
from portal.views.base import TenantScopedMixin, htmx_partial, render_page


class TokensMixin(TenantScopedMixin):
    template_name = "portal/tokens.html"
    model = ApiToken
    read_scope = Scope.ADMIN
    write_scope = Scope.ADMIN

    def tokens_context(self, *, form=None, **extra):
        return {
            "tokens": selectors.api_tokens_for_tenant(tenant=self.tenant),
            "form": form or TokenCreateForm(role=self.membership.role),
            **extra,
        }


class TokensView(TokensMixin, TemplateView):
    def get_context_data(self, **kwargs):
        return super().get_context_data(**self.tokens_context(), **kwargs)


class TokenCreateView(TokensMixin, View):
    http_method_names = ["post"]

    def post(self, request):
        form = TokenCreateForm(request.POST, role=self.membership.role)
        partial = "portal/tokens/_create_response.html"
        if not form.is_valid():
            return self._render(form, partial, status=400)
        try:
            token, plaintext = api_token_create(
                tenant=self.tenant,
                name=form.cleaned_data["name"],
                scopes=form.cleaned_data["scopes"],
                expires_at=form.cleaned_data["expires_at"],
                actor=self.actor,
            )
        except DomainError as exc:
            apply_domain_error(form, exc)
            return self._render(form, partial, status=exc.status_code)
        response = self._render(None, partial, status=201, created=token, plaintext=plaintext)
        add_never_cache_headers(response)
        return response

    def _render(self, form, partial, *, status, **extra):
        return render_page(
            self.request,
            self.template_name,
            self.tokens_context(form=form, **extra),
            partial_template_name=partial,
            status=status,
        )


class TokenRevokeView(TokensMixin, View):
    http_method_names = ["post"]

    def post(self, request, pk):
        token = api_token_revoke(token=self.get_scoped_object(pk=pk), actor=self.actor)
        if htmx_partial(request):
            return render(request, "portal/tokens/_row.html", {"token": token})
        messages.success(request, f"The token {token.name} was revoked.")
        return redirect("portal:tokens")
