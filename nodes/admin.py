"""Staff admin for the fleet. Actions go through the audited services in ``nodes.services``."""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.db.models import Count, Q
from django.shortcuts import render

from nodes.models import (
    FleetAlert,
    Gpu,
    GpuMinuteRollup,
    GpuModel,
    GpuSample,
    HeartbeatBatch,
    Node,
    NodeBootstrapToken,
    NodeCommand,
    NodeCommandEvent,
    NodeCredential,
    NodeWorkloadStatus,
    Region,
    RolloutCampaign,
    RolloutStep,
    SequenceGap,
    UnknownGpuReport,
)
from nodes.services import health, rollouts
from nodes.services.registration import (
    bootstrap_token_create,
    gpu_conflict_alert_resolve,
    gpu_models_rematch,
    node_rekey_token_create,
)
from portal.actors import Actor
from portal.admin_actions import RecordAdmin, run_each


@admin.register(GpuModel)
class GpuModelAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "vendor",
        "memory_gib",
        "bf16_tflops",
        "fp32_tflops",
        "memory_bandwidth_gbps",
        "compute_weight",
        "oversubscription",
        "mig_capable",
        "software_stack",
        "cuda_compute_capability",
        "gfx_target",
    ]
    list_filter = ["vendor", "software_stack", "mig_capable", "architecture"]
    search_fields = ["name", "short_name", "aliases"]
    list_editable = ["compute_weight", "oversubscription"]


@admin.register(Region)
class RegionAdmin(admin.ModelAdmin):
    list_display = ["code", "name", "location", "backend", "node_count"]
    search_fields = ["code", "name", "location"]
    # Set on /staff/queue-policy/ or the staff API, where they are validated and audited; a Slurm
    # region's backend and configuration by ``manage.py slurm_region`` (nodes.services.slurm).
    readonly_fields = ["queue_policy", "queue_policy_by_plan", "backend", "slurm"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(_nodes=Count("nodes"))

    @admin.display(ordering="_nodes", description="nodes")
    def node_count(self, obj):
        return obj._nodes


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    can_delete = False
    fields = [
        "index",
        "uuid",
        "model",
        "reported_name",
        "health",
        "health_reason",
        "isolated",
        "last_util_pct",
    ]
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False


class ReasonForm(forms.Form):
    reason = forms.CharField(max_length=255, required=False)


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = [
        "hostname",
        "region",
        "domain",
        "state",
        "gpu_count",
        "interconnect",
        "last_heartbeat_at",
        "last_seq",
        "agent_version",
        "simulated",
    ]
    list_filter = ["state", "region", "interconnect", "simulated"]
    search_fields = ["hostname", "labels"]
    readonly_fields = [
        "state",
        "state_reason",
        "state_changed_at",
        "resume_state",
        "registered_at",
        "last_heartbeat_at",
        "seq_epoch",
        "last_seq",
        "status",
    ]
    inlines = [GpuInline]
    actions = ["cordon", "drain", "uncordon", "maintenance", "make_rekey_token"]

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .select_related("region")
            .annotate(_gpus=Count("gpus", filter=Q(gpus__removed_at__isnull=True)))
        )

    @admin.display(ordering="_gpus", description="GPUs")
    def gpu_count(self, obj):
        return obj._gpus

    @admin.action(description="Cordon: no new work")
    def cordon(self, request, queryset):
        run_each(self, request, queryset, lambda n, a: health.node_cordon(node=n, actor=a), "Cordoned")

    @admin.action(description="Drain: no new work, let running work finish")
    def drain(self, request, queryset):
        run_each(self, request, queryset, lambda n, a: health.node_drain(node=n, actor=a), "Draining")

    @admin.action(description="Uncordon: back to READY")
    def uncordon(self, request, queryset):
        run_each(self, request, queryset, lambda n, a: health.node_uncordon(node=n, actor=a), "Uncordoned")

    @admin.action(description="Maintenance (asks for a reason)")
    def maintenance(self, request, queryset):
        if "apply" in request.POST:
            form = ReasonForm(request.POST)
            if form.is_valid():
                reason = form.cleaned_data["reason"]
                run_each(
                    self,
                    request,
                    queryset,
                    lambda n, a: health.node_set_maintenance(node=n, actor=a, reason=reason),
                    "Put in maintenance",
                )
                return None
        return render(
            request,
            "admin/nodes/reason_form.html",
            {
                "title": "Put nodes in maintenance",
                "objects": queryset,
                "form": ReasonForm(),
                "action": "maintenance",
                "opts": self.model._meta,
            },
        )

    @admin.action(description="Re-key: make a token that replaces the node's credential (shown once)")
    def make_rekey_token(self, request, queryset):
        for node in queryset:
            token, plaintext = node_rekey_token_create(node=node, actor=Actor(user=request.user))
            self.message_user(
                request,
                f"Re-key token for {node.hostname} (expires {token.expires_at:%Y-%m-%d %H:%M} UTC, shown "
                f"once): {plaintext}",
                messages.WARNING,
            )


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = [
        "uuid",
        "node",
        "index",
        "model",
        "reported_name",
        "health",
        "isolated",
        "health_reason",
        "last_util_pct",
        "last_temp_c",
        "last_sample_at",
    ]
    list_filter = ["health", "isolated", "model", "node__region", "mig_mode"]
    search_fields = ["uuid", "reported_name", "node__hostname"]
    list_select_related = ["node", "model"]
    raw_id_fields = ["node"]
    readonly_fields = [
        "health",
        "health_reason",
        "health_changed_at",
        "isolated",
        "last_sample_at",
        "last_util_pct",
        "last_mem_used_mib",
        "last_power_w",
        "last_temp_c",
        "last_sm_clock_mhz",
        "ecc_sbe_total",
        "ecc_dbe_total",
        "last_xid",
        "xid_count",
        # MIG changes go through nodes.services.mig (the node page, the staff API): audited, drained.
        "mig_mode",
        "mig_layout",
        "mig_configuring",
        "mig_pending",
        "mig_requested_at",
        "mig_sent_at",
    ]
    actions = ["return_to_service", "isolate"]

    @admin.action(description="Return to service (healthy, schedulable)")
    def return_to_service(self, request, queryset):
        run_each(
            self, request, queryset, lambda g, a: health.gpu_return_to_service(gpu=g, actor=a), "Returned"
        )

    @admin.action(description="Isolate from scheduling")
    def isolate(self, request, queryset):
        run_each(
            self,
            request,
            queryset,
            lambda g, a: health.gpu_isolate(gpu=g, actor=a, reason=f"isolated by {a}"),
            "Isolated",
        )


@admin.register(UnknownGpuReport)
class UnknownGpuReportAdmin(admin.ModelAdmin):
    list_display = [
        "reported_name",
        "gpu_count",
        "first_seen_at",
        "last_seen_at",
        "example_node",
        "resolved_at",
    ]
    list_filter = [("resolved_at", admin.EmptyFieldListFilter)]
    search_fields = ["reported_name"]
    actions = ["rematch"]

    @admin.action(description="Match again against the catalog (after adding an alias)")
    def rematch(self, request, queryset):
        linked = gpu_models_rematch(actor=Actor(user=request.user))
        self.message_user(request, f"Linked {linked} GPU(s) to catalog models.", messages.SUCCESS)


class BootstrapTokenForm(forms.ModelForm):
    expires_in_hours = forms.FloatField(
        required=False,
        min_value=0.1,
        initial=settings.NODE_BOOTSTRAP_TOKEN_TTL_H,
        help_text=f"Empty: {settings.NODE_BOOTSTRAP_TOKEN_TTL_H} h (NODE_BOOTSTRAP_TOKEN_TTL_H).",
    )
    never_expires = forms.BooleanField(
        required=False,
        help_text="A token that never expires: until it is used, whoever reads it can register a node.",
    )

    class Meta:
        model = NodeBootstrapToken
        fields = ["region", "note"]

    def clean(self):
        data = super().clean()
        if data.get("never_expires") and data.get("expires_in_hours"):
            self.add_error("expires_in_hours", "Leave this empty for a token that never expires.")
        return data


@admin.register(NodeBootstrapToken)
class NodeBootstrapTokenAdmin(admin.ModelAdmin):
    """Adding a token here mints one and shows its plaintext once, in the success message. Re-key
    tokens are made from the node (its admin action or its fleet page)."""

    form = BootstrapTokenForm
    list_display = [
        "__str__",
        "region",
        "rekey_node",
        "note",
        "created_at",
        "expires_at",
        "used_at",
        "used_by_node",
    ]
    list_filter = [
        "region",
        ("used_at", admin.EmptyFieldListFilter),
        ("rekey_node", admin.EmptyFieldListFilter),
    ]
    search_fields = ["key_id", "note", "intended_hostname", "rekey_node__hostname"]
    actions = ["make_token_like_these"]

    def has_change_permission(self, request, obj=None):
        return obj is None

    def save_model(self, request, obj, form, change):
        hours = form.cleaned_data.get("expires_in_hours")
        never = bool(form.cleaned_data.get("never_expires"))
        token, plaintext = bootstrap_token_create(
            region=form.cleaned_data.get("region"),
            actor=Actor(user=request.user),
            expires_in=timedelta(hours=hours) if hours else None,
            never_expires=never,
            note=form.cleaned_data.get("note") or "",
        )
        obj.pk = token.pk
        self.message_user(request, f"Bootstrap token (shown once): {plaintext}", messages.WARNING)
        if never:
            self.message_user(
                request,
                "This token never expires: until it is used, whoever reads it can register a node.",
                messages.WARNING,
            )

    @admin.action(description="Make a new bootstrap token like these (a new node; default expiry)")
    def make_token_like_these(self, request, queryset):
        for old in queryset:
            if old.rekey_node_id is not None:
                _, plaintext = node_rekey_token_create(node=old.rekey_node, actor=Actor(user=request.user))
            else:
                _, plaintext = bootstrap_token_create(
                    region=old.region, actor=Actor(user=request.user), note=old.note
                )
            self.message_user(request, f"Bootstrap token (shown once): {plaintext}", messages.WARNING)


@admin.register(NodeCredential)
class NodeCredentialAdmin(admin.ModelAdmin):
    list_display = ["__str__", "node", "created_at"]
    search_fields = ["node__hostname"]
    readonly_fields = ["node", "key_hash", "created_at"]

    def has_add_permission(self, request):
        return False


class NodeCommandEventInline(admin.TabularInline):
    model = NodeCommandEvent
    extra = 0
    can_delete = False
    fields = ["at", "event", "from_state", "to_state", "attempt", "detail"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(NodeCommand)
class NodeCommandAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "node",
        "kind",
        "state",
        "attempt",
        "max_attempts",
        "created_at",
        "deadline",
        "finished_at",
    ]
    list_filter = ["state", "kind"]
    search_fields = ["id", "node__hostname", "idempotency_key"]
    list_select_related = ["node"]
    raw_id_fields = ["node"]
    inlines = [NodeCommandEventInline]
    readonly_fields = [f.name for f in NodeCommand._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(NodeCommandEvent)
class NodeCommandEventAdmin(admin.ModelAdmin):
    list_display = ["command", "at", "event", "from_state", "to_state", "attempt"]
    list_filter = ["event"]
    search_fields = ["command__id"]
    raw_id_fields = ["command"]


@admin.register(NodeWorkloadStatus)
class NodeWorkloadStatusAdmin(admin.ModelAdmin):
    list_display = ["workload_id", "node", "state", "exit_code", "started_at", "finished_at", "updated_at"]
    list_filter = ["state"]
    search_fields = ["workload_id", "node__hostname"]
    raw_id_fields = ["node"]


@admin.register(HeartbeatBatch)
class HeartbeatBatchAdmin(admin.ModelAdmin):
    list_display = ["node", "epoch", "seq", "received_at", "sent_at", "sample_count", "out_of_order"]
    list_filter = ["out_of_order"]
    search_fields = ["node__hostname"]
    raw_id_fields = ["node"]
    show_full_result_count = False


@admin.register(SequenceGap)
class SequenceGapAdmin(admin.ModelAdmin):
    list_display = ["node", "epoch", "first_seq", "last_seq", "missing", "filled_count", "detected_at"]
    search_fields = ["node__hostname"]
    raw_id_fields = ["node"]


@admin.register(GpuSample)
class GpuSampleAdmin(admin.ModelAdmin):
    list_display = ["gpu", "ts", "util_pct", "mem_used_mib", "power_w", "temp_c", "sm_clock_mhz", "ecc_dbe"]
    search_fields = ["gpu__uuid"]
    raw_id_fields = ["gpu"]
    show_full_result_count = False


@admin.register(GpuMinuteRollup)
class GpuMinuteRollupAdmin(admin.ModelAdmin):
    list_display = ["gpu", "minute", "sample_count", "util_avg", "util_max", "power_avg_w", "temp_max"]
    search_fields = ["gpu__uuid"]
    raw_id_fields = ["gpu"]
    show_full_result_count = False


@admin.register(FleetAlert)
class FleetAlertAdmin(admin.ModelAdmin):
    list_display = ["kind", "subject", "opened_at", "last_seen_at", "resolved_at", "message"]
    list_filter = ["kind", ("resolved_at", admin.EmptyFieldListFilter)]
    search_fields = ["message", "subject"]
    actions = ["resolve"]

    @admin.action(description="Resolve a GPU UUID conflict: staff have dealt with it")
    def resolve(self, request, queryset):
        run_each(
            self,
            request,
            queryset,
            lambda alert, a: gpu_conflict_alert_resolve(alert=alert, actor=a),
            "Resolved",
        )


class RolloutStepInline(admin.TabularInline):
    model = RolloutStep
    extra = 0
    can_delete = False
    fields = ["position", "node", "batch", "state", "message", "drain_started_at", "finished_at"]
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(RolloutCampaign)
class RolloutCampaignAdmin(RecordAdmin):
    """Campaigns are started on the fleet's Rollouts page or the staff API; here staff look, and
    pause, resume or abort through the same audited services."""

    list_display = [
        "id",
        "name",
        "upgrade",
        "state",
        "batch_size",
        "max_region_share",
        "created_by",
        "created_at",
    ]
    list_filter = ["state"]
    search_fields = ["name", "upgrade"]
    inlines = [RolloutStepInline]
    actions = ["pause", "resume", "abort"]

    @admin.action(description="Pause the selected campaigns")
    def pause(self, request, queryset):
        run_each(self, request, queryset, lambda c, a: rollouts.rollout_pause(campaign=c, actor=a), "Paused")

    @admin.action(description="Resume the selected campaigns")
    def resume(self, request, queryset):
        run_each(
            self, request, queryset, lambda c, a: rollouts.rollout_resume(campaign=c, actor=a), "Resumed"
        )

    @admin.action(description="Abort the selected campaigns")
    def abort(self, request, queryset):
        run_each(self, request, queryset, lambda c, a: rollouts.rollout_abort(campaign=c, actor=a), "Aborted")


@admin.register(RolloutStep)
class RolloutStepAdmin(RecordAdmin):
    list_display = ["campaign", "node", "batch", "state", "message", "finished_at"]
    list_filter = ["state"]
    search_fields = ["node__hostname"]
    list_select_related = ["campaign", "node"]
