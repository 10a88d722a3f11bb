"""``/account/ssh-keys/``: the signed-in person's saved SSH keys (add, list, delete).

Keys belong to the person, not to a team: the page shows the person's own keys only
(``SshKey.objects.for_person``), another person's key id answers 404. A key opens the running
instances of every team where the person's role may operate workloads.
"""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.shortcuts import get_object_or_404, redirect, render
from django.views import View

from portal.actors import Actor
from portal.errors import DomainError
from portal.forms import apply_domain_error
from scheduling.models import SshKey
from scheduling.selectors.access import SSH_ROLES
from scheduling.services.ssh_keys import ssh_key_create, ssh_key_delete


class SshKeyForm(forms.Form):
    name = forms.CharField(
        label="Name", max_length=100, widget=forms.TextInput(attrs={"placeholder": "laptop"})
    )
    public_key = forms.CharField(
        label="Public key",
        max_length=16_000,
        strip=False,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "ssh-ed25519 AAAA… you@laptop"}),
        help_text="The .pub file's line: ed25519, ECDSA, or RSA of 2048 bits or more.",
    )


class SshKeysView(LoginRequiredMixin, View):
    template_name = "scheduling/ssh_keys.html"

    def _render(self, request, form, status=200):
        keys = SshKey.objects.for_person(request.user)
        roles = ", ".join(str(role.label).lower() for role in SSH_ROLES)
        context = {"keys": keys, "form": form, "ssh_roles": roles}
        return render(request, self.template_name, context, status=status)

    def get(self, request):
        return self._render(request, SshKeyForm())

    def post(self, request):
        form = SshKeyForm(request.POST)
        if not form.is_valid():
            return self._render(request, form, status=400)
        try:
            key = ssh_key_create(user=request.user, actor=Actor(user=request.user), **form.cleaned_data)
        except DomainError as exc:
            apply_domain_error(form, exc)
            return self._render(request, form, status=exc.status_code)
        messages.success(request, f"The key {key.name} ({key.fingerprint}) is saved.")
        return redirect("scheduling:ssh-keys")


class SshKeyDeleteView(LoginRequiredMixin, View):
    http_method_names = ["post"]

    def post(self, request, pk):
        key = get_object_or_404(SshKey.objects.for_person(request.user), pk=pk)
        ssh_key_delete(key=key, actor=Actor(user=request.user))
        messages.success(request, f"The key {key.name} is deleted: it opens nothing from now on.")
        return redirect("scheduling:ssh-keys")
