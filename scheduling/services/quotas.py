"""Staff change tenants' quotas: one tenant's limits, or one limit for many tenants at once.

Every change is validated first (a negative or non-integer limit is refused naming the field, and
nothing is written), applied under the quota row's lock (the lock submissions take, so a change
applies from the next submission on; what already runs is not touched) and audited with the values
before and after. A limit below what the tenant uses now is allowed, and the result says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import transaction

from nodes.models import GpuModel
from portal.actors import Actor
from portal.errors import ValidationFailed
from portal.services.audit import audit_record
from scheduling.locks import lock_quota
from scheduling.models import Quota, QuotaModelLimit
from scheduling.selectors.shared import QuotaUsage, quota_usage_by_tenant
from scheduling.selectors.staff_quotas import (
    LIMIT_FIELDS,
    LIMIT_LABELS,
    QUOTA_AUDIT_ACTION,
    model_use_of,
    use_of,
)

EDITABLE_FIELDS = (*LIMIT_FIELDS, "fair_share_weight")
MAX_LIMIT = 2_147_483_647  # PositiveIntegerField
WEIGHT_MIN, WEIGHT_MAX = Decimal("0.01"), Decimal("9999.99")


def _fail(name: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{name}: {message}", fields={name: [message]})


def _limit(name: str, value: Any) -> int | None:
    """A limit: a whole number from 0 to MAX_LIMIT, or None / '' for no limit."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise _fail(name, "Must be a whole number, or empty for no limit.")
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("-").isdigit():
            raise _fail(name, "Must be a whole number, or empty for no limit.")
        value = int(text)
    if not isinstance(value, int):
        raise _fail(name, "Must be a whole number, or empty for no limit.")
    if value < 0:
        raise _fail(name, "Must not be negative.")
    if value > MAX_LIMIT:
        raise _fail(name, f"At most {MAX_LIMIT:,}.")
    return value


def _weight(value: Any) -> Decimal:
    name = "fair_share_weight"
    if value is None or isinstance(value, bool | float) or (isinstance(value, str) and not value.strip()):
        raise _fail(name, "Give a decimal number such as 1 or 2.5.")
    try:
        d = Decimal(str(value).strip())
    except InvalidOperation:
        raise _fail(name, "Give a decimal number such as 1 or 2.5.") from None
    if not d.is_finite() or not WEIGHT_MIN <= d <= WEIGHT_MAX:
        raise _fail(name, f"Must be between {WEIGHT_MIN} and {WEIGHT_MAX}.")
    if d.as_tuple().exponent < -2:
        raise _fail(name, "At most 2 decimal places.")
    return d.quantize(Decimal("0.01"))


def quota_changes_clean(changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` validated: limit fields (int or None), ``fair_share_weight`` (Decimal) and
    ``model_limits`` ({GpuModel or its id: int or None}, None removing that model's limit)."""
    if not isinstance(changes, dict):
        raise ValidationFailed("The changes must be an object.")
    out: dict[str, Any] = {}
    for name, value in changes.items():
        if name in LIMIT_FIELDS:
            out[name] = _limit(name, value)
        elif name == "fair_share_weight":
            out[name] = _weight(value)
        elif name == "model_limits":
            if not isinstance(value, dict):
                raise _fail(name, "Must map GPU models to limits.")
            catalog = {m.pk: m for m in GpuModel.objects.all()}
            limits = {}
            for key, limit in value.items():
                model = catalog.get(key.pk if isinstance(key, GpuModel) else key)
                if model is None:
                    raise _fail(name, f"Unknown GPU model {key!r}.")
                limits[model] = _limit(f"max_gpus[{model.name}]", limit)
            out[name] = limits
        else:
            raise _fail(name, f"Not a quota field; one of {', '.join((*EDITABLE_FIELDS, 'model_limits'))}.")
    return out


@dataclass
class QuotaUpdate:
    quota: Quota
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.after)


def _json(value: Any) -> Any:
    return str(value) if isinstance(value, Decimal) else value


def _apply(*, tenant, clean: dict[str, Any], actor: Actor, usage, bulk: bool) -> QuotaUpdate:
    quota = lock_quota(tenant=tenant)
    result = QuotaUpdate(quota=quota)
    for name in EDITABLE_FIELDS:
        if name in clean and getattr(quota, name) != clean[name]:
            result.before[name] = _json(getattr(quota, name))
            result.after[name] = _json(clean[name])
            setattr(quota, name, clean[name])
    if result.after:
        quota.save()
    for name in LIMIT_FIELDS:
        limit, in_use = getattr(quota, name), use_of(name, usage)
        if name in result.after and limit is not None and in_use > limit:
            result.warnings.append(
                f"{LIMIT_LABELS[name]}: the new limit {limit} is below the {in_use} in use now; nothing "
                "running is stopped, and new requests are refused until use falls below it."
            )
    if "model_limits" in clean:
        current = {ml.gpu_model_id: ml for ml in QuotaModelLimit.objects.filter(quota=quota)}
        for model, limit in clean["model_limits"].items():
            key = f"max_gpus[{model.name}]"
            old = current.get(model.pk)
            if (old.max_gpus if old else None) == limit:
                continue
            result.before[key], result.after[key] = (old.max_gpus if old else None), limit
            if limit is None:
                old.delete()
            elif old is None:
                QuotaModelLimit.objects.create(quota=quota, gpu_model=model, max_gpus=limit)
            else:
                old.max_gpus = limit
                old.save(update_fields=["max_gpus"])
            in_use = model_use_of(model.pk, usage)
            if limit is not None and in_use > limit:
                result.warnings.append(
                    f"{model.name}: the new limit {limit} is below the {in_use} GPUs in use now."
                )
    if result.after:
        audit_record(
            tenant=tenant,
            actor=actor,
            action=QUOTA_AUDIT_ACTION,
            target=quota,
            data={"before": result.before, "after": result.after, "bulk": bulk, "warnings": result.warnings},
        )
    return result


def quota_update(*, tenant, changes: dict[str, Any], actor: Actor) -> QuotaUpdate:
    """Set some of a tenant's limits (None: no limit); only the fields given change. One
    transaction, one audit event with the values before and after (none when nothing changed)."""
    clean = quota_changes_clean(changes)
    with transaction.atomic():
        result = _apply(
            tenant=tenant,
            clean=clean,
            actor=actor,
            usage=_usage_of([tenant.pk]).get(tenant.pk),
            bulk=False,
        )
    return result


def quota_bulk_update(*, tenants, name: str, value: Any, actor: Actor) -> list[QuotaUpdate]:
    """Set one field to one value for every tenant given: all or none (one transaction), one audit
    event per tenant whose value changed."""
    if name not in EDITABLE_FIELDS:
        raise _fail("field", f"One of {', '.join(EDITABLE_FIELDS)}.")
    tenants = sorted(tenants, key=lambda t: t.pk)  # quota rows are locked in one order
    if not tenants:
        raise _fail("tenants", "Choose at least one tenant.")
    clean = quota_changes_clean({name: value})
    usage = _usage_of([t.pk for t in tenants])
    with transaction.atomic():
        return [_apply(tenant=t, clean=clean, actor=actor, usage=usage.get(t.pk), bulk=True) for t in tenants]


def _usage_of(ids: list[int]) -> dict[int, QuotaUsage]:
    usage = quota_usage_by_tenant(tenant_ids=ids)
    return {i: usage.get(i) or QuotaUsage() for i in ids}
