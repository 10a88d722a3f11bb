"""Rate cards: versions in force, price lookup, the tenant's card and discount."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from metering.locks import lock_rate_card
from metering.models import BillingAccount, GpuPrice, RateCard, RateCardVersion
from metering.money import ZERO, quantize_unit
from nodes.models import Region
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
    gpu_prices: dict[tuple, object],
    vcpu_hour_price=None,
    ram_gib_hour_price=None,
    storage_gib_hour_price=None,
    gpu_memory_gib_hour_price=None,
    now: datetime | None = None,
    allow_past: bool = False,
) -> RateCardVersion:
    """Add a price version to ``rate_card`` from ``effective_from``; ``gpu_prices`` maps
    ``(gpu_model_id, plan)`` to the price of one GPU-hour, and ``(gpu_model_id, plan, region_id)``
    to that region's price (which wins there over the price without a region).

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
    regions = set(Region.objects.values_list("pk", flat=True))
    for key, value in gpu_prices.items():
        model_id, plan, region_id = (*key, None) if len(key) == 2 else key
        if plan not in Plan.values:
            raise ValidationFailed(
                f"plan: unknown plan {plan!r}.", fields={"plan": [f"Unknown plan {plan!r}."]}
            )
        if region_id is not None and region_id not in regions:
            raise ValidationFailed(
                f"region: unknown region {region_id!r}.",
                fields={"region": [f"Unknown region {region_id!r}."]},
            )
        prices[(model_id, plan, region_id)] = _price(value, "price_per_gpu_hour")
    vcpu = _price(vcpu_hour_price, "vcpu_hour_price")
    ram = _price(ram_gib_hour_price, "ram_gib_hour_price")
    storage = _price(storage_gib_hour_price, "storage_gib_hour_price")
    gpu_memory = _price(gpu_memory_gib_hour_price, "gpu_memory_gib_hour_price")
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
                gpu_memory_gib_hour_price=gpu_memory,
            )
        except IntegrityError as exc:
            raise ValidationFailed(
                "effective_from: overlaps another version.", fields={"effective_from": [str(exc)[:200]]}
            ) from None
        GpuPrice.objects.bulk_create(
            GpuPrice(
                version=version,
                gpu_model_id=model_id,
                plan=plan,
                region_id=region_id,
                price_per_gpu_hour=price,
            )
            for (model_id, plan, region_id), price in prices.items()
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
    """A version with its GPU prices loaded: ``gpu[(gpu_model_id, plan)]`` per GPU-hour, and
    ``regional[(gpu_model_id, plan, region_id)]`` where a region has a price of its own."""

    version: RateCardVersion
    gpu: dict[tuple[int, str], Decimal]
    regional: dict[tuple[int, str, int], Decimal] = field(default_factory=dict)

    def price(self, gpu_model_id: int, plan: str, region_id: int | None) -> Decimal | None:
        """One GPU-hour of the model on the plan in the region: the region's own price, or else
        the card's price without a region."""
        if region_id is not None and self.regional:
            found = self.regional.get((gpu_model_id, plan, region_id))
            if found is not None:
                return found
        return self.gpu.get((gpu_model_id, plan))

    @property
    def gpu_memory_price(self) -> Decimal | None:
        return self.version.gpu_memory_gib_hour_price

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
        regional: dict[int, dict[tuple[int, str, int], Decimal]] = {v.pk: {} for v in versions}
        for p in GpuPrice.objects.filter(version__rate_card=rate_card):
            if p.region_id is None:
                prices[p.version_id][(p.gpu_model_id, p.plan)] = p.price_per_gpu_hour
            else:
                regional[p.version_id][(p.gpu_model_id, p.plan, p.region_id)] = p.price_per_gpu_hour
        self.versions = [PricedVersion(v, prices[v.pk], regional[v.pk]) for v in versions]

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


def current_prices(
    *, gpu_model, tenant=None, at: datetime | None = None, region=None
) -> dict[str, Decimal | None]:
    """Hourly price of one GPU of ``gpu_model`` per plan, now (after the tenant's discount), in
    ``region`` (None: the card's price without a region)."""
    return current_price_table(gpu_models=[gpu_model], tenant=tenant, at=at, region=region)[gpu_model.pk]


def current_version(*, tenant=None, at: datetime | None = None) -> RateCardVersion | None:
    """The version in force at ``at`` of the tenant's card (None: the default card)."""
    at = at or timezone.now()
    card = (
        rate_card_for_tenant(tenant=tenant)
        if tenant is not None
        else RateCard.objects.filter(is_default=True).first()
    )
    if card is None:
        return None
    return (
        RateCardVersion.objects.filter(rate_card=card, effective_from__lte=at)
        .filter(Q(effective_to__isnull=True) | Q(effective_to__gt=at))
        .first()
    )


def current_price_table(
    *, gpu_models, tenant=None, at: datetime | None = None, region=None, regions=None
) -> dict:
    """``current_prices`` of many GPU models in three queries: ``{model pk: {plan: price}}`` for
    ``region`` (one region or None); with ``regions``, ``{(model pk, region pk): {plan: price}}``
    for each of them (a region's own price where it has one)."""
    ids = {getattr(m, "pk", m) for m in gpu_models}
    region_ids = (
        [getattr(r, "pk", r) for r in regions] if regions is not None else [getattr(region, "pk", region)]
    )
    keys = [(pk, rid) for pk in ids for rid in region_ids]
    table: dict[tuple, dict[str, Decimal | None]] = {k: dict.fromkeys(Plan.values) for k in keys}
    version = current_version(tenant=tenant, at=at)
    if version is not None:
        discount = billing_account_for(tenant=tenant).discount_percent if tenant is not None else ZERO
        general: dict[tuple[int, str], Decimal] = {}
        regional: dict[tuple[int, str, int], Decimal] = {}
        for model_id, plan, region_id, price in GpuPrice.objects.filter(
            version=version, gpu_model_id__in=ids
        ).values_list("gpu_model_id", "plan", "region_id", "price_per_gpu_hour"):
            if region_id is None:
                general[(model_id, plan)] = price
            else:
                regional[(model_id, plan, region_id)] = price
        priced = PricedVersion(version, general, regional)
        for model_id, region_id in keys:
            for plan in Plan.values:
                table[(model_id, region_id)][plan] = discounted(
                    priced.price(model_id, plan, region_id), discount
                )
    if regions is not None:
        return table
    return {model_id: prices for (model_id, _), prices in table.items()}
