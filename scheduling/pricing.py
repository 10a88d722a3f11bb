"""Where prices come from: a registry that metering fills (scheduling never imports metering).

A price provider answers, for one GPU model in one region, the current hourly price of one GPU per
plan and the spot price floor (the lowest ``spot_max_price`` a spot request may name). The first
registered provider that returns a value wins. With none registered (metering not installed or not
configured yet) prices are unknown (None) and the spot floor is ``SCHEDULING_SPOT_PRICE_FLOOR``.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Protocol

from django.conf import settings


class PriceProvider(Protocol):
    def prices(self, *, gpu_model, region) -> dict[str, Decimal | None]:
        """Hourly price of one GPU per plan (``on_demand``, ``spot``, ``reserved``); None = unknown."""
        ...

    def spot_floor(self, *, gpu_model, region) -> Decimal | None: ...

    # Optional: ``price_table(*, pairs)``, ``prices`` for many (gpu_model, region) pairs at once:
    # ``{price_key(gpu_model, region): {plan: price}}`` (a catalog page in a few queries).

    # Optional: ``estimate(*, tenant, gpu_model, regions, gpu_count, fraction_milli, cpu_millicores,
    # ram_mib)``, the hourly price of a whole workload spec per plan for the tenant (its discount,
    # vCPU and RAM prices), in the dearest of ``regions``; see ``workload_estimate``.


_providers: list[PriceProvider] = []


def register_price_provider(provider: PriceProvider) -> PriceProvider:
    if provider not in _providers:
        _providers.append(provider)
    return provider


def unregister_price_provider(provider: PriceProvider) -> None:
    if provider in _providers:
        _providers.remove(provider)


PLANS = ("on_demand", "spot", "reserved")


def price_key(gpu_model, region) -> tuple[int, int | None]:
    """A price table's key for a GPU model in a region (None: no region)."""
    return gpu_model.pk, getattr(region, "pk", None)


def gpu_price_table(*, pairs) -> dict[tuple[int, int | None], dict[str, Decimal | None]]:
    """``gpu_prices`` for many (gpu_model, region) pairs: ``{price_key(model, region): prices}``."""
    pairs = {price_key(m, r): (m, r) for m, r in pairs}
    out = {key: dict.fromkeys(PLANS) for key in pairs}
    for provider in _providers:
        table = getattr(provider, "price_table", None)
        if table is not None:
            answers = table(pairs=list(pairs.values()))
        else:
            answers = {key: provider.prices(gpu_model=m, region=r) for key, (m, r) in pairs.items()}
        for key, prices in answers.items():
            for plan, price in prices.items():
                if plan in out[key] and out[key][plan] is None and price is not None:
                    out[key][plan] = price
    return out


def gpu_prices(*, gpu_model, region) -> dict[str, Decimal | None]:
    return gpu_price_table(pairs=[(gpu_model, region)])[price_key(gpu_model, region)]


def spot_price_floor(*, gpu_model, region) -> Decimal:
    for provider in _providers:
        floor = provider.spot_floor(gpu_model=gpu_model, region=region)
        if floor is not None:
            return floor
    return Decimal(str(settings.SCHEDULING_SPOT_PRICE_FLOOR))


def workload_estimate(
    *,
    tenant,
    gpu_model,
    regions,
    gpu_count: int,
    fraction_milli: int,
    cpu_millicores: int = 0,
    ram_mib: int = 0,
) -> dict[str, Decimal | None]:
    """Hourly price of a workload spec per plan, in the dearest of ``regions`` (the scheduler may place
    it in any): the first provider with an ``estimate`` that prices a plan wins (metering: the same
    figure as ``/api/v1/cost-estimate/``); otherwise the list price of one GPU times the GPUs."""
    out: dict[str, Decimal | None] = dict.fromkeys(PLANS)
    for provider in _providers:
        estimate = getattr(provider, "estimate", None)
        if estimate is None:
            continue
        priced = estimate(
            tenant=tenant,
            gpu_model=gpu_model,
            regions=regions,
            gpu_count=gpu_count,
            fraction_milli=fraction_milli,
            cpu_millicores=cpu_millicores,
            ram_mib=ram_mib,
        )
        for plan, price in priced.items():
            if plan in out and out[plan] is None and price is not None:
                out[plan] = price
    gpus = Decimal(gpu_count) * Decimal(fraction_milli) / 1000
    for plan in PLANS:
        if out[plan] is None:
            listed = [gpu_prices(gpu_model=gpu_model, region=r)[plan] for r in regions]
            if listed and all(p is not None for p in listed):
                out[plan] = max(listed) * gpus
    return out
