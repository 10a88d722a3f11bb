"""Rate cards and their versions, tenant billing accounts, usage records, invoices and their lines,
credits, credit notes and budgets.

Prices never rewrite the past: a :class:`RateCardVersion` is in force on ``[effective_from,
effective_to)`` (an open end: until further notice) and versions of one card never overlap (checked
by the service; on PostgreSQL also an exclusion constraint, migration ``0002``). Usage is rated with
the version in force at each instant, and an interval that crosses a change becomes two records.

A finalized invoice is immutable: a database trigger (PostgreSQL and SQLite, migration ``0002``)
refuses an update of its money fields and any insert, update or delete of its lines.
"""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from metering.money import (
    AMOUNT_MAX_DIGITS,
    AMOUNT_PLACES,
    MONEY_MAX_DIGITS,
    MONEY_PLACES,
    UNIT_PRICE_MAX_DIGITS,
    UNIT_PRICE_PLACES,
)
from portal.tenancy import TenantOwnedModel
from scheduling.models import Plan


def _unit_price(**kwargs):
    return models.DecimalField(
        max_digits=UNIT_PRICE_MAX_DIGITS,
        decimal_places=UNIT_PRICE_PLACES,
        validators=[MinValueValidator(0)],
        **kwargs,
    )


def _money(**kwargs):
    return models.DecimalField(max_digits=MONEY_MAX_DIGITS, decimal_places=MONEY_PLACES, **kwargs)


def _percent(**kwargs):
    return models.DecimalField(
        max_digits=6,
        decimal_places=3,
        default=0,
        validators=[MinValueValidator(0), MaxValueValidator(100)],
        **kwargs,
    )


class RateCard(models.Model):
    """A price list. One card is the default; a tenant's billing account may name another (an
    override card with its own versions)."""

    name = models.CharField(max_length=100, unique=True)
    currency = models.CharField(max_length=3, default="USD")
    is_default = models.BooleanField(default=False)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["is_default"], condition=Q(is_default=True), name="ratecard_one_default"
            )
        ]

    def __str__(self) -> str:
        return self.name


class RateCardVersion(models.Model):
    rate_card = models.ForeignKey(RateCard, on_delete=models.PROTECT, related_name="versions")
    number = models.PositiveIntegerField()
    effective_from = models.DateTimeField()
    effective_to = models.DateTimeField(null=True, blank=True, help_text="Exclusive; empty: open-ended.")
    vcpu_hour_price = _unit_price(null=True, blank=True)
    ram_gib_hour_price = _unit_price(null=True, blank=True)
    storage_gib_hour_price = _unit_price(
        null=True, blank=True, help_text="Per GiB-hour of a volume's size; empty: volumes are not billed."
    )
    gpu_memory_gib_hour_price = _unit_price(
        null=True,
        blank=True,
        help_text="Per GiB-hour of GPU memory held (the GPU's memory times the share of it held); "
        "empty: GPU memory is not billed apart.",
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["rate_card_id", "effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["rate_card", "number"], name="ratecardversion_unique_number"),
            models.UniqueConstraint(
                fields=["rate_card", "effective_from"], name="ratecardversion_unique_start"
            ),
            models.CheckConstraint(
                condition=Q(effective_to__isnull=True) | Q(effective_to__gt=F("effective_from")),
                name="ratecardversion_period_positive",
            ),
            models.CheckConstraint(
                condition=Q(vcpu_hour_price__isnull=True) | Q(vcpu_hour_price__gte=0),
                name="ratecardversion_vcpu_price_nonneg",
            ),
            models.CheckConstraint(
                condition=Q(ram_gib_hour_price__isnull=True) | Q(ram_gib_hour_price__gte=0),
                name="ratecardversion_ram_price_nonneg",
            ),
            models.CheckConstraint(
                condition=Q(storage_gib_hour_price__isnull=True) | Q(storage_gib_hour_price__gte=0),
                name="ratecardversion_storage_price_nonneg",
            ),
            models.CheckConstraint(
                condition=Q(gpu_memory_gib_hour_price__isnull=True) | Q(gpu_memory_gib_hour_price__gte=0),
                name="ratecardversion_gpu_memory_price_nonneg",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.rate_card} v{self.number}"


class GpuPrice(models.Model):
    """Price of one GPU-hour of ``gpu_model`` on ``plan`` in one rate-card version. For the
    reserved plan it is the hourly rate a reservation's monthly fee is computed from. With a
    ``region`` it is that region's price (power and space cost differ), which wins there over the
    price without one."""

    version = models.ForeignKey(RateCardVersion, on_delete=models.CASCADE, related_name="gpu_prices")
    gpu_model = models.ForeignKey("nodes.GpuModel", on_delete=models.PROTECT, related_name="+")
    plan = models.CharField(max_length=16, choices=Plan.choices)
    region = models.ForeignKey(
        "nodes.Region",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        help_text="Empty: every region without a price of its own.",
    )
    price_per_gpu_hour = _unit_price()

    class Meta:
        ordering = ["version_id", "gpu_model_id", "plan", "region_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["version", "gpu_model", "plan"],
                condition=Q(region__isnull=True),
                name="gpuprice_unique",
            ),
            models.UniqueConstraint(
                fields=["version", "gpu_model", "plan", "region"],
                condition=Q(region__isnull=False),
                name="gpuprice_unique_region",
            ),
            models.CheckConstraint(condition=Q(price_per_gpu_hour__gte=0), name="gpuprice_nonneg"),
        ]

    def __str__(self) -> str:
        return f"{self.gpu_model_id}/{self.plan}: {self.price_per_gpu_hour}/h"


class BillingAccount(TenantOwnedModel):
    """A tenant's billing terms: an optional override rate card, a discount and a tax rate."""

    tenant = models.OneToOneField("portal.Tenant", on_delete=models.CASCADE, related_name="billing_account")
    rate_card = models.ForeignKey(RateCard, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    discount_percent = _percent(help_text="Off every usage and reserved-fee price.")
    tax_rate_percent = _percent()
    stripe_customer_id = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["tenant_id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(discount_percent__gte=0, discount_percent__lte=100), name="billing_discount_range"
            ),
            models.CheckConstraint(
                condition=Q(tax_rate_percent__gte=0, tax_rate_percent__lte=100), name="billing_tax_range"
            ),
        ]

    def __str__(self) -> str:
        return f"billing account of tenant {self.tenant_id}"


class UsageRecord(TenantOwnedModel):
    """One segment of one allocation: inside one billing period and one price version.

    Unique on (allocation, period, version, segment start): rebuilding usage for the same
    allocation makes the same rows, so replays and reruns never bill twice. ``amount`` is unrounded
    (10 places); invoices round per line.
    """

    # Few indexes: the monthly run rewrites every record's ``invoice`` once, and each index costs
    # a write per record. Tenant and allocation are served by ``usage_tenant_period_id`` and the
    # unique segment; model, region and version are never looked up by themselves (only a
    # delete of one of those, which PROTECT refuses anyway, would scan).
    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+", db_index=False)
    allocation = models.ForeignKey(
        "scheduling.Allocation", on_delete=models.PROTECT, related_name="+", db_index=False
    )
    workload = models.ForeignKey("scheduling.Workload", on_delete=models.PROTECT, related_name="+")
    gpu_model = models.ForeignKey(
        "nodes.GpuModel", on_delete=models.PROTECT, related_name="+", db_index=False
    )
    region = models.ForeignKey("nodes.Region", on_delete=models.PROTECT, related_name="+", db_index=False)
    plan = models.CharField(max_length=16, choices=Plan.choices)
    period_start = models.DateField(help_text="First day (UTC) of the billing month.")
    version = models.ForeignKey(RateCardVersion, on_delete=models.PROTECT, related_name="+", db_index=False)
    start = models.DateTimeField()
    end = models.DateTimeField()
    fraction_milli = models.PositiveSmallIntegerField()
    seconds = models.DecimalField(max_digits=20, decimal_places=6, help_text="Wall-clock seconds.")
    minimum_topup_s = models.DecimalField(
        max_digits=20, decimal_places=6, default=0, help_text="Added so the allocation bills its minimum."
    )
    gpu_seconds = models.DecimalField(max_digits=24, decimal_places=9)
    vcpu_seconds = models.DecimalField(max_digits=24, decimal_places=9, default=0)
    ram_gib_seconds = models.DecimalField(max_digits=24, decimal_places=9, default=0)
    gpu_memory_gib_seconds = models.DecimalField(
        max_digits=24,
        decimal_places=9,
        default=0,
        help_text="GPU memory held: GPU-seconds x the model's GiB.",
    )
    gpu_memory_amount = models.DecimalField(
        max_digits=AMOUNT_MAX_DIGITS,
        decimal_places=AMOUNT_PLACES,
        default=0,
        help_text="The part of ``amount`` that is GPU memory (its own invoice line).",
    )
    unit_price = _unit_price(help_text="Per GPU-hour, after the tenant's discount.")
    amount = models.DecimalField(max_digits=AMOUNT_MAX_DIGITS, decimal_places=AMOUNT_PLACES)
    avg_util_pct = models.FloatField(null=True, blank=True)
    avg_mem_used_mib = models.FloatField(null=True, blank=True)
    invoice = models.ForeignKey(
        "metering.Invoice",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="usage_records",
        db_index=False,  # indexed by ``usage_invoice``
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["start", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["allocation", "period_start", "version", "start"], name="usagerecord_unique_segment"
            ),
            # (Equal only for a Slurm run sacct records as 0 s: billed its minimum.)
            models.CheckConstraint(condition=Q(end__gte=F("start")), name="usagerecord_end_not_before_start"),
            models.CheckConstraint(condition=Q(amount__gte=0), name="usagerecord_amount_nonneg"),
        ]
        indexes = [
            # A tenant's month in id order: the run's aggregates and the API's cursor pages.
            models.Index(fields=["tenant", "period_start", "id"], name="usage_tenant_period_id"),
            models.Index(fields=["invoice"], name="usage_invoice"),
        ]

    def __str__(self) -> str:
        return f"usage {self.allocation_id} {self.start:%Y-%m-%d %H:%M:%S}..{self.end:%H:%M:%S}"


class StorageUsageRecord(TenantOwnedModel):
    """One piece of a volume's life, inside one billing period and one price version: its size
    times its seconds, in GiB-seconds. Unique on (volume, period, version, start), like
    :class:`UsageRecord`: rebuilding makes the same rows, so reruns never bill twice."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+", db_index=False)
    volume = models.ForeignKey(
        "scheduling.Volume", on_delete=models.PROTECT, related_name="+", db_index=False
    )
    region = models.ForeignKey("nodes.Region", on_delete=models.PROTECT, related_name="+", db_index=False)
    period_start = models.DateField(help_text="First day (UTC) of the billing month.")
    version = models.ForeignKey(RateCardVersion, on_delete=models.PROTECT, related_name="+", db_index=False)
    start = models.DateTimeField()
    end = models.DateTimeField()
    size_gib = models.PositiveIntegerField()
    gib_seconds = models.DecimalField(max_digits=24, decimal_places=6)
    unit_price = _unit_price(help_text="Per GiB-hour, after the tenant's discount.")
    amount = models.DecimalField(max_digits=AMOUNT_MAX_DIGITS, decimal_places=AMOUNT_PLACES)
    invoice = models.ForeignKey(
        "metering.Invoice", null=True, blank=True, on_delete=models.SET_NULL, related_name="storage_records"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["start", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["volume", "period_start", "version", "start"], name="storageusage_unique_segment"
            ),
            models.CheckConstraint(condition=Q(end__gt=F("start")), name="storageusage_end_after_start"),
            models.CheckConstraint(condition=Q(amount__gte=0), name="storageusage_amount_nonneg"),
        ]
        indexes = [models.Index(fields=["tenant", "period_start", "id"], name="storageusage_tenant_period")]

    def __str__(self) -> str:
        return f"storage {self.volume_id} {self.start:%Y-%m-%d %H:%M}..{self.end:%H:%M}"


class InvoiceStatus(models.TextChoices):
    DRAFT = "draft", "Draft"
    FINALIZED = "finalized", "Finalized"
    PAID = "paid", "Paid"
    VOID = "void", "Void"


class Invoice(TenantOwnedModel):
    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="invoices")
    period_start = models.DateField(help_text="First day (UTC) of the month; the period is the month.")
    period_end = models.DateField(help_text="First day of the next month (exclusive).")
    currency = models.CharField(max_length=3, default="USD")
    status = models.CharField(max_length=16, choices=InvoiceStatus.choices, default=InvoiceStatus.DRAFT)
    subtotal = _money(default=0)
    credits = _money(default=0)
    tax_rate_percent = _percent()
    tax = _money(default=0)
    total = _money(default=0)
    grace_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    built_at = models.DateTimeField(null=True, blank=True)
    finalized_at = models.DateTimeField(null=True, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    voided_at = models.DateTimeField(null=True, blank=True)
    external_id = models.CharField(max_length=64, blank=True, help_text="The payment provider's id.")
    due_at = models.DateTimeField(null=True, blank=True, help_text="Set at finalization: payment terms.")
    payment_provider = models.CharField(max_length=16, blank=True)
    payment_attempt = models.PositiveIntegerField(
        default=0, help_text="Submissions to the provider; part of every idempotency key."
    )
    uncollectible_at = models.DateTimeField(
        null=True, blank=True, help_text="When the provider gave up collecting it; it is still owed."
    )
    dispute_status = models.CharField(
        max_length=32, blank=True, help_text="The provider's dispute of its payment, as last seen."
    )
    disputed_at = models.DateTimeField(
        null=True, blank=True, help_text="Set while a dispute is open: dunning leaves the invoice alone."
    )

    class Meta:
        ordering = ["-period_start", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "period_start"], name="invoice_unique_tenant_period"),
            models.CheckConstraint(
                condition=Q(period_end__gt=F("period_start")), name="invoice_period_positive"
            ),
        ]

    def __str__(self) -> str:
        return f"invoice {self.tenant_id} {self.period_start:%Y-%m}"

    @property
    def is_draft(self) -> bool:
        return self.status == InvoiceStatus.DRAFT


class LineKind(models.TextChoices):
    RESERVED_FEE = "reserved_fee", "Reserved instances"
    CANCEL_FEE = "cancel_fee", "Reservation cancellation fees"
    ON_DEMAND = "on_demand", "On-demand usage"
    SPOT = "spot", "Spot usage"
    RESERVED_OVERAGE = "reserved_overage", "Usage above reserved capacity"
    GPU_MEMORY = "gpu_memory", "GPU memory"
    STORAGE = "storage", "Volume storage"
    ADJUSTMENT = "adjustment", "Adjustment"
    CREDIT = "credit", "Credits applied"
    TAX = "tax", "Tax"


# The order lines appear in (and are numbered by).
LINE_ORDER = [k.value for k in LineKind]


class InvoiceLine(TenantOwnedModel):
    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    position = models.PositiveIntegerField()
    kind = models.CharField(max_length=24, choices=LineKind.choices)
    description = models.CharField(max_length=255)
    gpu_model = models.ForeignKey(
        "nodes.GpuModel", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    plan = models.CharField(max_length=16, blank=True)
    original_period = models.DateField(
        null=True, blank=True, help_text="Adjustments: the period billed late."
    )
    quantity = models.DecimalField(max_digits=24, decimal_places=9, default=0)
    unit = models.CharField(max_length=16, blank=True)
    unit_price = models.DecimalField(
        max_digits=UNIT_PRICE_MAX_DIGITS, decimal_places=UNIT_PRICE_PLACES, null=True, blank=True
    )
    amount = _money()

    class Meta:
        ordering = ["invoice_id", "position"]
        constraints = [
            models.UniqueConstraint(fields=["invoice", "position"], name="invoiceline_unique_position"),
        ]

    def __str__(self) -> str:
        return f"{self.description}: {self.amount}"


class CreditKind(models.TextChoices):
    PROMOTIONAL = "promotional", "Promotional"
    PREPAID = "prepaid", "Prepaid"


# Credits are applied in this order: promotional first (they cannot be refunded), then prepaid.
CREDIT_ORDER = [CreditKind.PROMOTIONAL, CreditKind.PREPAID]


class CreditEntry(TenantOwnedModel):
    """Append-only ledger: a grant is positive, an application to an invoice negative. The balance of
    a kind is the sum of its entries. Rows are never updated or deleted."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=16, choices=CreditKind.choices)
    amount = _money()
    currency = models.CharField(max_length=3, default="USD")
    invoice = models.ForeignKey(Invoice, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    note = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["invoice", "kind"], condition=Q(invoice__isnull=False), name="credit_once_per_invoice"
            ),
            models.CheckConstraint(
                condition=Q(invoice__isnull=True, amount__gt=0) | Q(invoice__isnull=False, amount__lt=0),
                name="credit_grant_positive_use_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.amount}"


class CreditNote(TenantOwnedModel):
    """A correction to a finalized invoice: the amount given back, with the reason."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    invoice = models.ForeignKey(Invoice, on_delete=models.PROTECT, related_name="credit_notes")
    amount = _money()
    reason = models.CharField(max_length=255)
    refund_of = models.CharField(
        max_length=64,
        blank=True,
        help_text="The provider's charge whose refund this records (the money went back to the card).",
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [models.CheckConstraint(condition=Q(amount__gt=0), name="creditnote_amount_positive")]

    def __str__(self) -> str:
        return f"credit note {self.amount} on invoice {self.invoice_id}"


def default_alert_thresholds() -> list[int]:
    return [50, 80, 100]


class BudgetLimitAction(models.TextChoices):
    ALERT = "alert", "Alert only"
    REFUSE = "refuse", "Refuse new work past the limit"
    STOP = "stop", "Refuse new work and stop running on-demand and spot work (with notice)"


class Budget(TenantOwnedModel):
    """A tenant's monthly budget. What its limit does is ``limit_action``: alert only, refuse new
    workloads that would pass it, or also stop running on-demand and spot work once it is passed
    (after ``METERING_BUDGET_STOP_NOTICE_S`` of notice). An alert fires once per month at each of
    ``alert_thresholds`` (percent of ``monthly_limit``)."""

    tenant = models.OneToOneField("portal.Tenant", on_delete=models.CASCADE, related_name="budget")
    monthly_limit = _money(validators=[MinValueValidator(0)])
    limit_action = models.CharField(
        max_length=8, choices=BudgetLimitAction.choices, default=BudgetLimitAction.ALERT
    )
    stop_notice_at = models.DateTimeField(
        null=True, blank=True, help_text="When the notice that running work stops was sent (stop budgets)."
    )
    alert_thresholds = models.JSONField(
        default=default_alert_thresholds, blank=True, help_text="Percent, e.g. [50, 80, 100]."
    )

    class Meta:
        ordering = ["tenant_id"]
        constraints = [models.CheckConstraint(condition=Q(monthly_limit__gte=0), name="budget_limit_nonneg")]

    def __str__(self) -> str:
        return f"budget {self.monthly_limit} of tenant {self.tenant_id}"

    @property
    def hard_limit(self) -> bool:
        """The limit refuses new work (``refuse`` or ``stop``)."""
        return self.limit_action != BudgetLimitAction.ALERT


class CostToDate(TenantOwnedModel):
    """A tenant's cost of the current month so far, kept by beat every minute
    (``services.budgets.costs_to_date_update``): recorded usage plus what running allocations have
    accrued since their last record. Unrounded; shown rounded."""

    tenant = models.OneToOneField("portal.Tenant", on_delete=models.CASCADE, related_name="cost_to_date")
    period_start = models.DateField(help_text="The month the amount is for.")
    amount = models.DecimalField(max_digits=AMOUNT_MAX_DIGITS, decimal_places=AMOUNT_PLACES, default=0)
    currency = models.CharField(max_length=3, default="USD")
    as_of = models.DateTimeField()

    class Meta:
        ordering = ["tenant_id"]

    def __str__(self) -> str:
        return f"cost to date {self.amount} of tenant {self.tenant_id} ({self.period_start:%Y-%m})"


class BudgetAlert(TenantOwnedModel):
    """A budget threshold passed: at most one per (tenant, month, threshold), so the alert is sent
    once however often the cost is recomputed."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    period_start = models.DateField()
    threshold = models.PositiveSmallIntegerField(help_text="Percent of the monthly limit.")
    amount = _money(help_text="Cost to date when it fired.")
    monthly_limit = _money()
    currency = models.CharField(max_length=3, default="USD")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-period_start", "threshold"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "period_start", "threshold"], name="budgetalert_once_per_month"
            )
        ]

    def __str__(self) -> str:
        return f"budget alert {self.threshold}% of tenant {self.tenant_id} ({self.period_start:%Y-%m})"


class PlatformCost(models.Model):
    """GPU time the platform pays for itself, never billed to a tenant: a warm-pool slot's time from
    its creation until a request bound it (or it was released), one row per slot and month, valued
    at the default rate card's on-demand price (the revenue the GPU could have earned)."""

    class Kind(models.TextChoices):
        WARM_POOL = "warm_pool", "Warm pool"

    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.WARM_POOL)
    slot = models.ForeignKey("scheduling.WarmSlot", null=True, on_delete=models.SET_NULL, related_name="+")
    gpu_model = models.ForeignKey("nodes.GpuModel", on_delete=models.PROTECT, related_name="+")
    region = models.ForeignKey("nodes.Region", on_delete=models.PROTECT, related_name="+")
    period_start = models.DateField()
    start = models.DateTimeField()
    end = models.DateTimeField()
    gpu_seconds = models.DecimalField(max_digits=24, decimal_places=9)
    unit_price = _unit_price(null=True, blank=True, help_text="On-demand per GPU-hour; empty: no price.")
    amount = models.DecimalField(max_digits=AMOUNT_MAX_DIGITS, decimal_places=AMOUNT_PLACES, default=0)
    bound_to = models.ForeignKey(
        "scheduling.Workload", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["start", "id"]
        constraints = [
            models.UniqueConstraint(fields=["slot", "period_start"], name="platformcost_once_per_slot_month"),
            models.CheckConstraint(condition=Q(end__gt=F("start")), name="platformcost_end_after_start"),
        ]

    def __str__(self) -> str:
        return f"platform cost {self.kind} {self.start:%Y-%m-%d %H:%M}..{self.end:%H:%M}: {self.amount}"


class SpotPrice(models.Model):
    """The spot price of one GPU-hour of a model in a region from ``at`` until the next row: its
    history. How it is set: ``metering.services.spot``."""

    gpu_model = models.ForeignKey("nodes.GpuModel", on_delete=models.PROTECT, related_name="+")
    region = models.ForeignKey("nodes.Region", on_delete=models.PROTECT, related_name="+")
    at = models.DateTimeField()
    price = _unit_price()
    floor = _unit_price()
    on_demand = _unit_price()
    utilisation = models.DecimalField(max_digits=6, decimal_places=5)

    class Meta:
        ordering = ["gpu_model_id", "region_id", "at"]
        constraints = [
            models.UniqueConstraint(fields=["gpu_model", "region", "at"], name="spotprice_unique_at"),
            models.CheckConstraint(
                condition=Q(price__gte=F("floor"), price__lte=F("on_demand")), name="spotprice_within_bounds"
            ),
        ]

    def __str__(self) -> str:
        return f"spot {self.gpu_model_id}/{self.region_id} {self.price} at {self.at:%Y-%m-%d %H:%M}"


class StripeEventResult(models.TextChoices):
    OK = "ok", "Processed"
    IGNORED = "ignored", "Not a kind of event gpupool acts on"
    UNMATCHED = "unmatched", "About an object gpupool does not know: kept, staff alerted"
    HELD = "held", "Did not match our invoice (amount, currency or customer): kept, staff alerted"


class StripeEvent(models.Model):
    """A Stripe webhook event processed once: the unique ``event_id`` makes a redelivery a no-op.
    The row is written in the same transaction as the event's effects, so an event whose
    processing failed leaves no row and is processed when Stripe delivers it again."""

    event_id = models.CharField(max_length=255, unique=True)
    type = models.CharField(max_length=100)
    created = models.DateTimeField(help_text="When Stripe created the event.")
    received_at = models.DateTimeField(default=timezone.now)
    livemode = models.BooleanField(default=False)
    result = models.CharField(max_length=16, choices=StripeEventResult.choices)
    invoice = models.ForeignKey(Invoice, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    payload = models.JSONField(default=dict, blank=True, help_text="The event as delivered.")

    class Meta:
        ordering = ["-received_at", "-id"]

    def __str__(self) -> str:
        return f"{self.type} {self.event_id}"


class BillingAlert(models.Model):
    """Something about money that staff must look at: an invoice that could not be sent to the
    payment provider, a provider event gpupool could not match, a dispute. At most one is open per
    kind and subject; a repeat updates the open one (``metering.services.alerts``)."""

    class Kind(models.TextChoices):
        SUBMISSION_FAILED = "submission_failed", "A finalized invoice could not be sent to the provider"
        UNMATCHED_EVENT = "unmatched_event", "A provider event about an object gpupool does not know"
        PAYMENT_MISMATCH = "payment_mismatch", "A payment that does not match its invoice"
        DISPUTE = "dispute", "A payment was disputed"
        PROVIDER_STATE = "provider_state", "The provider's invoice disagrees with ours"

    kind = models.CharField(max_length=32, choices=Kind.choices)
    subject = models.CharField(max_length=255, blank=True)
    message = models.TextField()
    invoice = models.ForeignKey(Invoice, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    data = models.JSONField(default=dict, blank=True)
    count = models.PositiveIntegerField(default=1)
    opened_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    resolved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-opened_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "subject"],
                condition=Q(resolved_at__isnull=True),
                name="billingalert_one_open_per_subject",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.subject}"
