"""How the cross-tenant tests make one object of a tenant-owned model.

model_bakery fills any model; a model it cannot build (check constraints, required JSON shapes)
gets its own maker here, keyed by ``app_label.ModelName``. ``fields`` fix what a route needs of
the object (a workload's ``kind``, a reservation's ``status``): the walker's positive control shows
the owner reaching it, so an object of the wrong kind fails the test instead of passing it.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db.models import Model
from model_bakery import baker

MAKERS: dict[str, Callable[..., Model]] = {}

H100 = "NVIDIA H100 SXM 80GB"


def make_tenant_object(model: type[Model], *, tenant, **fields) -> Model:
    maker = MAKERS.get(model._meta.label)
    if maker is not None:
        return maker(tenant=tenant, **fields)
    return baker.make(model, tenant=tenant, **fields)


def make_person_object(model: type[Model], *, person, **fields) -> Model:
    """A row of a person (``PersonOwnedModel``): a saved SSH key is a real key of theirs."""
    if model._meta.label == "scheduling.SshKey":
        from nodes.agent.workload_rules import parse_ssh_public_key
        from tests.ssh_keys import public_key

        parsed = parse_ssh_public_key(public_key())
        fields = {"name": "walker", "public_key": parsed.line, "fingerprint": parsed.fingerprint, **fields}
    return baker.make(model, user=person, **fields)


def catalog_gpu():
    """The catalog's H100 with one ready node of it, so a workload or reservation naming it is
    accepted (submission checks the fleet has the model)."""
    from django.utils import timezone

    from nodes.models import Gpu, GpuModel, Node, NodeState, Region

    model = GpuModel.objects.get(name=H100)
    region, _ = Region.objects.get_or_create(code="us-east-1", defaults={"name": "US East"})
    node, created = Node.objects.get_or_create(
        hostname="walker-h100",
        defaults={
            "region": region,
            "cpu_cores": 96,
            "ram_mib": 1024 * 1024,
            "state": NodeState.READY,
            "last_heartbeat_at": timezone.now(),
        },
    )
    if created:
        Gpu.objects.create(node=node, index=0, uuid="GPU-walker-0", model=model, reported_name=model.name)
    return model, region


def _make_reservation(*, tenant, **fields):
    from datetime import timedelta

    from django.utils import timezone

    model, region = catalog_gpu()
    start = timezone.now() - timedelta(hours=1)
    return baker.make(
        "scheduling.Reservation",
        tenant=tenant,
        gpu_model=model,
        region=region,
        starts_at=start,
        ends_at=start + timedelta(days=1),
        count=1,
        **fields,
    )


MAKERS["scheduling.Reservation"] = _make_reservation


def _make_invoice(*, tenant, **fields):
    from datetime import date

    from metering.models import Invoice

    # Invoices are unique per (tenant, period): each one made here takes the next month back.
    months = 2024 * 12 + 2 - Invoice.objects.filter(tenant=tenant).count()
    start = date(months // 12, months % 12 + 1, 1)
    end = date((months + 1) // 12, (months + 1) % 12 + 1, 1)
    return Invoice.objects.create(tenant=tenant, period_start=start, period_end=end, **fields)


def _make_usage_record(*, tenant, **fields):
    from datetime import UTC, date, datetime

    from django.utils import timezone

    from metering.models import RateCard, RateCardVersion, UsageRecord
    from nodes.models import Gpu, GpuModel, Node, Region
    from scheduling.models import Allocation, Workload

    model = GpuModel.objects.order_by("pk").first()
    region, _ = Region.objects.get_or_create(code="maker-region", defaults={"name": "Maker"})
    node = Node.objects.create(hostname=f"maker-{tenant.pk}-{timezone.now().timestamp()}", region=region)
    gpu = Gpu.objects.create(
        node=node, index=0, uuid=f"GPU-maker-{node.pk}", model=model, reported_name=model.name
    )
    card, _ = RateCard.objects.get_or_create(name="maker card")
    version = RateCardVersion.objects.filter(rate_card=card).first() or RateCardVersion.objects.create(
        rate_card=card, number=1, effective_from=datetime(2020, 1, 1, tzinfo=UTC)
    )
    start, end = datetime(2024, 3, 1, tzinfo=UTC), datetime(2024, 3, 1, 1, tzinfo=UTC)
    workload = Workload.objects.create(tenant=tenant, kind="job", image="img")
    allocation = Allocation.objects.create(
        tenant=tenant,
        workload=workload,
        node=node,
        gpu=gpu,
        gpu_model=model,
        plan="on_demand",
        started_at=start,
        ended_at=end,
    )
    return UsageRecord.objects.create(
        tenant=tenant,
        allocation=allocation,
        workload=workload,
        gpu_model=model,
        region=region,
        plan="on_demand",
        period_start=date(2024, 3, 1),
        version=version,
        start=start,
        end=end,
        fraction_milli=1000,
        seconds=3600,
        gpu_seconds=3600,
        unit_price=2,
        amount=2,
        **fields,
    )


MAKERS["metering.Invoice"] = _make_invoice
MAKERS["metering.UsageRecord"] = _make_usage_record


def _make_secret(*, tenant, **fields):
    """A real secret (a name the API's URLs accept, a value that decrypts)."""
    from portal.actors import Actor
    from portal.models import TenantSecret
    from portal.services.secrets import secret_create

    name = fields.pop("name", None) or f"walker-{TenantSecret.objects.count()}"
    return secret_create(tenant=tenant, name=name, value="walker-secret", actor=Actor.system())


def _make_template(*, tenant, **fields):
    """A tenant's own template that obeys the workload rules."""
    from portal.actors import Actor
    from scheduling.models import WorkloadTemplate
    from scheduling.services.templates import template_create

    n = WorkloadTemplate.objects.count()
    data = {"name": f"walker-{n}", "image": "ghcr.io/acme/walker:1", **fields}
    return template_create(tenant=tenant, data=data, actor=Actor.system())


MAKERS["portal.TenantSecret"] = _make_secret
MAKERS["scheduling.WorkloadTemplate"] = _make_template


def _make_webhook_endpoint(*, tenant, **fields):
    from portal.crypto import secret_encrypt
    from webhooks.models import WebhookEndpoint

    fields = {"url": "https://hooks.example.com/walker", "event_types": ["*"], **fields}
    return WebhookEndpoint.objects.create(
        tenant=tenant, secret_ciphertext=secret_encrypt("whsec_walker"), **fields
    )


def _make_webhook_delivery(*, tenant, **fields):
    from django.utils import timezone

    from webhooks.models import WebhookDelivery, WebhookEvent

    endpoint = fields.pop("endpoint", None) or _make_webhook_endpoint(tenant=tenant)
    event = WebhookEvent.objects.create(tenant=tenant, type="budget.alert", payload={"threshold": 50})
    fields = {"state": "failed", "retry_until": timezone.now(), **fields}
    return WebhookDelivery.objects.create(tenant=tenant, endpoint=endpoint, event=event, **fields)


MAKERS["webhooks.WebhookEndpoint"] = _make_webhook_endpoint
MAKERS["webhooks.WebhookDelivery"] = _make_webhook_delivery
