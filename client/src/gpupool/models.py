"""Typed objects of the API. Each class names the OpenAPI component it mirrors (``SCHEMA``); a test
(tests/client/test_client.py::test_the_client_and_the_schema_agree) holds their fields to the portal's schema, names and types.

Money and other decimals are ``Decimal``, times are timezone-aware ``datetime``, days ``date``;
every other field is the JSON value as the API gives it. ``raw`` keeps the whole object.
"""

from __future__ import annotations

import dataclasses
import typing
from datetime import date, datetime
from decimal import Decimal
from typing import Any, ClassVar, Self


def _convert(kind: Any, value: Any) -> Any:
    if value is None or value == "":
        return None if kind in (Decimal, datetime, date) else value
    if kind is Decimal:
        return Decimal(str(value))
    if kind is datetime:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if kind is date:
        return date.fromisoformat(str(value))
    return value


def _base_type(annotation: Any) -> Any:
    """``Decimal | None`` -> ``Decimal``; anything else as it is."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 else annotation


@dataclasses.dataclass
class Model:
    SCHEMA: ClassVar[str] = ""
    raw: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def api_fields(cls) -> dict[str, Any]:
        """Each API field with its Python type (``raw`` is not one)."""
        hints = typing.get_type_hints(cls)
        return {f.name: _base_type(hints[f.name]) for f in dataclasses.fields(cls) if f.name != "raw"}

    @classmethod
    def from_api(cls, data: dict) -> Self:
        values = {name: _convert(kind, data.get(name)) for name, kind in cls.api_fields().items()}
        return cls(raw=data, **values)


@dataclasses.dataclass
class Workload(Model):
    """An instance or a job, as lists give it."""

    SCHEMA: ClassVar[str] = "Workload"
    id: int = 0
    kind: str = ""
    name: str = ""
    state: str = ""
    state_reason: str = ""
    pending: dict | None = None
    gpu_models: list | None = None
    min_gpu_memory_gib: int | None = None
    min_compute_weight: Decimal | None = None
    gpu_vendor: str = ""
    cuda_capability: str = ""
    rocm_target: str = ""
    min_driver: str = ""
    min_cuda: str = ""
    min_rocm: str = ""
    gpu_count: int = 0
    gang: bool = False
    gpus_per_node: Any = None
    split_regions_ok: bool = False
    node_selector: Any = None
    affinity: Any = None
    anti_affinity: Any = None
    spread: Any = None
    preference: str = ""
    gpu_fraction_milli: int | None = None
    mig_profile: str = ""
    cpu_millicores: int | None = None
    ram_mib: int | None = None
    region: str | None = None
    other_regions_ok: bool = False
    plan: str = ""
    spot_max_price: Decimal | None = None
    reservation: int | None = None
    priority_class: str = ""
    image: str = ""
    template: str = ""
    command: Any = None
    env: Any = None
    ports: Any = None
    ssh_public_key: str = ""
    max_runtime_s: int | None = None
    estimated_runtime_s: int | None = None
    requeue_on_preemption: bool = False
    checkpoint_resume: bool = False
    max_retries: int | None = None
    retries: int | None = None
    attempt: int | None = None
    exit_code: int | None = None
    submitted_at: datetime | None = None
    scheduled_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    elastic: dict | None = None
    array_count: int | None = None
    array_parallelism: int | None = None
    array_parent: int | None = None
    array_index: int | None = None


@dataclasses.dataclass
class WorkloadDetail(Workload):
    """One workload: where it runs, how to reach it, its volumes, an array's task counts and what
    it waits for."""

    SCHEMA: ClassVar[str] = "WorkloadDetail"
    placement: list | None = None
    access: dict | None = None
    volumes: list | None = None
    array: dict | None = None
    depends_on: list | None = None


@dataclasses.dataclass
class GpuType(Model):
    SCHEMA: ClassVar[str] = "GpuType"
    id: int = 0
    name: str = ""
    short_name: str = ""
    vendor: str = ""
    architecture: str = ""
    memory_gib: int = 0
    bf16_tflops: Decimal | None = None
    fp32_tflops: Decimal | None = None
    memory_bandwidth_gbps: int | None = None
    compute_weight: Decimal | None = None
    mig_capable: bool = False
    mig_profiles: Any = None
    software_stack: Any = None
    cuda_compute_capability: str = ""
    gfx_target: str = ""
    availability: list | None = None


@dataclasses.dataclass
class Volume(Model):
    SCHEMA: ClassVar[str] = "Volume"
    id: int = 0
    name: str = ""
    region: str = ""
    size_gib: int = 0
    used_bytes: int | None = None
    used_measured_at: datetime | None = None
    state: str = ""
    created_at: datetime | None = None
    in_use_by: list | None = None


@dataclasses.dataclass
class Secret(Model):
    SCHEMA: ClassVar[str] = "Secret"
    name: str = ""
    created_at: datetime | None = None
    updated_at: datetime | None = None


@dataclasses.dataclass
class Template(Model):
    SCHEMA: ClassVar[str] = "Template"
    id: int = 0
    name: str = ""
    catalog: bool = False
    description: str = ""
    image: str = ""
    command: Any = None
    ports: Any = None
    env: Any = None
    min_gpu_memory_gib: int | None = None
    volume_mount_path: str = ""
    volume_required: bool = False
    created_at: datetime | None = None
    updated_at: datetime | None = None


@dataclasses.dataclass
class ApiToken(Model):
    SCHEMA: ClassVar[str] = "ApiToken"
    id: int = 0
    name: str = ""
    prefix: str = ""
    scopes: list | None = None
    status: str = ""
    created_by: str | None = None
    created: datetime | None = None
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None


@dataclasses.dataclass
class ApiTokenCreated(ApiToken):
    """A new token: ``token`` is its secret, shown this once."""

    SCHEMA: ClassVar[str] = "ApiTokenCreated"
    token: str = ""


@dataclasses.dataclass
class Invoice(Model):
    SCHEMA: ClassVar[str] = "Invoice"
    id: int = 0
    period_start: date | None = None
    period_end: date | None = None
    currency: str = ""
    status: str = ""
    subtotal: Decimal | None = None
    credits: Decimal | None = None
    tax_rate_percent: Decimal | None = None
    tax: Decimal | None = None
    total: Decimal | None = None
    grace_until: datetime | None = None
    finalized_at: datetime | None = None
    paid_at: datetime | None = None
    voided_at: datetime | None = None
    lines: list | None = None


@dataclasses.dataclass
class UsageRecord(Model):
    SCHEMA: ClassVar[str] = "UsageRecord"
    id: int = 0
    workload: int | None = None
    allocation: int | None = None
    gpu_model: str = ""
    region: str = ""
    plan: str = ""
    period_start: date | None = None
    start: datetime | None = None
    end: datetime | None = None
    fraction_milli: int | None = None
    seconds: Decimal | None = None
    minimum_topup_s: Decimal | None = None
    gpu_seconds: Decimal | None = None
    vcpu_seconds: Decimal | None = None
    ram_gib_seconds: Decimal | None = None
    unit_price: Decimal | None = None
    amount: Decimal | None = None
    gpu_memory_gib_seconds: Decimal | None = None
    gpu_memory_amount: Decimal | None = None
    avg_util_pct: float | None = None
    avg_mem_used_mib: float | None = None
    invoice: int | None = None


@dataclasses.dataclass
class Budget(Model):
    SCHEMA: ClassVar[str] = "BudgetOutput"
    period_start: date | None = None
    amount: Decimal | None = None
    currency: str = ""
    as_of: datetime | None = None
    monthly_limit: Decimal | None = None
    percent: Decimal | None = None
    hard_limit: bool = False
    limit_action: str | None = None  # "alert", "refuse" or "stop"
    alert_thresholds: list | None = None
    alerts_fired: list | None = None


@dataclasses.dataclass
class WorkloadLogs(Model):
    SCHEMA: ClassVar[str] = "WorkloadLogs"
    lines: list | None = None
    next: str = ""


@dataclasses.dataclass
class Me(Model):
    SCHEMA: ClassVar[str] = "Me"
    tenant: dict | None = None
    scopes: list | None = None
    user: Any = None
    token: Any = None


@dataclasses.dataclass
class WebhookEndpoint(Model):
    """Where the team's events are sent (``event_types``: names, or ``["*"]`` for all)."""

    SCHEMA: ClassVar[str] = "WebhookEndpoint"
    id: int = 0
    url: str = ""
    description: str = ""
    event_types: list | None = None
    enabled: bool = False
    previous_secret_expires_at: datetime | None = None  # after a roll that kept the old secret
    created_at: datetime | None = None
    updated_at: datetime | None = None


@dataclasses.dataclass
class WebhookEndpointCreated(WebhookEndpoint):
    """A new endpoint, or one whose secret was rolled: ``secret`` (``whsec_...``) is shown this
    once; ``gpupool.webhooks.verify`` checks deliveries with it."""

    SCHEMA: ClassVar[str] = "WebhookEndpointCreated"
    secret: str = ""


@dataclasses.dataclass
class WebhookDelivery(Model):
    """One event sent to one endpoint: ``pending`` while attempts remain, then ``succeeded`` or
    ``failed``."""

    SCHEMA: ClassVar[str] = "WebhookDelivery"
    id: int = 0
    endpoint: int = 0
    event_id: str = ""
    event_type: str = ""
    state: str = ""
    attempts: int = 0
    next_attempt_at: datetime | None = None
    retry_until: datetime | None = None
    last_status: int | None = None
    last_error: str = ""
    created_at: datetime | None = None
    delivered_at: datetime | None = None


@dataclasses.dataclass
class WebhookDeliveryDetail(WebhookDelivery):
    """A delivery with the body each attempt sends (``payload``) and every attempt (``attempt_log``:
    number, manual, at, status, latency_ms, error, response_excerpt)."""

    SCHEMA: ClassVar[str] = "WebhookDeliveryDetail"
    payload: dict | None = None
    attempt_log: list | None = None


@dataclasses.dataclass
class EventType(Model):
    SCHEMA: ClassVar[str] = "EventType"
    name: str = ""
    description: str = ""


MODELS: tuple[type[Model], ...] = (
    Workload, WorkloadDetail, GpuType, Volume, Secret, Template, ApiToken, ApiTokenCreated, Invoice,
    UsageRecord, Budget, WorkloadLogs, Me, WebhookEndpoint, WebhookEndpointCreated, WebhookDelivery,
    WebhookDeliveryDetail, EventType,
)  # fmt: skip
