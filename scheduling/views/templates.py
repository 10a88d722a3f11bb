"""The templates page: the catalog gpupool staff manage and the team's own templates, each with a
"Launch" that opens the launch form from it; the team's own are created, edited and deleted here.

The permissions are the API's (``/api/v1/templates/``): reading needs the read scope; creating,
changing and deleting the write scope, and only the team's own templates (a catalog template is
a 403, another team's a 404). Every rule is the template service's; the form checks shapes only
and shows the service's errors next to the field they name.
"""

from __future__ import annotations

import shlex
from typing import Any

from django import forms
from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect
from django.views.generic import View

from portal.errors import DomainError
from portal.models import Scope
from portal.views.base import TenantScopedMixin, forbidden, htmx_partial
from scheduling.models import WorkloadTemplate
from scheduling.services.templates import EDITABLE, template_create, template_delete, template_update


class TemplateForm(forms.Form):
    name = forms.CharField(label="Name", max_length=100, help_text="Letters, digits and _ . : / -")
    description = forms.CharField(
        label="Description", required=False, max_length=2000, widget=forms.Textarea(attrs={"rows": 2})
    )
    image = forms.CharField(label="Image", max_length=255, help_text="e.g. nvcr.io/nvidia/pytorch:24.08-py3")
    command = forms.CharField(
        label="Command", required=False, max_length=4000,
        help_text="Split like a shell would (no shell features); empty: the image's own.",
    )  # fmt: skip
    ports = forms.CharField(
        label="Ports", required=False, max_length=400,
        help_text="Instances: container ports, comma-separated; 8888 is HTTP (through the portal), 22/tcp raw TCP.",
    )  # fmt: skip
    env = forms.CharField(
        label="Environment variables", required=False, strip=False,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "MODE=train"}),
        help_text="One NAME=value a line.",
    )  # fmt: skip
    secret_env = forms.CharField(
        label="Secrets as variables", required=False,
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "HF_TOKEN=hf-token"}),
        help_text="One NAME=SECRET a line: the variable gets your team's secret when the workload starts.",
    )  # fmt: skip
    min_gpu_memory_gib = forms.IntegerField(
        label="Minimum GPU memory (GiB)", min_value=0, max_value=4096, initial=0
    )
    volume_mount_path = forms.CharField(
        label="Volume mounted at", required=False, max_length=255,
        help_text="Where a volume chosen at launch is mounted; empty: the launch says.",
    )  # fmt: skip
    volume_required = forms.BooleanField(
        label="Needs a volume", required=False,
        help_text="Launching from it asks for a volume (one of yours, or a new one).",
    )  # fmt: skip

    def clean_command(self) -> list[str]:
        try:
            return shlex.split(self.cleaned_data.get("command") or "")
        except ValueError as exc:
            raise forms.ValidationError(f"Cannot split this command: {exc}.") from None

    def clean_ports(self) -> list[Any]:
        out: list[Any] = []
        for part in (self.cleaned_data.get("ports") or "").replace(" ", "").split(","):
            if not part:
                continue
            number, _, protocol = part.partition("/")
            if not number.isdigit():
                raise forms.ValidationError(f"{part!r}: a port number, optionally /http or /tcp.")
            out.append({"port": int(number), "protocol": protocol} if protocol else int(number))
        return out

    @staticmethod
    def _lines(text: str) -> dict[str, str]:
        pairs = {}
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            name, sep, value = line.partition("=")
            if not sep or not name.strip():
                raise forms.ValidationError(f"Line {number}: write NAME=value.")
            pairs[name.strip()] = value
        return pairs

    def clean_env(self) -> dict[str, str]:
        return self._lines(self.cleaned_data.get("env") or "")

    def clean_secret_env(self) -> dict[str, dict[str, str]]:
        pairs = self._lines(self.cleaned_data.get("secret_env") or "")
        return {k: {"secret": v.strip()} for k, v in pairs.items()}

    def data_for_service(self) -> dict[str, Any]:
        data = {f: self.cleaned_data[f] for f in EDITABLE}
        data["env"] = {**data["env"], **self.cleaned_data["secret_env"]}
        return data

    def show_error(self, exc: DomainError) -> None:
        self.add_error(None, exc.message)
        for key, errors in (exc.fields or {}).items():
            if key in self.fields and key not in self.errors:
                self.add_error(key, " ".join(map(str, errors)))

    @staticmethod
    def initial_of(template: WorkloadTemplate) -> dict[str, Any]:
        """A template's values as the form writes them."""
        ports = []
        for p in template.ports or []:
            ports.append(f"{p['port']}/{p['protocol']}" if isinstance(p, dict) else str(p))
        return {
            "name": template.name,
            "description": template.description,
            "image": template.image,
            "command": shlex.join(template.command or []),
            "ports": ", ".join(ports),
            "env": "\n".join(f"{k}={v}" for k, v in template.env.items() if not isinstance(v, dict)),
            "secret_env": "\n".join(
                f"{k}={v['secret']}" for k, v in template.env.items() if isinstance(v, dict)
            ),
            "min_gpu_memory_gib": template.min_gpu_memory_gib,
            "volume_mount_path": template.volume_mount_path,
            "volume_required": template.volume_required,
        }


class TemplatesMixin(TenantScopedMixin):
    model = WorkloadTemplate
    read_scope = Scope.READ
    write_scope = Scope.WRITE

    def available(self):
        return WorkloadTemplate.objects.available_to(self.tenant)

    def own(self, pk: int) -> WorkloadTemplate | None:
        """The team's own template ``pk``; None for a catalog template (the caller answers 403);
        Http404 for anything else, another team's included."""
        template = get_object_or_404(self.available(), pk=pk)
        return None if template.is_catalog else template

    def context(self, form: TemplateForm | None = None) -> dict[str, Any]:
        templates = list(self.available())
        return {
            "catalog": [t for t in templates if t.is_catalog],
            "own": [t for t in templates if not t.is_catalog],
            "form": form or TemplateForm(),
            "can_write": self.has_scope(Scope.WRITE),
        }

    def catalog_denied(self):
        return forbidden(self.request, "Catalog templates are managed by gpupool staff.")


class TemplatesView(TemplatesMixin, View):
    template_name = "scheduling/templates.html"
    partial_template_name = "scheduling/_templates_list.html"

    def get(self, request):
        return self.render(self.context())

    def post(self, request):
        form = TemplateForm(request.POST)
        if not form.is_valid():
            return self.render(self.context(form), status=400, template_name=self.template_name)
        try:
            template = template_create(tenant=self.tenant, data=form.data_for_service(), actor=self.actor)
        except DomainError as exc:
            form.show_error(exc)
            return self.render(self.context(form), status=exc.status_code, template_name=self.template_name)
        messages.success(request, f"Template {template.name} created.")
        return redirect("scheduling:templates")


class TemplateEditView(TemplatesMixin, View):
    """Change one of the team's own templates (GET needs the write scope too: it is a form)."""

    template_name = "scheduling/template_edit.html"
    read_scope = Scope.WRITE

    def get(self, request, pk: int):
        template = self.own(pk)
        if template is None:
            return self.catalog_denied()
        form = TemplateForm(initial=TemplateForm.initial_of(template))
        return self.render({"form": form, "template": template})

    def post(self, request, pk: int):
        template = self.own(pk)
        if template is None:
            return self.catalog_denied()
        form = TemplateForm(request.POST, initial=TemplateForm.initial_of(template))
        if not form.is_valid():
            return self.render({"form": form, "template": template}, status=400)
        try:
            template_update(template=template, data=form.data_for_service(), actor=self.actor)
        except DomainError as exc:
            form.show_error(exc)
            return self.render({"form": form, "template": template}, status=exc.status_code)
        messages.success(request, f"Template {template.name} saved.")
        return redirect("scheduling:templates")


class TemplateDeleteView(TemplatesMixin, View):
    """Delete one of the team's own templates: htmx gets the lists again, a plain form a redirect."""

    partial_template_name = "scheduling/_templates_list.html"

    def post(self, request, pk: int):
        template = self.own(pk)
        if template is None:
            return self.catalog_denied()
        name = template.name
        template_delete(template=template, actor=self.actor)
        if htmx_partial(request):
            context = {**self.context(), "done": f"Template {name} deleted."}
            return self.render(context, template_name=self.partial_template_name)
        messages.success(request, f"Template {name} deleted.")
        return redirect("scheduling:templates")
