"""Rate cards: versions in force, price lookup, the tenant's card and discount."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from metering.locks import lock_rate_card
from metering.models import BillingAccount, GpuPrice, RateCard, RateCardVersion
from metering.money import ZERO, quantize_unit
from portal.errors import ValidationFailed
from scheduling.models import Plan


def _price(value, field: str) -> Decimal | None:
    if value is None or value == "":
        return None
    if isinstance(value, float):
        value = str(value)
    try:
        price = Decimal(value)
    except (InvalidOperation, TypeError, ValueError):
        raise ValidationFailed(f"{field}: not a number.", fields={field: ["Not a number."]}) from None
    if not price.is_finite():
        raise ValidationFailed(f"{field}: not a number.", fields={field: ["Not a number."]})
    if price < 0:
        raise ValidationFailed(
            f"{field}: a price cannot be negative.", fields={field: ["Must be 0 or more."]}
        )
    return quantize_unit(price)


def rate_card_version_create(
    *,
    rate_card: RateCard,
    effective_from: datetime,
    effective_to: datetime | None = None,
    gpu_prices: dict[tuple[int, str], object],
    vcpu_hour_price=None,
    ram_gib_hour_price=None,
    storage_gib_hour_price=None,
    now: datetime | None = None,
    allow_past: bool = False,
) -> RateCardVersion:
    """Add a price version to ``rate_card`` from ``effective_from``; ``gpu_prices`` maps
    ``(gpu_model_id, plan)`` to the price of one GPU-hour.

    The past is never rewritten: ``effective_from`` may not lie in the past (``allow_past`` is for
    seeding a new card), and a version may not overlap another. An open-ended version in force at
    ``effective_from`` is closed there (that is how a price change is made)."""
    now = now or timezone.now()
    if effective_from.tzinfo is None:
        raise ValidationFailed(
            "effective_from must be timezone-aware.", fields={"effective_from": ["No timezone."]}
        )
    if not allow_past and effective_from < now:
        raise ValidationFailed(
            "effective_from: a price change cannot start in the past.",
            fields={"effective_from": ["Must not be in the past."]},
        )
    if effective_to is not None and effective_to <= effective_from:
        raise ValidationFailed(
            "effective_to: must be after effective_from.",
            fields={"effective_to": ["Must be after effective_from."]},
        )
    prices = {}
    for (model_id, plan), value in gpu_prices.items():
        if plan not in Plan.values:
            raise ValidationFailed(
                f"plan: unknown plan {plan!r}.", fields={"plan": [f"Unknown plan {plan!r}."]}
            )
        prices[(model_id, plan)] = _price(value, "price_per_gpu_hour")
    vcpu = _price(vcpu_hour_price, "vcpu_hour_price")
    ram = _price(ram_gib_hour_price, "ram_gib_hour_price")
    storage = _price(storage_gib_hour_price, "storage_gib_hour_price")
    with transaction.atomic():
        lock_rate_card(rate_card_id=rate_card.pk)
        versions = list(RateCardVersion.objects.filter(rate_card=rate_card).order_by("effective_from"))
        open_before = [v for v in versions if v.effective_to is None and v.effective_from < effective_from]
        for v in open_before:
            v.effective_to = effective_from
        for v in versions:
            end = v.effective_to
            if v.effective_from < (effective_to or datetime.max.replace(tzinfo=effective_from.tzinfo)) and (
                end is None or end > effective_from
            ):
                end_txt = f"{end:%Y-%m-%d %H:%M}" if end else "open"
                raise ValidationFailed(
                    f"effective_from: overlaps version {v.number} ([{v.effective_from:%Y-%m-%d %H:%M}, {end_txt})).",
                    fields={"effective_from": [f"Overlaps version {v.number}."]},
                )
        for v in open_before:
            v.save(update_fields=["effective_to"])
        number = max((v.number for v in versions), default=0) + 1
        try:
            version = RateCardVersion.objects.create(
                rate_card=rate_card,
                number=number,
                effective_from=effective_from,
                effective_to=effective_to,
                vcpu_hour_price=vcpu,
                ram_gib_hour_price=ram,
                storage_gib_hour_price=storage,
            )
        except IntegrityError as exc:
            raise ValidationFailed(
                "effective_from: overlaps another version.", fields={"effective_from": [str(exc)[:200]]}
            ) from None
        GpuPrice.objects.bulk_create(
            GpuPrice(version=version, gpu_model_id=model_id, plan=plan, price_per_gpu_hour=price)
            for (model_id, plan), price in prices.items()
        )
    return version


def rate_card_for_tenant(*, tenant) -> RateCard | None:
    account = BillingAccount.objects.filter(tenant=tenant).select_related("rate_card").first()
    if account is not None and account.rate_card is not None:
        return account.rate_card
    return RateCard.objects.filter(is_default=True).first()


def billing_account_for(*, tenant) -> BillingAccount:
    tenant_id = getattr(tenant, "pk", tenant)
    account = BillingAccount.objects.filter(tenant_id=tenant_id).first()
    return account if account is not None else BillingAccount(tenant_id=tenant_id)


@dataclass(frozen=True)
class PricedVersion:
    """A version with its GPU prices loaded: ``gpu[(gpu_model_id, plan)]`` per GPU-hour."""

    version: RateCardVersion
    gpu: dict[tuple[int, str], Decimal]

    @property
    def start(self) -> datetime:
        return self.version.effective_from

    @property
    def end(self) -> datetime | None:
        return self.version.effective_to

    def covers(self, at: datetime) -> bool:
        return self.start <= at and (self.end is None or at < self.end)


class PriceBook:
    """The versions of one rate card, loaded once, for rating many intervals."""

    def __init__(self, rate_card: RateCard | None):
        self.rate_card = rate_card
        self.versions: list[PricedVersion] = []
        if rate_card is None:
            return
        versions = list(RateCardVersion.objects.filter(rate_card=rate_card).order_by("effective_from"))
        prices: dict[int, dict[tuple[int, str], Decimal]] = {v.pk: {} for v in versions}
        for p in GpuPrice.objects.filter(version__rate_card=rate_card):
            prices[p.version_id][(p.gpu_model_id, p.plan)] = p.price_per_gpu_hour
        self.versions = [PricedVersion(v, prices[v.pk]) for v in versions]

    def at(self, at: datetime) -> PricedVersion | None:
        for v in self.versions:
            if v.covers(at):
                return v
        return None

    def boundaries(self, start: datetime, end: datetime) -> list[datetime]:
        """Version starts and ends strictly inside ``(start, end)``."""
        out = set()
        for v in self.versions:
            for point in (v.start, v.end):
                if point is not None and start < point < end:
                    out.add(point)
        return sorted(out)

    def in_force(self, start: datetime, end: datetime) -> list[PricedVersion]:
        return [v for v in self.versions if v.start < end and (v.end is None or v.end > start)]


class TenantPricing:
    """Many tenants' billing accounts, rate cards and price books, loaded in bulk: one query per
    batch of tenants for the accounts, one for the default card, two per rate card (its versions
    and prices), however many tenants share it. What ``rate_card_for_tenant`` and
    ``billing_account_for`` answer for one tenant, for a whole run."""

    def __init__(self):
        self.accounts: dict[int, BillingAccount] = {}
        self._books: dict[int | None, PriceBook] = {}
        self._default: RateCard | None = None
        self._default_loaded = False

    def load(self, tenant_ids) -> None:
        missing = {getattr(t, "pk", t) for t in tenant_ids} - set(self.accounts)
        if not missing:
            return
        found = {
            a.tenant_id: a
            for a in BillingAccount.objects.filter(tenant_id__in=missing).select_related("rate_card")
        }
        for tenant_id in missing:
            self.accounts[tenant_id] = found.get(tenant_id) or BillingAccount(tenant_id=tenant_id)

    @property
    def default_card(self) -> RateCard | None:
        if not self._default_loaded:
            self._default = RateCard.objects.filter(is_default=True).first()
            self._default_loaded = True
        return self._default

    def account(self, tenant_id: int) -> BillingAccount:
        self.load([tenant_id])
        return self.accounts[tenant_id]

    def card(self, tenant_id: int) -> RateCard | None:
        account = self.account(tenant_id)
        return account.rate_card if account.rate_card_id is not None else self.default_card

    def book(self, tenant_id: int) -> PriceBook:
        card = self.card(tenant_id)
        key = card.pk if card is not None else None
        if key not in self._books:
            self._books[key] = PriceBook(card)
        return self._books[key]


def discounted(price: Decimal | None, discount_percent: Decimal) -> Decimal | None:
    if price is None:
        return None
    return quantize_unit(price * (Decimal(100) - Decimal(discount_percent)) / Decimal(100))


def current_prices(*, gpu_model, tenant=None, at: datetime | None = None) -> dict[str, Decimal | None]:
    """Hourly price of one GPU of ``gpu_model`` per plan, now (after the tenant's discount)."""
    return current_price_table(gpu_models=[gpu_model], tenant=tenant, at=at)[gpu_model.pk]


def current_price_table(
    *, gpu_models, tenant=None, at: datetime | None = None
) -> dict[int, dict[str, Decimal | None]]:
    """``current_prices`` of many GPU models in three queries: ``{model pk: {plan: price}}``."""
    at = at or timezone.now()
    ids = {getattr(m, "pk", m) for m in gpu_models}
    out: dict[int, dict[str, Decimal | None]] = {pk: dict.fromkeys(Plan.values) for pk in ids}
    card = (
        rate_card_for_tenant(tenant=tenant)
        if tenant is not None
        else RateCard.objects.filter(is_default=True).first()
    )
    if card is None:
        return out
    version = (
        RateCardVersion.objects.filter(rate_card=card, effective_from__lte=at)
        .filter(Q(effective_to__isnull=True) | Q(effective_to__gt=at))
        .first()
    )
    if version is None:
        return out
    discount = billing_account_for(tenant=tenant).discount_percent if tenant is not None else ZERO
    for model_id, plan, price in GpuPrice.objects.filter(version=version, gpu_model_id__in=ids).values_list(
        "gpu_model_id", "plan", "price_per_gpu_hour"
    ):
        if plan in out[model_id]:
            out[model_id][plan] = discounted(price, discount)
    return out
