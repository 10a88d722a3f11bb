"""The price provider scheduling asks for ``/api/v1/gpu-types/`` prices and the spot floor."""

from __future__ import annotations

from metering.services.rates import current_prices


class RateCardPriceProvider:
    """Prices of the default rate card's version in force now (region-independent). The spot
    floor is the rate card's spot price: a spot request may not name a maximum below it."""

    def prices(self, *, gpu_model, region):
        return current_prices(gpu_model=gpu_model)

    def spot_floor(self, *, gpu_model, region):
        return current_prices(gpu_model=gpu_model).get("spot")


provider = RateCardPriceProvider()
