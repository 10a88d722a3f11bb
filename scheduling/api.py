"""``/api/v1/instances/``, ``/jobs/``, ``/gpu-types/``, ``/reservations/``, ``/quotas/``.

Registered on portal's shared router (portal autodiscovers this module). Views parse input and
call one service; the rules live in ``scheduling.services``.
"""

from __future__ import annotations

import functools
import logging
import time
from datetime import timedelta
from decimal import Decimal

import django_filters
from django.conf import settings
from django.core.cache import cache
from django.db import models
from django.db.models import QuerySet
from django.urls import path
from django.utils import timezone
from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from nodes.models import GpuModel
from portal.api.context import request_context
from portal.api.filters import TenantFilterSet, UTCDateTimeFilter
from portal.api.parsers import YAMLParser
from portal.api.routers import extra_urlpatterns, router
from portal.api.serializers import BoundedDateTimeField, FieldsOnceModelSerializer
from portal.api.viewsets import TenantReadOnlyViewSet
from portal.errors import NotFound, ValidationFailed
from portal.models import Scope
from scheduling import api_work  # noqa: F401  (registers /api/v1/work/)
from scheduling.api_access import AccessSerializer, SshKeyViewSet
from scheduling.api_fields import EnvValueField
from scheduling.api_render import LIST_VALUES, access_json, workload_json, workload_row
from scheduling.k8s_manifest import is_manifest, manifest_error, manifest_translate
from scheduling.models import (
    DependencyCondition,
    GpuVendor,
    LogStream,
    Plan,
    PriorityClass,
    Reservation,
    Workload,
    WorkloadKind,
    WorkloadState,
)
from scheduling.pricing import gpu_price_table, price_key
from scheduling.selectors.access import SHARE_PARAM, proxy_url, workload_access, workload_ports
from scheduling.selectors.arrays import array_summary, array_tasks, workload_dependencies
from scheduling.selectors.shared import (
    gpu_availability,
    quota_for_tenant,
    quota_usage,
    workload_events,
    workload_gpu_model_names,
    workload_log_lines,
    workload_placement,
    workload_volumes,
)
from scheduling.selectors.workload_metrics import workload_gpu_metrics, workload_held, workload_last_placement
from scheduling.services.access import share_link_create, share_link_revoke
from scheduling.services.elastic import workload_resize
from scheduling.services.lifecycle import workload_stop
from scheduling.services.reservations import reservation_cancel, reservation_request
from scheduling.services.submission import workload_submit

logger = logging.getLogger(__name__)
LOG_TAIL_MAX = 10_000

# A workload's metrics: the longest window one request may ask for, and the window by default.
METRICS_MAX_WINDOW = timedelta(days=1)
METRICS_DEFAULT_WINDOW = timedelta(hours=1)

# --- serializers -----------------------------------------------------------------------------------


class ElasticStateSerializer(serializers.Serializer):
    min_gpus = serializers.IntegerField()
    max_gpus = serializers.IntegerField()
    target_gpus = serializers.IntegerField()
    on_resize = serializers.ChoiceField(choices=[("signal", "signal"), ("restart", "restart")])


class ResizeSerializer(serializers.Serializer):
    gpu_count = serializers.IntegerField(help_text="The GPUs the elastic job should hold, within its bounds.")


# A workload as the list and the detail give it. The fields describe it (the schema);
# ``to_representation`` builds a model instance's dict directly, key by key as DRF's field-by-field
# loop would (tests/scheduling/test_api_rendering.py compares the two), without copying the fields
# for every request or resolving each field's source. (A comment: a docstring would be the schema's
# description.)
class WorkloadSerializer(FieldsOnceModelSerializer):
    gpu_models = serializers.SerializerMethodField()
    # A read-only model field loses its blank and null in DRF's schema: they are declared here, as
    # the model has them (no vendor or priority class asked for; no region).
    gpu_vendor = serializers.ChoiceField(choices=GpuVendor.choices, allow_blank=True, read_only=True)
    priority_class = serializers.ChoiceField(choices=PriorityClass.choices, allow_blank=True, read_only=True)
    region = serializers.SlugRelatedField(read_only=True, slug_field="code", allow_null=True)
    pending = serializers.SerializerMethodField()
    elastic = serializers.SerializerMethodField()

    class Meta:
        model = Workload
        fields = [
            "id",
            "kind",
            "name",
            "state",
            "state_reason",
            "pending",
            "gpu_models",
            "min_gpu_memory_gib",
            "min_compute_weight",
            "gpu_vendor",
            "cuda_capability",
            "rocm_target",
            "min_driver",
            "min_cuda",
            "min_rocm",
            "gpu_count",
            "gang",
            "gpus_per_node",
            "split_regions_ok",
            "node_selector",
            "affinity",
            "anti_affinity",
            "spread",
            "preference",
            "gpu_fraction_milli",
            "mig_profile",
            "cpu_millicores",
            "ram_mib",
            "region",
            "other_regions_ok",
            "plan",
            "spot_max_price",
            "reservation",
            "priority_class",
            "image",
            "template",
            "command",
            "env",
            "ports",
            "ssh_public_key",
            "max_runtime_s",
            "estimated_runtime_s",
            "requeue_on_preemption",
            "checkpoint_resume",
            "max_retries",
            "retries",
            "attempt",
            "exit_code",
            "elastic",
            "array_count",
            "array_parallelism",
            "array_parent",
            "array_index",
            "submitted_at",
            "scheduled_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields

    def to_representation(self, instance):
        if isinstance(instance, Workload):
            return workload_json(workload_row(instance), self.get_gpu_models(instance))
        if isinstance(instance, dict) and "gpu_model_names" in instance:  # a page's values() row
            return workload_json(instance, instance["gpu_model_names"])
        return super().to_representation(instance)

    def get_gpu_models(self, w: Workload) -> list[str]:
        """The GPU models the workload may run on, by name."""
        # A page's come with its workloads (_WorkloadViewSet.paginate_queryset); one workload's here.
        names = getattr(w, "gpu_model_names", None)
        if names is None:
            names = workload_gpu_model_names(workload_ids=[w.pk])[w.pk]
        return names

    @extend_schema_field(ElasticStateSerializer(allow_null=True))
    def get_elastic(self, w: Workload) -> dict | None:
        """An elastic job's bounds, the size its tenant asked for and how a resize reaches it; the
        GPUs it holds now are ``gpu_count``."""
        if not w.is_elastic:
            return None
        return {
            "min_gpus": w.elastic_min_gpus,
            "max_gpus": w.elastic_max_gpus,
            "target_gpus": w.elastic_target_gpus,
            "on_resize": w.elastic_on_resize or "signal",
        }

    def get_pending(self, w: Workload) -> dict | None:
        """Why it waits and, where the scheduler can tell, when it is expected to start."""
        if w.state not in (WorkloadState.PENDING, WorkloadState.QUEUED):
            return None
        return {
            "reason": w.pending_reason or "queued",
            "message": w.pending_message,
            "expected_start_at": w.expected_start_at,
        }


class WorkItemsSerializer(serializers.Serializer):
    items = serializers.IntegerField()
    lease_s = serializers.IntegerField()
    pending = serializers.IntegerField()
    leased = serializers.IntegerField()
    done = serializers.IntegerField()


class ArraySummarySerializer(serializers.Serializer):
    count = serializers.IntegerField()
    parallelism = serializers.IntegerField()
    made = serializers.IntegerField(help_text="Tasks made so far (at most parallelism unfinished at once).")
    states = serializers.DictField(child=serializers.IntegerField(), help_text="Tasks by state.")
    work = WorkItemsSerializer(allow_null=True, help_text="Work-queue mode: its items by state.")


class DependencySerializer(serializers.Serializer):
    job = serializers.IntegerField()
    condition = serializers.ChoiceField(choices=DependencyCondition.choices)
    state = serializers.CharField(help_text="That job's state now.")


class WorkloadDetailSerializer(WorkloadSerializer):
    placement = serializers.SerializerMethodField()
    access = serializers.SerializerMethodField()
    volumes = serializers.SerializerMethodField()
    array = serializers.SerializerMethodField()
    depends_on = serializers.SerializerMethodField()

    class Meta(WorkloadSerializer.Meta):
        fields = [*WorkloadSerializer.Meta.fields, "placement", "access", "volumes", "array", "depends_on"]
        read_only_fields = fields

    def to_representation(self, instance):
        if not isinstance(instance, Workload):
            return super().to_representation(instance)
        data = super().to_representation(instance)
        rows = workload_placement(workload=instance)  # once, for placement and access both
        data["placement"] = self.get_placement(instance, rows)
        data["access"] = access_json(self.access_of(instance, rows))
        data["volumes"] = self.get_volumes(instance)
        data["array"] = self.get_array(instance)
        data["depends_on"] = self.get_depends_on(instance)
        return data

    @extend_schema_field(ArraySummarySerializer(allow_null=True))
    def get_array(self, w: Workload) -> dict | None:
        return array_summary(workload=w)

    # A workload just submitted without volumes or dependencies (``submitted_detail``) has none to read.
    @extend_schema_field(DependencySerializer(many=True))
    def get_depends_on(self, w: Workload) -> list[dict]:
        return [] if getattr(w, "no_dependencies", False) else workload_dependencies(workload=w)

    def get_volumes(self, w: Workload) -> list[dict]:
        return [] if getattr(w, "no_volumes", False) else workload_volumes(workload=w)

    def access_of(self, w: Workload, placement: list[dict] | None = None) -> dict:
        return workload_access(workload=w, placement=placement, request=self.context.get("request"))

    @extend_schema_field(AccessSerializer)
    def get_access(self, w: Workload) -> dict:
        return AccessSerializer(self.access_of(w)).data

    def get_placement(self, w: Workload, rows: list[dict] | None = None) -> list[dict]:
        return [
            {
                "node": p["node__hostname"],
                "region": p["node__region__code"],
                "gpu_index": p["gpu__index"],
                "gpu_model": p["gpu_model__name"],
                "fraction_milli": p["fraction_milli"],
            }
            for p in (workload_placement(workload=w) if rows is None else rows)
        ]


class _SpecSerializer(serializers.Serializer):
    """Shape and types only; the service checks the spec against the catalog, fleet and quotas.
    A field this portal does not know is refused, naming it, never silently dropped (a job sent with
    a feature the portal lacks must not run without it)."""

    def validate(self, attrs):
        if isinstance(self.initial_data, dict):
            unknown = sorted(set(self.initial_data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    {name: ["Unknown field: this portal does not support it."] for name in unknown}
                )
        return attrs

    name = serializers.CharField(required=False, allow_blank=True, max_length=100)
    gpu_models = serializers.ListField(
        child=serializers.CharField(max_length=80), required=False, max_length=32
    )
    gpu_model = serializers.CharField(required=False, max_length=80)
    min_gpu_memory_gib = serializers.IntegerField(required=False)
    min_compute_weight = serializers.DecimalField(required=False, max_digits=5, decimal_places=2)
    gpu_vendor = serializers.CharField(required=False, allow_blank=True)
    cuda_capability = serializers.CharField(required=False, allow_blank=True)
    rocm_target = serializers.CharField(required=False, allow_blank=True)
    min_driver = serializers.CharField(
        required=False, allow_blank=True, help_text="Minimum GPU driver version of the node, e.g. 550.54."
    )
    min_cuda = serializers.CharField(
        required=False,
        allow_blank=True,
        help_text="Minimum CUDA version the node's driver supports, e.g. 12.4.",
    )
    min_rocm = serializers.CharField(
        required=False, allow_blank=True, help_text="Minimum ROCm version of the node, e.g. 6.1."
    )
    gpu_count = serializers.IntegerField(required=False)
    gang = serializers.BooleanField(required=False)
    gpus_per_node = serializers.JSONField(required=False)  # checked by the service: sizes or "any"
    split_regions_ok = serializers.BooleanField(required=False)
    gpu_fraction_milli = serializers.IntegerField(required=False)
    mig_profile = serializers.CharField(required=False, allow_blank=True)
    # Placement constraints: the service checks keys, values, sizes and ids (services.placement).
    node_selector = serializers.DictField(
        child=serializers.CharField(allow_blank=True),
        required=False,
        help_text='Node labels it needs, e.g. {"rack": "r12"}: only servers whose agent registered them.',
    )
    affinity = serializers.DictField(
        required=False,
        help_text='{"workloads": [ids of yours], "topology_key": "node" | a label such as "rack"}: '
        "placed in a node or label domain that holds one of them.",
    )
    anti_affinity = serializers.DictField(
        required=False,
        help_text="Like affinity, but kept out of every domain that holds one of them.",
    )
    spread = serializers.DictField(
        required=False,
        help_text='{"topology_key": "rack", "max_skew": 1}: an array\'s tasks or a gang\'s nodes spread '
        "over the label's values, no value more than max_skew members ahead of another.",
    )
    preference = serializers.ChoiceField(
        choices=[("fastest", "fastest"), ("cheapest", "cheapest")],
        required=False,
        allow_blank=True,
        help_text="With several acceptable models: by compute weight, or by compute weight per price.",
    )
    cpu_millicores = serializers.IntegerField(required=False)
    ram_mib = serializers.IntegerField(required=False)
    region = serializers.CharField(required=False, allow_blank=True)
    other_regions_ok = serializers.BooleanField(required=False)
    plan = serializers.ChoiceField(choices=Plan.choices, required=False)
    spot_max_price = serializers.DecimalField(
        required=False, max_digits=22, decimal_places=10, allow_null=True
    )
    reservation = serializers.IntegerField(required=False, allow_null=True)
    priority_class = serializers.ChoiceField(choices=PriorityClass.choices, required=False, allow_blank=True)
    image = serializers.CharField(required=False, allow_blank=True, max_length=255)
    max_runtime_s = serializers.IntegerField(required=False, allow_null=True)
    # Values reach the workload exactly as given; {"secret": "NAME"} puts a secret's value there.
    env = serializers.DictField(child=EnvValueField(), required=False)
    # [{"volume": ID, "mount_path": "/workspace", "shared": false}]; the service checks each item.
    volumes = serializers.ListField(child=serializers.DictField(), required=False, max_length=8)
    # Arguments reach the workload exactly as given: no trimming (the service applies the workload
    # rules, the same for instances and jobs). An instance without one runs its image's default.
    command = serializers.ListField(
        child=serializers.CharField(allow_blank=True, trim_whitespace=False), required=False
    )
    # Jobs only (the service refuses them on an instance, naming the field).
    array = serializers.DictField(
        required=False,
        help_text='{"count": N, "parallelism": P}: N tasks, at most P at once, each told GPUPOOL_ARRAY_INDEX '
        'and GPUPOOL_ARRAY_COUNT. Work-queue mode: {"parallelism": P, "work": {"first": 1, "last": 100, '
        '"chunk": 5, "lease_s": 300}}: P workers pull frame ranges from GPUPOOL_WORK_URL.',
    )
    depends_on = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        max_length=32,
        help_text='[{"job": ID, "condition": "succeeded" | "finished"}]: waits until each has ended so.',
    )


class InstanceCreateSerializer(_SpecSerializer):
    template = serializers.CharField(
        required=False, allow_blank=True, max_length=100, help_text="Fills what the request leaves unset."
    )
    ports = serializers.ListField(
        child=serializers.JSONField(),
        required=False,
        max_length=64,
        help_text='Container ports: a number (HTTP) or {"port": N, "protocol": "http"|"tcp"}. HTTP ports '
        "are reached through the portal's proxy (access.ports[].url), TCP ports on the node.",
    )
    ssh_public_key = serializers.CharField(required=False, allow_blank=True)


class JobCreateSerializer(_SpecSerializer):
    template = serializers.CharField(
        required=False, allow_blank=True, max_length=100, help_text="Fills what the request leaves unset."
    )
    estimated_runtime_s = serializers.IntegerField(required=False, allow_null=True)
    requeue_on_preemption = serializers.BooleanField(required=False)
    checkpoint_resume = serializers.BooleanField(required=False)
    max_retries = serializers.IntegerField(required=False)
    elastic = serializers.DictField(
        required=False,
        help_text='{"min_gpus": 2, "max_gpus": 8, "on_resize": "signal" | "restart"}: the scheduler may grow '
        "the job into idle GPUs of its node and shrinks it toward min_gpus before preempting others; "
        "gpu_count is its starting size (default min_gpus). A resize reaches it as GPUPOOL_RESIZE_FILE "
        "and SIGUSR1, or as a restart from its checkpoint with the new WORLD_SIZE.",
    )


class WorkloadEventSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    from_state = serializers.CharField()
    to_state = serializers.CharField()
    reason = serializers.CharField()
    message = serializers.CharField()


class WorkloadMetricsQuerySerializer(serializers.Serializer):
    """``?since=&until=`` of a workload's metrics: at most ``METRICS_MAX_WINDOW``; by default the last
    hour of its current (or last) placement."""

    since = BoundedDateTimeField(required=False)
    until = BoundedDateTimeField(required=False)

    def validate(self, attrs):
        since, until = attrs.get("since"), attrs.get("until")
        if since is not None and until is not None:
            if since >= until:
                raise serializers.ValidationError({"since": "Must be before until."})
            if until - since > METRICS_MAX_WINDOW:
                raise serializers.ValidationError(
                    {"until": f"At most {METRICS_MAX_WINDOW.days * 24} hours after since."}
                )
        return attrs


class WorkloadMetricsPointSerializer(serializers.Serializer):
    minute = serializers.DateTimeField()
    util_pct = serializers.FloatField(allow_null=True)
    mem_used_mib = serializers.IntegerField(allow_null=True)
    power_w = serializers.FloatField(allow_null=True)
    temp_c = serializers.IntegerField(allow_null=True)


class HeldSerializer(serializers.Serializer):
    start = serializers.DateTimeField()
    end = serializers.DateTimeField(allow_null=True, help_text="Null while it holds the GPU.")


class WorkloadGpuMetricsSerializer(serializers.Serializer):
    gpu = serializers.CharField(help_text="The GPU's UUID.")
    node = serializers.CharField()
    index = serializers.IntegerField()
    model = serializers.CharField()
    shared = serializers.BooleanField(
        help_text="A share of the GPU: utilisation and power are null (not attributable), memory is "
        "the workload's own processes', temperature the GPU's."
    )
    held = HeldSerializer(many=True)
    minutes = WorkloadMetricsPointSerializer(many=True)


class WorkloadMetricsSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    since = serializers.DateTimeField()
    until = serializers.DateTimeField()
    gpus = WorkloadGpuMetricsSerializer(many=True)


# --- instances and jobs ----------------------------------------------------------------------------


class LogQuerySerializer(serializers.Serializer):
    tail = serializers.IntegerField(min_value=1, max_value=LOG_TAIL_MAX, default=100)
    since = serializers.IntegerField(min_value=0, max_value=2**63 - 1, required=False)
    follow = serializers.BooleanField(default=False)


class LogLineSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    stream = serializers.ChoiceField(choices=LogStream.choices)
    text = serializers.CharField()


class WorkloadLogsSerializer(serializers.Serializer):
    lines = LogLineSerializer(many=True)
    next = serializers.CharField(help_text="The cursor to pass as since= for the lines after these.")


def log_line_json(row: tuple) -> dict:
    """One stored line as the API and the follow stream give it."""
    _, at, stream, text = row
    return {"at": at.isoformat().replace("+00:00", "Z"), "stream": stream, "text": text}


class WorkloadFilter(TenantFilterSet):
    state = django_filters.MultipleChoiceFilter(choices=WorkloadState.choices)
    plan = django_filters.ChoiceFilter(choices=Plan.choices)
    region = django_filters.CharFilter(field_name="region__code")
    name = django_filters.CharFilter(lookup_expr="icontains")
    submitted_after = UTCDateTimeFilter(field_name="submitted_at", lookup_expr="gte")
    submitted_before = UTCDateTimeFilter(field_name="submitted_at", lookup_expr="lt")
    active = django_filters.BooleanFilter(method="filter_active")

    class Meta:
        model = Workload
        fields = ["state", "plan", "region", "name"]

    def filter_active(self, queryset, name, value):
        terminal = [WorkloadState.STOPPED, WorkloadState.SUCCEEDED, WorkloadState.FAILED]
        return queryset.exclude(state__in=terminal) if value else queryset.filter(state__in=terminal)


@functools.cache
def list_rows() -> QuerySet:
    """Every workload as a list row (``LIST_VALUES``): the base each list request narrows (each
    filter makes a new queryset), never evaluated itself."""
    return Workload.objects.values(*LIST_VALUES)


@functools.cache
def stored_form_rows() -> QuerySet:
    """The columns whose stored form may differ from what a new instance holds (JSON, which jsonb
    orders by its own rule, and decimals, which their column rounds), as ``values()`` rows: the base
    ``submitted_detail`` narrows to one workload, built once per process."""
    names = [
        f.attname
        for f in Workload._meta.concrete_fields
        if isinstance(f, models.JSONField | models.DecimalField)
    ]
    return Workload.objects.values(*names)


def submitted_detail(workload: Workload) -> dict:
    """A workload that ``workload_submit`` just stored, as its detail renders it: the instance the
    service saved, with its JSON and decimal columns read back as stored, and what the service
    attached (``workload.submitted``) instead of reading it: its GPU model names, and no volumes or
    dependencies to read when it has none. The same answer as a GET of it."""
    for name, value in stored_form_rows().get(pk=workload.pk).items():
        setattr(workload, name, value)
    submitted = workload.submitted
    workload.gpu_model_names = submitted.gpu_model_names
    workload.no_volumes = submitted.no_volumes
    workload.no_dependencies = submitted.no_dependencies
    return WorkloadDetailSerializer(workload).data


class _WorkloadViewSet(TenantReadOnlyViewSet, mixins.CreateModelMixin):
    kind: str = ""
    create_serializer: type[serializers.Serializer] = _SpecSerializer
    filterset_class = WorkloadFilter

    def get_queryset(self):
        qs = super().get_queryset().filter(kind=self.kind).select_related("region")
        # The agent's last message (up to SCHEDULING_LOG_TAIL_CHARS) is only in ``logs``: a list
        # page does not read fifty of them.
        return qs.defer("log_tail") if self.action in ("list", "retrieve", "logs") else qs

    # A page of rows (values()), not model instances: Django builds no instance for them, and the
    # values() names are resolved once per process (``list_rows``), not per request.
    def list(self, request, *args, **kwargs):
        rows = self.filter_queryset(self.scoped(list_rows()).filter(kind=self.kind))
        page = self.paginate_queryset(rows)
        if page is None:  # no pagination class: every row
            return Response(self.get_serializer(self.with_model_names(list(rows)), many=True).data)
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    def paginate_queryset(self, queryset):
        page = super().paginate_queryset(queryset)
        return page if page is None else self.with_model_names(page)

    @staticmethod
    def with_model_names(page: list) -> list:
        """The page's workloads (rows or instances) with their GPU model names, in one query."""
        rows = bool(page) and isinstance(page[0], dict)
        names = workload_gpu_model_names(workload_ids=[w["id"] if rows else w.pk for w in page])
        for w in page:
            if rows:
                w["gpu_model_names"] = names[w["id"]]
            else:
                w.gpu_model_names = names[w.pk]
        return page

    def get_serializer_class(self):
        if self.action == "create":
            return self.create_serializer
        return WorkloadDetailSerializer if self.action in ("retrieve", "stop") else WorkloadSerializer

    @extend_schema(responses={201: WorkloadDetailSerializer})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        spec = dict(serializer.validated_data)
        workload = workload_submit(tenant=self.ctx.tenant, kind=self.kind, spec=spec, actor=self.actor)
        return Response(submitted_detail(workload), status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=WorkloadDetailSerializer)
    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        workload_stop(workload=self.get_object(), actor=self.actor)
        return Response(WorkloadDetailSerializer(self.get_queryset().get(pk=pk)).data)

    # All of them, unfiltered: the list's pagination and filters do not apply.
    @extend_schema(responses=WorkloadEventSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def events(self, request, pk=None):
        events = workload_events(workload=self.get_object())
        return Response(WorkloadEventSerializer(events, many=True).data)

    @extend_schema(parameters=[WorkloadMetricsQuerySerializer], responses=WorkloadMetricsSerializer)
    @action(detail=True, methods=["get"], filter_backends=[])
    def metrics(self, request, pk=None):
        """Per GPU it held, per minute: utilisation, memory, power and temperature, only while it held
        the GPU (``scheduling.selectors.workload_metrics``)."""
        workload = self.get_object()  # another tenant's: 404 whatever the query says
        query = WorkloadMetricsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        now = timezone.now()
        since, until = query.validated_data.get("since"), query.validated_data.get("until")
        if until is None:
            held = workload_held(workload=workload)
            until = workload_last_placement(held, now=now)[2] if held else now
            if since is not None:
                until = min(until, since + METRICS_MAX_WINDOW)
        if since is None:
            since = until - METRICS_DEFAULT_WINDOW
        metrics = workload_gpu_metrics(workload=workload, since=since, until=until, now=now)
        return Response(
            WorkloadMetricsSerializer(
                {"id": workload.pk, "since": since, "until": until, "gpus": metrics}
            ).data
        )

    @extend_schema(parameters=[LogQuerySerializer], responses=WorkloadLogsSerializer)
    @action(detail=True, methods=["get"])
    def logs(self, request, pk=None):
        """The workload's output (stdout and stderr), line by line: the last ``tail`` lines, or with
        ``since`` (a ``next`` from before) the first ``tail`` lines after it. ``follow=1`` streams new
        lines as ``text/event-stream``; the portal's ASGI server serves that
        (``scheduling.log_follow``), so it never reaches here."""
        workload = self.get_object()  # another tenant's: 404 whatever the query says
        query = LogQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        if query.validated_data["follow"]:
            raise ValidationFailed(
                "Follow streams are served by the portal's ASGI server only.",
                fields={"follow": ["Not served here."]},
            )
        rows, cursor = workload_log_lines(
            workload=workload,
            since=query.validated_data.get("since"),
            tail=query.validated_data["tail"],
        )
        return Response({"lines": [log_line_json(row) for row in rows], "next": str(cursor)})


class ShareLinkSerializer(serializers.Serializer):
    secret = serializers.CharField(help_text="Shown once; only its hash is kept.")
    urls = serializers.ListField(
        child=serializers.CharField(), help_text="Each HTTP port's proxy URL carrying the secret."
    )


@extend_schema_view(
    create=extend_schema(
        examples=[
            OpenApiExample(
                "A notebook on one H100",
                value={"name": "notebook", "gpu_models": ["H100"], "image": "ghcr.io/acme/notebook:1"},
                request_only=True,
            )
        ]
    )
)
class InstanceViewSet(_WorkloadViewSet):
    """GPU instances: long-running and interactive. POST to ask for one; POST ``{id}/stop/`` to stop it.
    ``{id}/share-link/``: POST makes a link that opens its HTTP ports to anyone holding it (shown
    once, replacing any other), DELETE revokes it."""

    queryset = Workload.objects.all()
    kind = WorkloadKind.INSTANCE
    create_serializer = InstanceCreateSerializer

    def get_serializer_context(self):
        return {**super().get_serializer_context(), "request": self.request}

    @extend_schema(request=None, responses={200: ShareLinkSerializer, 204: None})
    @action(detail=True, methods=["post", "delete"], url_path="share-link")
    def share_link(self, request, pk=None):
        workload = self.get_object()
        if request.method == "DELETE":  # idempotent: no link afterwards either way
            share_link_revoke(workload=workload, actor=self.actor)
            return Response(status=status.HTTP_204_NO_CONTENT)
        http_ports = [p["port"] for p in workload_ports(workload=workload) if p["protocol"] == "http"]
        if not http_ports:
            raise ValidationFailed(
                "This instance has no HTTP port to share.", fields={"ports": ["No HTTP port."]}
            )
        secret = share_link_create(workload=workload, actor=self.actor)
        urls = [
            f"{proxy_url(workload.pk, port, request=request)}?{SHARE_PARAM}={secret}" for port in http_ports
        ]
        return Response(ShareLinkSerializer({"secret": secret, "urls": urls}).data)


class JobCreatedSerializer(WorkloadDetailSerializer):
    warnings = serializers.ListField(
        child=serializers.CharField(),
        help_text="A Kubernetes manifest's fields that were not applied, each by its path; empty otherwise.",
    )

    class Meta(WorkloadDetailSerializer.Meta):
        fields = [*WorkloadDetailSerializer.Meta.fields, "warnings"]
        read_only_fields = fields


class K8sJobManifestSerializer(serializers.Serializer):
    """Documents the manifest form of a job request; ``scheduling.k8s_manifest`` reads it."""

    apiVersion = serializers.ChoiceField(choices=["batch/v1"])
    kind = serializers.ChoiceField(choices=["Job"])
    metadata = serializers.DictField(required=False, help_text="name: the job's name.")
    spec = serializers.DictField(
        help_text="A batch/v1 JobSpec. The first container's image, command, args, env (values only) and "
        'resources.limits ("nvidia.com/gpu": count, "nvidia.com/gpu.model": model or family such as A100, '
        "cpu, memory); nodeSelector nvidia.com/gpu.product and topology.kubernetes.io/region; completions "
        "and parallelism (an array), backoffLimit (max_retries), activeDeadlineSeconds (max_runtime_s). "
        "Other fields are listed in the answer's warnings; one that cannot be honoured is a 400 naming "
        "it by its path."
    )


K8S_EXAMPLE = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"name": "train"},
    "spec": {
        "backoffLimit": 2,
        "template": {
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "train",
                        "image": "ghcr.io/acme/train:1",
                        "command": ["python", "train.py"],
                        "resources": {"limits": {"nvidia.com/gpu": 2, "nvidia.com/gpu.model": "A100"}},
                    }
                ],
            }
        },
    },
}


@extend_schema_view(
    create=extend_schema(
        description="A job spec (JSON), or a Kubernetes batch/v1 Job manifest as application/yaml (or as "
        "JSON with apiVersion and kind), translated into the same spec (scheduling.k8s_manifest).",
        request={
            "application/json": JobCreateSerializer,
            "application/yaml": K8sJobManifestSerializer,
            "application/x-www-form-urlencoded": JobCreateSerializer,
            "multipart/form-data": JobCreateSerializer,
        },
        responses={201: JobCreatedSerializer},
        examples=[
            OpenApiExample(
                "A Kubernetes Job on two A100s (application/yaml)",
                value=K8S_EXAMPLE,
                media_type="application/yaml",
                request_only=True,
            ),
            OpenApiExample(
                "A training job on two H100s",
                value={
                    "name": "train",
                    "gpu_models": ["H100"],
                    "gpu_count": 2,
                    "image": "ghcr.io/acme/train:1",
                    "command": ["python", "train.py"],
                },
                media_type="application/json",
                request_only=True,
            ),
        ],
    )
)
class JobViewSet(_WorkloadViewSet):
    """Batch jobs: run to completion. ``{id}/logs/`` gives their output; an array job's
    ``{id}/tasks/`` lists its tasks (jobs of their own: their logs, events and stop are theirs)."""

    queryset = Workload.objects.all()
    kind = WorkloadKind.JOB
    create_serializer = JobCreateSerializer
    parser_classes = [*api_settings.DEFAULT_PARSER_CLASSES, YAMLParser]

    def create(self, request, *args, **kwargs):
        """A spec, or a Kubernetes Job manifest (YAML, or JSON with apiVersion and kind) translated
        into one: both go through the spec's serializer and ``workload_submit``."""
        media_type = request.content_type.split(";")[0].strip().lower()
        manifest = media_type == YAMLParser.media_type or (
            media_type == "application/json" and is_manifest(request.data)
        )
        warnings: list[str] = []
        data = request.data
        if manifest:
            translation = manifest_translate(request.data)
            data, warnings = translation.spec, translation.warnings
        serializer = self.get_serializer(data=data)
        if not serializer.is_valid():
            if not manifest:
                raise serializers.ValidationError(serializer.errors)
            raise manifest_error(ValidationFailed("This manifest is not valid.", fields=serializer.errors))
        try:
            workload = workload_submit(
                tenant=self.ctx.tenant, kind=self.kind, spec=dict(serializer.validated_data), actor=self.actor
            )
        except ValidationFailed as exc:
            if manifest:
                raise manifest_error(exc) from None
            raise
        body = {**submitted_detail(workload), "warnings": warnings}
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=ResizeSerializer, responses=WorkloadDetailSerializer)
    @action(detail=True, methods=["post"])
    def resize(self, request, pk=None):
        """Resize a running elastic job: a shrink is at once, a growth as GPUs of its node free up."""
        job = self.get_object()  # another tenant's: 404
        serializer = ResizeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        workload_resize(workload=job, gpu_count=serializer.validated_data["gpu_count"], actor=self.actor)
        return Response(WorkloadDetailSerializer(self.get_queryset().get(pk=pk)).data)

    @extend_schema(responses=WorkloadSerializer(many=True))
    @action(detail=True, methods=["get"], filter_backends=[])
    def tasks(self, request, pk=None):
        job = self.get_object()  # another tenant's: 404
        if job.array_count is None:
            raise NotFound(f"Job {job.pk} is not an array job.")
        tasks = array_tasks(workload=job)
        page = self.paginate_queryset(tasks)
        return self.get_paginated_response(WorkloadSerializer(page, many=True).data)


# --- GPU types -------------------------------------------------------------------------------------


class GpuTypeSerializer(FieldsOnceModelSerializer):
    availability = serializers.SerializerMethodField()

    class Meta:
        model = GpuModel
        fields = [
            "id",
            "name",
            "short_name",
            "vendor",
            "architecture",
            "memory_gib",
            "bf16_tflops",
            "fp32_tflops",
            "memory_bandwidth_gbps",
            "compute_weight",
            "mig_capable",
            "mig_profiles",
            "software_stack",
            "cuda_compute_capability",
            "gfx_target",
            "availability",
        ]
        read_only_fields = fields

    def get_availability(self, m: GpuModel) -> list[dict]:
        """Per region: GPUs in the fleet, schedulable, wholly free, free capacity, and the hourly
        price per GPU per plan (null until a price provider, i.e. metering, supplies it)."""
        per_region = self.context["availability"].get(m.pk, {})
        regions = self.context["regions"]
        out = []
        for code in sorted(per_region):
            ra = per_region[code]
            out.append(
                {
                    "region": code,
                    "total_gpus": ra.total_gpus,
                    "schedulable_gpus": ra.schedulable_gpus,
                    "free_gpus": ra.free_gpus,
                    "free_gpu_milli": ra.free_milli,
                    "price_per_gpu_hour": {
                        k: (str(v) if v is not None else None)
                        for k, v in self.context["prices"][price_key(m, regions.get(code))].items()
                    },
                }
            )
        return out


class GpuTypeViewSet(viewsets.ReadOnlyModelViewSet):
    """The GPU catalog (shared by every tenant) with live availability per region."""

    queryset = GpuModel.objects.all().order_by("vendor", "name")
    serializer_class = GpuTypeSerializer
    pagination_class = None
    filterset_fields = ["vendor", "mig_capable"]
    lookup_value_regex = r"[0-9]+"

    CACHE_KEY = "scheduling:gpu-types:v2"
    REFRESH_KEY = "scheduling:gpu-types:refresh"
    # An answer older than the setting is still served, for up to this many times the setting,
    # while a worker computes the next.
    STALE_FACTOR = 10

    def list(self, request, *args, **kwargs):
        """The unfiltered list is the same for everyone (list prices, the fleet's availability): it
        is fresh for ``SCHEDULING_GPU_TYPES_CACHE_S`` seconds (clients poll it; at 500 nodes and
        forty catalog models it is the dearest read of the API: about 25 ms of Python and 10 ms of
        PostgreSQL). When it is older, the first request to see that asks a worker for the next
        answer (``scheduling.tasks.refresh_gpu_types``) and answers, as every request does until
        the next is there, with the previous one. Only when the cache holds none (a cold start, a
        lost cache, a worker away for longer than the answer is kept) does a request compute it,
        as it does when the task cannot be sent. Under bench/scale.py, when the request that found
        the answer old computed the next, about 30 of some 5,700 reads a minute paid that, two or
        three times over on a busy machine: reads of the slowest 1 % (about 57 a minute)."""
        ttl = settings.SCHEDULING_GPU_TYPES_CACHE_S
        if not ttl or request.query_params:
            return super().list(request, *args, **kwargs)
        cached = cache.get(self.CACHE_KEY)
        if cached is None:
            return Response(gpu_types_cache_fill())
        computed_at, data = cached
        if time.time() - computed_at >= ttl and cache.add(self.REFRESH_KEY, 1, ttl):
            from scheduling.tasks import refresh_gpu_types

            try:
                # Not run once it is older than an answer is kept: a worker back after a while
                # does not run one refresh per request that asked for it meanwhile.
                refresh_gpu_types.apply_async(expires=ttl * self.STALE_FACTOR, retry=False)
            except Exception:
                logger.warning(
                    "Could not enqueue the GPU catalog's refresh; computing it here", exc_info=True
                )
                data = gpu_types_refresh()
        return Response(data)

    @staticmethod
    def catalog_context() -> dict:
        """What the serializer reads besides the models: availability, regions, prices."""
        from nodes.models import Region

        availability = gpu_availability()
        regions = {r.code: r for r in Region.objects.all()}
        models = GpuModel.objects.in_bulk(list(availability))
        prices = gpu_price_table(
            pairs=[(models[pk], regions.get(code)) for pk, per in availability.items() for code in per]
        )
        return {"availability": availability, "regions": regions, "prices": prices}

    def get_serializer_context(self):
        return {**super().get_serializer_context(), **self.catalog_context()}


def gpu_types_cache_fill() -> list:
    """The unfiltered /api/v1/gpu-types/ answer, computed now and cached with the time it was
    computed (``GpuTypeViewSet``), for ``STALE_FACTOR`` times ``SCHEDULING_GPU_TYPES_CACHE_S``."""
    now = time.time()
    view = GpuTypeViewSet
    data = list(GpuTypeSerializer(view.queryset.all(), many=True, context=view.catalog_context()).data)
    cache.set(view.CACHE_KEY, (now, data), settings.SCHEDULING_GPU_TYPES_CACHE_S * view.STALE_FACTOR)
    return data


def gpu_types_refresh() -> list:
    """A refresh asked for under ``GpuTypeViewSet.REFRESH_KEY``: the answer filled, then the way clear
    for the next. One that fails leaves the way closed until the lock expires: one try per
    SCHEDULING_GPU_TYPES_CACHE_S, not one per request."""
    data = gpu_types_cache_fill()
    cache.delete(GpuTypeViewSet.REFRESH_KEY)
    return data


# --- reservations ----------------------------------------------------------------------------------


class ReservationSerializer(serializers.ModelSerializer):
    gpu_model = serializers.SlugRelatedField(read_only=True, slug_field="name")
    region = serializers.SlugRelatedField(read_only=True, slug_field="code")

    class Meta:
        model = Reservation
        fields = [
            "id",
            "gpu_model",
            "region",
            "count",
            "starts_at",
            "ends_at",
            "status",
            "note",
            "created_at",
            "activated_at",
            "cancelled_at",
            "cancel_fee_percent",
        ]
        read_only_fields = fields


# How far ahead a reservation may start and how long it may run: bounded so that every date a
# reservation makes (billing periods, term months) stays well inside what datetimes can hold.
RESERVATION_MAX_LEAD = timedelta(days=5 * 366)
RESERVATION_MAX_TERM = timedelta(days=3 * 366)


class ReservationCreateSerializer(serializers.Serializer):
    gpu_model = serializers.CharField(max_length=80)
    region = serializers.CharField(max_length=32)
    count = serializers.IntegerField(min_value=1, max_value=100_000)
    starts_at = serializers.DateTimeField()
    ends_at = serializers.DateTimeField()
    note = serializers.CharField(required=False, allow_blank=True, max_length=255)

    def validate_starts_at(self, value):
        if value > timezone.now() + RESERVATION_MAX_LEAD:
            raise serializers.ValidationError("Must start within 5 years from now.")
        return value

    def validate(self, attrs):
        if attrs["ends_at"] > attrs["starts_at"] + RESERVATION_MAX_TERM:
            raise serializers.ValidationError({"ends_at": "Must be at most 3 years after starts_at."})
        return attrs


class ReservationViewSet(TenantReadOnlyViewSet, mixins.CreateModelMixin):
    """Reserved capacity. POST asks for one (staff confirm it); ``{id}/cancel/`` withdraws a request."""

    queryset = Reservation.objects.select_related("gpu_model", "region")
    serializer_class = ReservationSerializer
    filterset_fields = ["status"]
    read_scope = Scope.BILLING  # as the reservations page: reserved capacity is a billing matter
    write_scope = Scope.BILLING

    def get_serializer_class(self):
        return ReservationCreateSerializer if self.action == "create" else ReservationSerializer

    @extend_schema(responses={201: ReservationSerializer})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        r = reservation_request(tenant=self.ctx.tenant, actor=self.actor, **serializer.validated_data)
        return Response(ReservationSerializer(r).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=ReservationSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        r = reservation_cancel(reservation=self.get_object(), actor=self.actor)
        return Response(ReservationSerializer(r).data)


# --- quotas ----------------------------------------------------------------------------------------


class QuotaLimitsSerializer(serializers.Serializer):
    max_gpus_total = serializers.IntegerField(allow_null=True)
    max_concurrent_workloads = serializers.IntegerField(allow_null=True)
    max_spot_gpus = serializers.IntegerField(allow_null=True)
    max_gpus_per_request = serializers.IntegerField(allow_null=True)
    max_gpus_per_model = serializers.DictField(
        child=serializers.IntegerField(), help_text="GPUs at most, by model name."
    )


class QuotaUsageSerializer(serializers.Serializer):
    workloads = serializers.IntegerField()
    gpus = serializers.DecimalField(max_digits=12, decimal_places=3, coerce_to_string=True)
    spot_gpus = serializers.DecimalField(max_digits=12, decimal_places=3, coerce_to_string=True)
    gpus_per_model = serializers.DictField(
        child=serializers.DecimalField(max_digits=12, decimal_places=3, coerce_to_string=True),
        help_text="GPUs in use, by model name.",
    )


class QuotaSerializer(serializers.Serializer):
    limits = QuotaLimitsSerializer(help_text="Limits (null: no limit).")
    usage = QuotaUsageSerializer(help_text="What counts against them now.")


class QuotaView(APIView):
    """The tenant's limits (null: no limit) and what counts against them now: one object, not a
    list."""

    read_scope = Scope.READ

    @extend_schema(responses=QuotaSerializer)
    def get(self, request):
        tenant = request_context(request).tenant
        quota = quota_for_tenant(tenant=tenant)
        if quota is not None:
            limits = {
                "max_gpus_total": quota.max_gpus_total,
                "max_concurrent_workloads": quota.max_concurrent_workloads,
                "max_spot_gpus": quota.max_spot_gpus,
                "max_gpus_per_request": quota.max_gpus_per_request,
            }
            model_limits = {lim.gpu_model.name: lim.max_gpus for lim in quota.model_limits.all()}
        else:
            limits = dict(settings.SCHEDULING_DEFAULT_QUOTA)
            model_limits = {}
        usage = quota_usage(tenant=tenant)
        names = dict(GpuModel.objects.filter(pk__in=list(usage.model_milli)).values_list("pk", "name"))
        return Response(
            {
                "limits": {**limits, "max_gpus_per_model": model_limits},
                "usage": {
                    "workloads": usage.workloads,
                    "gpus": str(usage.gpus),
                    "spot_gpus": str(usage.spot_gpus),
                    "gpus_per_model": {
                        names[k]: str(Decimal(v) / 1000) for k, v in usage.model_milli.items() if k in names
                    },
                },
            }
        )


router.register("instances", InstanceViewSet, basename="instance")
router.register("jobs", JobViewSet, basename="job")
router.register("gpu-types", GpuTypeViewSet, basename="gpu-type")
router.register("reservations", ReservationViewSet, basename="reservation")
extra_urlpatterns.append(path("quotas/", QuotaView.as_view(), name="quota-list"))
router.register("ssh-keys", SshKeyViewSet, basename="ssh-key")

from scheduling import api_templates, volumes_api  # noqa: E402,F401  (register /templates/, /volumes/)
