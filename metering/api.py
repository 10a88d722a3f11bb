"""``/api/v1/usage/``, ``/api/v1/invoices/`` (list, detail, CSV, PDF) and ``/api/v1/cost-estimate/``."""

from __future__ import annotations

import functools
from decimal import Decimal

import orjson
from django.db import connections, models
from django.db.models import Func, QuerySet
from django.db.models.functions import Cast
from django.http import HttpResponse
from django.urls import path
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from metering.documents import invoice_filename, invoice_pdf
from metering.models import BudgetLimitAction, Invoice, InvoiceLine, UsageRecord
from metering.money import quantize_money
from metering.selectors.shared import hourly_estimate, invoice_csv
from metering.services.budgets import budget_set, budget_status
from metering.services.rates import rate_card_for_tenant
from nodes.models import GpuModel, Region
from portal.actors import actor_from_request
from portal.api.context import request_context
from portal.api.filters import BoundedDateFilter, TenantFilterSet
from portal.api.pagination import CursorPagination
from portal.api.routers import extra_urlpatterns, router
from portal.api.viewsets import TenantReadOnlyViewSet
from portal.errors import ValidationFailed
from portal.models import Scope
from scheduling.models import MILLI
from scheduling.selectors.versions import regions_meeting_versions
from scheduling.services.placement import placement_explain
from scheduling.services.versions import (
    MIN_VERSION_FIELDS,
    min_driver_check,
    min_versions_validate,
    min_versions_vendor_ok,
)


class UsageRecordSerializer(serializers.ModelSerializer):
    gpu_model = serializers.SlugRelatedField(read_only=True, slug_field="name")
    region = serializers.SlugRelatedField(read_only=True, slug_field="code")

    class Meta:
        model = UsageRecord
        fields = [
            "id",
            "workload",
            "allocation",
            "gpu_model",
            "region",
            "plan",
            "period_start",
            "start",
            "end",
            "fraction_milli",
            "seconds",
            "minimum_topup_s",
            "gpu_seconds",
            "vcpu_seconds",
            "ram_gib_seconds",
            "gpu_memory_gib_seconds",
            "gpu_memory_amount",
            "unit_price",
            "amount",
            "avg_util_pct",
            "avg_mem_used_mib",
            "invoice",
        ]
        read_only_fields = fields


class UsageFilter(TenantFilterSet):
    period = BoundedDateFilter(
        field_name="period_start", help_text="First day of the month, e.g. 2024-03-01."
    )

    class Meta:
        model = UsageRecord
        fields = ["period", "workload", "plan", "invoice"]


class UsagePagination(CursorPagination):
    """A month of one tenant's usage fits in one page: ``page_size`` up to 10,000. The list pages
    ``values_list(named=True)`` rows: DRF reads the cursor's position as the row's ``id`` attribute."""

    max_page_size = 10_000


class _IsoUtc(Func):
    """A timestamp as DRF renders it: ISO 8601 in UTC, ``Z``, microseconds only when there are some."""

    output_field = models.TextField()
    template = (
        "(to_char(%(expressions)s AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS') || CASE WHEN "
        "mod(date_part('microseconds', %(expressions)s)::bigint, 1000000) <> 0 "
        "THEN to_char(%(expressions)s AT TIME ZONE 'UTC', '.US') ELSE '' END || 'Z')"
    )


# The list's columns as the serializer names them, with the values_list() path of each.
_USAGE_KEYS = list(UsageRecordSerializer.Meta.fields)
_USAGE_PATHS = {"gpu_model": "gpu_model__name", "region": "region__code"}
_USAGE_DECIMALS = {
    f.name: f.decimal_places
    for f in UsageRecord._meta.concrete_fields
    if isinstance(f, models.DecimalField) and f.name in _USAGE_KEYS
}


def _usage_values(queryset):
    """The records as named ``values_list`` rows in ``_USAGE_KEYS`` order, as the serializer renders
    them (named, so that the cursor paginator finds each row's ``id``). On PostgreSQL decimals,
    dates and timestamps come as text from SQL (the column's places; ISO 8601), which spares parsing
    10,000 rows of them; elsewhere ``_usage_rows`` formats them."""
    if connections[queryset.db].vendor != "postgresql":
        return queryset.values_list(*(_USAGE_PATHS.get(k, k) for k in _USAGE_KEYS), named=True), False
    # Not "_txt_": a named row's field names cannot start with an underscore.
    texts = {f"txt_{k}": Cast(k, models.TextField()) for k in [*_USAGE_DECIMALS, "period_start"]}
    texts |= {f"txt_{k}": _IsoUtc(k) for k in ("start", "end")}
    paths = [f"txt_{k}" if f"txt_{k}" in texts else _USAGE_PATHS.get(k, k) for k in _USAGE_KEYS]
    return queryset.annotate(**texts).values_list(*paths, named=True), True


@functools.cache
def _usage_base() -> tuple[QuerySet, bool]:
    """``_usage_values`` of every record: the base each list request narrows (tenant, filters,
    cursor) with a clone, so the annotations and names are resolved once per process."""
    return _usage_values(UsageRecord.objects.all())


def _usage_rows(page: list[tuple], as_text: bool) -> list[dict]:
    rows = [dict(zip(_USAGE_KEYS, values, strict=True)) for values in page]
    if not as_text:
        for row in rows:
            for k, places in _USAGE_DECIMALS.items():
                row[k] = f"{row[k].quantize(Decimal(1).scaleb(-places)):f}"
    return rows


class UsageViewSet(TenantReadOnlyViewSet):
    """Usage records: one per allocation, month and price version. Newest first, cursor-paginated;
    ``page_size`` up to 10,000 gives a month of a busy tenant in one call."""

    queryset = UsageRecord.objects.select_related("gpu_model", "region")
    serializer_class = UsageRecordSerializer
    filterset_class = UsageFilter
    pagination_class = UsagePagination
    read_scope = Scope.BILLING

    def list(self, request, *args, **kwargs):
        # The serializer's output from one values() query, rendered by orjson: 10,000 records in a
        # fraction of what model instances and the serializer take.
        base, as_text = _usage_base()
        values = self.filter_queryset(self.scoped(base))
        rows = _usage_rows(self.paginate_queryset(values), as_text)
        body = {"next": self.paginator.get_next_link(), "previous": self.paginator.get_previous_link()}
        body["results"] = rows
        return HttpResponse(orjson.dumps(body, option=orjson.OPT_UTC_Z), content_type="application/json")


class InvoiceLineSerializer(serializers.ModelSerializer):
    gpu_model = serializers.SlugRelatedField(read_only=True, slug_field="name")

    class Meta:
        model = InvoiceLine
        fields = [
            "position",
            "kind",
            "description",
            "gpu_model",
            "plan",
            "original_period",
            "quantity",
            "unit",
            "unit_price",
            "amount",
        ]
        read_only_fields = fields


class InvoiceSerializer(serializers.ModelSerializer):
    lines = InvoiceLineSerializer(many=True, read_only=True)

    class Meta:
        model = Invoice
        fields = [
            "id",
            "period_start",
            "period_end",
            "currency",
            "status",
            "subtotal",
            "credits",
            "tax_rate_percent",
            "tax",
            "total",
            "grace_until",
            "finalized_at",
            "paid_at",
            "voided_at",
            "lines",
        ]
        read_only_fields = fields


class InvoiceViewSet(TenantReadOnlyViewSet):
    queryset = Invoice.objects.prefetch_related("lines__gpu_model")
    serializer_class = InvoiceSerializer
    filterset_fields = ["status", "period_start"]
    read_scope = Scope.BILLING

    @extend_schema(responses={(200, "text/csv"): OpenApiResponse(description="The invoice's lines as CSV.")})
    @action(detail=True, methods=["get"])
    def csv(self, request, pk=None):
        invoice = self.get_object()
        response = HttpResponse(invoice_csv(invoice=invoice), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="{invoice_filename(invoice, "csv")}"'
        return response

    @extend_schema(
        responses={(200, "application/pdf"): OpenApiResponse(description="The invoice as a PDF document.")}
    )
    @action(detail=True, methods=["get"])
    def pdf(self, request, pk=None):
        invoice = self.get_object()
        response = HttpResponse(invoice_pdf(invoice), content_type="application/pdf")
        response["Content-Disposition"] = f'attachment; filename="{invoice_filename(invoice, "pdf")}"'
        return response


class CostEstimateInput(serializers.Serializer):
    gpu_model = serializers.CharField(
        max_length=80, required=False, help_text="A model's name or short name (or gpu_models)."
    )
    gpu_models = serializers.ListField(
        child=serializers.CharField(max_length=80),
        required=False,
        min_length=1,
        max_length=32,
        help_text="Several acceptable models: the placement section says which one it would choose.",
    )
    preference = serializers.ChoiceField(
        choices=[("fastest", "fastest"), ("cheapest", "cheapest")],
        required=False,
        help_text="With several models: rank by compute weight, or by compute weight per price.",
    )
    gpu_count = serializers.IntegerField(min_value=1, max_value=1024, default=1)
    gpu_fraction_milli = serializers.IntegerField(min_value=1, max_value=MILLI, default=MILLI)
    # The bounds of a submission (scheduling.services.submission): no larger figure can be priced.
    cpu_millicores = serializers.IntegerField(min_value=0, max_value=10_000_000, default=0)
    ram_mib = serializers.IntegerField(min_value=0, max_value=1 << 40, default=0)
    region = serializers.CharField(
        max_length=32,
        required=False,
        help_text="A region's code: its own price. Without one, the dearest region that has the model.",
    )

    min_driver = serializers.CharField(
        max_length=32,
        required=False,
        allow_blank=True,
        help_text="Price only nodes with at least this driver.",
    )
    min_cuda = serializers.CharField(
        max_length=32, required=False, allow_blank=True, help_text="Price only nodes with at least this CUDA."
    )
    min_rocm = serializers.CharField(
        max_length=32, required=False, allow_blank=True, help_text="Price only nodes with at least this ROCm."
    )

    def validate_region(self, value):
        region = Region.objects.filter(code=value).first()
        if region is None:
            raise serializers.ValidationError(f"Unknown region {value!r}.")
        return region

    def validate_gpu_model(self, value):
        model = (
            GpuModel.objects.filter(name=value).first() or GpuModel.objects.filter(short_name=value).first()
        )
        if model is None:
            raise serializers.ValidationError(f"Unknown GPU model {value!r}.")
        return model

    def validate_gpu_models(self, value):
        return list({self.validate_gpu_model(v).pk: self.validate_gpu_model(v) for v in value}.values())

    def validate(self, attrs):
        if ("gpu_model" in attrs) == ("gpu_models" in attrs):
            raise serializers.ValidationError({"gpu_model": ["Give gpu_model or gpu_models (one of them)."]})
        attrs["models"] = attrs.pop("gpu_models", None) or [attrs.pop("gpu_model")]
        if attrs.get("preference") and len(attrs["models"]) < 2:
            raise serializers.ValidationError({"preference": ["Only with several gpu_models."]})
        if attrs["gpu_fraction_milli"] != MILLI and attrs["gpu_count"] != 1:
            raise serializers.ValidationError(
                {"gpu_fraction_milli": ["A fraction of a GPU needs gpu_count 1."]}
            )
        # The submission's rules, the same messages (scheduling.services.versions): min_cuda keeps
        # the NVIDIA models, min_rocm the AMD ones; none left is a 400 naming the field.
        values = min_versions_validate(attrs)
        for key in ("min_cuda", "min_rocm"):
            if not values[key]:
                continue
            kept = [m for m in attrs["models"] if min_versions_vendor_ok(m.vendor, {key: values[key]})]
            if not kept:
                names = ", ".join(m.name for m in attrs["models"])
                stack = "CUDA" if key == "min_cuda" else "ROCm"
                message = (
                    f"{names} has no {stack}."
                    if len(attrs["models"]) == 1
                    else f"None of {names} has {stack}."
                )
                raise serializers.ValidationError({key: [message]})
            attrs["models"] = kept
        min_driver_check(values, {m.vendor for m in attrs["models"]})
        attrs.update(values)
        return attrs


class PlacementCandidateSerializer(serializers.Serializer):
    gpu_model = serializers.CharField()
    compute_weight = serializers.DecimalField(max_digits=6, decimal_places=2)
    price_per_gpu_hour = serializers.DecimalField(max_digits=22, decimal_places=10, allow_null=True)
    score = serializers.FloatField()


class PlacementChoiceSerializer(serializers.Serializer):
    preference = serializers.CharField(allow_null=True)
    gpu_model = serializers.CharField()
    region = serializers.CharField(allow_null=True)
    reason = serializers.CharField()
    candidates = PlacementCandidateSerializer(many=True)


class CostEstimateOutput(serializers.Serializer):
    currency = serializers.CharField()
    per_hour = serializers.DictField(child=serializers.CharField(allow_null=True))
    placement = PlacementChoiceSerializer(
        help_text="The model (and region) the scheduler would choose, with the ranked candidates; "
        "per_hour prices that model when a preference is given, else the dearest candidate."
    )


class CostEstimateView(APIView):
    """Price one hour of a workload spec for each plan (after the tenant's discount)."""

    # A POST that writes nothing: pricing a spec is reading, open to read-only tokens and viewers.
    write_scope = Scope.READ

    @extend_schema(request=CostEstimateInput, responses=CostEstimateOutput)
    def post(self, request):
        tenant = request_context(request).tenant
        data = CostEstimateInput(data=request.data)
        data.is_valid(raise_exception=True)
        spec = data.validated_data
        placement = placement_explain(
            models=spec["models"], region=spec.get("region"), preference=spec.get("preference", "")
        )
        chosen = [m for m in spec["models"] if m.name == placement["gpu_model"]]
        models = chosen if spec.get("preference") else spec["models"]
        regions = [spec["region"]] if spec.get("region") is not None else None
        wanted = {k: spec[k] for k in MIN_VERSION_FIELDS if spec[k]}
        if wanted:
            # Priced only where a node meets the minimums: where the scheduler could place it.
            meeting = {r for m in models for r in regions_meeting_versions(gpu_model=m, values=wanted)}
            if regions is not None:
                meeting &= set(regions)
            if not meeting:
                field = next(iter(wanted))
                where = f" in {spec['region'].code}" if spec.get("region") is not None else ""
                needs = ", ".join(f"{k} {v}" for k, v in wanted.items())
                message = f"No node with {' or '.join(m.name for m in models)}{where} meets {needs}."
                raise ValidationFailed(f"{field}: {message}", fields={field: [message]})
            regions = sorted(meeting, key=lambda r: r.code)
        per_hour = hourly_estimate(
            tenant=tenant,
            gpu_models=models,
            gpu_count=spec["gpu_count"],
            fraction_milli=spec["gpu_fraction_milli"],
            cpu_millicores=spec["cpu_millicores"],
            ram_mib=spec["ram_mib"],
            regions=regions,
        )
        card = rate_card_for_tenant(tenant=tenant)
        currency = card.currency if card is not None else tenant.currency
        return Response(
            {
                "currency": currency,
                "per_hour": {
                    plan: None if v is None else str(quantize_money(v, currency))
                    for plan, v in per_hour.items()
                },
                "placement": placement,
            }
        )


class BudgetInput(serializers.Serializer):
    monthly_limit = serializers.DecimalField(
        max_digits=18, decimal_places=3, min_value=Decimal(0), help_text="In the tenant's currency."
    )
    limit_action = serializers.ChoiceField(
        choices=BudgetLimitAction.choices,
        required=False,
        help_text="What the limit does: alert (only), refuse (new workloads that would pass it), stop (also "
        "stop running on-demand and spot work once it is passed, after notice). Default: refuse with "
        "hard_limit, otherwise alert.",
    )
    hard_limit = serializers.BooleanField(
        required=False,
        help_text="Older form of limit_action: true is refuse (when limit_action is not given).",
    )
    alert_thresholds = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=1000),
        required=False,
        max_length=20,
        help_text="Percent of the budget at which an alert is sent, once a month each (default 50, 80, 100).",
    )


class BudgetOutput(serializers.Serializer):
    period_start = serializers.DateField()
    amount = serializers.CharField(help_text="Cost of the month so far, rounded to the currency.")
    currency = serializers.CharField()
    as_of = serializers.DateTimeField(allow_null=True, help_text="When the cost was computed (every minute).")
    monthly_limit = serializers.CharField(allow_null=True)
    percent = serializers.CharField(allow_null=True, help_text="Cost so far as a percent of the budget.")
    hard_limit = serializers.BooleanField(help_text="The limit refuses new work (refuse or stop).")
    limit_action = serializers.CharField(allow_null=True)
    alert_thresholds = serializers.ListField(child=serializers.IntegerField())
    alerts_fired = serializers.ListField(child=serializers.IntegerField(), help_text="This month.")


def _budget_body(status) -> dict:
    cur = status.currency
    return {
        "period_start": status.period_start,
        "amount": str(quantize_money(status.amount, cur)),
        "currency": cur,
        "as_of": status.as_of,
        "monthly_limit": None
        if status.monthly_limit is None
        else str(quantize_money(status.monthly_limit, cur)),
        "percent": None if status.percent is None else str(status.percent),
        "hard_limit": status.hard_limit,
        "limit_action": status.limit_action,
        "alert_thresholds": status.alert_thresholds,
        "alerts_fired": status.alerts_fired,
    }


class BudgetView(APIView):
    """The month's cost to date (kept every minute) against the tenant's budget; PUT sets the budget."""

    read_scope = Scope.BILLING
    write_scope = Scope.BILLING

    @extend_schema(responses=BudgetOutput)
    def get(self, request):
        status = budget_status(tenant=request_context(request).tenant)
        return Response(BudgetOutput(_budget_body(status)).data)

    @extend_schema(request=BudgetInput, responses=BudgetOutput)
    def put(self, request):
        ctx = request_context(request)
        data = BudgetInput(data=request.data)
        data.is_valid(raise_exception=True)
        budget_set(tenant=ctx.tenant, actor=actor_from_request(request), **data.validated_data)
        return Response(BudgetOutput(_budget_body(budget_status(tenant=ctx.tenant))).data)


router.register("usage", UsageViewSet, basename="usage")
router.register("invoices", InvoiceViewSet, basename="invoice")

extra_urlpatterns.append(path("cost-estimate/", CostEstimateView.as_view(), name="cost-estimate"))
extra_urlpatterns.append(path("budget/", BudgetView.as_view(), name="budget"))
