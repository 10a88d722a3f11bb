"""Staff pages: rate cards (read-only versions: prices change through the service), billing
accounts, budgets, credits (grants only) and invoices with the on-demand run, finalize, paid and
void actions. Everything with consequences goes through the services."""

from __future__ import annotations

from django.contrib import admin

from metering.models import (
    BillingAccount,
    BillingAlert,
    Budget,
    BudgetAlert,
    CostToDate,
    CreditEntry,
    CreditNote,
    GpuPrice,
    Invoice,
    InvoiceLine,
    PlatformCost,
    RateCard,
    RateCardVersion,
    SpotPrice,
    StorageUsageRecord,
    StripeEvent,
    UsageRecord,
)
from metering.periods import period_of, previous_period
from metering.services.invoices import (
    invoice_build,
    invoice_finalize,
    invoice_mark_paid,
    invoice_run,
    invoice_void,
)
from portal.admin_actions import RecordAdmin, run_each


class GpuPriceInline(admin.TabularInline):
    model = GpuPrice
    extra = 0
    can_delete = False
    readonly_fields = ["gpu_model", "plan", "price_per_gpu_hour"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(RateCardVersion)
class RateCardVersionAdmin(admin.ModelAdmin):
    list_display = ["rate_card", "number", "effective_from", "effective_to"]
    list_filter = ["rate_card"]
    readonly_fields = [
        "rate_card",
        "number",
        "effective_from",
        "effective_to",
        "vcpu_hour_price",
        "ram_gib_hour_price",
        "storage_gib_hour_price",
    ]
    inlines = [GpuPriceInline]

    def has_add_permission(self, request):
        return False


@admin.register(RateCard)
class RateCardAdmin(admin.ModelAdmin):
    list_display = ["name", "currency", "is_default"]


@admin.register(BillingAccount)
class BillingAccountAdmin(admin.ModelAdmin):
    list_display = ["tenant", "rate_card", "discount_percent", "tax_rate_percent"]
    search_fields = ["tenant__slug"]


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    list_display = ["tenant", "monthly_limit", "hard_limit"]


@admin.register(CreditEntry)
class CreditEntryAdmin(admin.ModelAdmin):
    """The ledger is append-only: entries are added, never changed or deleted."""

    list_display = ["tenant", "kind", "amount", "invoice", "note", "created_at"]
    list_filter = ["kind"]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in CreditEntry._meta.fields] if obj is not None else ["invoice", "created_at"]

    def has_delete_permission(self, request, obj=None):
        return False


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    extra = 0
    can_delete = False
    fields = ["position", "kind", "description", "original_period", "quantity", "unit_price", "amount"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ["tenant", "period_start", "status", "subtotal", "credits", "tax", "total"]
    list_filter = ["status", "period_start"]
    inlines = [InvoiceLineInline]
    actions = ["rebuild", "finalize", "mark_paid", "void", "run_last_month"]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Invoice._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Rebuild the selected drafts from usage")
    def rebuild(self, request, queryset):
        run_each(
            self,
            request,
            queryset,
            lambda i, a: invoice_build(tenant=i.tenant, period_start=i.period_start),
            "Rebuilt",
        )

    @admin.action(description="Finalize the selected drafts")
    def finalize(self, request, queryset):
        run_each(self, request, queryset, lambda i, a: invoice_finalize(invoice=i, actor=a), "Finalized")

    @admin.action(description="Mark the selected invoices paid")
    def mark_paid(self, request, queryset):
        run_each(self, request, queryset, lambda i, a: invoice_mark_paid(invoice=i, actor=a), "Marked paid")

    @admin.action(description="Void the selected invoices")
    def void(self, request, queryset):
        run_each(
            self, request, queryset, lambda i, a: invoice_void(invoice=i, actor=a, reason="staff"), "Voided"
        )

    @admin.action(description="Run last month's invoices now (all tenants)")
    def run_last_month(self, request, queryset):
        from django.utils import timezone

        invoices = invoice_run(period_start=previous_period(period_of(timezone.now())))
        self.message_user(request, f"Invoice run: {len(invoices)} invoices built.")


@admin.register(StorageUsageRecord)
class StorageUsageRecordAdmin(RecordAdmin):
    list_display = [
        "tenant",
        "volume",
        "region",
        "start",
        "end",
        "size_gib",
        "unit_price",
        "amount",
        "invoice",
    ]
    list_filter = ["period_start"]


@admin.register(UsageRecord)
class UsageRecordAdmin(RecordAdmin):
    list_display = [
        "tenant",
        "workload",
        "gpu_model",
        "region",
        "plan",
        "start",
        "end",
        "gpu_seconds",
        "amount",
        "invoice",
    ]
    list_filter = ["plan", "gpu_model", "region", "period_start"]
    search_fields = ["tenant__slug", "workload__id"]
    list_select_related = ["tenant", "workload", "gpu_model", "region", "invoice"]
    date_hierarchy = "start"


@admin.register(CreditNote)
class CreditNoteAdmin(RecordAdmin):
    list_display = ["tenant", "invoice", "amount", "reason", "created_at"]
    search_fields = ["tenant__slug", "reason"]
    list_select_related = ["tenant", "invoice"]


@admin.register(CostToDate)
class CostToDateAdmin(RecordAdmin):
    list_display = ["tenant", "period_start", "amount", "currency", "as_of"]
    search_fields = ["tenant__slug"]
    list_select_related = ["tenant"]


@admin.register(BudgetAlert)
class BudgetAlertAdmin(RecordAdmin):
    list_display = [
        "tenant",
        "period_start",
        "threshold",
        "amount",
        "monthly_limit",
        "currency",
        "created_at",
    ]
    list_filter = ["threshold", "period_start"]
    search_fields = ["tenant__slug"]
    list_select_related = ["tenant"]


@admin.register(BillingAlert)
class BillingAlertAdmin(admin.ModelAdmin):
    """What staff must look at about money (metering.services.alerts); resolve one by setting
    its resolved time."""

    list_display = ["kind", "subject", "invoice", "count", "opened_at", "last_seen_at", "resolved_at"]
    list_filter = ["kind", ("resolved_at", admin.EmptyFieldListFilter)]
    search_fields = ["subject", "message"]
    readonly_fields = ["kind", "subject", "message", "invoice", "data", "count", "opened_at", "last_seen_at"]
    fields = [*readonly_fields, "resolved_at"]

    def has_add_permission(self, request):
        return False


@admin.register(PlatformCost)
class PlatformCostAdmin(RecordAdmin):
    list_display = ["kind", "gpu_model", "region", "start", "end", "gpu_seconds", "amount", "bound_to"]
    list_filter = ["kind", "gpu_model", "region", "period_start"]
    list_select_related = ["gpu_model", "region", "bound_to"]
    date_hierarchy = "start"


@admin.register(SpotPrice)
class SpotPriceAdmin(RecordAdmin):
    list_display = ["gpu_model", "region", "at", "price", "floor", "on_demand", "utilisation"]
    list_filter = ["gpu_model", "region"]
    list_select_related = ["gpu_model", "region"]
    date_hierarchy = "at"


@admin.register(StripeEvent)
class StripeEventAdmin(RecordAdmin):
    list_display = ["event_id", "type", "created", "received_at", "livemode", "result", "invoice"]
    list_filter = ["type", "result", "livemode"]
    search_fields = ["event_id"]
    date_hierarchy = "received_at"
