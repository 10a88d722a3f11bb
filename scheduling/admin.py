"""Staff pages: quotas (limits per tenant), reservations (confirm, end), warm pools, and read-only
views of workloads and allocations. Changes with consequences go through the services."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages

from portal.actors import Actor
from portal.admin_actions import RecordAdmin, run_each
from portal.errors import DomainError
from scheduling.models import (
    Allocation,
    GangAddress,
    PublishedPort,
    Quota,
    QuotaModelLimit,
    Reservation,
    SlurmJob,
    SshKey,
    Volume,
    VolumeResize,
    WarmPool,
    WarmSlot,
    WorkItem,
    Workload,
    WorkloadDependency,
    WorkloadEvent,
    WorkloadLogBatch,
    WorkloadLogLine,
    WorkloadShareLink,
    WorkloadTemplate,
    WorkloadVolume,
)
from scheduling.services.lifecycle import workload_stop
from scheduling.services.quotas import EDITABLE_FIELDS, quota_update
from scheduling.services.reservations import reservation_activate, reservation_cancel
from scheduling.services.templates import EDITABLE as TEMPLATE_EDITABLE
from scheduling.services.templates import template_check, template_create, template_delete, template_update


class QuotaModelLimitInline(admin.TabularInline):
    model = QuotaModelLimit
    extra = 1
    autocomplete_fields = ["gpu_model"]


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    """Limits are read under the quota row's lock at every submission, so a change applies to
    the next submission; what already runs is not touched."""

    list_display = [
        "tenant",
        "max_gpus_total",
        "max_concurrent_workloads",
        "max_spot_gpus",
        "max_gpus_per_request",
        "fair_share_weight",
        "updated_at",
    ]
    search_fields = ["tenant__slug", "tenant__name"]
    autocomplete_fields = ["tenant"]
    inlines = [QuotaModelLimitInline]

    def get_readonly_fields(self, request, obj=None):
        return ["tenant"] if obj is not None else []

    def save_model(self, request, obj, form, change):
        # Saved in save_related, with the per-model limits, through the service: one audited change.
        obj._quota_changes = {
            f: form.cleaned_data[f] for f in EDITABLE_FIELDS if not change or f in form.changed_data
        }

    def save_related(self, request, form, formsets, change):
        limits: dict[int, int | None] = {}
        for formset in formsets:
            # Not saved by the formset: the admin's change message reads what it would have saved.
            formset.new_objects, formset.changed_objects, formset.deleted_objects = [], [], []
            for f in formset.forms:
                data = getattr(f, "cleaned_data", None) or {}
                if not data or not (f.has_changed() or data.get("DELETE")):
                    continue
                old, new = f.initial.get("gpu_model"), data.get("gpu_model")
                if old is not None and (data.get("DELETE") or new is None or new.pk != old):
                    limits[old] = None
                if new is not None and not data.get("DELETE"):
                    limits[new.pk] = data.get("max_gpus")
        obj = form.instance
        result = quota_update(
            tenant=obj.tenant,
            changes={**obj._quota_changes, "model_limits": limits},
            actor=Actor(user=request.user),
        )
        obj.pk, obj.updated_at, obj._state.adding = result.quota.pk, result.quota.updated_at, False
        for w in result.warnings:
            messages.warning(request, w)


@admin.register(Reservation)
class ReservationAdmin(admin.ModelAdmin):
    list_display = ["id", "tenant", "gpu_model", "count", "region", "starts_at", "ends_at", "status"]
    list_filter = ["status", "region", "gpu_model"]
    search_fields = ["tenant__slug", "note"]
    autocomplete_fields = ["tenant", "gpu_model"]
    readonly_fields = ["status", "created_at", "activated_at", "cancelled_at", "cancel_fee_percent"]
    actions = ["activate", "activate_over_capacity", "cancel"]

    @admin.action(description="Confirm (guarantee and bill) the selected reservations")
    def activate(self, request, queryset):
        run_each(
            self, request, queryset, lambda r, a: reservation_activate(reservation=r, actor=a), "Confirmed"
        )

    @admin.action(
        description="Confirm even beyond the region's capacity (overbooks it: some reserved GPUs may "
        "not be there when every reservation is used at once)"
    )
    def activate_over_capacity(self, request, queryset):
        run_each(
            self,
            request,
            queryset,
            lambda r, a: reservation_activate(reservation=r, actor=a, override_capacity=True),
            "Confirmed over capacity",
        )

    @admin.action(description="Cancel or end the selected reservations")
    def cancel(self, request, queryset):
        run_each(
            self,
            request,
            queryset,
            lambda r, a: reservation_cancel(reservation=r, actor=a, staff=True),
            "Cancelled",
        )


@admin.register(WarmPool)
class WarmPoolAdmin(admin.ModelAdmin):
    list_display = [
        "gpu_model",
        "region",
        "image",
        "template",
        "min_size",
        "target_size",
        "max_size",
        "enabled",
    ]
    list_filter = ["enabled", "region", "gpu_model"]
    readonly_fields = ["target_size", "arrival_rate_per_s", "rate_updated_at"]


class WorkloadEventInline(admin.TabularInline):
    model = WorkloadEvent
    extra = 0
    can_delete = False
    fields = ["at", "from_state", "to_state", "reason", "message", "actor_repr"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Workload)
class WorkloadAdmin(admin.ModelAdmin):
    """Read-only: workloads change state only through the state machine."""

    list_display = [
        "id",
        "tenant",
        "kind",
        "name",
        "state",
        "plan",
        "gpu_count",
        "gpu_fraction_milli",
        "submitted_at",
    ]
    list_filter = ["state", "kind", "plan"]
    search_fields = ["=id", "name", "tenant__slug"]
    inlines = [WorkloadEventInline]
    actions = ["stop"]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.fields] + ["gpu_models"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Stop the selected workloads")
    def stop(self, request, queryset):
        run_each(self, request, queryset, lambda w, a: workload_stop(workload=w, actor=a), "Stopping")


class StopConfirmationFilter(admin.SimpleListFilter):
    """Allocations released without the node's report, and whether the node has confirmed since."""

    title = "forced stop"
    parameter_name = "stop"

    def lookups(self, request, model_admin):
        return [("unconfirmed", "Unconfirmed"), ("confirmed", "Confirmed")]

    def queryset(self, request, queryset):
        if self.value() == "unconfirmed":
            return queryset.filter(stop_forced_at__isnull=False, stop_confirmed_at__isnull=True)
        if self.value() == "confirmed":
            return queryset.filter(stop_confirmed_at__isnull=False)
        return queryset


@admin.register(Allocation)
class AllocationAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "workload",
        "tenant",
        "node",
        "gpu",
        "gpu_model",
        "fraction_milli",
        "started_at",
        "ended_at",
        "stop_forced_at",
        "stop_confirmed_at",
    ]
    list_filter = ["plan", "gpu_model", StopConfirmationFilter]
    search_fields = ["=workload__id", "node__hostname"]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(WarmSlot)
class WarmSlotAdmin(RecordAdmin):
    list_display = [
        "id",
        "pool",
        "node",
        "gpu",
        "created_at",
        "ready_at",
        "ended_at",
        "end_reason",
        "bound_to",
    ]
    list_filter = ["pool", "end_reason"]
    search_fields = ["node__hostname", "gpu__uuid"]
    list_select_related = ["pool", "node", "gpu", "bound_to"]
    date_hierarchy = "created_at"


class WorkloadTemplateForm(forms.ModelForm):
    """Each field checked by the template service (the workload rules), its errors on the field."""

    class Meta:
        model = WorkloadTemplate
        fields = list(TEMPLATE_EDITABLE)

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        try:
            template_check(
                tenant=None,
                data={f: data[f] for f in self.Meta.fields if f in data},
                exclude=self.instance.pk,
            )
        except DomainError as exc:
            for field, messages_ in exc.fields.items():
                self.add_error(field if field in self.fields else None, messages_)
        return data


@admin.register(WorkloadTemplate)
class WorkloadTemplateAdmin(admin.ModelAdmin):
    """The template catalog every tenant launches from. Saved and deleted through the template
    services, so every change is audited. Tenants' own templates are listed here too, read-only
    (their owners change them through the API)."""

    form = WorkloadTemplateForm
    list_display = ["name", "tenant", "image", "min_gpu_memory_gib", "updated_at"]
    list_filter = [("tenant", admin.EmptyFieldListFilter)]
    search_fields = ["name", "image", "tenant__slug"]
    actions = None  # a bulk delete would skip the service and its audit

    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and (obj is None or obj.is_catalog)

    def has_delete_permission(self, request, obj=None):
        return super().has_delete_permission(request, obj) and (obj is None or obj.is_catalog)

    def save_model(self, request, obj, form, change):
        actor = Actor(user=request.user)
        data = {f: form.cleaned_data[f] for f in form.Meta.fields}
        if change:
            changed = {f: data[f] for f in form.changed_data if f in data}
            saved = template_update(template=obj, data=changed, actor=actor)
        else:
            saved = template_create(tenant=None, data=data, actor=actor)
        obj.pk = saved.pk

    def delete_model(self, request, obj):
        template_delete(template=obj, actor=Actor(user=request.user))


@admin.register(WorkloadLogLine)
class WorkloadLogLineAdmin(RecordAdmin):
    """Read-only: lines come from the agents; the purge deletes them."""

    list_display = ["id", "workload", "at", "stream", "text"]
    list_filter = ["stream"]
    search_fields = ["=workload__id"]
    list_select_related = ["workload"]
    show_full_result_count = False  # a count of millions of lines per changelist would be slow


@admin.register(WorkloadLogBatch)
class WorkloadLogBatchAdmin(RecordAdmin):
    list_display = ["id", "node", "seq", "lines", "received_at"]
    search_fields = ["node__hostname"]
    list_select_related = ["node"]


@admin.register(SshKey)
class SshKeyAdmin(admin.ModelAdmin):
    """Read-only: people add and delete their keys themselves (audited by the service)."""

    list_display = ["name", "user", "fingerprint", "created"]
    search_fields = ["user__email", "fingerprint", "name"]
    readonly_fields = ["user", "name", "public_key", "fingerprint", "created"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Volume)
class VolumeAdmin(RecordAdmin):
    """Read-only: tenants create, resize and delete volumes (the delete sends the data removal)."""

    list_display = [
        "id",
        "tenant",
        "name",
        "region",
        "size_gib",
        "used_bytes",
        "state",
        "created_at",
        "deleted_at",
    ]
    list_filter = ["state", "region"]
    search_fields = ["name", "tenant__slug"]


@admin.register(VolumeResize)
class VolumeResizeAdmin(RecordAdmin):
    """Each change of a volume's size: storage billing charges each size for its own hours."""

    list_display = ["volume", "tenant", "at", "from_gib", "to_gib"]
    search_fields = ["volume__name", "tenant__slug"]
    list_select_related = ["volume", "tenant"]


@admin.register(WorkloadVolume)
class WorkloadVolumeAdmin(RecordAdmin):
    list_display = ["workload", "volume", "mount_path", "shared"]


@admin.register(PublishedPort)
class PublishedPortAdmin(RecordAdmin):
    """What nodes published for running workloads (kept while they hold their GPUs)."""

    list_display = ["workload", "node", "port", "protocol", "host_port", "note"]
    list_filter = ["protocol"]
    search_fields = ["workload__id", "node__hostname"]
    list_select_related = ["workload", "node"]


@admin.register(WorkloadShareLink)
class WorkloadShareLinkAdmin(RecordAdmin):
    """Which instances have a share link (the secret is not stored; tenants revoke it in the API
    or on the workload's page)."""

    list_display = ["workload", "tenant", "created_by", "created_at"]
    search_fields = ["workload__id", "tenant__slug"]
    list_select_related = ["workload", "tenant", "created_by"]
    exclude = ["token_hash"]


@admin.register(WorkloadDependency)
class WorkloadDependencyAdmin(RecordAdmin):
    """A job waiting for another to end (``depends_on``); set at submission, never changed."""

    list_display = ["workload", "on", "condition", "tenant"]
    list_filter = ["condition"]
    search_fields = ["workload__id", "on__id", "tenant__slug"]
    list_select_related = ["workload", "on", "tenant"]


@admin.register(SlurmJob)
class SlurmJobAdmin(RecordAdmin):
    """Read-only: the Slurm job a Slurm region's workload became (scheduling.services.slurm)."""

    list_display = [
        "workload",
        "region",
        "job_id",
        "account",
        "state",
        "reason",
        "submitted_at",
        "accounted_at",
    ]
    list_filter = ["region", "state"]
    search_fields = ["=workload__id", "=job_id", "account"]
    list_select_related = ["workload", "region"]


@admin.register(WorkItem)
class WorkItemAdmin(RecordAdmin):
    """A work-queue array's items: who holds each, until when, and how often it was handed out."""

    list_display = [
        "job",
        "index",
        "first",
        "last",
        "state",
        "leased_to",
        "lease_expires_at",
        "leases",
        "done_at",
    ]
    list_filter = ["state"]
    search_fields = ["job__id", "tenant__slug"]
    list_select_related = ["job", "leased_to"]


@admin.register(GangAddress)
class GangAddressAdmin(RecordAdmin):
    """The gang members' addresses on their region's gang network: handed out by the cycle and
    released by it, never edited here."""

    list_display = ["address", "region", "workload", "rank", "attempt", "node"]
    list_filter = ["region"]
    search_fields = ["=workload__id", "=address", "node__hostname"]
    list_select_related = ["region", "workload", "node"]
