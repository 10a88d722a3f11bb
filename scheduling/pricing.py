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


_providers: list[PriceProvider] = []


def register_price_provider(provider: PriceProvider) -> PriceProvider:
    if provider not in _providers:
        _providers.append(provider)
    return provider


def unregister_price_provider(provider: PriceProvider) -> None:
    if provider in _providers:
        _providers.remove(provider)


PLANS = ("on_demand", "spot", "reserved")


def gpu_prices(*, gpu_model, region) -> dict[str, Decimal | None]:
    out: dict[str, Decimal | None] = dict.fromkeys(PLANS)
    for provider in _providers:
        for plan, price in provider.prices(gpu_model=gpu_model, region=region).items():
            if plan in out and out[plan] is None and price is not None:
                out[plan] = price
    return out


def spot_price_floor(*, gpu_model, region) -> Decimal:
    for provider in _providers:
        floor = provider.spot_floor(gpu_model=gpu_model, region=region)
        if floor is not None:
            return floor
    return Decimal(str(settings.SCHEDULING_SPOT_PRICE_FLOOR))
