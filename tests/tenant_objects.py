"""How the cross-tenant test makes one object of a tenant-owned model.

model_bakery fills any model; a model it cannot build (check constraints, required JSON shapes)
gets its own maker here, keyed by ``app_label.ModelName``.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db.models import Model
from model_bakery import baker

MAKERS: dict[str, Callable[..., Model]] = {}


def make_tenant_object(model: type[Model], *, tenant) -> Model:
    maker = MAKERS.get(model._meta.label)
    if maker is not None:
        return maker(tenant=tenant)
    return baker.make(model, tenant=tenant)


def _make_reservation(*, tenant):
    from datetime import timedelta

    from django.utils import timezone

    start = timezone.now()
    return baker.make(
        "scheduling.Reservation", tenant=tenant, starts_at=start, ends_at=start + timedelta(days=1), count=1
    )


MAKERS["scheduling.Reservation"] = _make_reservation
