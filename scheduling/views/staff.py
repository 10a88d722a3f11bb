"""Staff operations pages for scheduling: quota management and the queue.

* ``/staff/quotas/``: every tenant's limits beside what counts against them now (one query per
  aggregate, not per tenant), search and "at or over a limit" filter, bulk change of one field for
  the selected tenants, and the audit trail of quota changes;
* ``/staff/quotas/<tenant>/``: one tenant's quota in a form (per-model limits included);
* ``/staff/queue/``: pending demand by GPU model and region, why it waits, and the fair-share
  standing per tenant; its body reloads every 10 s (htmx);
* ``/staff/queue-policy/``: each region's queue policy (``scheduling.services.queue_policy``).

Changes go through ``scheduling.services.quotas`` (validated, audited with before and after); a
refusal answers 400 with the message beside the field it names and writes nothing.
"""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.mixins import AccessMixin
from django.core.paginator import Paginator
from django.db.models import Q
from django.shortcuts import get_object_or_404, redirect
from django.views.generic import View

from nodes.models import GpuModel, QueuePolicy, Region
from portal.actors import Actor, actor_from_request
from portal.errors import ValidationFailed
from portal.models import AuditEvent, Tenant
from portal.views.base import forbidden, htmx_partial, render_page
from scheduling.models import Plan
from scheduling.selectors import staff_quotas as qs
from scheduling.selectors.staff_queue import queue_overview
from scheduling.services.queue_policy import QUEUE_POLICY_AUDIT_ACTION, region_queue_policy_set
from scheduling.services.quotas import EDITABLE_FIELDS, quota_bulk_update, quota_update

PAGE_SIZE = 50
QUEUE_REFRESH_S = 10


class StaffOnlyMixin(AccessMixin):
    """Anonymous people sign in first; signed-in people who are not staff get 403."""

    def dispatch(self, request, *args, **kwargs):
        if not request.user.is_authenticated:
            return self.handle_no_permission()
        if not request.user.is_staff:
            return forbidden(request, "The operations pages are for gpupool staff.")
        return super().dispatch(request, *args, **kwargs)

    @property
    def actor(self) -> Actor:
        return actor_from_request(self.request)


# --- quotas --------------------------------------------------------------------------------------------


class QuotaFilterForm(forms.Form):
    q = forms.CharField(label="Tenant", required=False, max_length=100)
    status = forms.ChoiceField(
        label="Status",
        required=False,
        choices=[("", "Any tenant"), ("limited", "At or over a limit"), ("over", "Over a limit")],
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["status"].widget.attrs["class"] = "select-sm"


FIELD_CHOICES = [(name, qs.LIMIT_LABELS[name]) for name in EDITABLE_FIELDS]


class QuotaBulkForm(forms.Form):
    tenants = forms.ModelMultipleChoiceField(label="Tenants", queryset=Tenant.objects.all(), required=False)
    field = forms.CharField(label="Limit")
    value = forms.CharField(label="New value", required=False, max_length=32)


LIMIT_HELP = "Empty: no limit."


class QuotaEditForm(forms.Form):
    """One text input per limit and per catalog model; the service validates the values, so a
    bad one reads the same here, in the admin and in bulk changes."""

    def __init__(self, *args, models: list[GpuModel], **kwargs):
        super().__init__(*args, **kwargs)
        for name in EDITABLE_FIELDS:
            self.fields[name] = forms.CharField(
                label=qs.LIMIT_LABELS[name],
                required=name == "fair_share_weight",
                max_length=32,
                help_text="Share of the fleet relative to others (default 1)."
                if name == "fair_share_weight"
                else LIMIT_HELP,
            )
        self.models = models
        for m in models:
            self.fields[f"model_{m.pk}"] = forms.CharField(
                label=f"{m.name} GPUs", required=False, max_length=32, help_text=LIMIT_HELP
            )

    def changes(self) -> dict:
        data = self.cleaned_data
        changes = {name: data.get(name) for name in EDITABLE_FIELDS}
        changes["model_limits"] = {m: data.get(f"model_{m.pk}") for m in self.models}
        return changes

    def add_service_error(self, exc: ValidationFailed) -> None:
        by_model = {f"max_gpus[{m.name}]": f"model_{m.pk}" for m in self.models}
        placed = False
        for name, errors in exc.fields.items():
            target = name if name in self.fields else by_model.get(name)
            if target is not None:
                for e in errors if isinstance(errors, list) else [errors]:
                    self.add_error(target, e)
                placed = True
        if not placed:
            self.add_error(None, exc.message)


def _tenants(q: str):
    tenants = Tenant.objects.order_by("name", "pk")
    if q:
        tenants = tenants.filter(Q(name__icontains=q) | Q(slug__icontains=q))
    return tenants


def _list_context(request, *, bulk_form: QuotaBulkForm | None = None) -> tuple[dict, int]:
    form = QuotaFilterForm(request.GET or None)
    q, status, code = "", "", 200
    if form.is_bound:
        if form.is_valid():
            q, status = form.cleaned_data["q"].strip(), form.cleaned_data["status"]
        else:
            code = 400
    tenants = _tenants(q)
    if status:
        # The filter needs everyone's use: three grouped queries, then rows for the matches.
        usage = qs.quota_usage_by_tenant(tenant_ids=None if not q else tenants.values_list("pk", flat=True))
        rows = qs.quota_rows(tenants=tenants, usage=usage)
        rows = [r for r in rows if r.status == "over" or (status == "limited" and r.status == "full")]
        paginator = Paginator(rows, PAGE_SIZE)
        page = paginator.get_page(request.GET.get("page"))
        rows = list(page.object_list)
    else:
        paginator = Paginator(tenants, PAGE_SIZE)
        page = paginator.get_page(request.GET.get("page"))
        rows = qs.quota_rows(tenants=page.object_list)
    context = {
        "form": form,
        "filtered": bool(q or status),
        "rows": rows,
        "page": page,
        "paginator": paginator,
        "limit_labels": [qs.LIMIT_LABELS[n] for n in qs.LIMIT_FIELDS],
        "bulk_form": bulk_form or QuotaBulkForm(),
        "field_choices": FIELD_CHOICES,
    }
    return context, code


class QuotaListView(StaffOnlyMixin, View):
    template_name = "scheduling/staff/quotas.html"
    partial_template_name = "scheduling/staff/_quota_rows.html"

    def get(self, request):
        context, status = _list_context(request)
        if not htmx_partial(request):
            context["audit"] = qs.quota_audit_trail()
        return render_page(
            request,
            self.template_name,
            context,
            partial_template_name=self.partial_template_name,
            status=status,
        )


class QuotaBulkView(StaffOnlyMixin, View):
    """POST ``tenants`` (ids), ``field`` and ``value``: one transaction, one audit event per tenant."""

    http_method_names = ["post"]

    def post(self, request):
        form = QuotaBulkForm(request.POST)
        if form.is_valid():
            try:
                results = quota_bulk_update(
                    tenants=list(form.cleaned_data["tenants"]),
                    name=form.cleaned_data["field"],
                    value=form.cleaned_data["value"],
                    actor=self.actor,
                )
            except ValidationFailed as exc:
                for name, errors in exc.fields.items():
                    target = name if name in ("tenants", "field") else "value"
                    for e in errors if isinstance(errors, list) else [errors]:
                        form.add_error(target, f"{name}: {e}" if target == "value" else e)
            else:
                changed = sum(1 for r in results if r.changed)
                label = qs.LIMIT_LABELS[form.cleaned_data["field"]]
                messages.success(request, f"{label} set for {len(results)} tenant(s); {changed} changed.")
                for r in results:
                    for w in r.warnings:
                        messages.warning(request, f"{r.quota.tenant.name}: {w}")
                return redirect("scheduling:staff-quotas")
        context, _ = _list_context(request, bulk_form=form)
        context["audit"] = qs.quota_audit_trail()
        return render_page(request, QuotaListView.template_name, context, status=400)


class QuotaEditView(StaffOnlyMixin, View):
    template_name = "scheduling/staff/quota_edit.html"

    def _context(self, tenant: Tenant, form: QuotaEditForm, row: qs.QuotaRow | None = None) -> dict:
        row = row or qs.quota_rows(tenants=[tenant])[0]
        use = {lim.name: lim for lim in row.limits}
        fields = [(form[name], use.get(name)) for name in EDITABLE_FIELDS]
        model_fields = [(form[f"model_{m.pk}"], qs.model_use_of(m.pk, row.usage)) for m in form.models]
        return {
            "tenant": tenant,
            "row": row,
            "form": form,
            "fields": fields,
            "model_fields": model_fields,
            "audit": qs.quota_audit_trail(tenant=tenant, limit=20),
        }

    def _initial(self, row: qs.QuotaRow) -> dict:
        initial = {lim.name: "" if lim.limit is None else lim.limit for lim in row.limits}
        initial["fair_share_weight"] = row.fair_share_weight
        return initial

    def get(self, request, pk: int):
        tenant = get_object_or_404(Tenant, pk=pk)
        models = list(GpuModel.objects.order_by("vendor", "name"))
        row = qs.quota_rows(tenants=[tenant])[0]
        initial = self._initial(row)
        current = {lim.name: lim.limit for lim in row.model_limits}
        for m in models:
            initial[f"model_{m.pk}"] = current.get(f"max_gpus[{m.name}]", "")
        form = QuotaEditForm(initial=initial, models=models)
        return render_page(request, self.template_name, self._context(tenant, form, row))

    def post(self, request, pk: int):
        tenant = get_object_or_404(Tenant, pk=pk)
        models = list(GpuModel.objects.order_by("vendor", "name"))
        form = QuotaEditForm(request.POST, models=models)
        if form.is_valid():
            try:
                result = quota_update(tenant=tenant, changes=form.changes(), actor=self.actor)
            except ValidationFailed as exc:
                form.add_service_error(exc)
            else:
                if result.changed:
                    messages.success(request, f"Quota of {tenant.name} saved ({', '.join(result.after)}).")
                else:
                    messages.info(request, f"Nothing changed in the quota of {tenant.name}.")
                for w in result.warnings:
                    messages.warning(request, w)
                return redirect("scheduling:staff-quotas")
        return render_page(request, self.template_name, self._context(tenant, form), status=400)


# --- queue ---------------------------------------------------------------------------------------------


class QueueView(StaffOnlyMixin, View):
    template_name = "scheduling/staff/queue.html"
    partial_template_name = "scheduling/staff/_queue_body.html"

    def get(self, request):
        context = {"queue": queue_overview(), "refresh_s": QUEUE_REFRESH_S}
        return render_page(
            request, self.template_name, context, partial_template_name=self.partial_template_name
        )


# --- queue policy --------------------------------------------------------------------------------------


class QueuePolicyView(StaffOnlyMixin, View):
    """Each region's queue policy, one small form per region; POST ``region`` (code),
    ``queue_policy`` and ``plan_<plan>`` (blank: the region's policy). A bad value answers 400 with the message beside the region's field."""

    template_name = "scheduling/staff/queue_policy.html"

    def _context(self, errors: dict[str, str] | None = None) -> dict:
        regions = list(Region.objects.order_by("code"))
        for r in regions:
            r.plan_rows = [
                (value, label, r.queue_policy_by_plan.get(value, "")) for value, label in Plan.choices
            ]
        return {
            "regions": regions,
            "choices": QueuePolicy.choices,
            "plan_choices": [("", "Region's policy"), *[(v, lbl) for v, lbl in QueuePolicy.choices if v]],
            "errors": errors or {},
            "audit": AuditEvent.objects.filter(action=QUEUE_POLICY_AUDIT_ACTION).order_by("-created", "-id")[
                :20
            ],
        }

    def get(self, request):
        return render_page(request, self.template_name, self._context())

    def post(self, request):
        code = request.POST.get("region", "")
        if not code:  # the form names its region; a post without one is a 400 naming the field
            return render_page(
                request,
                self.template_name,
                self._context({"region": "region: this field is required."}),
                status=400,
            )
        region = get_object_or_404(Region, code=code)
        try:
            by_plan = {p: request.POST.get(f"plan_{p}", "") for p in Plan.values}
            changed = region_queue_policy_set(
                region=region,
                policy=request.POST.get("queue_policy"),
                by_plan={p: v for p, v in by_plan.items() if v},
                actor=self.actor,
            )
        except ValidationFailed as exc:
            message = "; ".join(str(e) for errs in exc.fields.values() for e in errs)
            return render_page(request, self.template_name, self._context({region.code: message}), status=400)
        label = QueuePolicy(region.queue_policy).label
        if changed:
            messages.success(request, f"Queue policy of {region.code} set to {label}.")
        else:
            messages.info(request, f"Queue policy of {region.code} was already {label}.")
        return redirect("scheduling:staff-queue-policy")
